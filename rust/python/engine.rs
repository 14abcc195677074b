//! `Engine`: load a model folder; generate, chat and complete; stats; logits; benchmark; close.
//! Every call that waits returns an awaitable or an async iterator; the work runs on the engine
//! thread or a blocking thread, never holding the GIL.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyDict, PyList, PyString, PyTuple};

use super::args::{self, bad, text, type_name, Flag};
use super::awaitable::{ready_awaitable, spawn_awaitable};
use super::errors::to_pyerr;
use super::json::py_to_json;
use super::loading::PyLoadingEngine;
use super::output::{completion, prompt_logprobs_list};
use super::sampling_params::resolve;
use super::stream::{collect, PyTokenStream, StreamState};
use super::tokenizer::PyTokenizer;
use crate::bench::BenchSpec;
use crate::cache::CacheOptions;
use crate::device::Device;
use crate::engine::request::{validate_messages, PromptTokenLogprob, SamplingParams};
use crate::engine::stats::StatsSnapshot;
use crate::engine::{Engine, EngineOptions, Submission};
use crate::error::StrataError;
use crate::model::tokenizer::Tokenizer;

#[pyclass(name = "Engine", module = "strata_rs", frozen)]
pub struct PyEngine {
    engine: Arc<Mutex<Engine>>,
    tokenizer: Py<PyTokenizer>,
}

/// The engine's lock. Whoever holds it must not wait for the GIL (no `py.detach` around it, no
/// Python run under it): threads that hold the GIL take it too, and would deadlock.
fn lock(engine: &Mutex<Engine>) -> MutexGuard<'_, Engine> {
    crate::sync::lock(engine)
}

fn join_error(e: tokio::task::JoinError) -> StrataError {
    StrataError::Internal(format!("engine task failed: {e}"))
}

fn stopped_error() -> StrataError {
    StrataError::EngineStopped("the engine thread stopped before answering".into())
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

/// An error about the prompt (the core's "prompt", the tokenizer's "text"), renamed after the
/// argument it came from.
fn rename_prompt(e: StrataError, field: &str) -> StrataError {
    match e {
        StrataError::InvalidRequest { field: f, reason } if f == "prompt" || f == "text" => {
            StrataError::invalid(field, reason)
        }
        StrataError::ContextOverflow(m) => match m.strip_prefix("prompt: ") {
            Some(rest) => StrataError::ContextOverflow(format!("{field}: {rest}")),
            None => StrataError::ContextOverflow(m),
        },
        other => other,
    }
}

/// Cancels a request when the future that collects it is dropped.
struct CancelOnDrop(crate::engine::request::CancelFlag);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

impl PyEngine {
    fn vocab_size(&self) -> usize {
        lock(&self.engine).info().config.vocab_size
    }

    fn tokenizer_arc(&self) -> Arc<Tokenizer> {
        lock(&self.engine).tokenizer().clone()
    }

    /// Token ids of a prompt given as text (encoded with special tokens) or as ids.
    fn prompt_ids(&self, py: Python<'_>, prompt: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        if let Ok(s) = prompt.cast::<PyString>() {
            let text = text("prompt", s)?;
            let tok = self.tokenizer_arc();
            return py
                .detach(|| tok.encode(&text, true))
                .map_err(|e| to_pyerr(rename_prompt(e, "prompt")));
        }
        if prompt.is_instance_of::<PyList>() || prompt.is_instance_of::<PyTuple>() {
            return args::token_ids("prompt", prompt);
        }
        Err(to_pyerr(StrataError::invalid(
            "prompt",
            "must be a string or a list of token ids",
        )))
    }

    /// Queues a request. `field` is the caller's argument the ids came from: the core's errors
    /// about the prompt name "prompt", which for chat is the rendered `messages`.
    fn submit(
        &self,
        py: Python<'_>,
        ids: Vec<u32>,
        params: SamplingParams,
        field: &str,
    ) -> PyResult<Submission> {
        // The lock is taken and let go without the GIL: a thread that holds it must never wait
        // for the GIL, or a second thread submitting (holding the GIL, waiting for the lock)
        // deadlocks with it.
        py.detach(|| lock(&self.engine).submit(ids, params))
            .map_err(|e| to_pyerr(rename_prompt(e, field)))
    }

    fn stream(
        &self,
        py: Python<'_>,
        ids: Vec<u32>,
        params: SamplingParams,
        field: &str,
    ) -> PyResult<PyTokenStream> {
        let want_logprobs = params.logprobs.is_some();
        let sub = self.submit(py, ids, params, field)?;
        Ok(PyTokenStream::new(
            sub.events,
            sub.cancel,
            self.tokenizer_arc(),
            want_logprobs,
            sub.id,
        ))
    }

    /// Queues a request and returns the awaitable of its whole answer.
    fn completion<'py>(
        &self,
        py: Python<'py>,
        ids: Vec<u32>,
        params: SamplingParams,
        field: &str,
    ) -> PyResult<Bound<'py, PyAny>> {
        let (n, want_logprobs) = (params.n, params.logprobs.is_some());
        let Submission { events, cancel, .. } = self.submit(py, ids, params, field)?;
        let tok = self.tokenizer_arc();
        let work = async move {
            // Dropped with this future (the caller's task cancelled): the request is cancelled.
            let _cancel_on_drop = CancelOnDrop(cancel);
            let mut state = StreamState::new(events);
            collect(&mut state, n).await
        };
        spawn_awaitable(py, work, move |py, (choices, usage)| {
            Ok(Py::new(py, completion(py, &tok, choices, usage, want_logprobs)?)?.into_any())
        })
    }

    /// The token ids of `messages` rendered with the chat template; errors name `messages`.
    fn chat_ids(
        &self,
        py: Python<'_>,
        messages: &Bound<'_, PyAny>,
        add_generation_prompt: Flag,
        chat_template_kwargs: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<u32>> {
        let add_generation_prompt = add_generation_prompt.get("add_generation_prompt")?;
        // Taken as any object so that a wrong type is an InvalidRequest naming the argument.
        let extra = match chat_template_kwargs.filter(|k| !k.is_none()) {
            None => None,
            Some(k) if k.is_instance_of::<PyDict>() => Some(py_to_json(k, "chat_template_kwargs")?),
            Some(k) => {
                return Err(bad(
                    "chat_template_kwargs",
                    format!("must be a dict or None, got {}", type_name(k)),
                ))
            }
        };
        let messages = py_to_json(messages, "messages")?;
        let tok = self.tokenizer_arc();
        py.detach(|| -> Result<Vec<u32>, StrataError> {
            validate_messages(&messages)?;
            let text = tok.apply_chat_template(&messages, add_generation_prompt, extra.as_ref())?;
            // The template writes the special tokens itself.
            tok.encode(&text, false)
        })
        .map_err(|e| to_pyerr(rename_prompt(e, "messages")))
    }
}

