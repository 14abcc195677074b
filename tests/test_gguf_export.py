"""GGUF export checked by running the exported file in llama.cpp.

llama.cpp's logits for the exported tiny f32 models must match the
independent NumPy reference (tests/reference.py), and its tokenizer must
split text exactly like the `tokenizers` package does with tokenizer.json.
The tests that run llama.cpp are skipped unless llama-cpp-python (the bench extra) is installed;
the export's own checks need only the `gguf` package (a test dependency).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import strata_rs
from reference import reference_logits

gguf = pytest.importorskip("gguf")
try:
    import llama_cpp
except ImportError:
    llama_cpp = None

needs_llama_cpp = pytest.mark.skipif(
    llama_cpp is None, reason="needs llama-cpp-python: pip install 'strata-rs[bench-llama-cpp]'"
)

from strata_rs.bench.gguf_export import export_gguf  # noqa: E402

VOCAB = 512  # the tiny preset's vocab_size
# Ids 0-2 are the special tokens; the rest are ordinary.  Seeded for replay.
SEQ = np.random.default_rng(7).integers(3, VOCAB, 40).tolist()
F32_REL_TOL = 1e-3  # of the reference logits' range
# f32 KV cache: llama.cpp's default f16 cache would dominate the error.
GGML_TYPE_F32 = 0

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Café naïve façade — déjà vu, Ærøskøbing, Ελληνικά, 日本語",
    "emoji 🦀🐍 and 👩‍💻 mixed with text",
    "line one\nline two\r\n\n\n  indented\ttabs\t\there  \n",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\nprint(f(12345))\n",
    "   leading and trailing spaces   ",
    "it's they're we'll I'd 1234567890 3.14159",
]

# (family, make_model overrides): the rope scaling each tiny preset ships
# (llama3 for llama, linear for mistral) plus plain RoPE.
CASES: list[tuple[str, dict[str, Any]]] = [
    ("llama", {"rope_scaling": None}),
    ("llama", {}),
    ("mistral", {}),
    ("qwen2", {}),
    ("qwen3", {}),
    # What GGUF can express of Gemma 3 (llama.cpp fixes the layer pattern and the attention
    # scale): six layers, the last global, the scale of the head size; a final soft cap.
    (
        "gemma3",
        {
            "num_hidden_layers": 6,
            "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
            "sliding_window_pattern": 6,
            "query_pre_attn_scalar": 32,
            "final_logit_softcapping": 30.0,
        },
    ),
    # Stacked experts; llama.cpp's qwen3moe has no dense layers and always renormalizes.
    ("qwen3_moe", {"mlp_only_layers": [], "norm_topk_prob": True}),
    ("mixtral", {}),
    # Fused attn_qkv and ffn_up, half of each head rotated, LongRoPE past the 64-token original
    # context (llama.cpp's n_ctx 128 and the reference's 256 both pick the long factors); the
    # window of 48 does not reach the 40 tokens (llama.cpp ignores phi3's window anyway: "Phi SWA
    # is currently disabled"). Then Phi-3-mini-4k's plain RoPE.
    ("phi3", {}),
    ("phi3", {"rope_scaling": None}),
]


def _case_id(case: tuple[str, dict[str, Any]]) -> str:
    family, overrides = case
    return family + ("-norope" if overrides.get("rope_scaling", 0) is None else "")


@pytest.fixture(scope="module")
def exported(
    model_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., tuple[Path, Path]]:
    """export(family, **overrides) -> (model folder, f32 GGUF), cached."""
    cache: dict[tuple[object, ...], tuple[Path, Path]] = {}

    def export(family: str, **overrides: Any) -> tuple[Path, Path]:
        key = (family, repr(sorted(overrides.items())))
        if key not in cache:
            folder = model_dir(family, "f32", **overrides)
            out = tmp_path_factory.mktemp("gguf") / f"{family}.gguf"
            # llama.cpp fixes up the special tokens of models whose general.name says Phi-3,
            # looking up SentencePiece's <s>, </s> and <unk>, which the tiny byte-level
            # vocabulary lacks: the file is named otherwise.
            cache[key] = (folder, export_gguf(folder, out, "f32", name="tiny"))
        return cache[key]

    return export


@needs_llama_cpp
@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_llama_cpp_logits_match_reference(
    exported: Callable[..., tuple[Path, Path]], case: tuple[str, dict[str, Any]]
) -> None:
    family, overrides = case
    folder, path = exported(family, **overrides)
    llm = llama_cpp.Llama(
        model_path=str(path),
        n_ctx=128,
        n_batch=64,
        n_threads=2,
        logits_all=True,
        type_k=GGML_TYPE_F32,
        type_v=GGML_TYPE_F32,
        verbose=False,
    )
    try:
        llm.eval(SEQ)
        got = np.array(llm.scores[: len(SEQ)], dtype=np.float64)
    finally:
        llm.close()
    want = reference_logits(folder, SEQ)
    assert got.shape == want.shape
    diff = float(np.abs(got - want).max())
    span = float(np.ptp(want))
    assert diff <= F32_REL_TOL * span, f"max |diff| {diff:.3g} vs logit range {span:.3g}"
    assert (got.argmax(-1) == want.argmax(-1)).all()


@needs_llama_cpp
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_llama_cpp_tokenizer_matches_tokenizers(
    exported: Callable[..., tuple[Path, Path]], family: str
) -> None:
    from tokenizers import Tokenizer

    folder, path = exported(family, rope_scaling=None) if family == "llama" else exported(family)
    hf = Tokenizer.from_file(str(folder / "tokenizer.json"))
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        for text in TEXTS:
            want = hf.encode(text, add_special_tokens=False).ids
            got = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
            assert got == want, text
            # Special tokens are parsed only when asked for.
            chat = f"<|im_start|>user\n{text}<|im_end|>"
            assert llm.tokenize(chat.encode(), add_bos=False, special=True) == hf.encode(chat).ids
            assert llm.detokenize(got).decode("utf-8") == text
    finally:
        llm.close()


@needs_llama_cpp
def test_llama_cpp_bf16_close_to_reference(model_dir: Callable[..., Path], tmp_path: Path) -> None:
    # bf16 checkpoint copied bit for bit (q/k rows permuted as raw bits).
    # llama.cpp rounds activations to bf16 for bf16 matmuls, so the bound
    # only catches layout mistakes, which scramble the logits entirely.
    folder = model_dir("llama", "bf16", rope_scaling=None)
    path = export_gguf(folder, tmp_path / "m.gguf", "bf16")
    llm = llama_cpp.Llama(
        model_path=str(path), n_ctx=128, n_batch=64, n_threads=2, logits_all=True, verbose=False
    )
    try:
        llm.eval(SEQ)
        got = np.array(llm.scores[: len(SEQ)], dtype=np.float64)
    finally:
        llm.close()
    want = reference_logits(folder, SEQ)
    assert float(np.abs(got - want).max()) <= 0.05 * float(np.ptp(want))
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


def test_export_metadata(exported: Callable[..., tuple[Path, Path]]) -> None:
    folder, path = exported("llama")
    fields = {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items()}
    assert fields["general.architecture"] == "llama"
    assert fields["tokenizer.ggml.model"] == "gpt2"
    assert fields["tokenizer.ggml.pre"] == "gpt-2"
    assert fields["tokenizer.ggml.bos_token_id"] == 1
    assert fields["tokenizer.ggml.eos_token_id"] == 2
    # Nothing in the folder says whether to add BOS (no add_bos_token, no post-processor), so
    # there is no key, as llama.cpp's converter writes it: llama.cpp and strata-rs then take the
    # "gpt-2" pre-tokenizer's default, false, as transformers adds none.
    assert "tokenizer.ggml.add_bos_token" not in fields
    assert strata_rs.Tokenizer.load(path).encode(TEXTS[0]) == hf_ids(folder, TEXTS[0])
    assert len(fields["tokenizer.ggml.tokens"]) == VOCAB
    assert fields["tokenizer.ggml.token_type"][:3] == [int(gguf.TokenType.CONTROL)] * 3
    assert "<|im_start|>" in fields["tokenizer.chat_template"]


def hf_ids(folder: Path, text: str) -> list[int]:
    """The folder's tokenizer.json ids for `text`, special tokens added as it adds them."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids


