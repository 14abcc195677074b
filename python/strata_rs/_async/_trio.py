"""trio's side of the loop interface the extension uses (see `strata_rs._async`).

`TrioLoop` gives what an asyncio loop gives the extension: `create_future` (a `TrioFuture`),
`call_soon_threadsafe` (through the run's `TrioToken.run_sync_soon`) and `add_reader` (a system
task that waits for the fd to be readable, then runs the callback: the stream dispatcher's
`drain`). One loop per `trio.run`, kept in a RunVar, so that it and its dispatcher go with the run.

Stream chunks skip the future: `stream_hooks` gives the extension what it needs to park a task
in trio's scheduler and reschedule it itself (`TrioNext` in rust/python/dispatch.rs).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator
from typing import Any

import trio
from outcome import Error, Value
from trio.lowlevel import Abort, current_task, reschedule, wait_readable, wait_task_rescheduled

_log = logging.getLogger("strata_rs")


class TrioFuture:
    """The part of asyncio.Future the extension uses, awaitable by one trio task at a time.

    Settled on the run's own thread only (the dispatcher's drain, or a callback sent with
    `call_soon_threadsafe`). A waiting task cancelled by its cancel scope marks it cancelled and
    runs its done callbacks, which is how the extension learns to drop the request's work."""

    # Class-level defaults and no __init__: one is made per stream chunk, and a call to a
    # Python __init__ was a measurable part of the delivery's cost on trio.
    _done = False
    _cancelled = False
    _result: Any = None
    _error: BaseException | None = None
    _waiter: trio.lowlevel.Task | None = None
    _callbacks: list[Callable[[TrioFuture], object]] | None = None

    def done(self) -> bool:
        return self._done

    def cancelled(self) -> bool:
        return self._cancelled

    # set_result and set_exception run once per stream chunk: kept to a few bytecodes.
    def set_result(self, value: Any) -> None:
        if self._done:
            raise RuntimeError("the future is already settled")
        self._done = True
        self._result = value
        if self._waiter is not None:
            reschedule(self._waiter, Value(value))
            self._waiter = None
        if self._callbacks is not None:
            self._run_callbacks()

    def set_exception(self, error: BaseException) -> None:
        if self._done:
            raise RuntimeError("the future is already settled")
        self._done = True
        self._error = error
        if self._waiter is not None:
            reschedule(self._waiter, Error(error))
            self._waiter = None
        if self._callbacks is not None:
            self._run_callbacks()

    def result(self) -> Any:
        if self._cancelled:
            raise RuntimeError("the awaitable was cancelled")
        if not self._done:
            raise RuntimeError("the result is not ready yet")
        if self._error is not None:
            raise self._error
        return self._result

    def add_done_callback(self, callback: Callable[[TrioFuture], object]) -> None:
        if self._done:
            callback(self)
        elif self._callbacks is None:
            self._callbacks = [callback]
        else:
            self._callbacks.append(callback)

    def _run_callbacks(self) -> None:
        callbacks, self._callbacks = self._callbacks, None
        for callback in callbacks or ():
            # They run inside trio's scheduler (an abort function), where an exception would
            # crash the whole run.
            try:
                callback(self)
            except Exception:
                _log.exception("a strata_rs future's done callback failed")

    def _abort(self, _raise_cancel: Any) -> Abort:
        self._waiter = None
        self._done = self._cancelled = True
        self._run_callbacks()
        return Abort.SUCCEEDED

    def __await__(self) -> Generator[Any, Any, Any]:
        if not self._done:
            if self._waiter is not None:
                raise RuntimeError("another task is already awaiting this strata_rs awaitable")
            self._waiter = current_task()
            # trio's own awaitable, handed on rather than wrapped: one generator less to go
            # through on every chunk.
            return wait_task_rescheduled(self._abort).__await__()
        # Settled before it was awaited (a chunk that was already there): no yield, as an
        # asyncio future that is done.
        return _settled(self)


def _settled(future: TrioFuture) -> Generator[Any, Any, Any]:
    return future.result()
    yield  # a generator that returns at once


def _guarded(callback: Callable[..., object], args: tuple[Any, ...]) -> None:
    # trio treats an exception from a run_sync_soon callback as a crash of the run.
    try:
        callback(*args)
    except Exception:
        _log.exception("a strata_rs callback on the trio loop failed")


async def _watch(
    fd: int, callback: Callable[[], object], on_exit: Callable[[], object] | None
) -> None:
    try:
        while True:
            await wait_readable(fd)
            try:
                callback()
            except Exception:
                # As an asyncio loop does with a reader callback's error: logged, and it goes on.
                _log.exception("delivering strata_rs stream chunks failed")
    finally:
        # The run is ending (trio cancels its system tasks then).
        if on_exit is not None:
            on_exit()


class TrioLoop:
    """The extension's view of one trio run."""

    __slots__ = ("__weakref__", "_token")

    def __init__(self, token: trio.lowlevel.TrioToken) -> None:
        self._token = token

    def create_future(self) -> TrioFuture:
        return TrioFuture()

    def call_soon_threadsafe(
        self, callback: Callable[..., object], *args: Any, context: object = None
    ) -> None:
        """Runs `callback(*args)` on the run's thread; raises trio.RunFinishedError once the run
        is over (the extension then drops the value: nobody waits for it)."""
        self._token.run_sync_soon(_guarded, callback, args)

    def stream_hooks(self) -> tuple[Any, ...] | None:
        """For the extension's stream chunks (`TrioNext`, rust/python/dispatch.rs): trio's run
        context (its `task` is the running task, its `runner` the thread's run), this run's
        runner (whose `reschedule` the extension calls), the message a task yields to be parked
        (`WaitTaskRescheduled`, what `wait_task_rescheduled` yields), `Abort.SUCCEEDED` and
        `Abort.FAILED`. Those are trio's internals, stable for years but not public: None when
        they are not there, and streams then use `create_future` like every other awaitable."""
        try:
            from trio._core._run import GLOBAL_RUN_CONTEXT
            from trio._core._traps import WaitTaskRescheduled

            runner = GLOBAL_RUN_CONTEXT.runner
            runner.reschedule  # noqa: B018 (checked here, used by the extension)
        except (ImportError, AttributeError):
            return None
        return (GLOBAL_RUN_CONTEXT, runner, WaitTaskRescheduled, Abort.SUCCEEDED, Abort.FAILED)

    def add_reader(
        self,
        fd: int,
        callback: Callable[[], object],
        *,
        on_exit: Callable[[], object] | None = None,
    ) -> None:
        """Runs `callback()` whenever `fd` is readable, until the run ends, then `on_exit()` (the
        dispatcher lets go of the run there, so that the run's objects are freed with it). The
        callback must make `fd` unreadable (the doorbell's reset), as with asyncio's add_reader."""
        trio.lowlevel.spawn_system_task(
            _watch, fd, callback, on_exit, name="strata_rs stream delivery"
        )


_LOOP: trio.lowlevel.RunVar[TrioLoop] = trio.lowlevel.RunVar("strata_rs_loop")


def current_loop() -> TrioLoop:
    """The running trio run's loop, made on first use."""
    try:
        return _LOOP.get()
    except LookupError:
        loop = TrioLoop(trio.lowlevel.current_trio_token())
        _LOOP.set(loop)
        return loop
