//! `LoadingEngine`: what `Engine.load` returns. Awaiting it gives the engine; as an async
//! context manager (`async with Engine.load(...) as engine:`) it gives the engine on entry and
//! closes it on exit, so that the one-line form needs no second `await`.

use pyo3::prelude::*;
use pyo3::types::PyTuple;

#[pyclass(name = "LoadingEngine", module = "strata_rs", frozen)]
pub struct PyLoadingEngine {
    /// The running loop's future of the engine (`spawn_awaitable`).
    future: Py<PyAny>,
}

impl PyLoadingEngine {
    pub fn new(future: Py<PyAny>) -> Self {
        PyLoadingEngine { future }
    }
}

#[pymethods]
impl PyLoadingEngine {
    fn __await__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.future.bind(py).call_method0("__await__")
    }

    fn __aenter__(&self, py: Python<'_>) -> Py<PyAny> {
        self.future.clone_ref(py)
    }

    /// The engine's `__aexit__`: closes it, lets an exception through. Only reached after
    /// `__aenter__` gave the engine, so the future holds it.
    #[pyo3(signature = (*exc))]
    fn __aexit__<'py>(
        &self,
        py: Python<'py>,
        exc: &Bound<'py, PyTuple>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let engine = self.future.bind(py).call_method0("result")?;
        engine.call_method1("__aexit__", exc)
    }

    fn __repr__(&self) -> String {
        "<LoadingEngine: await it, or use it with async with>".into()
    }
}
