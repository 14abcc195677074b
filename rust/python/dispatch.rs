//! `LoopDispatcher`: hands stream chunks to an event loop (asyncio's, uvloop's or a trio run's)
//! with one wake-up per loop.
//!
//! A stream's next chunk used to travel engine thread → tokio worker (awaiting the channel) →
//! blocking thread (attaching to Python) → `call_soon_threadsafe` → event loop: three thread
//! wake-ups per token and stream, each taking CPU from the compute threads on a small machine
//! (docs/benchmarks.md, "Figures behind code comments": what the engine spent per step waking
//! that chain).
//!
//! Now the event loop's thread polls the channels itself. Each loop has one dispatcher, with a
//! `Doorbell` (an eventfd; a pipe off Linux, `rust/engine/doorbell.rs`) that the loop watches
//! (`add_reader`) and that tokio's channels ring, as their waker, when the engine sends. When it
//! fires, `drain` polls every waiting stream and settles their futures, holding the GIL it
//! already has. No Rust thread ever attaches to Python on this path, so it cannot touch an
//! exiting interpreter.
//!
//! Nothing here is asyncio's own: the loop is whatever `awaitable::current_loop` returns, and
//! only its `create_future` and `add_reader` are called. On trio, `add_reader` starts a system
//! task that waits for its descriptor (`trio.lowlevel.wait_readable`) and calls `drain`
//! (`strata_rs._async._trio`): the same single wake-up per ring, on the run's own thread.
//!
//! On trio a chunk has no future: `__anext__` returns a [`TrioNext`], an awaitable that parks
//! the awaiting task the way `trio.lowlevel.wait_task_rescheduled` does (it yields trio's own
//! `WaitTaskRescheduled` message, with itself as the abort function), and `drain` hands it the
//! chunk and calls the run's `reschedule` for its task. Per chunk that skips a Python future and
//! its `done`/`set_result` frames, an `outcome.Value`, and trio's `wait_task_rescheduled`
//! coroutine and unwrapping. The message is built without its class's Python `__init__`, the
//! task is resumed with None (the interpreter then takes `__next__`, not a `send` method call),
//! and a stream's later calls in the same run reuse its loop without trio's RunVar lookup
//! (`same_trio_run`): Python frames per chunk that were ours, not trio's. The trio objects it
//! needs come from `TrioLoop.stream_hooks()`; when that gives None (a trio whose internals
//! moved), streams use `create_future` as asyncio does.

use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use pyo3::exceptions::{PyOSError, PyRuntimeError, PyStopIteration};
use pyo3::ffi;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::IntoPyDict;

use super::awaitable::current_loop;
use super::stream::StreamShared;
use crate::engine::doorbell::Doorbell;
use crate::sync::lock;

/// What an `__anext__` that is not settled yet waits in.
enum Target {
    /// A future of the loop's `create_future` (asyncio's).
    Future(Py<PyAny>),
    /// On trio.
    Trio(Py<TrioNext>),
}

/// An `__anext__` that is not settled yet.
struct Waiting {
    stream: Arc<StreamShared>,
    target: Target,
}

/// The trio objects [`TrioNext`] uses, from `TrioLoop.stream_hooks()` (see its docstring).
struct TrioHooks {
    /// trio's run context (a thread-local): its `task` is the task running now, its `runner`
    /// the run of this thread.
    run_context: Py<PyAny>,
    /// The run these hooks belong to.
    runner: Py<PyAny>,
    /// The run's `reschedule(task, next_send)`.
    reschedule: Py<PyAny>,
    /// `WaitTaskRescheduled`: what a task yields to trio to be parked until rescheduled.
    park: Py<PyAny>,
    /// `object.__new__`, to build a `park` message without its Python `__init__` (one is built
    /// per chunk), when that gives the same message (checked once, in `from_loop`).
    new_park: Option<Py<PyAny>>,
    /// `Abort.SUCCEEDED` and `Abort.FAILED`.
    abort_succeeded: Py<PyAny>,
    abort_failed: Py<PyAny>,
}

