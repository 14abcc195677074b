//! `Engine`: load a model folder, get logits, benchmark, close. Every call that waits returns an
//! awaitable; the work runs on the engine thread or a blocking thread, never holding the GIL.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyDict};
use pyo3_async_runtimes::tokio::future_into_py;

use super::errors::to_pyerr;
use super::tokenizer::PyTokenizer;
use crate::bench::BenchSpec;
use crate::device::Device;
use crate::engine::{Engine, EngineOptions};
use crate::error::StrataError;

#[pyclass(name = "Engine", module = "strata_rs", frozen)]
pub struct PyEngine {
    engine: Arc<Mutex<Engine>>,
    tokenizer: Py<PyTokenizer>,
}

fn lock(engine: &Mutex<Engine>) -> MutexGuard<'_, Engine> {
    // A poisoned lock only means a panic elsewhere; the engine's own state is still consistent.
    engine.lock().unwrap_or_else(|p| p.into_inner())
}

fn join_error(e: tokio::task::JoinError) -> PyErr {
    to_pyerr(StrataError::Internal(format!("engine task failed: {e}")))
}

fn stopped_error() -> PyErr {
    to_pyerr(StrataError::EngineStopped(
        "the engine thread stopped before answering".into(),
    ))
}

/// Token ids from Python ints, each checked to be a non-negative 32-bit id.
fn token_ids(ids: Vec<i64>) -> PyResult<Vec<u32>> {
    ids.iter()
        .map(|&t| {
            u32::try_from(t).map_err(|_| {
                to_pyerr(StrataError::invalid(
                    "token_ids",
                    format!("token id {t} is not a valid id"),
                ))
            })
        })
        .collect()
}

fn usize_arg(value: Option<i64>, field: &str) -> PyResult<Option<usize>> {
    value
        .map(|v| {
            usize::try_from(v).map_err(|_| {
                to_pyerr(StrataError::invalid(
                    field,
                    format!("must be >= 0, got {v}"),
                ))
            })
        })
        .transpose()
}

