"""Quantized GGUF models against the independent NumPy reference.

Each model folder is exported to GGUF with its matrices in one ggml block
format (the `gguf` package quantizes the legacy formats, strata's own
quantizer the K-quants and IQ4), then the engine's logits are compared with
`reference.py`'s float64 forward over the same file's tensors, dequantized by
`gguf.quants.dequantize` (not by strata-rs).

Tolerance.  The weights are the same on both sides; what differs is that
strata-rs quantizes each activation row to 8 bits before a quantized product
(one scale d = amax/127 per block of 32, or per 256 for the K-quants), as
llama.cpp does.  Rounding moves an element by at most d/2 = amax/254, so one
product is off by at most 1/254 (0.39%) of sum |x||w|.  The longest chain of
quantized products from the embedding to the logits in these two-layer models
is nine (q/k/v, o, gate/up, down per layer, then the head); adding the
worst cases gives 9/254 = 3.5% of the logits' range.  ACT_Q8_REL_TOL is that
bound.

Argmax.  The issue asks for 99% argmax agreement over 300 positions; on these
random-weight models (nearly flat logits) 8-bit activations alone flip more:
llama.cpp itself, on the same files against the same reference, agrees at
97.3% (q8_0), 93.0% (q4_0) and 95.0% (q4_1) of the positions (llama-cpp-python
0.3.36, measured once; CI has no llama.cpp).  So what is asserted: every flip is
a near-tie the error bound allows (the reference's logit of strata's pick is
within 2 x the bound of its best), and the agreement is at least 90% (below
llama.cpp's lowest, 93.0%, by the margin of one flip in twenty).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import strata_rs
from reference import reference_logits

pytestmark = pytest.mark.anyio
gguf = pytest.importorskip("gguf")

from strata_rs.bench.gguf_export import export_gguf  # noqa: E402

ACT_Q8_REL_TOL = 9 / 254
ARGMAX_AGREEMENT = 0.90
POSITIONS = 300
# Rows of 256 and 512 columns: whole blocks of every format (the K-quants' are 256).
SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 1024,
}
TYPES = (
    "q8_0",
    "q4_0",
    "q4_1",
    "q5_0",
    "q5_1",
    "q2_k",
    "q3_k",
    "q4_k",
    "q5_k",
    "q6_k",
    "iq4_nl",
    "iq4_xs",
)
SEQ = np.random.default_rng(7).integers(0, 512, POSITIONS).tolist()

MakeModel = Callable[..., Path]


async def engine_logits(path: Path, ids: list[int], **load_args: Any) -> np.ndarray:
    engine = await strata_rs.Engine.load(str(path), **load_args)
    try:
        return await engine.logits(ids)
    finally:
        await engine.close()


def agreement(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.mean(got.argmax(axis=-1) == want.argmax(axis=-1)))


def check(got: np.ndarray, path: Path, what: str) -> None:
    want = reference_logits(path, SEQ)
    assert got.shape == want.shape and np.isfinite(got).all(), what
    span = float(want.max() - want.min())
    worst = float(np.abs(got.astype(np.float64) - want).max())
    assert worst <= ACT_Q8_REL_TOL * span, f"{what}: max diff {worst:.4f} of range {span:.3f}"
    agree = agreement(got, want)
    print(f"{what}: max diff {worst / span:.2%} of the range; argmax {agree:.1%}")
    rows = np.arange(len(want))
    lost = want.max(axis=-1) - want[rows, got.argmax(axis=-1)]
    assert lost.max() <= 2 * ACT_Q8_REL_TOL * span, f"{what}: a flip past the bound"
    assert agree >= ARGMAX_AGREEMENT, f"{what}: argmax agrees at {agree:.1%} of positions"


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    from strata_rs.testing.models import make_model

    root = tmp_path_factory.mktemp("gguf")
    cache: dict[tuple[str, str], Path] = {}

    def get(family: str, dtype: str) -> Path:
        if (family, dtype) not in cache:
            folder = root / family
            if not folder.exists():
                make_model(folder, family, "tiny", "f32", 0, **SHAPE)
            cache[(family, dtype)] = export_gguf(folder, root / f"{family}-{dtype}.gguf", dtype)
        return cache[(family, dtype)]

    return get


@pytest.mark.parametrize("dtype", TYPES)
async def test_each_type_matches_the_reference(
    exported: Callable[[str, str], Path], dtype: str
) -> None:
    path = exported("llama", dtype)
    got = await engine_logits(path, SEQ)
    check(got, path, f"llama {dtype}")


@pytest.mark.parametrize(("family", "dtype"), [("qwen2", "q4_k"), ("qwen3", "q8_0")])
async def test_other_families(
    exported: Callable[[str, str], Path], family: str, dtype: str
) -> None:
    path = exported(family, dtype)
    got = await engine_logits(path, SEQ)
    check(got, path, f"{family} {dtype}")


async def test_the_engine_reports_the_file(exported: Callable[[str, str], Path]) -> None:
    path = exported("llama", "q4_k")
    engine = await strata_rs.Engine.load(str(path))
    try:
        assert engine.info["format"] == "gguf"
        assert engine.info["dtype"] == "q4_k"
        assert engine.info["model_dir"] == str(path)
    finally:
        await engine.close()
    # The folder holding the file loads it too.
    engine = await strata_rs.Engine.load(str(path.parent / "llama"))
    try:
        assert engine.info["format"] == "hf"
    finally:
        await engine.close()


@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q5_K_M", "Q6_K", "Q4_0"])
async def test_files_from_llama_cpps_quantizer(
    exported: Callable[[str, str], Path], tmp_path: Path, ftype: str
) -> None:
    """Files made by llama.cpp's own quantizer (mixed types, as people download them)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from strata_rs.bench.quantize import quantize_gguf

    source = exported("llama", "f32")
    out = quantize_gguf(source, tmp_path / f"{ftype}.gguf", ftype)
    assert llama_cpp is not None
    got = await engine_logits(out, SEQ)
    check(got, out, f"llama.cpp {ftype}")