impl TrioHooks {
    fn from_loop(event_loop: &Bound<'_, PyAny>) -> PyResult<Option<TrioHooks>> {
        let py = event_loop.py();
        if !event_loop.hasattr(intern!(py, "stream_hooks"))? {
            return Ok(None);
        }
        let hooks = event_loop.call_method0(intern!(py, "stream_hooks"))?;
        if hooks.is_none() {
            return Ok(None);
        }
        let (run_context, runner, park, abort_succeeded, abort_failed): (_, Py<PyAny>, _, _, _) =
            hooks.extract()?;
        let reschedule = runner.bind(py).getattr(intern!(py, "reschedule"))?.unbind();
        let mut trio = TrioHooks {
            run_context,
            runner,
            reschedule,
            park,
            new_park: Some(
                py.get_type::<PyAny>()
                    .getattr(intern!(py, "__new__"))?
                    .unbind(),
            ),
            abort_succeeded,
            abort_failed,
        };
        // The message built the short way must be the one trio's class builds (an attrs class
        // today); should that change, messages go through the class again.
        if !short_park_matches(py, &trio).unwrap_or(false) {
            trio.new_park = None;
        }
        Ok(Some(trio))
    }

    /// trio's message that parks the running task with `abort` as its abort function.
    fn park_message<'py>(
        &self,
        py: Python<'py>,
        abort: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let park = self.park.bind(py);
        let Some(new) = &self.new_park else {
            return park.call1((abort,));
        };
        let message = new.bind(py).call1((park,))?;
        // The instance's own attribute, as the class's `__init__` sets it (frozen: its
        // `__setattr__` refuses, so this goes around it as attrs does).
        let name = intern!(py, "abort_func");
        // SAFETY: all three are live objects; the GIL is held.
        if unsafe { ffi::PyObject_GenericSetAttr(message.as_ptr(), name.as_ptr(), abort.as_ptr()) }
            < 0
        {
            return Err(PyErr::fetch(py));
        }
        Ok(message)
    }
}

/// Whether `park_message`'s short way builds a message equal to the class's own.
fn short_park_matches(py: Python<'_>, hooks: &TrioHooks) -> PyResult<bool> {
    let abort = hooks.abort_failed.bind(py);
    let short = hooks.park_message(py, abort)?;
    let long = hooks.park.bind(py).call1((abort,))?;
    Ok(short.get_type().is(long.get_type())
        && short.eq(&long)?
        && short.getattr(intern!(py, "abort_func"))?.is(abort))
}

#[pyclass(frozen)]
pub struct LoopDispatcher {
    doorbell: Arc<Doorbell>,
    /// The doorbell as the waker every waiting stream's channel holds.
    waker: Waker,
    /// In `__anext__` order, so that two pending calls on one stream get its chunks in order.
    waiting: Mutex<Vec<Waiting>>,
    /// Set for a trio run: its streams' calls return [`TrioNext`]s. Taken by `close` when the
    /// run ends: the hooks hold the run's runner, whose run variables hold the loop, and a
    /// dispatcher kept past its run would keep the loop (its registry key) and so itself alive.
    trio: Mutex<Option<Arc<TrioHooks>>>,
    /// Made for a trio run (whose hooks `close` may have taken since).
    trio_run: bool,
}

impl LoopDispatcher {
    fn new(trio: Option<TrioHooks>) -> std::io::Result<Self> {
        let doorbell = Arc::new(Doorbell::new()?);
        Ok(LoopDispatcher {
            waker: Waker::from(doorbell.clone()),
            doorbell,
            waiting: Mutex::new(Vec::new()),
            trio_run: trio.is_some(),
            trio: Mutex::new(trio.map(Arc::new)),
        })
    }

