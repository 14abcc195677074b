"""`LLM`: the engine without async code, for scripts and notebooks (as vLLM's `LLM` and
llama-cpp-python's `Llama`).

It owns an asyncio event loop on a thread of its own, where the engine's awaitables and streams
run; every method hands its work to that loop and waits for the answer, so that any number of
threads may call one `LLM` at once. A list of prompts is submitted at once, so the engine runs
them as one batch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping, Sequence
from os import PathLike
from types import TracebackType
from typing import Any, TypeVar, overload

from strata_rs._core import (
    Completion,
    Engine,
    EngineStopped,
    SamplingParams,
    StreamChunk,
    Tokenizer,
    TokenStream,
)

T = TypeVar("T")

Messages = Sequence[Mapping[str, Any]]

# How long close() lets calls still in flight finish after the engine stopped (they end at once
# with EngineStopped: the wait is for their last callbacks) before it cancels them.
_SHUTDOWN_GRACE_S = 10.0


def _is_batch(prompts: object) -> bool:
    """A list of prompts, not one prompt (a string, or token ids: a list of ints)."""
    if isinstance(prompts, str | bytes) or not isinstance(prompts, Sequence):
        return False
    return len(prompts) == 0 or not isinstance(prompts[0], int)


def _is_conversation_batch(messages: object) -> bool:
    """A list of conversations (each a list of messages), not one conversation."""
    return (
        isinstance(messages, Sequence)
        and not isinstance(messages, str)
        and (len(messages) == 0 or isinstance(messages[0], Sequence))
    )


class LLM:
    """A loaded model with a synchronous API. `LLM(path, **options)` loads it as
    `Engine.load(path, **options)` does (and raises as it does).

    Usable as a context manager (`with LLM(path) as llm:`), which closes it, as close() does.
    Safe to call from several threads at once. KeyboardInterrupt (Ctrl-C) while a call or a
    stream waits cancels that request."""

    def __init__(self, model: str | PathLike[str], **load_options: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="strata_rs.LLM event loop", daemon=True
        )
        self._lock = threading.Lock()
        self._closed = False
        self._thread.start()
        try:
            self._engine: Engine = self._run(self._load(model, load_options))
        except BaseException:
            self._closed = True
            self._stop_loop()
            raise

    @staticmethod
    async def _load(model: str | PathLike[str], options: dict[str, Any]) -> Engine:
        return await Engine.load(model, **options)

    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("LLM methods cannot be called from its own event loop's thread")
        with self._lock:
            if self._closed:
                coro.close()
                raise EngineStopped("the engine is closed")
            return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        future = self._submit(coro)
        try:
            return future.result()
        except BaseException:
            # KeyboardInterrupt while waiting, most likely: cancelling the task cancels the
            # engine's awaitables it waits on, and so the requests.
            future.cancel()
            raise

    @staticmethod
    async def _gather(starts: list[Callable[[], Awaitable[T]]]) -> list[T]:
        # Every request is queued before the first is awaited: the engine batches them.
        futures: list[Any] = []
        try:
            for start in starts:
                futures.append(start())
            return list(await asyncio.gather(*futures))
        except BaseException:
            # One refused (EngineBusy) or failed, or the caller gave up: the others stop too.
            for f in futures:
                f.cancel()
            raise

    @overload
    def generate(
        self, prompts: str | Sequence[int], params: SamplingParams | None = None, **kwargs: Any
    ) -> Completion: ...
    @overload
    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | None = None,
        **kwargs: Any,
    ) -> list[Completion]: ...
    def generate(
        self, prompts: Any, params: SamplingParams | None = None, **kwargs: Any
    ) -> Completion | list[Completion]:
        """The whole answer to a prompt (text or token ids, as Engine.complete takes), or the
        answers to a list of prompts, run as one batch, in order. Sampling options as
        Engine.complete's."""
        batch = _is_batch(prompts)
        items = list(prompts) if batch else [prompts]
        engine = self._engine

        def start(p: Any) -> Callable[[], Awaitable[Completion]]:
            return lambda: engine.complete(p, params, **kwargs)

        out = self._run(self._gather([start(p) for p in items]))
        return out if batch else out[0]

    @overload
    def chat(
        self,
        messages: Messages,
        params: SamplingParams | None = None,
        **kwargs: Any,
    ) -> Completion: ...
    @overload
    def chat(
        self,
        messages: Sequence[Messages],
        params: SamplingParams | None = None,
        **kwargs: Any,
    ) -> list[Completion]: ...
    def chat(
        self, messages: Any, params: SamplingParams | None = None, **kwargs: Any
    ) -> Completion | list[Completion]:
        """The assistant's whole answer to a conversation, or to each of a list of
        conversations (one batch). Arguments as Engine.chat's (add_generation_prompt,
        chat_template_kwargs and sampling options)."""
        batch = _is_conversation_batch(messages)
        items = list(messages) if batch else [messages]
        engine = self._engine

        def start(m: Any) -> Callable[[], Awaitable[Completion]]:
            return lambda: engine.chat_complete(m, params, **kwargs)

        out = self._run(self._gather([start(m) for m in items]))
        return out if batch else out[0]

    def stream(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, **kwargs: Any
    ) -> ChunkIterator:
        """The chunks of the continuation of `prompt` as they come, as a plain iterator.
        Raises InvalidRequest, ContextOverflow, EngineBusy or EngineStopped at once, as
        Engine.generate does."""
        return ChunkIterator(self, self._engine.generate(prompt, params, **kwargs))

    def stream_chat(
        self, messages: Messages, params: SamplingParams | None = None, **kwargs: Any
    ) -> ChunkIterator:
        """The chunks of the assistant's answer to `messages` (Engine.chat's arguments)."""
        return ChunkIterator(self, self._engine.chat(messages, params, **kwargs))

    def logits(self, token_ids: Sequence[int]) -> Any:
        """Engine.logits: a float32 array `[len(token_ids), vocab_size]`."""
        engine = self._engine

        async def logits() -> Any:
            return await engine.logits(token_ids)

        return self._run(logits())

    def stats(self) -> dict[str, Any]:
        """Engine.stats()."""
        return dict(self._engine.stats())

    @property
    def info(self) -> dict[str, Any]:
        return self._engine.info

    @property
    def tokenizer(self) -> Tokenizer:
        return self._engine.tokenizer

    @property
    def engine(self) -> Engine:
        """The async Engine underneath (its awaitables belong to this LLM's loop thread)."""
        return self._engine

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Closes the engine (writing its disk tier) and stops the loop thread. Calls still
        waiting end with EngineStopped; later calls raise EngineStopped. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result()
        finally:
            self._stop_loop()

    async def _shutdown(self) -> None:
        await self._engine.close()
        me = asyncio.current_task()
        others = [t for t in asyncio.all_tasks() if t is not me]
        if others:
            _, pending = await asyncio.wait(others, timeout=_SHUTDOWN_GRACE_S)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.wait(pending)

    def _stop_loop(self) -> None:
        # Callbacks already queued (the results of the last tasks) run before stop() takes.
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else repr(self._engine)
        return f"LLM({state})"


