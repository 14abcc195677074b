"""Quantize on load: a Hugging Face folder's matrices quantized at `Engine.load(quantize=)`.

The reference is independent of the engine's forward: the folder's matrices are quantized
by `strata_rs.quantize` (the quantizer under test, the same blocks the engine makes), turned
back into floats by the `gguf` package's dequantizer, and run through `reference.py`'s
float64 forward. The engine must agree within the bound tests/quantized_logits.py derives for
8-bit activations, and every argmax flip must be a near-tie within it.

What is quantized, as `Engine.load`'s doc says: every layer matrix to the type asked, the
head to q6_k (q8_0 for "q8_0"), a matrix whose rows are not whole blocks to q8_0, the
embedding as stored.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import strata_rs
from quantized_logits import SHAPE, check_quantized_logits
from reference import forward, load_weights

pytestmark = pytest.mark.anyio
gguf = pytest.importorskip("gguf")

from strata_rs.bench.gguf_export import export_gguf  # noqa: E402

POSITIONS = 300
SEQ = np.random.default_rng(11).integers(0, 512, POSITIONS).tolist()
MATRICES = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def quantized(w: np.ndarray, want: str) -> tuple[np.ndarray, str, int]:
    """`w` as the engine quantizes it: (dequantized by the gguf package, the type used, its
    bytes)."""
    cols = w.shape[1]
    ty = next((t for t in (want, "q8_0") if cols % (256 if t.endswith("_k") else 32) == 0), None)
    if ty is None:
        return w, "as stored", w.nbytes
    blocks = strata_rs.quantize(np.ascontiguousarray(w, dtype=np.float32), ty)
    qtype = gguf.GGMLQuantizationType[ty.upper()]
    return gguf.quants.dequantize(blocks, qtype).reshape(w.shape), ty, blocks.nbytes


class Reference:
    """The reference logits over SEQ, the types the matrices were given, and the bytes the
    engine's memory accounting must hold for the weights."""

    def __init__(self, folder: Path, ty: str) -> None:
        config: dict[str, Any] = json.loads((folder / "config.json").read_text())
        stored = load_weights(folder)
        raw = {k: v.astype(np.float32) for k, v in stored.items()}
        self.used: set[str] = set()
        # The embedding as stored, the 1-D tensors as f32, the matrices as quantized.
        stored_size = {"float32": 4, "bfloat16": 2, "float16": 2}[config["torch_dtype"]]
        self.weight_bytes = stored["model.embed_tokens.weight"].size * stored_size
        self.weight_bytes += sum(4 * v.size for v in stored.values() if v.ndim == 1)
        for layer in range(int(config["num_hidden_layers"])):
            for m in MATRICES:
                name = f"model.layers.{layer}.{m}.weight"
                raw[name], t, nbytes = quantized(raw[name], ty)
                self.used.add(t)
                self.weight_bytes += nbytes
        tied = config["tie_word_embeddings"]
        head = raw["model.embed_tokens.weight" if tied else "lm_head.weight"]
        raw["lm_head.weight"], t, nbytes = quantized(head, "q8_0" if ty == "q8_0" else "q6_k")
        self.used.add(t)
        # The head is its own quantized matrix now (also when tied), the embedding as stored.
        self.weight_bytes += nbytes
        self.logits = forward({**config, "tie_word_embeddings": False}, raw, SEQ, None)


async def logits(
    folder: Path, ids: list[int], **load: Any
) -> tuple[np.ndarray, dict[str, Any], int]:
    """The engine's logits, its info, and the bytes its CPU pool holds for the weights."""
    engine = await strata_rs.Engine.load(str(folder), **load)
    try:
        got = await engine.logits(ids)
        weights = engine.stats()["memory"]["cpu"]["in_use_bytes"]["weights"]
        return got, engine.info, weights
    finally:
        await engine.close()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    from strata_rs.testing.models import make_model

    root = tmp_path_factory.mktemp("quantize")

    def get(family: str, dtype: str, **shape: int) -> Path:
        out = root / f"{family}-{dtype}-{len(shape)}"
        if not out.exists():
            make_model(out, family, "tiny", dtype, 0, **{**SHAPE, **shape})
        return out

    return get