    /// The awaitable of the stream's next chunk (a future of the loop, or on trio a
    /// [`TrioNext`]): settled at once when the chunk is there, else when the engine sends it.
    pub fn next_chunk<'py>(
        &self,
        event_loop: &Bound<'py, PyAny>,
        stream: &Arc<StreamShared>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = event_loop.py();
        let trio = lock(&self.trio).clone();
        let future = match (&trio, self.trio_run) {
            (Some(_), _) => None,
            (None, false) => Some(event_loop.call_method0(intern!(py, "create_future"))?),
            (None, true) => {
                return Err(PyRuntimeError::new_err(
                    "the trio run this stream was awaited in has ended",
                ));
            }
        };
        // No lock is held while Python runs (building a chunk may run a finalizer that reads
        // another stream). Only this loop's thread touches the list, so nothing slips between.
        // Behind an earlier pending call on the same stream: its turn comes first.
        let queued = lock(&self.waiting)
            .iter()
            .any(|w| Arc::ptr_eq(&w.stream, stream));
        let mut ready = None;
        if !queued {
            let mut cx = Context::from_waker(&self.waker);
            if let Poll::Ready(outcome) = stream.poll_chunk(py, &mut cx) {
                ready = Some(outcome);
            }
        }
        let target = match (future, trio) {
            (Some(future), _) => {
                if let Some(outcome) = ready {
                    settle(&future, outcome)?;
                    return Ok(future);
                }
                lock(&self.waiting).push(Waiting {
                    stream: stream.clone(),
                    target: Target::Future(future.clone().unbind()),
                });
                return Ok(future);
            }
            (None, Some(hooks)) => hooks,
            (None, None) => return Err(PyRuntimeError::new_err("no loop to wait on")),
        };
        let state = match ready {
            Some(outcome) => NextState::Ready(outcome),
            None => NextState::Pending(None),
        };
        let pending = matches!(state, NextState::Pending(_));
        let next = Bound::new(
            py,
            TrioNext {
                state: Mutex::new(state),
                hooks: target.clone(),
            },
        )?;
        if pending {
            lock(&self.waiting).push(Waiting {
                stream: stream.clone(),
                target: Target::Trio(next.clone().unbind()),
            });
        }
        Ok(next.into_any())
    }
}

/// Where a [`TrioNext`] is.
enum NextState {
    /// Its chunk has not come; the task parked in it once it is awaited.
    Pending(Option<Py<PyAny>>),
    /// The chunk (or the stream's exception, `StopAsyncIteration` at the end), not handed out.
    Ready(PyResult<Py<PyAny>>),
    /// Its task was cancelled while it waited (a cancel scope), or it was closed: the chunk
    /// stays in the stream for the next call.
    Cancelled,
    /// Handed out.
    Spent,
}

/// The awaitable of a stream's next chunk on trio: awaited, it parks its task in trio's
/// scheduler as `trio.lowlevel.wait_task_rescheduled` would, and the dispatcher's `drain`
/// reschedules the task when the chunk comes. Its own `__await__` iterator, one await only.
#[pyclass(frozen, module = "strata_rs")]
pub struct TrioNext {
    state: Mutex<NextState>,
    hooks: Arc<TrioHooks>,
}

impl TrioNext {
    /// The value of the `await` (as `StopIteration`) or its exception, once.
    fn hand_out(&self) -> PyErr {
        let state = std::mem::replace(&mut *lock(&self.state), NextState::Spent);
        match state {
            NextState::Ready(Ok(chunk)) => PyStopIteration::new_err((chunk,)),
            NextState::Ready(Err(e)) => e,
            other => {
                // Not reached (callers check); put back what was there.
                *lock(&self.state) = other;
                PyRuntimeError::new_err("the strata_rs chunk is not ready")
            }
        }
    }
}

