"""Quantized GGUF models against the independent NumPy reference.

Each model folder is exported to GGUF with its matrices in one ggml block
format (the `gguf` package quantizes the legacy formats, strata's own
quantizer the K-quants and IQ4), then the engine's logits are compared with
`reference.py`'s float64 forward over the same file's tensors, dequantized by
`gguf.quants.dequantize` (not by strata-rs).

The tolerance and the argmax floor, and why: tests/quantized_logits.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import strata_rs
from quantized_logits import ACT_Q8_REL_TOL, SHAPE, check_quantized_logits
from reference import reference_logits

pytestmark = pytest.mark.anyio
gguf = pytest.importorskip("gguf")

from strata_rs.bench.gguf_export import export_gguf  # noqa: E402

POSITIONS = 300
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
# Quantized mixtures of experts: see check_routed.
ROUTED_ARGMAX_AGREEMENT = 0.85

MakeModel = Callable[..., Path]


async def engine_logits(path: Path, ids: list[int], **load_args: Any) -> np.ndarray:
    engine = await strata_rs.Engine.load(str(path), **load_args)
    try:
        return await engine.logits(ids)
    finally:
        await engine.close()


def check(got: np.ndarray, path: Path, what: str) -> None:
    check_quantized_logits(got, reference_logits(path, SEQ), what)


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


# A tiny Gemma 3 that GGUF can express (llama.cpp fixes the layer pattern and the attention
# scale by architecture): six layers, the last one global, the scale of its head size.
GEMMA3_GGUF = {
    "num_hidden_layers": 6,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    "sliding_window_pattern": 6,
    "query_pre_attn_scalar": SHAPE["head_dim"],
    "final_logit_softcapping": 30.0,
}


async def test_gemma3_file_answers_as_its_folder(tmp_path: Path) -> None:
    from strata_rs.testing.models import make_model

    folder = make_model(tmp_path / "gemma3", "gemma3", "tiny", "f32", 0, **SHAPE, **GEMMA3_GGUF)
    # In f32 the file holds the folder's numbers, the norms' 1 added by the export rather than
    # at load: the same bits in, the same logits out.
    f32 = export_gguf(folder, tmp_path / "gemma3-f32.gguf", "f32")
    want = await engine_logits(folder, SEQ)
    np.testing.assert_array_equal(await engine_logits(f32, SEQ), want)
    check_quantized_logits(want, reference_logits(f32, SEQ), "gemma3 f32 file")
    for dtype in ("q8_0", "q4_k"):
        path = export_gguf(folder, tmp_path / f"gemma3-{dtype}.gguf", dtype)
        check(await engine_logits(path, SEQ), path, f"gemma3 {dtype}")


def longrope(rotary_dim: int) -> dict[str, Any]:
    """LongRoPE factors for `rotary_dim` rotated dimensions (distinct short and long sets)."""
    n = rotary_dim // 2
    return {
        "type": "longrope",
        "short_factor": [1.0 + 0.05 * i for i in range(n)],
        "long_factor": [1.0 + 0.4 * i for i in range(n)],
    }


@pytest.mark.parametrize(
    ("overrides", "dtypes"),
    [
        # Phi-3: half of each head rotates, untied, LongRoPE past the original 64 positions, a
        # 48-token window.
        ({"partial_rotary_factor": 0.5, "rope_scaling": longrope(32)}, ("q8_0", "q4_k")),
        # Phi-4-mini's shape of it: three quarters rotate, tied embeddings. Not Q4_K: on this
        # model (windowless) llama.cpp's own Q4_K logits are 3.97% of the range off the
        # reference of the file, past the bound of tests/quantized_logits.py (3.54%), and
        # strata's 4.16%; on the llama model of the same shape both are at 2.2%.
        (
            {
                "partial_rotary_factor": 0.75,
                "rope_scaling": longrope(48),
                "tie_word_embeddings": True,
            },
            ("q8_0", "q6_k"),
        ),
    ],
    ids=["phi3", "phi4-mini"],
)
async def test_phi3_file_answers_as_its_folder(
    tmp_path: Path, overrides: dict[str, Any], dtypes: tuple[str, ...]
) -> None:
    """A phi3 file holds q/k/v and gate/up fused (attn_qkv, ffn_up) and the LongRoPE factors
    as tensors; it answers as its folder, quantized as the reference of its file."""
    from strata_rs.testing.models import make_model

    folder = make_model(tmp_path / "phi", "phi3", "tiny", "f32", 0, **SHAPE, **overrides)
    want = await engine_logits(folder, SEQ)
    f32 = export_gguf(folder, tmp_path / "phi-f32.gguf", "f32")
    # The file stores the attention factor in f32 (the folder's is computed in f64).
    np.testing.assert_allclose(
        await engine_logits(f32, SEQ), want, rtol=0, atol=1e-5 * np.ptp(want)
    )
    check_quantized_logits(want, reference_logits(f32, SEQ), "phi3 f32 file")
    for dtype in dtypes:
        path = export_gguf(folder, tmp_path / f"phi-{dtype}.gguf", dtype)
        check(await engine_logits(path, SEQ), path, f"phi3 {dtype}")


@pytest.mark.parametrize(
    ("family", "overrides", "dtype"),
    [
        ("qwen3_moe", {"norm_topk_prob": True}, "q4_k"),
        ("mixtral", {}, "q8_0"),
        ("mixtral", {}, "q4_k"),
    ],
)
async def test_experts_file_answers_as_its_folder(
    tmp_path: Path, family: str, overrides: dict[str, Any], dtype: str
) -> None:
    """Stacked experts (one `ffn_*_exps` tensor per matrix) read as the folder's per-expert
    tensors; Qwen3-MoE's dense layer (mlp_only_layers) stays dense."""
    from strata_rs.testing.models import make_model

    folder = make_model(tmp_path / family, family, "tiny", "f32", 0, **SHAPE, **overrides)
    want = await engine_logits(folder, SEQ)
    f32 = export_gguf(folder, tmp_path / f"{family}-f32.gguf", "f32")
    got = await engine_logits(f32, SEQ)
    if family == "mixtral":
        # A llama file: q/k rows in adjacent pairs, so attention adds in another order.
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.ptp(want))
    else:
        np.testing.assert_array_equal(got, want)
    check_quantized_logits(got, reference_logits(f32, SEQ), f"{family} f32 file")
    path = export_gguf(folder, tmp_path / f"{family}-{dtype}.gguf", dtype)
    check_routed(await engine_logits(path, SEQ), reference_logits(path, SEQ), f"{family} {dtype}")


