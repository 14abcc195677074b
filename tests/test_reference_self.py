"""Tests of the model generator and the NumPy reference on their own.

These need neither the Rust extension nor a GPU.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from reference import (
    apply_rope,
    forward,
    gemma3_rope_config,
    inv_freq,
    load_weights,
    phi3_rope,
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
    """Tensor names/shapes spelled out from the HF modelling code (for the MoE families, as the
    Hub's checkpoints store them: one tensor per expert and projection)."""
    family = config["model_type"]
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    attention_bias = family in ("llama", "qwen3", "qwen3_moe", "gemma3_text") and config.get(
        "attention_bias"
    )
    bias = family == "qwen2" or attention_bias
    out: dict[str, list[int]] = {"model.embed_tokens.weight": [v, h], "model.norm.weight": [h]}
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        if family == "phi3":
            # Phi3Attention's qkv_proj (q, k, v rows) and Phi3MLP's gate_up_proj (gate, up rows).
            out |= {
                p + "input_layernorm.weight": [h],
                p + "post_attention_layernorm.weight": [h],
                p + "self_attn.qkv_proj.weight": [q + 2 * kv, h],
                p + "self_attn.o_proj.weight": [h, q],
                p + "mlp.gate_up_proj.weight": [2 * i, h],
                p + "mlp.down_proj.weight": [h, i],
            }
            continue
        out |= {
            p + "input_layernorm.weight": [h],
            p + "post_attention_layernorm.weight": [h],
            p + "self_attn.q_proj.weight": [q, h],
            p + "self_attn.k_proj.weight": [kv, h],
            p + "self_attn.v_proj.weight": [kv, h],
            p + "self_attn.o_proj.weight": [h, q],
        }
        # Qwen3MoeDecoderLayer: experts unless in mlp_only_layers or off the decoder_sparse_step.
        qwen3_moe_sparse = (
            family == "qwen3_moe"
            and n not in config["mlp_only_layers"]
            and (n + 1) % config["decoder_sparse_step"] == 0
        )
        if family == "mixtral":
            # Mixtral's experts are w1 (gate), w3 (up), w2 (down), intermediate_size wide.
            e = p + "block_sparse_moe."
            out[e + "gate.weight"] = [config["num_local_experts"], h]
            for x in range(config["num_local_experts"]):
                out |= {f"{e}experts.{x}.w1.weight": [i, h], f"{e}experts.{x}.w3.weight": [i, h]}
                out[f"{e}experts.{x}.w2.weight"] = [h, i]
        elif qwen3_moe_sparse:
            m, e = config["moe_intermediate_size"], p + "mlp."
            out[e + "gate.weight"] = [config["num_experts"], h]
            for x in range(config["num_experts"]):
                out |= {f"{e}experts.{x}.gate_proj.weight": [m, h]}
                out |= {f"{e}experts.{x}.up_proj.weight": [m, h]}
                out[f"{e}experts.{x}.down_proj.weight"] = [h, m]
        else:
            out |= {p + "mlp.gate_proj.weight": [i, h], p + "mlp.up_proj.weight": [i, h]}
            out[p + "mlp.down_proj.weight"] = [h, i]
        if bias:
            out |= {p + "self_attn.q_proj.bias": [q], p + "self_attn.k_proj.bias": [kv]}
            out |= {p + "self_attn.v_proj.bias": [kv]}
        if attention_bias:
            out[p + "self_attn.o_proj.bias"] = [h]
        if family in ("qwen3", "qwen3_moe", "gemma3_text"):
            out |= {p + "self_attn.q_norm.weight": [hd], p + "self_attn.k_norm.weight": [hd]}
        if family == "gemma3_text":
            out |= {
                p + "pre_feedforward_layernorm.weight": [h],
                p + "post_feedforward_layernorm.weight": [h],
            }
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
    assert config["model_type"] == {"gemma3": "gemma3_text"}.get(family, family)
    assert config["architectures"] == [
        {
            "llama": "LlamaForCausalLM",
            "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM",
            "gemma3": "Gemma3ForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM",
            "mixtral": "MixtralForCausalLM",
            "phi3": "Phi3ForCausalLM",
        }[family]
    ]
    assert config["hidden_size"] == 64
    assert config["num_hidden_layers"] == {"gemma3": 4, "qwen3_moe": 3}.get(family, 2)
    assert config["num_attention_heads"] == 4 and config["num_key_value_heads"] == 2
    assert config["tie_word_embeddings"] == (family in ("qwen3", "mistral", "gemma3"))
    if family in ("qwen3", "qwen3_moe", "mixtral"):
        assert config["head_dim"] == 16
    if family == "qwen3_moe":
        # Two sparse layers around a dense one (mlp_only_layers), 8 experts of 32, 2 a token.
        moe = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "intermediate_size")
        assert [config[k] for k in moe] == [8, 2, 32, 128]
        assert config["mlp_only_layers"] == [1] and config["decoder_sparse_step"] == 1
        assert config["norm_topk_prob"] is True and config["attention_bias"] is False
        assert config["use_sliding_window"] is False and config["sliding_window"] is None
        assert config["output_router_logits"] is False and config["router_aux_loss_coef"] == 0.001
        assert config["rope_theta"] == 1e6 and config["rope_scaling"] is None
    if family == "mixtral":
        # intermediate_size is each expert's width.
        moe = ("num_local_experts", "num_experts_per_tok", "intermediate_size")
        assert [config[k] for k in moe] == [8, 2, 32]
        assert config["sliding_window"] is None and config["router_jitter_noise"] == 0.0
        assert config["output_router_logits"] is False and config["router_aux_loss_coef"] == 0.02
        assert config["rope_theta"] == 1e6 and config["rope_scaling"] is None
    if family == "gemma3":
        # Decoupled head_dim, an attention scale that is not head_dim, GELU, no hidden_act.
        assert config["head_dim"] == 32 and config["query_pre_attn_scalar"] == 24
        assert config["hidden_activation"] == "gelu_pytorch_tanh" and "hidden_act" not in config
        types = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
        assert config["layer_types"] == types
        # The pattern rule (layer i full when (i + 1) % pattern == 0) gives the same list.
        pattern = config["sliding_window_pattern"]
        assert [(i + 1) % pattern == 0 for i in range(4)] == [t == "full_attention" for t in types]
        assert config["sliding_window"] == 8
        assert config["rope_theta"] == 1e6 and config["rope_local_base_freq"] == 1e4
        assert config["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
        assert config["final_logit_softcapping"] is None
        assert config["attn_logit_softcapping"] is None
    if family == "phi3":
        # No head_dim key (hidden / heads = 16), half of it rotated: 4 LongRoPE factors a list;
        # 100 tokens run past the 64-token original context; a window of 48 in every layer.
        assert "head_dim" not in config and config["partial_rotary_factor"] == 0.5
        assert config["max_position_embeddings"] == 256
        assert config["original_max_position_embeddings"] == 64
        scaling = config["rope_scaling"]
        assert scaling["type"] == "longrope" and set(scaling) == {
            "type",
            "long_factor",
            "short_factor",
        }
        assert len(scaling["long_factor"]) == len(scaling["short_factor"]) == 4
        assert len(set(scaling["long_factor"]) | set(scaling["short_factor"])) == 8
        assert config["sliding_window"] == 48 and config["rope_theta"] == 10000.0
        assert config["pad_token_id"] == 0 and config["hidden_act"] == "silu"
        assert config["resid_pdrop"] == config["embd_pdrop"] == config["attention_dropout"] == 0
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
    # Norm weights and biases are deliberately not 1 / 0; Gemma's, offsets from 1, not 0.
    if family == "gemma3":
        assert abs(truth["model.norm.weight"].mean()) < 0.05
        assert not np.allclose(truth["model.norm.weight"], 0.0)
    else:
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
    low, low_routes = routed_logits(models[family, "bf16"], SEQ)
    # Rounding the weights moves a router's logits by about 0.005, enough to swap the second and
    # third experts where they were that close (positions 9 and 83 in qwen3_moe, 30 in mixtral):
    # a jump in that position's logits (8% and 3% of the range), not an error. Elsewhere (later
    # positions read that one through attention only) they stay within 1% of the range.
    routes = routed_logits(models[family, "f32"], SEQ)[1]
    rerouted = np.zeros(len(SEQ), dtype=bool)
    for layer, chosen in routes.items():
        rerouted |= (low_routes[layer] != chosen).any(axis=1)
    assert rerouted.sum() <= 3
    close = ~rerouted
    assert np.abs(low - ref)[close].max() < 0.02 * (ref.max() - ref.min())
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


@pytest.mark.parametrize("rope_form", ["v4", "v5"])
def test_gemma3_rope_per_layer_type(rope_form: str) -> None:
    # Full layers: base 1e6, divided by the linear factor 8; sliding layers: base 1e4, unscaled.
    cfg = build_config("gemma3", "tiny", rope_form=rope_form)
    exponents = np.arange(0, 32, 2) / 32
    full = inv_freq(gemma3_rope_config(cfg, "full_attention"), 32)
    sliding = inv_freq(gemma3_rope_config(cfg, "sliding_attention"), 32)
    np.testing.assert_allclose(full, 1.0 / 1e6**exponents / 8.0, rtol=1e-15)
    np.testing.assert_allclose(sliding, 1.0 / 1e4**exponents, rtol=1e-15)


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


# --------------------------------------------------------------------------
# Gemma 3


@pytest.mark.parametrize("family", FAMILIES)
def test_rope_v5_form_is_the_same_model(
    tmp_path: Path, f32_logits: dict[str, np.ndarray], family: str
) -> None:
    # transformers 5's rope_parameters spelling of the same RoPE gives the same logits, bit
    # for bit (the same frequencies come out of both).
    d = make_model(tmp_path / "v5", family, rope_form="v5")
    config = json.loads((d / "config.json").read_text())
    assert "rope_parameters" in config
    assert not {"rope_theta", "rope_scaling", "rope_local_base_freq"} & set(config)
    np.testing.assert_array_equal(reference_logits(d, SEQ), f32_logits[family])


def test_gemma3_v5_rope_parameters() -> None:
    cfg = build_config("gemma3", "tiny", rope_form="v5")
    assert cfg["rope_parameters"] == {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    }


def test_gemma3_pattern_without_layer_types(
    tmp_path: Path, f32_logits: dict[str, np.ndarray]
) -> None:
    # Gemma 3's Hub configs (transformers 4.50) have no layer_types, only sliding_window_pattern.
    d = make_model(tmp_path / "pattern", "gemma3", layer_types=None)
    assert json.loads((d / "config.json").read_text())["layer_types"] is None
    np.testing.assert_array_equal(reference_logits(d, SEQ), f32_logits["gemma3"])


def test_gemma3_overrides(tmp_path: Path) -> None:
    # Another layer count gets layer_types from the pattern (every third layer full).
    cfg = build_config("gemma3", "tiny", num_hidden_layers=6)
    assert [t[0] for t in cfg["layer_types"]] == list("ssfssf")
    # attention_bias puts biases on q, k, v and o alike.
    d = make_model(tmp_path / "bias", "gemma3", attention_bias=True)
    config = json.loads((d / "config.json").read_text())
    header = header_tensors(d / "model.safetensors")
    assert "model.layers.3.self_attn.o_proj.bias" in header
    assert {k: v["shape"] for k, v in header.items()} == expected_shapes(config)
    assert np.isfinite(reference_logits(d, SEQ[:20])).all()


# Gemma 3 features the tiny model must exercise: each changed alone moves the argmax of the
# 100-token sequence at 10 positions or more (measured: 85, 64, 92, 58, 22, 34, 41).
GEMMA3_CHANGES: dict[str, dict[str, Any]] = {
    "window-256": {"sliding_window": 256},  # every layer sees every key
    "window-7": {"sliding_window": 7},
    "all-full": {"layer_types": ["full_attention"] * 4},
    "all-sliding": {"layer_types": ["sliding_attention"] * 4},
    "scale-head-dim": {"query_pre_attn_scalar": 32},  # 1/sqrt(head_dim), the usual scale
    "full-rope-unscaled": {"rope_scaling": None},
    "sliding-rope-global-base": {"rope_local_base_freq": 1e6},
}


@pytest.mark.parametrize("change", GEMMA3_CHANGES)
def test_gemma3_features_show(
    tmp_path: Path, f32_logits: dict[str, np.ndarray], change: str
) -> None:
    other = reference_logits(make_model(tmp_path / "m", "gemma3", **GEMMA3_CHANGES[change]), SEQ)
    assert (other.argmax(1) != f32_logits["gemma3"].argmax(1)).sum() >= 10


def test_gemma3_final_softcap(tmp_path: Path, f32_logits: dict[str, np.ndarray]) -> None:
    # cap * tanh(logits / cap) on the same model; tanh is monotonic, so no argmax moves: tests of
    # the cap must compare values (30 moves them by 6e-4 of their range here).
    capped = reference_logits(
        make_model(tmp_path / "m", "gemma3", final_logit_softcapping=30.0), SEQ
    )
    plain = f32_logits["gemma3"]
    np.testing.assert_allclose(capped, 30.0 * np.tanh(plain / 30.0), rtol=0, atol=1e-12)
    assert np.abs(capped - plain).max() > 1e-4 * (plain.max() - plain.min())
    assert (capped.argmax(1) == plain.argmax(1)).all()


# --------------------------------------------------------------------------
# Phi-3


def test_phi3_rope() -> None:
    cfg = build_config("phi3", "tiny")
    base = 1.0 / 10000.0 ** (np.arange(0, 8, 2) / 8)  # rotary_dim 8 of head_dim 16
    long, short = cfg["rope_scaling"]["long_factor"], cfg["rope_scaling"]["short_factor"]
    stretch = math.sqrt(1 + math.log(256 / 64) / math.log(64))
    # Served context 256 (max_position_embeddings) > 64: the long factors; up to 64 the short.
    for context, factors in ((None, long), (65, long), (64, short), (8, short)):
        freqs, scale, rotary_dim = phi3_rope(cfg, 16, context)
        assert rotary_dim == 8 and scale == pytest.approx(stretch, rel=1e-15)
        np.testing.assert_allclose(freqs, base / np.array(factors), rtol=1e-15)
    # The whole context within the original one: short factors, no stretch.
    freqs, scale, _ = phi3_rope({**cfg, "original_max_position_embeddings": 256}, 16)
    np.testing.assert_allclose(freqs, base / np.array(short), rtol=1e-15)
    assert scale == 1.0
    # An explicit attention_factor wins; a `factor` replaces max / original in the formula.
    explicit = {**cfg, "rope_scaling": {**cfg["rope_scaling"], "attention_factor": 1.25}}
    assert phi3_rope(explicit, 16)[1] == 1.25
    factor = {**cfg, "rope_scaling": {**cfg["rope_scaling"], "factor": 16.0}}
    assert phi3_rope(factor, 16)[1] == pytest.approx(math.sqrt(1 + math.log(16) / math.log(64)))
    # No scaling: plain frequencies over the rotated part, and partial_rotary_factor 0.75.
    plain = phi3_rope({**cfg, "rope_scaling": None, "partial_rotary_factor": 0.75}, 16)
    np.testing.assert_allclose(plain[0], 1.0 / 10000.0 ** (np.arange(0, 12, 2) / 12))
    assert plain[1:] == (1.0, 12)
    # transformers 5's spelling reads the same; its rope_parameters' partial_rotary_factor wins.
    v5 = build_config("phi3", "tiny", rope_form="v5")
    np.testing.assert_array_equal(phi3_rope(v5, 16)[0], phi3_rope(cfg, 16)[0])
    v5_other = {**v5, "rope_parameters": {**v5["rope_parameters"], "partial_rotary_factor": 1.0}}
    with pytest.raises(ValueError, match="4 for rotary_dim 16"):
        phi3_rope(v5_other, 16)


def test_phi3_v5_rope_parameters() -> None:
    # What transformers 5's Phi3Config writes: rope_type inside, partial_rotary_factor and the
    # original context copied in (and still at top level).
    cfg = build_config("phi3", "tiny", rope_form="v5")
    assert cfg["rope_parameters"] == {
        "long_factor": [1.5, 2.25, 3.0, 3.75],
        "original_max_position_embeddings": 64,
        "partial_rotary_factor": 0.5,
        "rope_theta": 10000.0,
        "rope_type": "longrope",
        "short_factor": [1.0, 1.25, 1.75, 2.5],
    }
    assert cfg["partial_rotary_factor"] == 0.5 and cfg["original_max_position_embeddings"] == 64
    plain = build_config("phi3", "tiny", rope_form="v5", rope_scaling=None)
    assert plain["rope_parameters"] == {
        "partial_rotary_factor": 0.5,
        "rope_theta": 10000.0,
        "rope_type": "default",
    }


def test_phi3_is_llama_with_fused_projections(models: dict[tuple[str, str], Path]) -> None:
    # With every dimension rotated, no scaling and no window, Phi-3 is Llama with q/k/v and
    # gate/up fused: split the tensors and the Llama forward gives the same logits.
    d = models["phi3", "f32"]
    config = json.loads((d / "config.json").read_text())
    config.update(partial_rotary_factor=1.0, rope_scaling=None, sliding_window=None)
    raw = load_weights(d)
    split = dict(raw)
    for n in range(2):
        p = f"model.layers.{n}."
        q, k, v = np.split(split.pop(p + "self_attn.qkv_proj.weight"), [64, 96])
        gate, up = np.split(split.pop(p + "mlp.gate_up_proj.weight"), 2)
        split |= {p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k}
        split |= {p + "self_attn.v_proj.weight": v, p + "mlp.gate_proj.weight": gate}
        split[p + "mlp.up_proj.weight"] = up
    llama = {**config, "model_type": "llama"}
    np.testing.assert_allclose(
        forward(config, raw, SEQ, None), forward(llama, split, SEQ, None), rtol=0, atol=1e-12
    )


def test_phi3_served_context_picks_the_factors(
    tmp_path: Path, models: dict[tuple[str, str], Path], f32_logits: dict[str, np.ndarray]
) -> None:
    # Serving at most the original 64 positions is the model with the short factors in the long
    # list (the attention factor still the model's); the default serves max_position_embeddings.
    d = models["phi3", "f32"]
    short = reference_logits(d, SEQ, context=64)
    scaling = build_config("phi3", "tiny")["rope_scaling"]
    same = make_model(
        tmp_path / "m", "phi3", rope_scaling={**scaling, "long_factor": scaling["short_factor"]}
    )
    np.testing.assert_array_equal(short, reference_logits(same, SEQ))
    np.testing.assert_array_equal(reference_logits(d, SEQ, context=256), f32_logits["phi3"])
    np.testing.assert_array_equal(reference_logits(d, SEQ, context=65), f32_logits["phi3"])


# Phi-3 features the tiny model must exercise: each changed alone moves the argmax of the
# 100-token sequence at 10 positions or more (measured: 29, 10, 84, 65, 70, 71, 25, 67).
_PHI3_SCALING = build_config("phi3", "tiny")["rope_scaling"]
PHI3_CHANGES: dict[str, dict[str, Any]] = {
    "no-window": {"sliding_window": None},
    "window-47": {"sliding_window": 47},
    "all-rotary": {
        "partial_rotary_factor": 1.0,
        "rope_scaling": {
            **_PHI3_SCALING,
            "long_factor": _PHI3_SCALING["long_factor"] * 2,
            "short_factor": _PHI3_SCALING["short_factor"] * 2,
        },
    },
    "no-scaling": {"rope_scaling": None},
    "long-is-short": {
        "rope_scaling": {**_PHI3_SCALING, "long_factor": _PHI3_SCALING["short_factor"]}
    },
    "unit-long-factors": {"rope_scaling": {**_PHI3_SCALING, "long_factor": [1.0] * 4}},
    "attention-factor-1.25": {"rope_scaling": {**_PHI3_SCALING, "attention_factor": 1.25}},
    "original-context-256": {"original_max_position_embeddings": 256},
}


@pytest.mark.parametrize("change", PHI3_CHANGES)
def test_phi3_features_show(tmp_path: Path, f32_logits: dict[str, np.ndarray], change: str) -> None:
    other = reference_logits(make_model(tmp_path / "m", "phi3", **PHI3_CHANGES[change]), SEQ)
    assert (other.argmax(1) != f32_logits["phi3"].argmax(1)).sum() >= 10


def test_phi3_presets() -> None:
    # Phi3Config takes longrope or no scaling, not llama-1b's llama3: at that shape the phi3
    # takes Phi-4-mini's RoPE.
    one_b = build_config("phi3", "llama-1b", "bf16")
    assert one_b["rope_scaling"]["type"] == "longrope" and one_b["partial_rotary_factor"] == 0.75
    assert len(one_b["rope_scaling"]["long_factor"]) == 64 * 3 // 4 // 2
    assert one_b["original_max_position_embeddings"] == 4096 and one_b["tie_word_embeddings"]
    with pytest.raises(ValueError, match="phi3"):
        build_config("phi3", "gemma3-1b")
    smol = build_config("phi3", "smollm-135m", "bf16")
    assert smol["rope_scaling"] is None and smol["original_max_position_embeddings"] == 8192
    one = build_config("phi3", "smollm-135m", num_hidden_layers=1)
    assert {k: list(v.shape) for k, v in make_weights(one).items()} == expected_shapes(one)


# --------------------------------------------------------------------------
# mixture of experts

MOE_FAMILIES = ("qwen3_moe", "mixtral")


def routed_logits(model_dir: Path, seq: list[int]) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """Reference logits and, per MoE layer, the experts each position chose ([n, k], sorted)."""
    config = json.loads((model_dir / "config.json").read_text())
    router_logits: dict[int, np.ndarray] = {}
    logits = forward(config, load_weights(model_dir), seq, None, router_logits=router_logits)
    k = int(config.get("num_experts_per_tok", 0))
    return logits, {
        layer: np.sort(np.argsort(-r, axis=1)[:, :k], axis=1) for layer, r in router_logits.items()
    }


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_routing_is_decisive_and_varied(
    models: dict[tuple[str, str], Path], family: str
) -> None:
    # The tiny models' routers must make the engine's expert choice matter and be unambiguous:
    # every expert serves somewhere, and no position sits near a tie between the second and
    # third experts (which float32 rounding could break either way). Measured on SEQ (router std
    # 0.375): each expert fills 2..62 of a layer's 200 slots; the second and third experts'
    # logits differ by 0.0069 at least (qwen3_moe layer 2; mixtral 0.031), 0.09 at the 5th
    # percentile; the second expert's renormalized weight has a median of 0.19..0.32.
    d = models[family, "f32"]
    config = json.loads((d / "config.json").read_text())
    router_logits: dict[int, np.ndarray] = {}
    forward(config, load_weights(d), SEQ, None, router_logits=router_logits)
    assert sorted(router_logits) == ([0, 2] if family == "qwen3_moe" else [0, 1])
    for logits in router_logits.values():
        assert logits.shape == (len(SEQ), 8)
        top = -np.sort(-logits, axis=1)
        chosen = np.argsort(-logits, axis=1)[:, :2]
        assert np.bincount(chosen.ravel(), minlength=8).min() >= 2
        assert (top[:, 1] - top[:, 2]).min() > 5e-3
        assert np.percentile(top[:, 1] - top[:, 2], 5) > 0.05
        second = 1.0 / (1.0 + np.exp(top[:, 0] - top[:, 1]))  # its weight once renormalized
        assert np.median(second) > 0.1


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_routing_matters(
    models: dict[tuple[str, str], Path], f32_logits: dict[str, np.ndarray], family: str
) -> None:
    # Routers drawn again (same std, another seed) send the positions to other experts: the
    # argmax moves at many positions (measured 55 and 64 of 100), so an engine that routes
    # wrongly cannot pass the argmax tests of bf16 models.
    d = models[family, "f32"]
    config = json.loads((d / "config.json").read_text())
    raw = load_weights(d)
    rng = np.random.default_rng(99)
    routers = [k for k in raw if k.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight"))]
    assert len(routers) == 2
    for name in routers:
        raw[name] = rng.standard_normal(raw[name].shape) * 0.375
    other = forward(config, raw, SEQ, None)
    assert (other.argmax(1) != f32_logits[family].argmax(1)).sum() >= 30


def test_qwen3_moe_norm_topk_prob(tmp_path: Path, f32_logits: dict[str, np.ndarray]) -> None:
    # Without norm_topk_prob the two experts weigh their softmax probabilities over all 8
    # (about 0.9 together here) instead of summing to 1: the logits move by 6% of their range.
    plain = f32_logits["qwen3_moe"]
    off = reference_logits(make_model(tmp_path / "off", "qwen3_moe", norm_topk_prob=False), SEQ)
    assert np.abs(off - plain).max() > 0.02 * (plain.max() - plain.min())


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_of_identical_experts_is_one_mlp(
    models: dict[tuple[str, str], Path], family: str
) -> None:
    # With every expert a copy of expert 0 and the chosen experts' weights summing to 1
    # (renormalized), routing cannot matter: each MoE layer is that expert as a dense MLP. The
    # dense model is the same tensors under dense names: Mixtral's w1/w3/w2 as Mistral's
    # gate/up/down projections, a Qwen3-MoE with every layer in mlp_only_layers.
    d = models[family, "f32"]
    config = json.loads((d / "config.json").read_text())
    raw = load_weights(d)
    if family == "mixtral":
        block, names = "block_sparse_moe.", ("w1", "w3", "w2")
        dense_config = {**config, "model_type": "mistral"}
    else:
        block, names = "mlp.", ("gate_proj", "up_proj", "down_proj")
        dense_config = {**config, "mlp_only_layers": [0, 1, 2]}
    dense = dict(raw)
    for layer in [0, 1] if family == "mixtral" else [0, 2]:
        p = f"model.layers.{layer}."
        for name, dense_name in zip(names, ("gate_proj", "up_proj", "down_proj"), strict=True):
            first = raw[f"{p}{block}experts.0.{name}.weight"]
            for e in range(1, 8):
                raw[f"{p}{block}experts.{e}.{name}.weight"] = first
            dense[f"{p}mlp.{dense_name}.weight"] = first
    np.testing.assert_allclose(
        forward(config, raw, SEQ, None), forward(dense_config, dense, SEQ, None), rtol=0, atol=1e-12
    )


def test_qwen3_moe_sparse_layer_rule(tmp_path: Path) -> None:
    # transformers' rule: experts where (layer + 1) % decoder_sparse_step == 0, unless the layer
    # is in mlp_only_layers; dense MLPs (intermediate_size wide) elsewhere.
    for overrides, sparse in (
        ({"decoder_sparse_step": 2, "mlp_only_layers": []}, [1]),
        ({"decoder_sparse_step": 1, "mlp_only_layers": []}, [0, 1, 2]),
        ({"decoder_sparse_step": 1, "mlp_only_layers": [0, 2]}, [1]),
    ):
        d = make_model(
            tmp_path / f"m{sparse}{overrides['decoder_sparse_step']}", "qwen3_moe", **overrides
        )
        config = json.loads((d / "config.json").read_text())
        header = header_tensors(d / "model.safetensors")
        assert {k: v["shape"] for k, v in header.items()} == expected_shapes(config)
        assert (
            sorted(int(k.split(".")[2]) for k in header if k.endswith("mlp.gate.weight")) == sparse
        )
        logits, routes = routed_logits(d, SEQ[:20])
        assert sorted(routes) == sparse and np.isfinite(logits).all()


def test_moe_presets() -> None:
    # qwen3-moe-1b: 1.02B parameters, 0.34B of them used per token (two experts of eight);
    # qwen3-dense-0.3b: the same shape with one dense MLP doing the same work per token.
    moe = build_config("qwen3_moe", "qwen3-moe-1b", "bf16")
    dense = build_config("qwen3", "qwen3-dense-0.3b", "bf16")
    shape = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    for config in (moe, dense):
        assert [config[k] for k in shape] == [1024, 24, 16, 4]
        assert config["head_dim"] == 64 and config["vocab_size"] == 49152
        assert config["tie_word_embeddings"] and config["max_position_embeddings"] == 8192
    assert [moe[k] for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size")] == [
        8,
        2,
        1536,
    ]
    assert moe["decoder_sparse_step"] == 1 and moe["mlp_only_layers"] == []
    assert dense["intermediate_size"] == 3072
    moe_shapes = expected_shapes(moe)
    total = sum(int(np.prod(s)) for s in moe_shapes.values())
    unused = sum(int(np.prod(s)) for k, s in moe_shapes.items() if ".experts." in k) * 6 // 8
    dense_total = sum(int(np.prod(s)) for s in expected_shapes(dense).values())
    assert total == 1_019_465_728 and total - unused == 339_988_480
    # The dense model lacks only the routers (24 x 8 x 1024).
    assert dense_total == total - unused - 24 * 8 * 1024
    # The generator writes those names and shapes (one layer, to keep it quick).
    one = build_config("qwen3_moe", "qwen3-moe-1b", "bf16", num_hidden_layers=1)
    weights = make_weights(one)
    assert {k: list(v.shape) for k, v in weights.items()} == expected_shapes(one)
    # The presets are their families' only.
    with pytest.raises(ValueError, match="qwen3_moe"):
        build_config("llama", "qwen3-moe-1b")
    with pytest.raises(ValueError, match="qwen3"):
        build_config("qwen3_moe", "qwen3-dense-0.3b")