#[pymethods]
impl TrioNext {
    fn __await__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __iter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __next__(slf: &Bound<'_, Self>) -> PyResult<Py<PyAny>> {
        Self::send(slf, &slf.py().None().into_bound(slf.py()))
    }

    /// Started (`value` None): the chunk at once when it is there, else parks the task (yields
    /// trio's message). Resumed by trio: the chunk `drain` left (sent None, so that the
    /// interpreter resumes it through `__next__` rather than a `send` method call), or the
    /// outcome trio sent (a cancellation's `Cancelled`).
    fn send(slf: &Bound<'_, Self>, value: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        let py = slf.py();
        let this = slf.get();
        let parked = {
            let mut state = lock(&this.state);
            match &mut *state {
                NextState::Ready(_) => None,
                NextState::Pending(task @ None) => {
                    let current = this
                        .hooks
                        .run_context
                        .bind(py)
                        .getattr(intern!(py, "task"))
                        .map_err(|_| {
                            PyRuntimeError::new_err(
                                "a strata_rs stream awaited outside a trio task",
                            )
                        })?;
                    *task = Some(current.unbind());
                    Some(())
                }
                NextState::Pending(Some(_)) if value.is_none() => {
                    return Err(PyRuntimeError::new_err(
                        "another task is already awaiting this strata_rs awaitable",
                    ))
                }
                NextState::Pending(Some(_)) | NextState::Cancelled => {
                    drop(state);
                    // Rescheduled by trio itself: with the outcome of a cancellation.
                    value.call_method0(intern!(py, "unwrap"))?;
                    return Err(PyRuntimeError::new_err(
                        "a strata_rs stream's task was resumed without its chunk",
                    ));
                }
                NextState::Spent => {
                    return Err(PyRuntimeError::new_err(
                        "cannot reuse an already awaited strata_rs chunk awaitable",
                    ))
                }
            }
        };
        match parked {
            Some(()) => Ok(this.hooks.park_message(py, slf.as_any())?.unbind()),
            None => Err(this.hand_out()),
        }
    }

    /// An exception thrown into the await (the awaiting coroutine's `throw`): the call gives up
    /// its place, and the exception goes on.
    #[pyo3(signature = (typ, val=None, _tb=None))]
    fn throw(
        &self,
        typ: &Bound<'_, PyAny>,
        val: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        self.give_up();
        Err(match val.filter(|v| !v.is_none()) {
            Some(v) => PyErr::from_value(v.clone()),
            None => PyErr::from_value(typ.clone()),
        })
    }

    fn close(&self) {
        self.give_up();
    }

    /// trio's abort function, while its task is parked here: a cancellation. The chunk stays in
    /// the stream; trio resumes the task with `Cancelled` (see `send`).
    fn __call__(&self, py: Python<'_>, _raise_cancel: &Bound<'_, PyAny>) -> Py<PyAny> {
        let mut state = lock(&self.state);
        if matches!(*state, NextState::Pending(_)) {
            *state = NextState::Cancelled;
            self.hooks.abort_succeeded.clone_ref(py)
        } else {
            // Not reached: drain reschedules the task, which ends its abortable wait.
            self.hooks.abort_failed.clone_ref(py)
        }
    }
}