def test_export_special_tokens_as_tokenizer_config_says(tmp_path: Path) -> None:
    # As llama.cpp's converter takes them (gguf's SpecialVocab): the ids of tokenizer_config.json's
    # tokens before config.json's ids (generation_config.json's first eos id, 2, is not read),
    # its add_bos/add_eos flags and its chat template.
    from strata_rs.testing.models import make_model

    folder = make_model(tmp_path / "llama", "llama")
    config_path = folder / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    tok_config.update(
        add_bos_token=True,
        add_eos_token=False,
        eos_token="<|endoftext|>",
        pad_token="<|im_end|>",
        chat_template="{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
    )
    config_path.write_text(json.dumps(tok_config))
    path = export_gguf(folder, tmp_path / "m.gguf", "f32")
    fields = {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items()}
    tok = json.loads((folder / "tokenizer.json").read_text())
    ids = {added["content"]: added["id"] for added in tok["added_tokens"]}
    assert fields["tokenizer.ggml.bos_token_id"] == ids["<|im_start|>"] == 1
    assert fields["tokenizer.ggml.eos_token_id"] == ids["<|endoftext|>"] == 0
    assert fields["tokenizer.ggml.padding_token_id"] == ids["<|im_end|>"] == 2
    assert fields["tokenizer.ggml.add_bos_token"] is True
    assert fields["tokenizer.ggml.add_eos_token"] is False
    assert fields["tokenizer.chat_template"] == tok_config["chat_template"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    assert fields["tokenizer.ggml.merges"] == merges
    # strata-rs adds the BOS the file asks for.
    assert strata_rs.Tokenizer.load(path).encode("Hi")[0] == 1


# Phi-4-mini's RoPE (three quarters of each head rotated) with a tied head, in transformers 5's
# spelling.
PHI4_MINI: dict[str, Any] = {
    "rope_form": "v5",
    "partial_rotary_factor": 0.75,
    "rope_scaling": {
        "long_factor": [1.25, 1.5, 2.0, 2.5, 3.25, 4.0],
        "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.75],
        "type": "longrope",
    },
    "tie_word_embeddings": True,
}


@pytest.mark.parametrize("variant", ["phi3", "phi4-mini", "no-scaling"])
def test_export_phi3_as_llama_cpp_converts_it(tmp_path: Path, variant: str) -> None:
    # The keys and tensors of llama.cpp's converter (convert_hf_to_gguf.py, Phi3MiniModel).
    from strata_rs.testing.models import make_model

    overrides = {"phi4-mini": PHI4_MINI, "no-scaling": {"rope_scaling": None}}.get(variant, {})
    folder = make_model(tmp_path / variant, "phi3", **overrides)
    path = export_gguf(folder, tmp_path / "m.gguf", "f32")
    reader = gguf.GGUFReader(path)
    fields = {k: f.contents() for k, f in reader.fields.items()}
    rotary = 12 if variant == "phi4-mini" else 8
    want = {
        "general.architecture": "phi3",
        "phi3.context_length": 256,
        "phi3.rope.scaling.original_context_length": 64,
        "phi3.embedding_length": 64,
        "phi3.feed_forward_length": 128,
        "phi3.block_count": 2,
        "phi3.attention.head_count": 4,
        "phi3.attention.head_count_kv": 2,
        "phi3.rope.dimension_count": rotary,
        "phi3.rope.freq_base": 10000.0,
        "phi3.attention.sliding_window": 48,
    }
    assert {k: fields.get(k) for k in want} == want
    assert fields["phi3.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    # No key or value length: head_dim is hidden_size / heads.
    assert "phi3.attention.key_length" not in fields
    tensors = {t.name: (t.tensor_type, [int(d) for d in reversed(t.shape)]) for t in reader.tensors}
    f32 = gguf.GGMLQuantizationType.F32
    # Fused, q rows then k then v (no permutation: llama.cpp rotates phi3 in halves), and the
    # fused gate_up_proj as ffn_up, gate rows first.
    assert tensors["blk.1.attn_qkv.weight"] == (f32, [(4 + 2 * 2) * 16, 64])
    assert tensors["blk.1.ffn_up.weight"] == (f32, [2 * 128, 64])
    assert tensors["blk.1.ffn_down.weight"] == (f32, [64, 128])
    assert "blk.0.ffn_gate.weight" not in tensors and "blk.0.attn_q.weight" not in tensors
    assert ("output.weight" in tensors) == (variant != "phi4-mini")
    if variant == "no-scaling":
        assert "phi3.rope.scaling.attn_factor" not in fields
        assert not {"rope_factors_long.weight", "rope_factors_short.weight"} & set(tensors)
    else:
        # sqrt(1 + ln(256 / 64) / ln 64), stored f32.
        assert fields["phi3.rope.scaling.attn_factor"] == pytest.approx(math.sqrt(4 / 3), 1e-7)
        scaling = PHI4_MINI["rope_scaling"] if variant == "phi4-mini" else None
        config = json.loads((folder / "config.json").read_text())
        scaling = scaling or config["rope_scaling"]
        by_name = {t.name: t for t in reader.tensors}
        for which in ("long", "short"):
            t = by_name[f"rope_factors_{which}.weight"]
            assert tensors[t.name] == (f32, [rotary // 2])
            np.testing.assert_array_equal(
                np.asarray(t.data), np.float32(scaling[f"{which}_factor"])
            )
    # The reference reads the file back to the model it came from (factors and the attention
    # factor stored f32), for either choice of LongRoPE factors.
    for context in (64, 256):
        want_logits = reference_logits(folder, SEQ, context=context)
        got = reference_logits(path, SEQ, context=context)
        assert np.abs(got - want_logits).max() <= 1e-6 * float(np.ptp(want_logits))


def test_export_bf16_rounds_and_keeps_norms_f32(
    model_dir: Callable[..., Path], tmp_path: Path
) -> None:
    folder = model_dir("qwen3", "f32")
    reader = gguf.GGUFReader(export_gguf(folder, tmp_path / "m.gguf", "bf16"))
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["token_embd.weight"] == gguf.GGMLQuantizationType.BF16
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.BF16
    assert types["blk.0.attn_norm.weight"] == gguf.GGMLQuantizationType.F32
    assert types["blk.0.attn_q_norm.weight"] == gguf.GGMLQuantizationType.F32


def test_export_rejects_unsupported_rope_scaling(
    model_dir: Callable[..., Path], tmp_path: Path
) -> None:
    # Only config.json matters: the export checks it before reading weights.
    folder = tmp_path / "yarn"
    folder.mkdir()
    config = json.loads((model_dir("qwen2", "f32") / "config.json").read_text())
    for scaling, message in [
        ({"rope_type": "dynamic", "factor": 4.0}, "rope scaling 'dynamic' is not supported"),
        (
            {"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.2},
            "YaRN's attention_factor is not supported",
        ),
        ({"rope_type": "yarn", "factor": 4.0, "truncate": False}, "YaRN's truncate=false"),
    ]:
        config["rope_scaling"] = scaling
        (folder / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=message):
            export_gguf(folder, tmp_path / "m.gguf", "f32")
