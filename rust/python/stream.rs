//! `TokenStream`: the async iterator `Engine.generate` and `Engine.chat` return.
//!
//! Each `__anext__` polls the request's channel on the event loop's thread (asyncio's or trio's)
//! and, when nothing is there yet, leaves its future with the loop's dispatcher (`dispatch.rs`),
//! which settles it when the engine sends. A call takes every delta already waiting for the same choice and merges them
//! into one chunk, so a consumer that falls behind catches up in one step instead of paying the
//! per-chunk cost for each token. Dropping the stream (breaking out of `async for`, a cancelled
//! task) cancels the request: the engine frees its blocks at its next step.

use std::future::poll_fn;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use pyo3::exceptions::PyStopAsyncIteration;
use pyo3::prelude::*;
use tokio::sync::mpsc::UnboundedReceiver;

use super::awaitable::ready_awaitable;
use super::dispatch::{current_dispatcher, LoopDispatcher};
use super::errors::to_pyerr;
use super::output::{chunk, ChoiceAcc};
use crate::engine::request::{CancelFlag, Delta, Event, Usage};
use crate::error::StrataError;
use crate::model::tokenizer::Tokenizer;

pub struct StreamState {
    events: UnboundedReceiver<Event>,
    /// A delta taken while merging that belongs to another choice: the next chunk starts with it.
    held: Option<Delta>,
    /// An error that arrived behind a delta: the next call raises it.
    failed: Option<StrataError>,
    /// The request's last delta (with usage) was delivered.
    done: bool,
}

/// What the stream and its event loop's dispatcher share.
pub struct StreamShared {
    state: Mutex<StreamState>,
    tokenizer: Arc<Tokenizer>,
    want_logprobs: bool,
}

impl StreamShared {
    /// The next chunk as a Python object (`StopAsyncIteration` at the end), or `Pending` with
    /// `cx`'s waker registered on the channel.
    pub fn poll_chunk(&self, py: Python<'_>, cx: &mut Context<'_>) -> Poll<PyResult<Py<PyAny>>> {
        // The lock is let go before the chunk is built: building it runs Python.
        let next = {
            let mut state = crate::sync::lock(&self.state);
            match state.poll_next_delta(cx) {
                Poll::Ready(next) => next,
                Poll::Pending => return Poll::Pending,
            }
        };
        Poll::Ready(match next {
            Ok(Some(d)) => {
                Ok(Py::new(py, chunk(py, &self.tokenizer, d, self.want_logprobs)?)?.into_any())
            }
            Ok(None) => Err(PyStopAsyncIteration::new_err(())),
            Err(e) => Err(to_pyerr(e)),
        })
    }
}

#[pyclass(name = "TokenStream", module = "strata_rs", frozen)]
pub struct PyTokenStream {
    shared: Arc<StreamShared>,
    /// The event loop of the last `__anext__` and its dispatcher.
    dispatcher: Mutex<Option<(Py<PyAny>, Py<LoopDispatcher>)>>,
    cancel: CancelFlag,
    request_id: u64,
}

impl PyTokenStream {
    pub fn new(
        events: UnboundedReceiver<Event>,
        cancel: CancelFlag,
        tokenizer: Arc<Tokenizer>,
        want_logprobs: bool,
        request_id: u64,
    ) -> Self {
        PyTokenStream {
            shared: Arc::new(StreamShared {
                state: Mutex::new(StreamState::new(events)),
                tokenizer,
                want_logprobs,
            }),
            dispatcher: Mutex::new(None),
            cancel,
            request_id,
        }
    }
}

fn closed_early() -> StrataError {
    StrataError::EngineStopped("the engine stopped before the request finished".into())
}

/// Merges `next` into `acc` when it continues the same choice.
fn merge(acc: &mut Delta, next: Delta) -> Option<Delta> {
    if next.index != acc.index || acc.finish_reason.is_some() {
        return Some(next);
    }
    acc.text.push_str(&next.text);
    acc.token_ids.extend(next.token_ids);
    acc.logprobs.extend(next.logprobs);
    acc.finish_reason = next.finish_reason;
    acc.usage = next.usage;
    None
}

impl StreamState {
    /// The next merged delta; `Ok(None)` once the request is complete.
    async fn next_delta(&mut self) -> Result<Option<Delta>, StrataError> {
        poll_fn(|cx| self.poll_next_delta(cx)).await
    }

    fn poll_next_delta(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Option<Delta>, StrataError>> {
        if self.done {
            return Poll::Ready(Ok(None));
        }
        let mut acc = match self.held.take() {
            Some(d) => d,
            None if self.failed.is_some() => {
                self.done = true;
                return Poll::Ready(Err(self.failed.take().unwrap_or_else(closed_early)));
            }
            None => match self.events.poll_recv(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Event::Delta(d))) => d,
                Poll::Ready(Some(Event::Error(e))) => {
                    self.done = true;
                    return Poll::Ready(Err(e));
                }
                Poll::Ready(None) => {
                    self.done = true;
                    return Poll::Ready(Err(closed_early()));
                }
            },
        };
        while acc.usage.is_none() && self.failed.is_none() {
            match self.events.try_recv() {
                Ok(Event::Delta(d)) => {
                    if let Some(other) = merge(&mut acc, d) {
                        self.held = Some(other);
                        break;
                    }
                }
                // An error after this delta surfaces on the next call.
                Ok(Event::Error(e)) => {
                    self.failed = Some(e);
                    break;
                }
                Err(_) => break,
            }
        }
        if acc.usage.is_some() {
            self.done = true;
        }
        Poll::Ready(Ok(Some(acc)))
    }
}

/// Collects a whole request: every choice's text and the usage.
pub async fn collect(
    state: &mut StreamState,
    n: usize,
) -> Result<(Vec<ChoiceAcc>, Usage), StrataError> {
    let mut choices: Vec<ChoiceAcc> = (0..n).map(|_| ChoiceAcc::default()).collect();
    loop {
        match state.next_delta().await? {
            Some(d) => {
                let usage = d.usage;
                if let Some(c) = choices.get_mut(d.index) {
                    c.add(d);
                }
                if let Some(u) = usage {
                    return Ok((choices, u));
                }
            }
            None => return Err(closed_early()),
        }
    }
}

impl StreamState {
    pub fn new(events: UnboundedReceiver<Event>) -> Self {
        StreamState {
            events,
            held: None,
            failed: None,
            done: false,
        }
    }
}

#[pymethods]
impl PyTokenStream {
    fn __aiter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __anext__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let (event_loop, dispatcher) = current_dispatcher(py, &self.dispatcher)?;
        dispatcher.get().next_chunk(&event_loop, &self.shared)
    }

    /// Stops the request; the engine frees its blocks at its next step and the stream ends with
    /// a chunk whose finish_reason is "cancelled".
    fn cancel(&self) {
        self.cancel.cancel();
    }

    /// Same as `cancel()`, awaitable, for `contextlib.aclosing`.
    fn aclose<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.cancel.cancel();
        ready_awaitable(py, py.None().into_bound(py))
    }

    #[getter]
    fn request_id(&self) -> u64 {
        self.request_id
    }
}

impl Drop for PyTokenStream {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}
