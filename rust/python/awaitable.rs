//! Awaitables backed by Rust futures, and the gate that keeps Rust threads out of an interpreter
//! that is shutting down.
//!
//! pyo3-async-runtimes' `future_into_py` attaches to Python from a runtime thread whenever its
//! future ends. A future that ends while the interpreter finalizes (a stream whose engine stops
//! as the process exits) then attaches to a dying interpreter, and the process aborts with
//! "PyGILState_Release: thread state must be current" or a segfault instead of exiting 0: about
//! one exit in seven did, measured with four open streams. So every attach from a Rust thread goes
//! through [`attach_unless_exiting`], and an `atexit` hook (run before finalization starts)
//! closes the gate and waits for attaches already in progress. Work that ends later is dropped:
//! nothing is left to receive it.
//!
//! The event loop is whichever async library's is running this thread ([`current_loop`]):
//! asyncio's (or uvloop's) itself, or trio's through `strata_rs._async._trio`, which offers the
//! same three methods the bindings call (`create_future`, `call_soon_threadsafe`, `add_reader`).
//! The tokio runtime still comes from pyo3-async-runtimes.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::time::{Duration, Instant};

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyCFunction;

use super::errors::to_pyerr;
use crate::error::StrataError;

static EXITING: AtomicBool = AtomicBool::new(false);
static ATTACHING: AtomicUsize = AtomicUsize::new(0);

/// How long the exit hook waits for attaches in progress (each is a short conversion).
const EXIT_WAIT: Duration = Duration::from_secs(5);

/// Counts one attach in progress, also when `f` panics.
struct Attaching;

impl Attaching {
    fn enter() -> Self {
        ATTACHING.fetch_add(1, SeqCst);
        Attaching
    }
}

impl Drop for Attaching {
    fn drop(&mut self) {
        ATTACHING.fetch_sub(1, SeqCst);
    }
}

/// Runs `f` attached to Python from a thread Python did not start; `None` once the interpreter
/// is exiting. The count goes up before the flag is read and the exit hook sets the flag before
/// it reads the count (both sequentially consistent), so no attach starts after the hook returns.
pub fn attach_unless_exiting<R>(f: impl FnOnce(Python<'_>) -> R) -> Option<R> {
    let _attaching = Attaching::enter();
    if EXITING.load(SeqCst) {
        return None;
    }
    Some(Python::attach(f))
}

/// Registered with `atexit`: closes the gate, then waits (without the GIL, which the attaches in
/// progress need) until none is left.
#[pyfunction]
fn close_python_gate(py: Python<'_>) {
    EXITING.store(true, SeqCst);
    py.detach(|| {
        let deadline = Instant::now() + EXIT_WAIT;
        while ATTACHING.load(SeqCst) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
    });
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let hook = wrap_pyfunction!(close_python_gate, m)?;
    m.py().import("atexit")?.call_method1("register", (hook,))?;
    Ok(())
}

/// What [`current_loop`] calls.
struct LoopHooks {
    /// `asyncio._get_running_loop`: the running asyncio loop or None, without raising.
    running: Py<PyAny>,
    /// `sniffio.thread_local`: its `name` is set ("trio") while trio runs this thread.
    library: Py<PyAny>,
    /// `strata_rs._async.current_loop`: picks by sniffio, raises when nothing runs.
    pick: Py<PyAny>,
}

/// The event loop of the async library running this thread: asyncio's own loop (checked first,
/// without leaving Rust: the common case stays as cheap as it was), a trio run's `TrioLoop`
/// when sniffio's thread-local says trio (straight to `_trio.current_loop`: this runs on every
/// `__anext__`), else what `strata_rs._async.current_loop` finds. Raises RuntimeError outside
/// async code.
pub fn current_loop(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    static HOOKS: PyOnceLock<LoopHooks> = PyOnceLock::new();
    // Imported on first use only: it imports trio.
    static TRIO_LOOP: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    let hooks = HOOKS.get_or_try_init(py, || -> PyResult<LoopHooks> {
        Ok(LoopHooks {
            running: py.import("asyncio")?.getattr("_get_running_loop")?.unbind(),
            library: py.import("sniffio")?.getattr("thread_local")?.unbind(),
            pick: py
                .import("strata_rs._async")?
                .getattr("current_loop")?
                .unbind(),
        })
    })?;
    // trio in guest mode runs inside a host asyncio loop: when sniffio names a library, the
    // asyncio loop of the thread is not necessarily the caller's.
    let library = hooks.library.bind(py).getattr(intern!(py, "name"))?;
    if library.is_none() {
        let running = hooks.running.bind(py).call0()?;
        if !running.is_none() {
            return Ok(running);
        }
    } else if library.eq(intern!(py, "trio"))? {
        let trio_loop = TRIO_LOOP.get_or_try_init(py, || -> PyResult<Py<PyAny>> {
            Ok(py
                .import("strata_rs._async._trio")?
                .getattr("current_loop")?
                .unbind())
        })?;
        return trio_loop.bind(py).call0();
    }
    hooks.pick.bind(py).call0()
}

/// An awaitable of the running loop that is already resolved to `value` (calls with nothing to
/// wait for that are awaitable all the same).
pub fn ready_awaitable<'py>(
    py: Python<'py>,
    value: Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    let future = current_loop(py)?.call_method0(intern!(py, "create_future"))?;
    future.call_method1(intern!(py, "set_result"), (value,))?;
    Ok(future)
}

