//! Python values -> serde_json, for chat messages and template variables.

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use serde_json::{Map, Number, Value};

use super::args::text;
use super::errors::to_pyerr;
use crate::error::StrataError;

/// Converts dicts, lists, tuples, str, int, float, bool and None; anything else is an
/// InvalidRequest naming `field` and the path inside it.
pub fn py_to_json(obj: &Bound<'_, PyAny>, field: &str) -> PyResult<Value> {
    convert(obj, field, 0)
}

fn convert(obj: &Bound<'_, PyAny>, path: &str, depth: usize) -> PyResult<Value> {
    if depth > 64 {
        return Err(to_pyerr(StrataError::invalid(path, "nested too deeply")));
    }
    if obj.is_none() {
        return Ok(Value::Null);
    }
    if obj.is_instance_of::<PyBool>() {
        return Ok(Value::Bool(obj.extract()?));
    }
    if obj.is_instance_of::<PyInt>() {
        if let Ok(i) = obj.extract::<i64>() {
            return Ok(Value::from(i));
        }
        return Err(to_pyerr(StrataError::invalid(path, "integer out of range")));
    }
    if obj.is_instance_of::<PyFloat>() {
        let x: f64 = obj.extract()?;
        return Number::from_f64(x)
            .map(Value::Number)
            .ok_or_else(|| to_pyerr(StrataError::invalid(path, "must be a finite number")));
    }
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(Value::String(text(path, s)?));
    }
    if let Ok(d) = obj.cast::<PyDict>() {
        let mut map = Map::new();
        for (k, v) in d.iter() {
            let key = match k.cast::<PyString>() {
                Ok(key) => text(path, key)?,
                Err(_) => {
                    return Err(to_pyerr(StrataError::invalid(
                        path,
                        "dictionary keys must be strings",
                    )))
                }
            };
            let value = convert(&v, &format!("{path}.{key}"), depth + 1)?;
            map.insert(key, value);
        }
        return Ok(Value::Object(map));
    }
    if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        let mut items = Vec::new();
        for (i, v) in obj.try_iter()?.enumerate() {
            items.push(convert(&v?, &format!("{path}[{i}]"), depth + 1)?);
        }
        return Ok(Value::Array(items));
    }
    let type_name = obj.get_type().name()?.to_string();
    Err(to_pyerr(StrataError::invalid(
        path,
        format!(
            "unsupported type {type_name} (expected dict, list, str, int, float, bool or None)"
        ),
    )))
}