impl TrioNext {
    fn give_up(&self) {
        let mut state = lock(&self.state);
        if matches!(*state, NextState::Pending(_)) {
            *state = NextState::Cancelled;
        }
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

/// Leaves the chunk in `next` and reschedules its parked task, if it has one yet.
fn resume(py: Python<'_>, next: &TrioNext, outcome: PyResult<Py<PyAny>>) -> PyResult<()> {
    let task = {
        let mut state = lock(&next.state);
        match std::mem::replace(&mut *state, NextState::Ready(outcome)) {
            NextState::Pending(task) => task,
            // Not reached: drain only resumes pending ones.
            other => {
                *state = other;
                None
            }
        }
    };
    if let Some(task) = task {
        next.hooks.reschedule.bind(py).call1((task, py.None()))?;
    }
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
            // Cancelled by its caller (a timeout, a cancelled task): the chunk stays queued.
            let done = match &w.target {
                Target::Future(future) => future
                    .bind(py)
                    .call_method0(intern!(py, "done"))
                    .and_then(|d| d.is_truthy()),
                Target::Trio(next) => {
                    Ok(!matches!(*lock(&next.get().state), NextState::Pending(_)))
                }
            };
            match done {
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
                    let settled = match &w.target {
                        Target::Future(future) => settle(future.bind(py), outcome),
                        Target::Trio(next) => resume(py, next.get(), outcome),
                    };
                    if let Err(e) = settled {
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

    /// Called by a trio loop when its run ends: drops the run's hooks and the calls still
    /// waiting (their tasks are gone), so that the loop, this dispatcher and its eventfd are
    /// freed with the run.
    fn close(&self) {
        let hooks = lock(&self.trio).take();
        let waiting = std::mem::take(&mut *lock(&self.waiting));
        drop((hooks, waiting));
    }
}

/// The event loop running in this thread and its dispatcher. `last` remembers the pair, so that
/// a stream's later calls skip the registry lookup.
pub fn current_dispatcher<'py>(
    py: Python<'py>,
    last: &Mutex<Option<(Py<PyAny>, Py<LoopDispatcher>)>>,
) -> PyResult<(Bound<'py, PyAny>, Bound<'py, LoopDispatcher>)> {
    if let Some(same) = same_trio_run(py, last)? {
        return Ok(same);
    }
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

/// `last` when it is a trio run's and a task of that run is running now: its loop is the one
/// `current_loop` would give (one loop per run), without the lookup, which on trio is Python
/// (sniffio's name, then the run's RunVar).
fn same_trio_run<'py>(
    py: Python<'py>,
    last: &Mutex<Option<(Py<PyAny>, Py<LoopDispatcher>)>>,
) -> PyResult<Option<(Bound<'py, PyAny>, Bound<'py, LoopDispatcher>)>> {
    let Some((event_loop, dispatcher)) = lock(last)
        .as_ref()
        .filter(|(_, d)| d.get().trio_run)
        .map(|(l, d)| (l.clone_ref(py), d.clone_ref(py)))
    else {
        return Ok(None);
    };
    let Some(hooks) = lock(&dispatcher.get().trio).clone() else {
        return Ok(None);
    };
    let run_context = hooks.run_context.bind(py);
    // `task` is there only while one of the thread's trio tasks runs: not in a guest run's
    // host-loop callbacks, where the caller may be an asyncio task.
    if run_context.getattr_opt(intern!(py, "task"))?.is_none() {
        return Ok(None);
    }
    match run_context.getattr_opt(intern!(py, "runner"))? {
        Some(runner) if runner.is(&hooks.runner) => {
            Ok(Some((event_loop.into_bound(py), dispatcher.into_bound(py))))
        }
        _ => Ok(None),
    }
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
    let trio = TrioHooks::from_loop(event_loop)?;
    let dispatcher = LoopDispatcher::new(trio)
        .map_err(|e| PyOSError::new_err(format!("cannot create a stream wake-up doorbell: {e}")))?;
    let fd = dispatcher.doorbell.fd();
    let trio_run = dispatcher.trio_run;
    let dispatcher = Bound::new(py, dispatcher)?;
    let drain = dispatcher.getattr("drain")?;
    if trio_run {
        // `TrioLoop.add_reader` calls `on_exit` when the run ends (see `close`).
        let on_exit = [("on_exit", dispatcher.getattr("close")?)].into_py_dict(py)?;
        event_loop.call_method("add_reader", (fd, drain), Some(&on_exit))?;
    } else {
        event_loop.call_method1("add_reader", (fd, drain))?;
    }
    registry.set_item(event_loop, &dispatcher)?;
    Ok(dispatcher)
}
