//! `quantize` and `dequantize`: the ggml block formats row by row, as the engine's kernels read
//! them (for tests against the independent `gguf` package, and for tools).
//!
//! Arrays cross as bytes (`numpy.ascontiguousarray(..).tobytes()` in, `numpy.frombuffer` of a
//! bytearray out): the abi3 build has no buffer protocol before Python 3.11.

use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes};

use super::args::{bad, type_name};
use crate::model::kernels::cpu::quant::{dequantize_row, quantize_row, QuantType};

/// The type named `name` (case-insensitive), or InvalidRequest (a ValueError) naming `type`.
fn quant_type(name: &str) -> PyResult<QuantType> {
    QuantType::from_name(name).ok_or_else(|| {
        let known: Vec<&str> = QuantType::ALL.iter().map(|t| t.name()).collect();
        bad(
            "type",
            format!(
                "unknown quantization type {name:?} (known: {})",
                known.join(", ")
            ),
        )
    })
}

/// The contiguous little-endian bytes of a 2-D numpy array of `dtype`, and its shape; errors name
/// `field`.
fn array_bytes<'py>(
    array: &Bound<'py, PyAny>,
    field: &str,
    dtype: &str,
) -> PyResult<(Bound<'py, PyBytes>, usize, usize)> {
    let np = array.py().import("numpy")?;
    if !array.is_instance(&np.getattr("ndarray")?)? {
        return Err(bad(
            field,
            format!(
                "must be a numpy.ndarray of {dtype}, got {}",
                type_name(array)
            ),
        ));
    }
    let got: String = array.getattr("dtype")?.getattr("name")?.extract()?;
    if got != dtype {
        return Err(bad(field, format!("must have dtype {dtype}, got {got}")));
    }
    let ndim: usize = array.getattr("ndim")?.extract()?;
    if ndim != 2 {
        return Err(bad(field, format!("must be 2-D, got {ndim}-D")));
    }
    let (rows, cols): (usize, usize) = array.getattr("shape")?.extract()?;
    // Little-endian whatever the array's byte order; a copy only when needed.
    let le = if dtype == "float32" { "<f4" } else { "u1" };
    let contiguous = np.call_method1("ascontiguousarray", (array, le))?;
    let bytes = contiguous.call_method0("tobytes")?.cast_into::<PyBytes>()?;
    Ok((bytes, rows, cols))
}

/// A `[rows, row_len]` numpy array of `dtype` over `bytes` (copied into a writable bytearray).
fn new_array<'py>(
    py: Python<'py>,
    bytes: &[u8],
    dtype: &str,
    rows: usize,
    row_len: usize,
) -> PyResult<Bound<'py, PyAny>> {
    let np = py.import("numpy")?;
    let buf = PyByteArray::new(py, bytes);
    let arr = np.call_method1("frombuffer", (buf, np.getattr(dtype)?))?;
    arr.call_method1("reshape", (rows, row_len))
}

/// Quantizes each row of a 2-D float32 array to the ggml block type `type` ("Q4_K", ...): a
/// `[rows, row_bytes]` uint8 array.
#[pyfunction]
#[pyo3(signature = (array, r#type))]
pub fn quantize<'py>(
    py: Python<'py>,
    array: &Bound<'py, PyAny>,
    r#type: &str,
) -> PyResult<Bound<'py, PyAny>> {
    let ty = quant_type(r#type)?;
    let (bytes, rows, cols) = array_bytes(array, "array", "float32")?;
    let Some(rb) = ty.row_bytes(cols) else {
        return Err(bad(
            "array",
            format!(
                "has {cols} columns, not a multiple of {}'s block of {}",
                ty.name(),
                ty.block_elems()
            ),
        ));
    };
    let src: Vec<f32> = bytes
        .as_bytes()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let mut out = vec![0u8; rows * rb];
    py.detach(|| {
        for (x, q) in src
            .chunks_exact(cols.max(1))
            .zip(out.chunks_exact_mut(rb.max(1)))
        {
            quantize_row(ty, x, q);
        }
    });
    new_array(py, &out, "uint8", rows, rb)
}

/// Dequantizes a 2-D uint8 array of ggml blocks of type `type`, `cols` values per row: a
/// `[rows, cols]` float32 array.
#[pyfunction]
#[pyo3(signature = (data, r#type, cols))]
pub fn dequantize<'py>(
    py: Python<'py>,
    data: &Bound<'py, PyAny>,
    r#type: &str,
    cols: i64,
) -> PyResult<Bound<'py, PyAny>> {
    let ty = quant_type(r#type)?;
    let cols =
        usize::try_from(cols).map_err(|_| bad("cols", format!("must be >= 0, got {cols}")))?;
    let Some(rb) = ty.row_bytes(cols) else {
        return Err(bad(
            "cols",
            format!(
                "is {cols}, not a multiple of {}'s block of {}",
                ty.name(),
                ty.block_elems()
            ),
        ));
    };
    let (bytes, rows, row_len) = array_bytes(data, "data", "uint8")?;
    if row_len != rb {
        return Err(bad(
            "data",
            format!(
                "has rows of {row_len} bytes, but {cols} columns of {} take {rb} bytes",
                ty.name()
            ),
        ));
    }
    let src = bytes.as_bytes();
    let mut out = vec![0f32; rows * cols];
    py.detach(|| {
        for (q, y) in src
            .chunks_exact(rb.max(1))
            .zip(out.chunks_exact_mut(cols.max(1)))
        {
            dequantize_row(ty, q, y);
        }
    });
    let raw: Vec<u8> = out.iter().flat_map(|v| v.to_le_bytes()).collect();
    new_array(py, &raw, "float32", rows, cols)
}
