//! `LoopDispatcher`: hands stream chunks to an event loop (asyncio's, uvloop's or a trio run's)
//! with one wake-up per loop.
//!
//! A stream's next chunk used to travel engine thread → tokio worker (awaiting the channel) →
//! blocking thread (attaching to Python) → `call_soon_threadsafe` → event loop: three thread
//! wake-ups per token and stream, each taking CPU from the compute threads on a small machine
//! (measured: the engine spent 30–60 µs per step waking that chain).
//!
//! Now the event loop's thread polls the channels itself. Each loop has one dispatcher, with a
//! `Doorbell` (an eventfd, `rust/engine/doorbell.rs`) that the loop watches (`add_reader`) and
//! that tokio's channels ring, as their waker, when the engine sends. When it fires, `drain`
//! polls every waiting stream and settles their futures, holding the GIL it already has. No Rust
//! thread ever attaches to Python on this path, so it cannot touch an exiting interpreter.
//!
//! Nothing here is asyncio's own: the loop is whatever `awaitable::current_loop` returns, and
//! only its `create_future` and `add_reader` are called. On trio, `add_reader` starts a system
//! task that waits for the eventfd (`trio.lowlevel.wait_readable`) and calls `drain`
//! (`strata_rs._async._trio`): the same single wake-up per ring, on the run's own thread.

use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use pyo3::exceptions::PyOSError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

use super::awaitable::current_loop;
use super::stream::StreamShared;
use crate::engine::doorbell::Doorbell;
use crate::sync::lock;

/// An `__anext__` whose future is not settled yet.
struct Waiting {
    stream: Arc<StreamShared>,
    future: Py<PyAny>,
}

#[pyclass(frozen)]
pub struct LoopDispatcher {
    doorbell: Arc<Doorbell>,
    /// The doorbell as the waker every waiting stream's channel holds.
    waker: Waker,
    /// In `__anext__` order, so that two pending calls on one stream get its chunks in order.
    waiting: Mutex<Vec<Waiting>>,
}

impl LoopDispatcher {
    fn new() -> std::io::Result<Self> {
        let doorbell = Arc::new(Doorbell::new()?);
        Ok(LoopDispatcher {
            waker: Waker::from(doorbell.clone()),
            doorbell,
            waiting: Mutex::new(Vec::new()),
        })
    }

    /// The future of the stream's next chunk: settled at once when the chunk is there, else when
    /// the engine sends it.
    pub fn next_chunk<'py>(
        &self,
        event_loop: &Bound<'py, PyAny>,
        stream: &Arc<StreamShared>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = event_loop.py();
        let future = event_loop.call_method0(intern!(py, "create_future"))?;
        // No lock is held while Python runs (building a chunk may run a finalizer that reads
        // another stream). Only this loop's thread touches the list, so nothing slips between.
        // Behind an earlier pending call on the same stream: its turn comes first.
        let queued = lock(&self.waiting)
            .iter()
            .any(|w| Arc::ptr_eq(&w.stream, stream));
        if !queued {
            let mut cx = Context::from_waker(&self.waker);
            if let Poll::Ready(outcome) = stream.poll_chunk(py, &mut cx) {
                settle(&future, outcome)?;
                return Ok(future);
            }
        }
        lock(&self.waiting).push(Waiting {
            stream: stream.clone(),
            future: future.clone().unbind(),
        });
        Ok(future)
    }
}

/// Resolves `future` with a chunk or an exception (`StopAsyncIteration` at the end).
fn settle(future: &Bound<'_, PyAny>, outcome: PyResult<Py<PyAny>>) -> PyResult<()> {
    match outcome {
        Ok(v) => future.call_method1("set_result", (v,))?,
        Err(e) => future.call_method1("set_exception", (e.into_value(future.py()),))?,
    };
    Ok(())
}

#[pymethods]
impl LoopDispatcher {
    /// The event loop's reader callback: polls every waiting stream, settles what is ready.
    fn drain(&self, py: Python<'_>) -> PyResult<()> {
        self.doorbell.reset();
        let mut cx = Context::from_waker(&self.waker);
        let waiting = std::mem::take(&mut *lock(&self.waiting));
        let mut kept = Vec::with_capacity(waiting.len());
        let mut blocked: Vec<Arc<StreamShared>> = Vec::new();
        // A Python error settling one future must not strand the others: it is raised (and
        // logged by the loop) after every entry was seen.
        let mut first_error = None;
        for w in waiting {
            let future = w.future.bind(py);
            // Cancelled by its caller (a timeout, a cancelled task): the chunk stays queued.
            match future.call_method0("done").and_then(|d| d.is_truthy()) {
                Ok(true) => continue,
                Ok(false) => {}
                Err(e) => {
                    first_error.get_or_insert(e);
                    kept.push(w);
                    continue;
                }
            }
            // A stream's later call waits until its earlier one is settled.
            if blocked.iter().any(|s| Arc::ptr_eq(s, &w.stream)) {
                kept.push(w);
                continue;
            }
            match w.stream.poll_chunk(py, &mut cx) {
                Poll::Ready(outcome) => {
                    if let Err(e) = settle(future, outcome) {
                        first_error.get_or_insert(e);
                    }
                }
                Poll::Pending => {
                    blocked.push(w.stream.clone());
                    kept.push(w);
                }
            }
        }
        // Calls made while the futures were settled go after the ones kept.
        let mut waiting = lock(&self.waiting);
        kept.append(&mut waiting);
        *waiting = kept;
        first_error.map_or(Ok(()), Err)
    }
}

/// The event loop running in this thread and its dispatcher. `last` remembers the pair, so that
/// a stream's later calls skip the registry lookup.
pub fn current_dispatcher<'py>(
    py: Python<'py>,
    last: &Mutex<Option<(Py<PyAny>, Py<LoopDispatcher>)>>,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, LoopDispatcher>)> {
    let event_loop = current_loop(py)?;
    let known = lock(last)
        .as_ref()
        .filter(|(l, _)| l.bind(py).is(&event_loop))
        .map(|(_, d)| d.clone_ref(py));
    if let Some(d) = known {
        return Ok((event_loop, d.into_bound(py)));
    }
    let dispatcher = dispatcher_for(&event_loop)?;
    *lock(last) = Some((event_loop.clone().unbind(), dispatcher.clone().unbind()));
    Ok((event_loop, dispatcher))
}

/// The dispatcher of `event_loop`, created and registered with it on first use. Kept in a
/// WeakKeyDictionary so that it goes with its loop; it holds no reference to the loop itself.
pub fn dispatcher_for<'py>(event_loop: &Bound<'py, PyAny>) -> PyResult<Bound<'py, LoopDispatcher>> {
    static REGISTRY: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    let py = event_loop.py();
    let registry = REGISTRY
        .get_or_try_init(py, || -> PyResult<Py<PyAny>> {
            Ok(py
                .import("weakref")?
                .getattr("WeakKeyDictionary")?
                .call0()?
                .unbind())
        })?
        .bind(py);
    if let Ok(found) = registry
        .call_method1("get", (event_loop,))?
        .cast_into::<LoopDispatcher>()
    {
        return Ok(found);
    }
    let dispatcher = LoopDispatcher::new()
        .map_err(|e| PyOSError::new_err(format!("cannot create a stream wake-up eventfd: {e}")))?;
    let fd = dispatcher.doorbell.fd();
    let dispatcher = Bound::new(py, dispatcher)?;
    event_loop.call_method1("add_reader", (fd, dispatcher.getattr("drain")?))?;
    registry.set_item(event_loop, &dispatcher)?;
    Ok(dispatcher)
}
