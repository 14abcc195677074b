"""Tests of the model generator and the NumPy reference on their own.

These need neither the Rust extension nor a GPU.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest
from reference import (
    apply_rope,
    inv_freq,
    load_weights,
    read_safetensors,
    read_safetensors_header,
    reference_logits,
    rope_attention_factor,
    round_bf16,
)
from strata_rs.testing.models import (
    FAMILIES,
    IM_END_ID,
    IM_START_ID,
    bf16_bits_to_f32,
    build_config,
    f32_to_bf16_bits,
    make_model,
    make_weights,
)

DTYPES = ("f32", "bf16", "f16")
SEQ = np.random.default_rng(1234).integers(0, 512, 100).tolist()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        (f, d): make_model(root / f"{f}-{d}", f, "tiny", d, seed=0)
        for f in FAMILIES
        for d in DTYPES
    }


@pytest.fixture(scope="module")
def f32_logits(models: dict[tuple[str, str], Path]) -> dict[str, np.ndarray]:
    return {f: reference_logits(models[f, "f32"], SEQ) for f in FAMILIES}


def expected_shapes(config: dict) -> dict[str, list[int]]:
    """Tensor names/shapes spelled out from the HF modelling code."""
    family = config["model_type"]
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    bias = family == "qwen2" or (family in ("llama", "qwen3") and config.get("attention_bias"))
    out: dict[str, list[int]] = {"model.embed_tokens.weight": [v, h], "model.norm.weight": [h]}
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out |= {
            p + "input_layernorm.weight": [h],
            p + "post_attention_layernorm.weight": [h],
            p + "self_attn.q_proj.weight": [q, h],
            p + "self_attn.k_proj.weight": [kv, h],
            p + "self_attn.v_proj.weight": [kv, h],
            p + "self_attn.o_proj.weight": [h, q],
            p + "mlp.gate_proj.weight": [i, h],
            p + "mlp.up_proj.weight": [i, h],
            p + "mlp.down_proj.weight": [h, i],
        }
        if bias:
            out |= {p + "self_attn.q_proj.bias": [q], p + "self_attn.k_proj.bias": [kv]}
            out |= {p + "self_attn.v_proj.bias": [kv]}
        if family != "qwen2" and config.get("attention_bias"):
            out[p + "self_attn.o_proj.bias"] = [h]
        if family == "qwen3":
            out |= {p + "self_attn.q_norm.weight": [hd], p + "self_attn.k_norm.weight": [hd]}
    if not config["tie_word_embeddings"]:
        out["lm_head.weight"] = [v, h]
    return out


def header_tensors(path: Path) -> dict[str, dict]:
    header, _ = read_safetensors_header(path)
    header.pop("__metadata__", None)
    return header


# --------------------------------------------------------------------------
# folder layout


@pytest.mark.parametrize("family", FAMILIES)
def test_config_and_side_files(models: dict[tuple[str, str], Path], family: str) -> None:
    for dtype, torch_dtype in (("f32", "float32"), ("bf16", "bfloat16"), ("f16", "float16")):
        config = json.loads((models[family, dtype] / "config.json").read_text())
        assert config["torch_dtype"] == torch_dtype
    assert config["model_type"] == family
    assert config["architectures"] == [
        {
            "llama": "LlamaForCausalLM",
            "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM",
        }[family]
    ]
    assert config["hidden_size"] == 64 and config["num_hidden_layers"] == 2
    assert config["num_attention_heads"] == 4 and config["num_key_value_heads"] == 2
    assert config["tie_word_embeddings"] == (family in ("qwen3", "mistral"))
    if family == "qwen3":
        assert config["head_dim"] == 16
    if family == "qwen2":
        assert "attention_bias" not in config and config["use_sliding_window"] is False
    if family == "mistral":
        assert config["sliding_window"] is None
    assert config["eos_token_id"] == IM_END_ID and config["bos_token_id"] == IM_START_ID

    d = models[family, "f32"]
    gen = json.loads((d / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [IM_END_ID, 0]
    tok_cfg = json.loads((d / "tokenizer_config.json").read_text())
    assert tok_cfg["eos_token"] == "<|im_end|>" and tok_cfg["bos_token"] == "<|im_start|>"
    assert "<|im_start|>" in tok_cfg["chat_template"]
    assert tok_cfg["model_max_length"] == config["max_position_embeddings"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_names_shapes_dtypes(
    models: dict[tuple[str, str], Path], family: str, dtype: str
) -> None:
    d = models[family, dtype]
    config = json.loads((d / "config.json").read_text())
    header = header_tensors(d / "model.safetensors")
    assert {k: v["shape"] for k, v in header.items()} == expected_shapes(config)
    assert {v["dtype"] for v in header.values()} == {
        {"f32": "F32", "bf16": "BF16", "f16": "F16"}[dtype]
    }
    # Values are exactly the generator's weights, rounded to the file dtype.
    truth = make_weights(config, seed=0)
    if dtype == "bf16":
        loaded = read_safetensors(d / "model.safetensors")
        for k, v in truth.items():
            np.testing.assert_array_equal(loaded[k], bf16_bits_to_f32(f32_to_bf16_bits(v)))
    else:
        from safetensors.numpy import load_file

        loaded = load_file(str(d / "model.safetensors"))
        for k, v in truth.items():
            assert loaded[k].dtype == (np.float32 if dtype == "f32" else np.float16)
            np.testing.assert_array_equal(loaded[k], v.astype(loaded[k].dtype))
    # Norm weights and biases are deliberately not 1 / 0.
    assert not np.allclose(truth["model.norm.weight"], 1.0)
    if family == "qwen2":
        assert np.abs(truth["model.layers.0.self_attn.q_proj.bias"]).max() > 0.01


def test_bf16_header_is_aligned(models: dict[tuple[str, str], Path]) -> None:
    with open(models["llama", "bf16"] / "model.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        raw = f.read(n)
    assert n % 8 == 0
    json.loads(raw.decode("utf-8"))  # trailing-space padding is valid JSON


def test_bf16_rounding_known_values() -> None:
    cases = {
        1.0: 0x3F80,
        -2.5: 0xC020,
        1.0 / 3.0: 0x3EAB,  # 0x3EAAAAAB: low half 0xAAAB > half, rounds up
        1.0 + 2.0**-7 + 2.0**-8: 0x3F82,  # 0x3F81_8000: exact tie, odd -> up to even
        1.0 + 2.0**-8 + 2.0**-9: 0x3F81,  # 0x3F80_C000: above the tie -> up
        1.0 + 2.0**-8: 0x3F80,  # 0x3F80_8000: exact tie, even -> stays
        1.0 + 2.0**-8 + 2.0**-16: 0x3F81,  # just above the tie -> up
        float("inf"): 0x7F80,
        -0.0: 0x8000,
    }
    values = np.array(list(cases), dtype=np.float32)
    assert f32_to_bf16_bits(values).tolist() == list(cases.values())
    nan = f32_to_bf16_bits(np.array([np.nan], dtype=np.float32))
    assert np.isnan(bf16_bits_to_f32(nan))[0]


def test_bf16_rounding_is_nearest() -> None:
    x = np.random.default_rng(5).standard_normal(100_000).astype(np.float32) * 3
    bits = f32_to_bf16_bits(x)
    y = bf16_bits_to_f32(bits).astype(np.float64)
    # Compare with both bf16 neighbours obtained by truncation, independently.
    lo = bf16_bits_to_f32((x.view(np.uint32) >> 16).astype(np.uint16)).astype(np.float64)
    hi = bf16_bits_to_f32(((x.view(np.uint32) >> 16) + 1).astype(np.uint16)).astype(np.float64)
    err = np.abs(y - x)
    assert np.all(err <= np.minimum(np.abs(lo - x), np.abs(hi - x)))


def test_reference_bf16_rounding_matches_the_generators() -> None:
    # Two implementations (the reference's, for matmul_inputs="bf16", and the model
    # generator's), ties included.
    x = np.random.default_rng(6).standard_normal(100_000).astype(np.float32) * 7
    ties = np.array([1.0 + 2.0**-7 + 2.0**-8, 1.0 + 2.0**-8, -(1.0 + 2.0**-8)], np.float32)
    for v in (x, ties):
        want = bf16_bits_to_f32(f32_to_bf16_bits(v)).astype(np.float64)
        assert np.array_equal(round_bf16(v.astype(np.float64)), want)
    assert round_bf16(np.array([1.0 + 2.0**-7 + 2.0**-8])).tolist() == [1.0 + 2.0**-6]


def test_shards_and_index(tmp_path: Path, models: dict[tuple[str, str], Path]) -> None:
    d = make_model(tmp_path / "sharded", "llama", "tiny", "bf16", seed=0, shards=3)
    assert not (d / "model.safetensors").exists()
    index = json.loads((d / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    total = 0
    for fname in files:
        header = header_tensors(d / fname)
        assert all(index["weight_map"][k] == fname for k in header)
        total += sum(v["data_offsets"][1] - v["data_offsets"][0] for v in header.values())
    assert index["metadata"]["total_size"] == total
    single = load_weights(models["llama", "bf16"])
    sharded = load_weights(d)
    assert sorted(single) == sorted(sharded) == sorted(index["weight_map"])
    for k in single:
        np.testing.assert_array_equal(single[k], sharded[k])


def test_seed_determinism(tmp_path: Path, models: dict[tuple[str, str], Path]) -> None:
    a = (models["qwen2", "f32"] / "model.safetensors").read_bytes()
    b = (make_model(tmp_path / "same", "qwen2") / "model.safetensors").read_bytes()
    c = (make_model(tmp_path / "other", "qwen2", seed=1) / "model.safetensors").read_bytes()
    assert a == b and a != c


def test_overrides(tmp_path: Path) -> None:
    cfg = build_config(
        "llama", "tiny", rope_scaling=None, tie_word_embeddings=True, attention_bias=True
    )
    assert cfg["rope_scaling"] is None and cfg["tie_word_embeddings"] and cfg["attention_bias"]
    d = make_model(tmp_path / "qwen3-hd32", "qwen3", head_dim=32)
    config = json.loads((d / "config.json").read_text())
    assert config["head_dim"] == 32
    header = header_tensors(d / "model.safetensors")
    assert header["model.layers.0.self_attn.q_proj.weight"]["shape"] == [128, 64]
    assert {k: v["shape"] for k, v in header.items()} == expected_shapes(config)
    assert np.isfinite(reference_logits(d, SEQ[:20])).all()
    d = make_model(tmp_path / "llama-bias", "llama", attention_bias=True)
    config = json.loads((d / "config.json").read_text())
    header = header_tensors(d / "model.safetensors")
    assert "model.layers.1.self_attn.o_proj.bias" in header
    assert {k: v["shape"] for k, v in header.items()} == expected_shapes(config)


def test_smollm_preset_shapes(tmp_path: Path) -> None:
    d = make_model(tmp_path / "smollm", "llama", "smollm-135m", "bf16")
    config = json.loads((d / "config.json").read_text())
    keys = ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads")
    assert [config[k] for k in keys] == [576, 30, 49152, 9]
    assert [config[k] for k in ("num_key_value_heads", "head_dim")] == [3, 64]
    assert config["tie_word_embeddings"] and config["rope_theta"] == 100000.0
    header = header_tensors(d / "model.safetensors")
    assert {k: v["shape"] for k, v in header.items()} == expected_shapes(config)
    n_params = sum(int(np.prod(v["shape"])) for v in header.values())
    assert 134_000_000 < n_params < 136_000_000


# --------------------------------------------------------------------------
# tokenizer


def test_tokenizer_round_trip(models: dict[tuple[str, str], Path]) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(models["llama", "f32"] / "tokenizer.json"))
    specials = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    assert [tok.token_to_id(t) for t in specials] == [0, 1, 2]
    assert tok.get_vocab_size() <= 512
    for text in ("def f(x):\n    return x ** 2\n", "  leading spaces, héllo wörld 🙂\ttab", ""):
        ids = tok.encode(text).ids
        assert tok.decode(ids) == text
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>").ids
    assert ids[0] == IM_START_ID and ids[-1] == IM_END_ID
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


# --------------------------------------------------------------------------
# reference


@pytest.mark.parametrize("family", FAMILIES)
def test_reference_logits_are_spread(f32_logits: dict[str, np.ndarray], family: str) -> None:
    logits = f32_logits[family]
    assert logits.shape == (len(SEQ), 512) and logits.dtype == np.float64
    assert np.isfinite(logits).all()
    top = np.sort(logits, axis=1)
    gap = top[:, -1] - top[:, -2]
    assert (gap > 1e-3).mean() >= 0.95
    assert np.median(gap) > 0.02
    assert len(set(logits.argmax(axis=1).tolist())) >= 20


@pytest.mark.parametrize("family", FAMILIES)
def test_reference_detects_rope_mistakes(
    tmp_path: Path, f32_logits: dict[str, np.ndarray], family: str
) -> None:
    # A plausible engine bug (wrong theta) must move the argmax somewhere,
    # otherwise the argmax-based bf16 tests would be toothless.
    wrong = reference_logits(make_model(tmp_path / "m", family, rope_theta=20000.0), SEQ)
    assert (wrong.argmax(1) != f32_logits[family].argmax(1)).sum() >= 5


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_reference_close_to_f32(
    models: dict[tuple[str, str], Path], f32_logits: dict[str, np.ndarray], family: str
) -> None:
    ref = f32_logits[family]
    low = reference_logits(models[family, "bf16"], SEQ)
    assert np.abs(low - ref).max() < 0.02 * (ref.max() - ref.min())
    assert (low.argmax(1) == ref.argmax(1)).mean() >= 0.95


def test_rope_scaling_frequencies() -> None:
    cfg = build_config("llama", "tiny")
    base = 1.0 / 10000.0 ** (np.arange(0, 16, 2) / 16)
    f = inv_freq(cfg, 16)
    # Wavelengths: 6.3 (< 32/4: kept), 19.9 (between 8 and 32: smoothed),
    # 62.8 and up (> 32: divided by factor 4).
    assert f[0] == base[0]
    assert base[1] / 4 < f[1] < base[1]
    np.testing.assert_allclose(f[2:], base[2:] / 4)
    np.testing.assert_allclose(inv_freq(build_config("mistral", "tiny"), 16), base / 2)
    np.testing.assert_allclose(inv_freq(build_config("qwen2", "tiny"), 16), base)
    # transformers 5 style: theta inside rope_parameters.
    v5 = {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}
    np.testing.assert_allclose(inv_freq(v5, 16), 1.0 / 500.0 ** (np.arange(0, 16, 2) / 16))


def test_yarn_frequencies() -> None:
    # Qwen2.5's long-context setting (head_dim 128, theta 1e6, 32K stretched 4 times): the
    # frequency that turns 32 times over 32K positions is dimension 23.6 (kept through index 23),
    # the one that turns once is 39.65 (divided by 4 from index 40), linear between.
    cfg = {
        "rope_theta": 1e6,
        "max_position_embeddings": 32768,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    }
    base = 1.0 / 1e6 ** (np.arange(0, 128, 2) / 128)
    f = inv_freq(cfg, 128)
    np.testing.assert_array_equal(f[:24], base[:24])
    np.testing.assert_allclose(f[40:], base[40:] / 4, rtol=1e-15)
    ramp = (31 - 23) / (40 - 23)
    assert f[31] == pytest.approx(base[31] * (1 - ramp) + base[31] / 4 * ramp, rel=1e-15)
    assert rope_attention_factor(cfg) == pytest.approx(1 + 0.1 * math.log(4))
    assert rope_attention_factor(build_config("llama", "tiny")) == 1.0


def test_rope_is_relative() -> None:
    # q.k after RoPE depends only on the distance between positions.
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((1, 1, 16)), rng.standard_normal((1, 1, 16))
    freqs = 1.0 / 100.0 ** (np.arange(0, 16, 2) / 16)

    def dot(m: int, n: int) -> float:
        return float(
            apply_rope(q, np.array([m]), freqs).ravel()
            @ apply_rope(k, np.array([n]), freqs).ravel()
        )

    assert dot(5, 2) == pytest.approx(dot(40, 37), abs=1e-12)
    assert dot(5, 2) != pytest.approx(dot(5, 3), abs=1e-6)
    assert dot(0, 0) == pytest.approx(float(q.ravel() @ k.ravel()), abs=1e-12)


def test_sliding_window_semantics(tmp_path: Path) -> None:
    # With one layer, position i under window W sees exactly keys i-W+1..i,
    # and RoPE is relative, so its logits equal the last row of a full causal
    # pass over just those W tokens.
    w = 8
    d = make_model(tmp_path / "swa", "mistral", num_hidden_layers=1, sliding_window=w)
    seq = SEQ[:30]
    windowed = reference_logits(d, seq)
    full = reference_logits(make_model(tmp_path / "full", "mistral", num_hidden_layers=1), seq)
    np.testing.assert_allclose(windowed[:w], full[:w], rtol=0, atol=1e-10)
    for i in (w, 17, 29):
        alone = reference_logits(d, seq[i - w + 1 : i + 1])[-1]
        np.testing.assert_allclose(windowed[i], alone, rtol=0, atol=1e-9)
        assert np.abs(windowed[i] - full[i]).max() > 1e-4


def test_qwen2_sliding_window_needs_flag(tmp_path: Path, f32_logits: dict[str, np.ndarray]) -> None:
    off = make_model(tmp_path / "off", "qwen2", sliding_window=8, use_sliding_window=False)
    np.testing.assert_array_equal(reference_logits(off, SEQ), f32_logits["qwen2"])
    on = make_model(
        tmp_path / "on", "qwen2", sliding_window=8, use_sliding_window=True, max_window_layers=0
    )
    assert np.abs(reference_logits(on, SEQ) - f32_logits["qwen2"]).max() > 1e-3


def test_reference_is_causal(
    models: dict[tuple[str, str], Path], f32_logits: dict[str, np.ndarray]
) -> None:
    prefix = reference_logits(models["qwen3", "f32"], SEQ[:37])
    np.testing.assert_allclose(prefix, f32_logits["qwen3"][:37], rtol=0, atol=1e-10)