#[pymethods]
impl PyEngine {
    /// Loads a Hugging Face model folder. Awaitable (and an async context manager that closes
    /// the engine); raises ModelLoadError, DeviceUnavailable or InvalidRequest.
    #[staticmethod]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (path, device = "cpu", max_batch = 8, max_context = None, kv_memory_mib = None, max_batch_tokens = 512, max_waiting = 256, threads = None, *, host_cache_mib = 4096, host_min_free_mib = 1024, disk_cache_dir = None, disk_cache_mib = 16384, disk_cache_days = 7.0, disk_write_when_idle = false, cache_faults = None, device_memory_mib = None, layer_split = None, vram_reserve_mib = 1024, kv_dtype = None, quantize = None, bf16_dot = false, speculative = None, num_speculative_tokens = 4, ngram_min = 2, ngram_max = 4, speculative_adaptive = true))]
    fn load<'py>(
        py: Python<'py>,
        path: PathBuf,
        device: &str,
        max_batch: i64,
        max_context: Option<i64>,
        kv_memory_mib: Option<i64>,
        max_batch_tokens: i64,
        max_waiting: i64,
        threads: Option<i64>,
        host_cache_mib: i64,
        host_min_free_mib: i64,
        disk_cache_dir: Option<PathBuf>,
        disk_cache_mib: i64,
        disk_cache_days: f64,
        disk_write_when_idle: bool,
        cache_faults: Option<String>,
        device_memory_mib: Option<&Bound<'py, PyAny>>,
        layer_split: Option<&Bound<'py, PyAny>>,
        vram_reserve_mib: i64,
        kv_dtype: Option<&Bound<'py, PyAny>>,
        quantize: Option<&Bound<'py, PyAny>>,
        bf16_dot: bool,
        speculative: Option<&Bound<'py, PyAny>>,
        num_speculative_tokens: i64,
        ngram_min: i64,
        ngram_max: i64,
        speculative_adaptive: bool,
    ) -> PyResult<PyLoadingEngine> {
        let cache = CacheOptions {
            host_cache_mib: usize_arg(Some(host_cache_mib), "host_cache_mib")?.unwrap_or(0),
            host_min_free_mib: usize_arg(Some(host_min_free_mib), "host_min_free_mib")?
                .unwrap_or(0),
            disk_cache_dir,
            disk_cache_mib: usize_arg(Some(disk_cache_mib), "disk_cache_mib")?.unwrap_or(0),
            disk_cache_days,
            faults: cache_faults.unwrap_or_default(),
            disk_write_when_idle,
        };
        let opts = EngineOptions {
            device: Device::parse(device).map_err(to_pyerr)?,
            threads: usize_arg(threads, "threads")?,
            max_batch_tokens: usize_arg(Some(max_batch_tokens), "max_batch_tokens")?.unwrap_or(0),
            max_batch: usize_arg(Some(max_batch), "max_batch")?.unwrap_or(0),
            max_waiting: usize_arg(Some(max_waiting), "max_waiting")?.unwrap_or(0),
            kv_memory_mib: usize_arg(kv_memory_mib, "kv_memory_mib")?,
            kv_dtype: kv_dtype.map(|v| args::string("kv_dtype", v)).transpose()?,
            quantize: quantize.map(|v| args::string("quantize", v)).transpose()?,
            bf16_dot,
            max_context: usize_arg(max_context, "max_context")?,
            speculative: speculative
                .map(|v| args::string_or_path("speculative", v))
                .transpose()?,
            num_speculative_tokens: usize_arg(
                Some(num_speculative_tokens),
                "num_speculative_tokens",
            )?
            .unwrap_or(0),
            ngram_min: usize_arg(Some(ngram_min), "ngram_min")?.unwrap_or(0),
            ngram_max: usize_arg(Some(ngram_max), "ngram_max")?.unwrap_or(0),
            speculative_adaptive,
            cache,
            device_memory_mib: device_memory_mib
                .map(|v| args::per_device_list("device_memory_mib", v))
                .transpose()?,
            layer_split: layer_split
                .map(|v| args::per_device_list("layer_split", v))
                .transpose()?,
            vram_reserve_mib: usize_arg(Some(vram_reserve_mib), "vram_reserve_mib")?.unwrap_or(0),
        };
        let load = async move {
            tokio::task::spawn_blocking(move || Engine::load(&path, opts))
                .await
                .map_err(join_error)?
        };
        let future = spawn_awaitable(py, load, |py, engine: Engine| {
            let tokenizer = Py::new(
                py,
                PyTokenizer {
                    inner: engine.tokenizer().clone(),
                },
            )?;
            let engine = PyEngine {
                engine: Arc::new(Mutex::new(engine)),
                tokenizer,
            };
            Ok(Py::new(py, engine)?.into_any())
        })?;
        Ok(PyLoadingEngine::new(future.unbind()))
    }

    /// Streams the continuation of `prompt` (a string, encoded with the model's special tokens,
    /// or a list of token ids). Sampling options come as `params` or as keyword arguments.
    /// Raises InvalidRequest, ContextOverflow or EngineBusy at once; returns a TokenStream.
    #[pyo3(signature = (prompt, params = None, **kwargs))]
    fn generate(
        &self,
        py: Python<'_>,
        prompt: &Bound<'_, PyAny>,
        params: Option<&Bound<'_, PyAny>>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<PyTokenStream> {
        let params = resolve(params, kwargs, self.vocab_size())?;
        let ids = self.prompt_ids(py, prompt)?;
        self.stream(py, ids, params, "prompt")
    }

    /// Streams the assistant's answer to `messages`, rendered with the model's chat template.
    #[pyo3(signature = (messages, params = None, *, add_generation_prompt = Flag::Value(true), chat_template_kwargs = None, **kwargs))]
    fn chat(
        &self,
        py: Python<'_>,
        messages: &Bound<'_, PyAny>,
        params: Option<&Bound<'_, PyAny>>,
        add_generation_prompt: Flag,
        chat_template_kwargs: Option<&Bound<'_, PyAny>>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<PyTokenStream> {
        let params = resolve(params, kwargs, self.vocab_size())?;
        let ids = self.chat_ids(py, messages, add_generation_prompt, chat_template_kwargs)?;
        self.stream(py, ids, params, "messages")
    }

    /// The whole answer to `messages` at once: an awaitable Completion (`chat`'s arguments).
    #[pyo3(signature = (messages, params = None, *, add_generation_prompt = Flag::Value(true), chat_template_kwargs = None, **kwargs))]
    fn chat_complete<'py>(
        &self,
        py: Python<'py>,
        messages: &Bound<'py, PyAny>,
        params: Option<&Bound<'py, PyAny>>,
        add_generation_prompt: Flag,
        chat_template_kwargs: Option<&Bound<'py, PyAny>>,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let params = resolve(params, kwargs, self.vocab_size())?;
        let ids = self.chat_ids(py, messages, add_generation_prompt, chat_template_kwargs)?;
        self.completion(py, ids, params, "messages")
    }

    /// The whole answer to `prompt` at once: an awaitable Completion.
    #[pyo3(signature = (prompt, params = None, **kwargs))]
    fn complete<'py>(
        &self,
        py: Python<'py>,
        prompt: &Bound<'py, PyAny>,
        params: Option<&Bound<'py, PyAny>>,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let params = resolve(params, kwargs, self.vocab_size())?;
        let ids = self.prompt_ids(py, prompt)?;
        self.completion(py, ids, params, "prompt")
    }

    /// Counters as of the engine's last step: running, waiting, K/V blocks, prefix hits, tokens,
    /// preemptions, step times, TTFT. A plain dict; cheap (no round trip to the engine thread).
    /// Its schema is `StatsSnapshot` (rust/engine/stats.rs), serialized as it is.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (s, block_bytes, memory) = {
            let engine = lock(&self.engine);
            (
                engine.stats(),
                engine.info().kv_block_bytes,
                engine.memory(),
            )
        };
        let snapshot = StatsSnapshot::new(s, block_bytes, memory);
        Ok(pythonize::pythonize(py, &snapshot)?.cast_into::<PyDict>()?)
    }

    /// Makes the engine thread's next step panic as a bug would (for tests of fault handling:
    /// open streams end with StrataError, stats()["stopped"] says why, later calls raise
    /// EngineStopped).
    fn _inject_fault(&self) -> PyResult<()> {
        lock(&self.engine).inject_fault().map_err(to_pyerr)
    }

    /// Logits of every position: a float32 numpy array `[len(token_ids), vocab_size]`.
    fn logits<'py>(
        &self,
        py: Python<'py>,
        token_ids: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let ids = args::token_ids("token_ids", token_ids)?;
        let n = ids.len();
        let (rx, vocab) = {
            let engine = lock(&self.engine);
            (
                engine.logits(ids).map_err(to_pyerr)?,
                engine.info().config.vocab_size,
            )
        };
        let work = async move { rx.await.map_err(|_| stopped_error())? };
        spawn_awaitable(py, work, move |py, logits: Vec<f32>| {
            // SAFETY: viewing initialized f32s as bytes.
            let bytes = unsafe {
                std::slice::from_raw_parts(logits.as_ptr() as *const u8, logits.len() * 4)
            };
            let buf = PyByteArray::new(py, bytes);
            let np = py.import("numpy")?;
            let arr = np.call_method1("frombuffer", (buf, np.getattr("float32")?))?;
            Ok(arr.call_method1("reshape", (n, vocab))?.unbind())
        })
    }

    /// The prefix hashes of the blocks the engine holds on the device and in the host tier
    /// (awaitable list of ints), for a router that sends a prompt where its prefix is.
    fn cached_block_hashes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let rx = lock(&self.engine).cached_block_hashes().map_err(to_pyerr)?;
        let work = async move { rx.await.map_err(|_| stopped_error()) };
        spawn_awaitable(py, work, move |py, hashes: Vec<u64>| {
            Ok(PyList::new(py, hashes)?.into_any().unbind())
        })
    }

    /// Each prompt token's logprob under the tokens before it: a list whose first entry is None,
    /// then `{"token_id", "token", "logprob", "rank", "top_logprobs"}` as a generated token's
    /// (`top_logprobs` alternatives, at most 20). One forward over the prompt, from a cold K/V
    /// state, its logits reduced a chunk at a time.
    #[pyo3(signature = (token_ids, top_logprobs = None))]
    fn prompt_logprobs<'py>(
        &self,
        py: Python<'py>,
        token_ids: &Bound<'py, PyAny>,
        top_logprobs: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let ids = args::token_ids("token_ids", token_ids)?;
        let top_logprobs = match top_logprobs.filter(|v| !v.is_none()) {
            Some(v) => args::int("top_logprobs", v, 0)?,
            None => 0,
        };
        let rx = lock(&self.engine)
            .prompt_logprobs(ids, top_logprobs)
            .map_err(to_pyerr)?;
        let tok = self.tokenizer_arc();
        let work = async move { rx.await.map_err(|_| stopped_error())? };
        spawn_awaitable(py, work, move |py, entries: Vec<PromptTokenLogprob>| {
            Ok(prompt_logprobs_list(py, &tok, &entries)?
                .into_any()
                .unbind())
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
        let work = async move { rx.await.map_err(|_| stopped_error())? };
        spawn_awaitable(py, work, |py, r: crate::bench::BenchReport| {
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
    }

    /// Stops the engine thread. Awaitable; idempotent.
    fn close<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        // Begun now, not when the awaitable runs: an `async with` left by a cancellation awaits
        // close() in a cancelled scope, which cancels the awaitable at once; the engine must
        // stop (and write its disk tier) all the same.
        let thread = lock(&self.engine).begin_close();
        let work = async move {
            if let Some(t) = thread {
                tokio::task::spawn_blocking(move || {
                    // A panicked engine thread has nothing left to clean up.
                    let _ = t.join();
                })
                .await
                .map_err(join_error)?;
            }
            Ok(())
        };
        spawn_awaitable(py, work, |py, ()| Ok(py.None()))
    }

    /// `async with await Engine.load(...) as engine:` gives the engine itself.
    fn __aenter__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        ready_awaitable(slf.py(), slf.clone().into_any())
    }

    /// Closes the engine (which writes the disk tier) when the block ends, also by an exception,
    /// which it lets through.
    #[pyo3(signature = (*_exc))]
    fn __aexit__<'py>(
        &self,
        py: Python<'py>,
        _exc: &Bound<'py, PyTuple>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.close(py)
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
        // Copied out first: building the dict runs Python, which may switch threads.
        let i = lock(&self.engine).info().clone();
        let c = &i.config;
        let d = PyDict::new(py);
        d.set_item("model_dir", i.model_dir.display().to_string())?;
        d.set_item("format", i.format)?;
        d.set_item("model_type", c.family.name())?;
        d.set_item("dtype", i.dtype)?;
        d.set_item("kv_dtype", i.kv_dtype)?;
        d.set_item("quantize", i.quantize)?;
        d.set_item("matmul_inputs", i.matmul_inputs)?;
        d.set_item("cpu_levels", &i.cpu_levels)?;
        match &i.speculative {
            Some(o) => {
                let spec = PyDict::new(py);
                match &i.draft_model {
                    Some(draft) => {
                        spec.set_item("method", "draft_model")?;
                        spec.set_item("draft_model", draft.path.to_string_lossy())?;
                        spec.set_item("draft_dtype", draft.dtype)?;
                        spec.set_item("draft_num_layers", draft.num_layers)?;
                    }
                    None => {
                        spec.set_item("method", "ngram")?;
                        spec.set_item("ngram_min", o.min_n)?;
                        spec.set_item("ngram_max", o.max_n)?;
                    }
                }
                spec.set_item("num_speculative_tokens", o.max_drafts)?;
                spec.set_item("adaptive", o.adaptive)?;
                d.set_item("speculative", spec)?;
            }
            None => d.set_item("speculative", py.None())?,
        }
        d.set_item("device", &i.device)?;
        let split = PyDict::new(py);
        for (device, layers) in i.devices.iter().zip(&i.layer_split) {
            split.set_item(device, layers)?;
        }
        d.set_item("layer_split", split)?;
        d.set_item("threads", i.threads)?;
        d.set_item("num_layers", c.num_layers)?;
        d.set_item("hidden_size", c.hidden_size)?;
        d.set_item("vocab_size", c.vocab_size)?;
        d.set_item("max_context", i.max_context)?;
        d.set_item("max_batch_tokens", i.max_batch_tokens)?;
        d.set_item("max_batch", i.max_batch)?;
        d.set_item("max_waiting", i.max_waiting)?;
        d.set_item("kv_blocks", i.kv_blocks)?;
        d.set_item("block_size", i.block_size)?;
        d.set_item("prefix_salt", i.prefix_salt)?;
        d.set_item("kv_block_bytes", i.kv_block_bytes)?;
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