@pytest.mark.parametrize(
    ("family", "dtype", "ty"),
    [
        ("llama", "f32", "q4_k"),
        ("llama", "bf16", "q6_k"),
        ("llama", "f16", "q8_0"),
        ("qwen3", "bf16", "q4_k"),
    ],
)
async def test_quantized_at_load_matches_the_reference(
    folder: Callable[..., Path], family: str, dtype: str, ty: str
) -> None:
    path = folder(family, dtype)
    got, info, weights = await logits(path, SEQ, quantize=ty)
    ref = Reference(path, ty)
    assert ref.used == {ty, "q8_0" if ty == "q8_0" else "q6_k"}
    assert info["quantize"] == ty
    assert info["dtype"] == ty
    assert info["format"] == "hf"
    # The device's accounting holds the quantized sizes (and a tied head's own copy: qwen3).
    assert weights == ref.weight_bytes
    check_quantized_logits(got, ref.logits, f"{family} {dtype} -> {ty}")


async def test_rows_that_are_not_whole_blocks_fall_back_to_q8_0(
    folder: Callable[..., Path],
) -> None:
    # Hidden 96: rows of 96 are not whole 256-blocks (q8_0 instead); the MLP's down rows of
    # 256 are.
    path = folder("llama", "f32", hidden_size=96, intermediate_size=256, head_dim=24)
    got, info, weights = await logits(path, SEQ, quantize="q4_k")
    ref = Reference(path, "q4_k")
    assert ref.used == {"q4_k", "q8_0"}
    assert weights == ref.weight_bytes
    assert info["quantize"] == "q4_k"
    # Six of the seven matrices a layer has hold rows of 96: q8_0 holds the most bytes.
    assert info["dtype"] == "q8_0"
    check_quantized_logits(got, ref.logits, "llama hidden 96 -> q4_k")


async def test_quantized_weights_decode_what_logits_predict(
    folder: Callable[..., Path],
) -> None:
    """The engine's greedy stream on the quantized weights follows its own logits (the
    decode path, one row per step, against the prefill path's rows)."""
    path = folder("llama", "f32")
    prompt = SEQ[:12]
    engine = await strata_rs.Engine.load(str(path), quantize="q4_k")
    try:
        out: list[int] = []
        async for chunk in engine.generate(prompt, max_tokens=16, temperature=0.0, ignore_eos=True):
            out.extend(chunk.token_ids)
        full = await engine.logits(prompt + out)
    finally:
        await engine.close()
    assert len(out) == 16
    assert full[len(prompt) - 1 : -1].argmax(axis=-1).tolist() == out


async def test_bad_quantize_values_are_refused(folder: Callable[..., Path], tmp_path: Path) -> None:
    path = folder("llama", "f32")
    with pytest.raises(strata_rs.InvalidRequest) as e:
        await strata_rs.Engine.load(str(path), quantize="q5_k")
    assert str(e.value) == 'quantize: must be "q8_0", "q4_k" or "q6_k", got "q5_k"'
    with pytest.raises(strata_rs.InvalidRequest) as e:
        await strata_rs.Engine.load(str(path), quantize=4)  # type: ignore[arg-type]
    assert str(e.value).startswith("quantize: ")
    gguf_path = export_gguf(path, tmp_path / "m.gguf", "q8_0")
    with pytest.raises(strata_rs.InvalidRequest) as e:
        await strata_rs.Engine.load(str(gguf_path), quantize="q4_k")
    assert str(e.value) == (
        f"quantize: {gguf_path} is a GGUF file, already in its stored types; quantize "
        "applies to Hugging Face folders"
    )
