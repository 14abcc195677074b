//! The exception classes, and StrataError -> PyErr.
//!
//! The classes are made with `type(name, bases, ns)` at import because `InvalidRequest` has two
//! bases (StrataError and ValueError), which `create_exception!` cannot express.

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

use crate::error::StrataError;

struct Classes {
    strata_error: Py<PyType>,
    model_load: Py<PyType>,
    invalid_request: Py<PyType>,
    context_overflow: Py<PyType>,
    device_unavailable: Py<PyType>,
    engine_stopped: Py<PyType>,
    engine_busy: Py<PyType>,
}

static CLASSES: PyOnceLock<Classes> = PyOnceLock::new();

fn make_class<'py>(
    py: Python<'py>,
    name: &str,
    bases: &[Bound<'py, PyType>],
    doc: &str,
) -> PyResult<Py<PyType>> {
    let ns = PyDict::new(py);
    ns.set_item("__module__", "strata_rs")?;
    ns.set_item("__doc__", doc)?;
    let class = py
        .get_type::<PyType>()
        .call1((name, PyTuple::new(py, bases)?, ns))?;
    Ok(class.cast_into::<PyType>()?.unbind())
}

fn classes(py: Python<'_>) -> PyResult<&Classes> {
    CLASSES.get_or_try_init(py, || {
        let exception = py.get_type::<pyo3::exceptions::PyException>();
        let value_error = py.get_type::<pyo3::exceptions::PyValueError>();
        let base = make_class(py, "StrataError", &[exception], "Base class of every strata-rs error.")?;
        let b = base.bind(py).clone();
        let invalid = make_class(
            py,
            "InvalidRequest",
            &[b.clone(), value_error],
            "A request or argument is invalid; the message names the field and the reason.",
        )?;
        Ok::<_, PyErr>(Classes {
            model_load: make_class(py, "ModelLoadError", std::slice::from_ref(&b), "The model folder cannot be loaded; the message names the file and the field or tensor.")?,
            context_overflow: make_class(py, "ContextOverflow", &[invalid.bind(py).clone()], "The request is longer than the engine's context.")?,
            device_unavailable: make_class(py, "DeviceUnavailable", std::slice::from_ref(&b), "The requested device cannot be used.")?,
            engine_busy: make_class(py, "EngineBusy", std::slice::from_ref(&b), "Too many requests are waiting; retry later.")?,
            engine_stopped: make_class(py, "EngineStopped", &[b], "The engine is closed or its loop has stopped.")?,
            invalid_request: invalid,
            strata_error: base,
        })
    })
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let c = classes(py)?;
    m.add("StrataError", c.strata_error.bind(py))?;
    m.add("ModelLoadError", c.model_load.bind(py))?;
    m.add("InvalidRequest", c.invalid_request.bind(py))?;
    m.add("ContextOverflow", c.context_overflow.bind(py))?;
    m.add("DeviceUnavailable", c.device_unavailable.bind(py))?;
    m.add("EngineStopped", c.engine_stopped.bind(py))?;
    m.add("EngineBusy", c.engine_busy.bind(py))?;
    Ok(())
}

pub fn to_pyerr(e: StrataError) -> PyErr {
    Python::attach(|py| {
        let c = match classes(py) {
            Ok(c) => c,
            Err(err) => return err,
        };
        let class = match &e {
            StrataError::ModelLoad { .. } => &c.model_load,
            StrataError::InvalidRequest { .. } => &c.invalid_request,
            StrataError::ContextOverflow(_) => &c.context_overflow,
            StrataError::DeviceUnavailable(_) => &c.device_unavailable,
            StrataError::EngineStopped(_) => &c.engine_stopped,
            StrataError::EngineBusy(_) => &c.engine_busy,
            StrataError::Internal(_) => &c.strata_error,
        };
        PyErr::from_type(class.bind(py).clone(), e.to_string())
    })
}