#[pymethods]
impl PyEngine {
    /// Loads a Hugging Face model folder. Awaitable; raises ModelLoadError, DeviceUnavailable or
    /// InvalidRequest.
    #[staticmethod]
    #[pyo3(signature = (path, device = "cpu", threads = None, max_batch_tokens = 512, kv_memory_mib = None, max_context = None))]
    fn load<'py>(
        py: Python<'py>,
        path: PathBuf,
        device: &str,
        threads: Option<i64>,
        max_batch_tokens: i64,
        kv_memory_mib: Option<i64>,
        max_context: Option<i64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let opts = EngineOptions {
            device: Device::parse(device).map_err(to_pyerr)?,
            threads: usize_arg(threads, "threads")?,
            max_batch_tokens: usize_arg(Some(max_batch_tokens), "max_batch_tokens")?.unwrap_or(0),
            kv_memory_mib: usize_arg(kv_memory_mib, "kv_memory_mib")?,
            max_context: usize_arg(max_context, "max_context")?,
        };
        future_into_py(py, async move {
            let engine = tokio::task::spawn_blocking(move || Engine::load(&path, opts))
                .await
                .map_err(join_error)?
                .map_err(to_pyerr)?;
            Python::attach(|py| {
                let tokenizer = Py::new(
                    py,
                    PyTokenizer {
                        inner: engine.tokenizer().clone(),
                    },
                )?;
                Ok(PyEngine {
                    engine: Arc::new(Mutex::new(engine)),
                    tokenizer,
                })
            })
        })
    }

    /// Logits of every position: a float32 numpy array `[len(token_ids), vocab_size]`.
    fn logits<'py>(&self, py: Python<'py>, token_ids: Vec<i64>) -> PyResult<Bound<'py, PyAny>> {
        let ids = self::token_ids(token_ids)?;
        let n = ids.len();
        let (rx, vocab) = {
            let engine = lock(&self.engine);
            (
                engine.logits(ids).map_err(to_pyerr)?,
                engine.info().config.vocab_size,
            )
        };
        future_into_py(py, async move {
            let logits = rx.await.map_err(|_| stopped_error())?.map_err(to_pyerr)?;
            Python::attach(|py| -> PyResult<Py<PyAny>> {
                // SAFETY: viewing initialized f32s as bytes.
                let bytes = unsafe {
                    std::slice::from_raw_parts(logits.as_ptr() as *const u8, logits.len() * 4)
                };
                let buf = PyByteArray::new(py, bytes);
                let np = py.import("numpy")?;
                let arr = np.call_method1("frombuffer", (buf, np.getattr("float32")?))?;
                Ok(arr.call_method1("reshape", (n, vocab))?.unbind())
            })
        })
    }

    /// Times prefill (cold) and single-token decode at given contexts, and the read bandwidth.
    #[pyo3(signature = (prefill_lens = vec![512, 2048], decode_contexts = vec![512, 2048], decode_steps = 32, repeats = 3))]
    fn benchmark<'py>(
        &self,
        py: Python<'py>,
        prefill_lens: Vec<usize>,
        decode_contexts: Vec<usize>,
        decode_steps: usize,
        repeats: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        let spec = BenchSpec {
            prefill_lens,
            decode_contexts,
            decode_steps,
            repeats,
        };
        let rx = lock(&self.engine).bench(spec).map_err(to_pyerr)?;
        future_into_py(py, async move {
            let r = rx.await.map_err(|_| stopped_error())?.map_err(to_pyerr)?;
            Python::attach(|py| -> PyResult<Py<PyAny>> {
                let d = PyDict::new(py);
                d.set_item(
                    "prefill_tok_s",
                    r.prefill
                        .into_iter()
                        .collect::<std::collections::BTreeMap<_, _>>(),
                )?;
                d.set_item(
                    "decode_tok_s",
                    r.decode
                        .into_iter()
                        .collect::<std::collections::BTreeMap<_, _>>(),
                )?;
                d.set_item("decode_weight_bytes", r.decode_weight_bytes)?;
                d.set_item(
                    "read_bandwidth_gb_s",
                    r.read_bandwidth
                        .into_iter()
                        .collect::<std::collections::BTreeMap<_, _>>(),
                )?;
                Ok(d.into_any().unbind())
            })
        })
    }

    /// Stops the engine thread. Awaitable; idempotent.
    fn close<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let engine = self.engine.clone();
        future_into_py(py, async move {
            tokio::task::spawn_blocking(move || lock(&engine).close())
                .await
                .map_err(join_error)?;
            Ok(())
        })
    }

    #[getter]
    fn tokenizer(&self, py: Python<'_>) -> Py<PyTokenizer> {
        self.tokenizer.clone_ref(py)
    }

    #[getter]
    fn closed(&self) -> bool {
        lock(&self.engine).is_closed()
    }

    /// What was loaded and how: model shape, dtype, device, threads, context, K/V pool.
    #[getter]
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let engine = lock(&self.engine);
        let i = engine.info();
        let c = &i.config;
        let d = PyDict::new(py);
        d.set_item("model_dir", i.model_dir.display().to_string())?;
        d.set_item("model_type", c.family.name())?;
        d.set_item("dtype", i.dtype)?;
        d.set_item("kv_dtype", i.kv_dtype)?;
        d.set_item("device", &i.device)?;
        d.set_item("threads", i.threads)?;
        d.set_item("num_layers", c.num_layers)?;
        d.set_item("hidden_size", c.hidden_size)?;
        d.set_item("vocab_size", c.vocab_size)?;
        d.set_item("max_context", i.max_context)?;
        d.set_item("max_batch_tokens", i.max_batch_tokens)?;
        d.set_item("kv_blocks", i.kv_blocks)?;
        d.set_item("block_size", i.block_size)?;
        d.set_item("decode_weight_bytes", i.decode_weight_bytes)?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        let engine = lock(&self.engine);
        let i = engine.info();
        format!(
            "Engine(model={:?}, device={:?})",
            i.model_dir.display().to_string(),
            i.device
        )
    }
}
