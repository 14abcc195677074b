//! The PyO3 binding layer: translation only, one file per exposed type. Logic lives in the core.

mod args;
mod awaitable;
mod dispatch;
mod engine;
mod errors;
mod json;
mod loading;
mod logging;
mod output;
mod quant;
mod sampling_params;
mod stream;
mod tokenizer;

use pyo3::prelude::*;
use pyo3::types::PyDict;

/// The GPUs the CUDA driver reports: `[]` when there is no driver.
#[pyfunction]
fn cuda_devices(py: Python<'_>) -> PyResult<Vec<Bound<'_, PyDict>>> {
    let found = py.detach(crate::device::cuda_devices);
    found
        .into_iter()
        .map(|d| {
            let dict = PyDict::new(py);
            dict.set_item("index", d.index)?;
            dict.set_item("name", d.name)?;
            dict.set_item("total_memory", d.total_memory)?;
            Ok(dict)
        })
        .collect()
}

/// Checks chat messages as `Engine.chat` does before rendering them (a non-empty list of objects,
/// each with a known role and text content); raises InvalidRequest naming the message at fault.
#[pyfunction]
fn validate_messages(messages: &Bound<'_, PyAny>) -> PyResult<()> {
    let messages = json::py_to_json(messages, "messages")?;
    crate::engine::request::validate_messages(&messages).map_err(errors::to_pyerr)
}

/// The prefix hashes of `token_ids`' full blocks, as an engine whose info has this
/// `prefix_salt` and `block_size` computes them: a router's key for where a prompt's prefix is
/// cached (`Engine.cached_block_hashes`).
#[pyfunction]
fn prefix_block_hashes(
    token_ids: &Bound<'_, PyAny>,
    prefix_salt: u64,
    block_size: usize,
) -> PyResult<Vec<u64>> {
    let ids = args::token_ids("token_ids", token_ids)?;
    if block_size == 0 {
        return Err(errors::to_pyerr(crate::error::StrataError::invalid(
            "block_size",
            "must be at least 1".to_string(),
        )));
    }
    let mut hashes = Vec::with_capacity(ids.len() / block_size);
    crate::kv::prefix::extend_hashes(prefix_salt, &ids, block_size, &mut hashes);
    Ok(hashes)
}

/// The Prometheus families `/metrics` reads from `Engine.stats()`: name, type, help, labels and
/// where in the stats dict the samples are (`crate::engine::stats::metrics::table`).
#[pyfunction]
fn stats_metrics(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    Ok(pythonize::pythonize(
        py,
        &crate::engine::stats::metrics::table(),
    )?)
}

#[pymodule]
#[pyo3(name = "_core")]
fn core_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    awaitable::register(m)?;
    logging::install();
    m.add_class::<engine::PyEngine>()?;
    m.add_class::<loading::PyLoadingEngine>()?;
    m.add_class::<tokenizer::PyTokenizer>()?;
    m.add_class::<sampling_params::PySamplingParams>()?;
    m.add_class::<stream::PyTokenStream>()?;
    m.add_class::<output::PyStreamChunk>()?;
    m.add_class::<output::PyCompletion>()?;
    m.add_class::<output::PyChoice>()?;
    m.add_class::<output::PyUsage>()?;
    m.add_function(wrap_pyfunction!(cuda_devices, m)?)?;
    m.add_function(wrap_pyfunction!(validate_messages, m)?)?;
    m.add_function(wrap_pyfunction!(prefix_block_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(stats_metrics, m)?)?;
    m.add_function(wrap_pyfunction!(quant::quantize, m)?)?;
    m.add_function(wrap_pyfunction!(quant::dequantize, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
