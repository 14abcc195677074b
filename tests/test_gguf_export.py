"""GGUF export checked by running the exported file in llama.cpp.

llama.cpp's logits for the exported tiny f32 models must match the
independent NumPy reference (tests/reference.py), and its tokenizer must
split text exactly like the `tokenizers` package does with tokenizer.json.
The tests that run llama.cpp are skipped unless llama-cpp-python (the bench extra) is installed;
the export's own checks need only the `gguf` package (a test dependency).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
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
            cache[key] = (folder, export_gguf(folder, out, "f32"))
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
    _, path = exported("llama")
    fields = {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items()}
    assert fields["general.architecture"] == "llama"
    assert fields["tokenizer.ggml.model"] == "gpt2"
    assert fields["tokenizer.ggml.pre"] == "gpt-2"
    assert fields["tokenizer.ggml.bos_token_id"] == 1
    assert fields["tokenizer.ggml.eos_token_id"] == 2
    assert fields["tokenizer.ggml.add_bos_token"] is False
    assert len(fields["tokenizer.ggml.tokens"]) == VOCAB
    assert fields["tokenizer.ggml.token_type"][:3] == [int(gguf.TokenType.CONTROL)] * 3
    assert "<|im_start|>" in fields["tokenizer.chat_template"]


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