def check_routed(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """A quantized mixture of experts against the reference of its file. The Q8 activations of
    the quantized products move each router's input a little, and a token whose k-th and next
    expert are that close takes the other one: its logits change wholesale. llama.cpp's Q8
    activations do the same: on these files and this sequence it is off by p90 3.5% and max 21%
    of the range, argmax 91% (mixtral q8_0), and p90 3.3%, argmax 89% (mixtral q4_k); the
    engine by p90 3.7%, max 21%, argmax 89% and p90 2.9%, argmax 91%. So the bound is llama.cpp's
    envelope: nine tokens in ten within 1.5 times a dense model's bound, and the argmax at 85%.
    The f32 files above are exact."""
    span = float(np.ptp(want))
    rows = np.abs(got.astype(np.float64) - want).max(axis=-1) / span
    agree = float(np.mean(got.argmax(axis=-1) == want.argmax(axis=-1)))
    p90 = float(np.quantile(rows, 0.9))
    print(f"{what}: p90 {p90:.2%} of the range; argmax {agree:.1%}")
    assert p90 <= 1.5 * ACT_Q8_REL_TOL, f"{what}: p90 {p90:.4f} of the range"
    assert agree >= ROUTED_ARGMAX_AGREEMENT, f"{what}: argmax agrees at {agree:.1%} of positions"


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


async def test_yarn_from_the_file(tmp_path: Path) -> None:
    """A qwen2 file with YaRN keys (as llama.cpp's converter writes Qwen2.5's): the scaling comes
    from the metadata, and positions past the original context match the reference."""
    from strata_rs.testing.models import make_model

    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 8}
    folder = make_model(tmp_path / "qwen2", "qwen2", "tiny", "f32", 0, **SHAPE, rope_scaling=yarn)
    path = export_gguf(folder, tmp_path / "qwen2-yarn.gguf", "q8_0")
    engine = await strata_rs.Engine.load(str(path))
    try:
        assert engine.info["max_context"] == 256
        got = await engine.logits(SEQ[:256])
    finally:
        await engine.close()
    check_quantized_logits(got, reference_logits(path, SEQ[:256]), "qwen2 q8_0 yarn")
    # The same file without its scaling answers differently: the test reads the keys.
    same = make_model(tmp_path / "plain", "qwen2", "tiny", "f32", 0, **SHAPE)
    plain = export_gguf(same, tmp_path / "qwen2-plain.gguf", "q8_0")
    assert not np.allclose(await engine_logits(plain, SEQ[:256]), got, atol=1e-3)


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
