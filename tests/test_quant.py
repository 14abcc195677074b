"""The ggml block formats against the independent `gguf` package (llama.cpp's Python reader).

`strata_rs.dequantize` must give `gguf.quants.dequantize`'s values to the bit, for every type,
on blocks `gguf` quantizes (the types it can) and on random valid bytes (the f16 scales drawn
finite). `strata_rs.quantize`'s output, read back by `gguf`, must be close to the input.
"""

from __future__ import annotations

import numpy as np
import pytest
import strata_rs

gguf = pytest.importorskip("gguf")

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402

TYPES = [
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "IQ4_NL",
    "IQ4_XS",
]
# Byte offsets of each block's f16 scales (d, and m or dmin), the only fields that can hold
# inf or nan: random bytes there are replaced by finite values.
F16_FIELDS = {
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q8_0": [0],
    "Q2_K": [80, 82],
    "Q3_K": [108],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
    "IQ4_NL": [0],
    "IQ4_XS": [0],
}
# The types `gguf.quants.quantize` implements.
GGUF_QUANTIZES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
# Relative RMS round-trip error allowed on Gaussian rows, about 1.5x what strata reaches
# (measured: Q4_0 0.087, Q4_1 0.078, Q5_0 0.044, Q5_1 0.038, Q8_0 0.0055, Q2_K 0.29, Q3_K 0.151,
# Q4_K 0.072, Q5_K 0.037, Q6_K 0.018 (0.020 at x1e-3, where d is an f16 subnormal), IQ4_NL
# 0.076, IQ4_XS 0.077; gguf's own Q4_0 .. Q8_0 quantizers reach the same to 1%).
RMS_BOUND = {
    "Q4_0": 0.13,
    "Q4_1": 0.12,
    "Q5_0": 0.066,
    "Q5_1": 0.057,
    "Q8_0": 0.008,
    "Q2_K": 0.42,
    "Q3_K": 0.22,
    "Q4_K": 0.10,
    "Q5_K": 0.055,
    "Q6_K": 0.03,
    "IQ4_NL": 0.11,
    "IQ4_XS": 0.11,
}


def qtype(name: str) -> GGMLQuantizationType:
    return GGMLQuantizationType[name]


def random_blocks(name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes for `rows` rows of `cols` values, with finite f16 scales."""
    block, size = GGML_QUANT_SIZES[qtype(name)]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for off in F16_FIELDS[name]:
        scales = rng.uniform(-2.0, 2.0, size=(rows, cols // block)).astype(np.float16)
        raw[:, :, off : off + 2] = scales.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, cols // block * size)


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_random_bytes_equals_gguf(name: str) -> None:
    rng = np.random.default_rng(TYPES.index(name))
    cols = 512
    data = random_blocks(name, 6, cols, rng)
    want = gguf_dequantize(data, qtype(name))
    got = strata_rs.dequantize(data, name, cols)
    assert got.dtype == np.float32 and got.shape == (6, cols)
    assert np.all(np.isfinite(want))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", GGUF_QUANTIZES)
def test_dequantize_gguf_quantized_blocks(name: str) -> None:
    rng = np.random.default_rng(100 + TYPES.index(name))
    x = rng.standard_normal((5, 256)).astype(np.float32)
    data = gguf_quantize(x, qtype(name))
    np.testing.assert_array_equal(
        strata_rs.dequantize(data, name, 256), gguf_dequantize(data, qtype(name))
    )


@pytest.mark.parametrize("name", TYPES)
def test_quantize_read_back_by_gguf_is_close(name: str) -> None:
    rng = np.random.default_rng(200 + TYPES.index(name))
    for scale in (1.0, 1e-3, 50.0):
        x = (rng.standard_normal((8, 1024)) * scale).astype(np.float32)
        data = strata_rs.quantize(x, name)
        block, size = GGML_QUANT_SIZES[qtype(name)]
        assert data.dtype == np.uint8 and data.shape == (8, 1024 // block * size)
        back = gguf_dequantize(data, qtype(name))
        # The same values as strata's own dequantizer, to the bit.
        np.testing.assert_array_equal(strata_rs.dequantize(data, name, 1024), back)
        rel = np.sqrt(np.sum((back - x) ** 2) / np.sum(x**2))
        assert rel < RMS_BOUND[name], f"{name} x{scale}: relative RMS error {rel:.4f}"
    if name in GGUF_QUANTIZES:
        # No worse than gguf's own quantizer by more than 5% (same scheme: range scales).
        x = rng.standard_normal((8, 1024)).astype(np.float32)
        ours = gguf_dequantize(strata_rs.quantize(x, name), qtype(name))
        theirs = gguf_dequantize(gguf_quantize(x, qtype(name)), qtype(name))
        assert np.sum((ours - x) ** 2) <= 1.05 * np.sum((theirs - x) ** 2)


def test_bad_arguments_name_the_argument() -> None:
    x = np.zeros((2, 64), dtype=np.float32)
    with pytest.raises(ValueError, match=r"type.*unknown quantization type .Q7_0."):
        strata_rs.quantize(x, "Q7_0")
    with pytest.raises(ValueError, match=r"array.*48 columns.*Q4_0's block of 32"):
        strata_rs.quantize(np.zeros((2, 48), dtype=np.float32), "Q4_0")
    with pytest.raises(ValueError, match=r"array.*dtype float32, got float64"):
        strata_rs.quantize(np.zeros((2, 64)), "Q8_0")
    with pytest.raises(ValueError, match=r"array.*2-D, got 1-D"):
        strata_rs.quantize(np.zeros(64, dtype=np.float32), "Q8_0")
    with pytest.raises(ValueError, match=r"array.*numpy.ndarray"):
        strata_rs.quantize([[0.0] * 64], "Q8_0")
    data = strata_rs.quantize(x, "q8_0")  # names are case-insensitive
    with pytest.raises(ValueError, match=r"cols.*is 40, not a multiple of Q8_0's block of 32"):
        strata_rs.dequantize(data, "Q8_0", 40)
    with pytest.raises(
        ValueError, match=r"data.*rows of 68 bytes, but 96 columns of Q8_0 take 102"
    ):
        strata_rs.dequantize(data, "Q8_0", 96)
    with pytest.raises(ValueError, match=r"cols.*>= 0"):
        strata_rs.dequantize(data, "Q8_0", -32)
    with pytest.raises(ValueError, match=r"type.*unknown"):
        strata_rs.dequantize(data, "F16", 64)
    with pytest.raises(ValueError, match=r"data.*dtype uint8, got int8"):
        strata_rs.dequantize(data.view(np.int8), "Q8_0", 64)


def test_layouts_and_empty_arrays() -> None:
    # Non-contiguous and big-endian input is read as the values it holds.
    x = np.random.default_rng(1).standard_normal((4, 128)).astype(np.float32)
    a = strata_rs.quantize(x, "Q8_0")
    b = strata_rs.quantize(np.asfortranarray(x), "Q8_0")
    c = strata_rs.quantize(x.astype(">f4"), "Q8_0")
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)
    assert strata_rs.quantize(np.zeros((0, 256), dtype=np.float32), "Q6_K").shape == (0, 210)
    assert strata_rs.dequantize(np.zeros((3, 0), dtype=np.uint8), "Q6_K", 0).shape == (3, 0)