/// Cancels the Rust task when the awaiting future is cancelled (an asyncio task's cancellation,
/// a trio cancel scope).
#[pyclass(frozen)]
struct AbortOnCancel {
    task: tokio::task::AbortHandle,
}

#[pymethods]
impl AbortOnCancel {
    fn __call__(&self, future: &Bound<'_, PyAny>) -> PyResult<()> {
        if future.call_method0("cancelled")?.is_truthy()? {
            self.task.abort();
        }
        Ok(())
    }
}

/// Runs on the event loop's thread: settles `future` unless it was cancelled meanwhile.
#[pyfunction]
fn settle(future: &Bound<'_, PyAny>, ok: bool, value: &Bound<'_, PyAny>) -> PyResult<()> {
    if future.call_method0("done")?.is_truthy()? {
        return Ok(());
    }
    let method = if ok { "set_result" } else { "set_exception" };
    future.call_method1(method, (value,))?;
    Ok(())
}

fn settle_fn(py: Python<'_>) -> PyResult<&Py<PyCFunction>> {
    static SETTLE: PyOnceLock<Py<PyCFunction>> = PyOnceLock::new();
    SETTLE.get_or_try_init(py, || Ok(wrap_pyfunction!(settle, py)?.unbind()))
}

/// A future of the running loop (asyncio's or trio's) resolved by `work`, run on the runtime.
/// Its value is turned into a Python object by `convert` when it is delivered, attached to
/// Python through the exit gate, on a blocking thread (the GIL may be contended; runtime workers
/// must not wait for it), and handed to the loop's thread with its `call_soon_threadsafe`.
/// Cancelling the future drops `work`.
pub fn spawn_awaitable<'py, V, F, C>(
    py: Python<'py>,
    work: F,
    convert: C,
) -> PyResult<Bound<'py, PyAny>>
where
    F: Future<Output = Result<V, StrataError>> + Send + 'static,
    V: Send + 'static,
    C: FnOnce(Python<'_>, V) -> PyResult<Py<PyAny>> + Send + 'static,
{
    let event_loop = current_loop(py)?;
    let future = event_loop.call_method0(intern!(py, "create_future"))?;
    let runtime = pyo3_async_runtimes::tokio::get_runtime();
    let task = runtime.spawn(work);
    future.call_method1(
        "add_done_callback",
        (AbortOnCancel {
            task: task.abort_handle(),
        },),
    )?;
    let (event_loop, target) = (event_loop.unbind(), future.clone().unbind());
    runtime.spawn(async move {
        let outcome = match task.await {
            Ok(outcome) => outcome,
            // Cancelled from Python: nobody awaits it any more.
            Err(e) if e.is_cancelled() => return,
            Err(e) => Err(StrataError::Internal(format!("a Rust task panicked: {e}"))),
        };
        tokio::task::spawn_blocking(move || {
            attach_unless_exiting(|py| {
                let (ok, value) = match outcome.map_err(to_pyerr).and_then(|v| convert(py, v)) {
                    Ok(v) => (true, v),
                    Err(e) => (false, e.into_value(py).into_any()),
                };
                let delivered = settle_fn(py).and_then(|settle| {
                    event_loop.call_method1(py, "call_soon_threadsafe", (settle, target, ok, value))
                });
                // A closed event loop (a finished trio run) has no one left waiting for it.
                drop(delivered);
            });
        });
    });
    Ok(future)
}
