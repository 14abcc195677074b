//! Checks of Python arguments that pyo3's own extraction would answer with a bare TypeError,
//! OverflowError or UnicodeEncodeError: each failure here is an InvalidRequest naming the field.

use pyo3::exceptions::PyOverflowError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyFloat, PyInt, PyList, PyString, PyTuple};

use super::errors::to_pyerr;
use crate::error::StrataError;

pub fn bad(field: &str, reason: impl Into<String>) -> PyErr {
    to_pyerr(StrataError::invalid(field, reason))
}

pub fn type_name(v: &Bound<'_, PyAny>) -> String {
    v.get_type()
        .name()
        .map_or_else(|_| "?".into(), |n| n.to_string())
}

/// The text of a Python str. A str holding a lone surrogate ("\ud800") has no UTF-8 form.
pub fn text(field: &str, s: &Bound<'_, PyString>) -> PyResult<String> {
    s.to_str().map(str::to_owned).map_err(|_| {
        bad(
            field,
            "must be valid Unicode text (it holds a lone surrogate)",
        )
    })
}

/// A str argument: an InvalidRequest naming `field` for anything else.
pub fn string(field: &str, v: &Bound<'_, PyAny>) -> PyResult<String> {
    match v.cast::<PyString>() {
        Ok(s) => text(field, s),
        Err(_) => Err(bad(
            field,
            format!("must be a string, got {}", type_name(v)),
        )),
    }
}

/// A str or an `os.PathLike` (a path given either way): an InvalidRequest naming `field` for
/// anything else.
pub fn string_or_path(field: &str, v: &Bound<'_, PyAny>) -> PyResult<String> {
    if v.cast::<PyString>().is_ok() {
        return string(field, v);
    }
    v.extract::<std::path::PathBuf>()
        .map(|p| p.to_string_lossy().into_owned())
        .map_err(|_| {
            bad(
                field,
                format!("must be a string or a path, got {}", type_name(v)),
            )
        })
}

/// A Python int (never a bool) of at least `min`.
pub fn int(field: &str, v: &Bound<'_, PyAny>, min: i64) -> PyResult<usize> {
    if v.is_instance_of::<PyBool>() || !v.is_instance_of::<PyInt>() {
        return Err(bad(
            field,
            format!("must be an integer, got {}", type_name(v)),
        ));
    }
    let x: i64 = v.extract().map_err(|_| bad(field, "is out of range"))?;
    if x < min {
        return Err(bad(field, format!("must be >= {min}, got {x}")));
    }
    usize::try_from(x).map_err(|_| bad(field, "is out of range"))
}

/// A str for a message: the text with unencodable characters replaced (names in errors).
pub fn lossy(v: &Bound<'_, PyAny>) -> String {
    match v.cast::<PyString>() {
        Ok(s) => s.to_string_lossy().into_owned(),
        Err(_) => v.to_string(),
    }
}

/// A list or tuple of token ids, each a Python int (or an object with `__index__`, such as a
/// numpy integer; never a bool) in 0..2**32.
pub fn token_ids(field: &str, v: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    if !(v.is_instance_of::<PyList>() || v.is_instance_of::<PyTuple>()) {
        return Err(bad(
            field,
            format!("must be a list of token ids, got {}", type_name(v)),
        ));
    }
    v.try_iter()?.map(|item| token_id(field, &item?)).collect()
}

fn token_id(field: &str, item: &Bound<'_, PyAny>) -> PyResult<u32> {
    let not_an_id = || {
        bad(
            field,
            format!(
                "must be a list of token ids, got a {} in the list",
                type_name(item)
            ),
        )
    };
    // bool is an int subclass in Python, but True is no token id.
    if item.is_instance_of::<PyBool>() {
        return Err(not_an_id());
    }
    let invalid = |t: &dyn std::fmt::Display| bad(field, format!("token id {t} is not a valid id"));
    match item.extract::<i64>() {
        Ok(t) => u32::try_from(t).map_err(|_| invalid(&t)),
        Err(e)
            if e.is_instance_of::<PyOverflowError>(item.py()) || item.is_instance_of::<PyInt>() =>
        {
            // Shown when it fits 128 bits: str() of a huge int can itself fail (digit limit).
            Err(match item.extract::<i128>() {
                Ok(t) => invalid(&t),
                Err(_) => invalid(&"beyond 2**127"),
            })
        }
        Err(_) => Err(not_an_id()),
    }
}

/// A bool argument as given. Its extraction never fails, so that a wrong type comes out of
/// [`Flag::get`] as an InvalidRequest naming the argument (pyo3's own would be a TypeError).
pub enum Flag {
    Value(bool),
    WrongType(String),
}

impl<'a, 'py> FromPyObject<'a, 'py> for Flag {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let obj = obj.to_owned();
        Ok(match obj.cast::<PyBool>() {
            Ok(b) => Flag::Value(b.is_true()),
            Err(_) => Flag::WrongType(type_name(&obj)),
        })
    }
}

impl Flag {
    pub fn get(&self, field: &str) -> PyResult<bool> {
        match self {
            Flag::Value(b) => Ok(*b),
            Flag::WrongType(t) => Err(bad(field, format!("must be a bool, got {t}"))),
        }
    }
}

/// A per-device list option (`device_memory_mib`, `layer_split`) as the core parses it: a str
/// ("300,120") is taken as it is; a number, or a list or tuple of numbers, is written out that
/// way (a float as Python's shortest round-trip text), and the core says what is out of range.
pub fn per_device_list(field: &str, v: &Bound<'_, PyAny>) -> PyResult<String> {
    let wrong = || {
        bad(
            field,
            format!(
                "must be a string such as \"300,120\", a number or a list of numbers, got {}",
                type_name(v)
            ),
        )
    };
    let int = |item: &Bound<'_, PyAny>| -> PyResult<String> {
        let number = item.is_instance_of::<PyInt>() || item.is_instance_of::<PyFloat>();
        if item.is_instance_of::<PyBool>() || !number {
            return Err(wrong());
        }
        Ok(item.str()?.to_string_lossy().into_owned())
    };
    if let Ok(s) = v.cast::<PyString>() {
        return text(field, s);
    }
    if v.is_instance_of::<PyList>() || v.is_instance_of::<PyTuple>() {
        let items: Vec<String> = v
            .try_iter()?
            .map(|item| int(&item?))
            .collect::<PyResult<_>>()?;
        return Ok(items.join(","));
    }
    int(v)
}