class _End:
    """The end of a stream, in the queue."""


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class ChunkIterator(Iterator[StreamChunk]):
    """The chunks of one request, read by a task on the LLM's loop and handed over through a
    queue. close() (also on KeyboardInterrupt while waiting, on leaving a `with` block, or when
    the iterator is dropped) cancels the request."""

    def __init__(self, llm: LLM, stream: TokenStream) -> None:
        self._stream = stream
        self._queue: queue.SimpleQueue[StreamChunk | _End | _Failed] = queue.SimpleQueue()
        self._finished = False
        self._pump: concurrent.futures.Future[None] | None = None
        self._pump = llm._submit(self._read())

    async def _read(self) -> None:
        try:
            async for chunk in self._stream:
                self._queue.put(chunk)
        except asyncio.CancelledError:
            self._queue.put(_End())
            raise
        except Exception as e:
            self._queue.put(_Failed(e))
        else:
            self._queue.put(_End())

    def __iter__(self) -> ChunkIterator:
        return self

    def __next__(self) -> StreamChunk:
        if self._finished:
            raise StopIteration
        try:
            item = self._queue.get()
        except BaseException:
            # KeyboardInterrupt while waiting for the engine.
            self.close()
            raise
        if isinstance(item, _End):
            self._finished = True
            raise StopIteration
        if isinstance(item, _Failed):
            self._finished = True
            raise item.error
        return item

    def close(self) -> None:
        """Cancels the request (if it has not finished); the iterator then ends."""
        self._finished = True
        self._stream.cancel()
        if self._pump is not None:
            self._pump.cancel()

    @property
    def request_id(self) -> int:
        return self._stream.request_id

    def __enter__(self) -> ChunkIterator:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __del__(self) -> None:
        # Dropped unfinished (a KeyboardInterrupt between two next() calls, a break):
        # nobody reads the rest.
        if not self._finished:
            self.close()
