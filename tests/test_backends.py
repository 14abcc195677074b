"""The async API on every library anyio serves: asyncio, asyncio with uvloop, and trio.

Each test runs once per backend (the `anyio_backend` fixture below). Outputs are compared token
for token with the same prompt run alone, so a backend that delivers chunks out of order, loses
one or duplicates one fails; cancellation is checked in the engine's own counters.
"""

from __future__ import annotations

import gc
import os
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import sniffio
from strata_rs import Engine, EngineStopped, LoadingEngine, StrataError
from streams import PARAMS, read_all, solo_ids

pytestmark = pytest.mark.anyio

MakeModel = Callable[..., Path]


def long_model(model_dir: MakeModel) -> Path:
    """The tiny llama with room for long streams (test_cache.py's, made once per session)."""
    return model_dir("llama", max_position_embeddings=8192)


@pytest.fixture(
    params=[
        pytest.param("asyncio", id="asyncio"),
        pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
        pytest.param("trio", id="trio"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


async def wait_for_stats(
    engine: Engine, pred: Callable[[dict[str, Any]], bool], timeout: float = 20.0
) -> dict[str, Any]:
    with anyio.fail_after(timeout):
        while not pred(s := dict(engine.stats())):
            await anyio.sleep(0.005)
    return s


async def test_every_call_works_on_the_running_library(
    model_dir: MakeModel, anyio_backend: Any
) -> None:
    model = long_model(model_dir)
    expected = await solo_ids(model, [5, 6, 7, 8])
    engine = await Engine.load(model, host_cache_mib=0, disk_cache_mib=0)
    try:
        library = "trio" if anyio_backend == "trio" else "asyncio"
        assert sniffio.current_async_library() == library
        assert await read_all(engine.generate([5, 6, 7, 8], **PARAMS)) == expected
        assert (await engine.complete([5, 6, 7, 8], **PARAMS)).token_ids == expected
        messages = [{"role": "user", "content": "hello there"}]
        chat = await engine.chat_complete(messages, **PARAMS)
        assert len(chat.token_ids) == 40
        assert await read_all(engine.chat(messages, **PARAMS)) == chat.token_ids
        logits = await engine.logits([5, 6, 7])
        assert logits.shape == (3, engine.info["vocab_size"])
        stream = engine.generate([5, 6, 7, 8], max_tokens=2000, temperature=0, ignore_eos=True)
        first = await stream.__anext__()
        await stream.aclose()
        chunks = [c async for c in stream]
        assert chunks[-1].finish_reason == "cancelled"
        ids = first.token_ids + [t for c in chunks for t in c.token_ids]
        assert ids[:40] == expected[: len(ids)] and len(ids) < 2000
    finally:
        await engine.close()
    assert engine.closed


async def test_a_cancel_scope_cancels_a_stream_mid_way(model_dir: MakeModel) -> None:
    engine = await Engine.load(long_model(model_dir), host_cache_mib=0, disk_cache_mib=0)
    try:
        got: list[int] = []
        with anyio.CancelScope() as scope:
            async for chunk in engine.generate([5, 6, 7], max_tokens=2000, ignore_eos=True):
                got += chunk.token_ids
                if len(got) >= 5:
                    scope.cancel()
        assert scope.cancelled_caught
        s = await wait_for_stats(engine, lambda s: s["requests_cancelled"] == 1)
        assert s["running"] == 0 and s["kv_blocks_used"] == 0
        assert 5 <= len(got) < 2000
    finally:
        await engine.close()


async def test_a_cancel_scope_cancels_a_complete(model_dir: MakeModel) -> None:
    engine = await Engine.load(long_model(model_dir), host_cache_mib=0, disk_cache_mib=0)
    try:
        with anyio.move_on_after(0.05) as scope:
            await engine.complete([5, 6, 7], max_tokens=2000, ignore_eos=True)
        assert scope.cancelled_caught
        s = await wait_for_stats(engine, lambda s: s["requests_cancelled"] == 1)
        assert s["running"] == 0 and s["kv_blocks_used"] == 0
        assert s["requests_finished"] == 0
    finally:
        await engine.close()


async def test_anext_calls_that_time_out_lose_no_token(model_dir: MakeModel) -> None:
    model = long_model(model_dir)
    prompt = [9, 10, 11]
    expected = await solo_ids(model, prompt)
    engine = await Engine.load(model, host_cache_mib=0, disk_cache_mib=0)
    try:
        stream = engine.generate(prompt, **PARAMS)
        ids: list[int] = []
        timeouts = 0
        while True:
            with anyio.move_on_after(0) as scope:
                try:
                    chunk = await stream.__anext__()
                except StopAsyncIteration:
                    break
                ids += chunk.token_ids
            # Cancelled while waiting: the chunk stays queued for the next call.
            timeouts += scope.cancelled_caught
        assert timeouts > 0, "no call timed out: the test did not test cancellation"
        assert ids == expected
    finally:
        await engine.close()


async def test_pending_anext_calls_awaited_by_other_tasks_keep_call_order(
    model_dir: MakeModel,
) -> None:
    model = long_model(model_dir)
    prompt = [12, 13, 14]
    expected = await solo_ids(model, prompt)
    engine = await Engine.load(model, host_cache_mib=0, disk_cache_mib=0)
    try:
        stream = engine.generate(prompt, **PARAMS)
        # Six calls made in order, each awaited by its own task (on trio, a task parked in the
        # awaitable itself; in whatever order the library starts them).
        calls = [stream.__anext__() for _ in range(6)]
        got: dict[int, list[int]] = {}
        ended: set[int] = set()

        async def wait(i: int) -> None:
            # A chunk carries every token ready when its call is served, so on a fast CPU the
            # 40 tokens may end the stream before the sixth call: the later calls then end it.
            try:
                got[i] = (await calls[i]).token_ids
            except StopAsyncIteration:
                ended.add(i)

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for i in reversed(range(6)):
                    tg.start_soon(wait, i)
        # Served in call order: the calls that saw the end come after every call that got ids.
        assert ended == set(range(6 - len(ended), 6))
        ids = [t for i in range(6 - len(ended)) for t in got[i]]
        ids += await read_all(stream)
        assert ids == expected
    finally:
        await engine.close()


async def test_concurrent_streams_from_several_tasks(model_dir: MakeModel) -> None:
    model = long_model(model_dir)
    prompts = [[20 + i, 30 + i, 40 + i] for i in range(8)]
    expected = [await solo_ids(model, p) for p in prompts]
    engine = await Engine.load(model, host_cache_mib=0, disk_cache_mib=0)
    results: dict[int, list[int]] = {}

    async def read(i: int) -> None:
        results[i] = await read_all(engine.generate(prompts[i], **PARAMS))

    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i in range(8):
                    tg.start_soon(read, i)
        assert [results[i] for i in range(8)] == expected
    finally:
        await engine.close()


async def test_closing_with_streams_in_flight_ends_them(model_dir: MakeModel) -> None:
    engine = await Engine.load(long_model(model_dir), max_batch=2)
    errors: list[BaseException] = []
    started = anyio.Event()

    async def read(prompt: list[int]) -> None:
        try:
            async for _ in engine.generate(prompt, max_tokens=2000, ignore_eos=True):
                started.set()
        except StrataError as e:
            errors.append(e)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for i in range(4):  # two running, two waiting
                tg.start_soon(read, [5, 6, 7 + i])
            await started.wait()
            await engine.close()
    assert len(errors) == 4
    assert all(isinstance(e, EngineStopped) for e in errors), errors
    assert engine.stats()["stopped"] == "the engine was closed"


async def test_async_with_closes_and_writes_the_disk_tier(
    model_dir: MakeModel, tmp_path: Path
) -> None:
    model = long_model(model_dir)
    prompt = list(range(3, 203))
    # One 200-token prompt and 40 answer tokens, of which the last is not fed: 14 full blocks.
    blocks = (200 + 40 - 1) // 16

    disk = tmp_path / "plain"
    loading = Engine.load(model, host_cache_mib=0, disk_cache_dir=disk)
    assert isinstance(loading, LoadingEngine)
    async with await loading as engine:
        assert len((await engine.complete(prompt, **PARAMS)).token_ids) == 40
    assert engine.closed
    assert len(list(disk.glob("*.kvb"))) == blocks

    # Without the second await, and left by an exception.
    disk = tmp_path / "raised"
    with pytest.raises(ValueError, match=r"^in the block$"):
        async with Engine.load(model, host_cache_mib=0, disk_cache_dir=disk) as engine:
            assert len((await engine.complete(prompt, **PARAMS)).token_ids) == 40
            raise ValueError("in the block")
    assert engine.closed
    assert len(list(disk.glob("*.kvb"))) == blocks

    # The next load adopts those files and hits them.
    async with Engine.load(model, host_cache_mib=0, disk_cache_dir=disk) as engine:
        assert engine.stats()["cache"]["adopted_files"] == blocks
        again = await engine.complete(prompt, **PARAMS)
        assert again.usage.cached_tokens == 192


def test_outside_async_code_is_a_runtime_error(model_dir: MakeModel) -> None:
    with pytest.raises(RuntimeError) as e:
        Engine.load(long_model(model_dir))
    assert str(e.value) == (
        "no running event loop: strata_rs awaitables need asyncio (or uvloop) or trio"
    )


def test_trio_streams_fall_back_to_futures_without_the_hooks(
    model_dir: MakeModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trio whose internals moved (`stream_hooks` gives None) still streams, through
    `create_future` as asyncio does: same tokens, and a timed-out `__anext__` loses none. Its own
    `trio.run`, so that the run's loop and dispatcher are new and see the patched hooks."""
    import trio
    from strata_rs._async._trio import TrioFuture, TrioLoop

    monkeypatch.setattr(TrioLoop, "stream_hooks", lambda self: None)
    model = long_model(model_dir)
    prompt = [9, 10, 11]

    async def main() -> tuple[list[int], list[int]]:
        expected = await solo_ids(model, prompt)
        engine = await Engine.load(model, host_cache_mib=0, disk_cache_mib=0)
        try:
            stream = engine.generate(prompt, **PARAMS)
            ids: list[int] = []
            timeouts = 0
            while True:
                call = stream.__anext__()
                assert isinstance(call, TrioFuture)
                with trio.move_on_after(0) as scope:
                    try:
                        ids += (await call).token_ids
                    except StopAsyncIteration:
                        break
                timeouts += scope.cancelled_caught
            assert timeouts > 0, "no call timed out: the test did not test cancellation"
            return ids, expected
        finally:
            await engine.close()

    ids, expected = trio.run(main)
    assert ids == expected


def test_a_trio_stream_call_parks_with_trios_own_message(model_dir: MakeModel) -> None:
    """A pending `__anext__` on trio yields the message `wait_task_rescheduled` yields (the
    extension builds it without the class's `__init__`): trio's class, equal to the one the class
    builds, naming the awaitable as its abort function. Closed before any drain could resume the
    task, the call gives up its place and the chunk stays in the stream."""
    import trio
    from trio._core._traps import WaitTaskRescheduled

    model = long_model(model_dir)
    prompt = [9, 10, 11]

    async def main() -> tuple[list[int], list[int]]:
        expected = await solo_ids(model, prompt)
        engine = await Engine.load(model, host_cache_mib=0, disk_cache_mib=0)
        try:
            stream = engine.generate(prompt, **PARAMS)
            ids: list[int] = []
            while True:
                call = stream.__anext__()
                try:
                    message = call.send(None)
                except StopIteration as ready:  # the chunk was there already
                    ids += ready.value.token_ids
                    continue
                call.close()
                break
            assert type(message) is WaitTaskRescheduled
            assert message == WaitTaskRescheduled(call)
            assert message.abort_func is call
            with trio.fail_after(60):
                ids += await read_all(stream)
            return ids, expected
        finally:
            await engine.close()

    ids, expected = trio.run(main)
    assert ids == expected


def test_a_trio_stream_read_across_two_runs(model_dir: MakeModel) -> None:
    """A stream remembers the loop of its last call; a call from another trio run must use that
    run's loop and dispatcher, not the old run's (whose watcher is gone: the call would hang)."""
    import trio

    model = long_model(model_dir)
    prompt = [9, 10, 11]

    async def first() -> tuple[list[int], Engine, Any, list[int]]:
        expected = await solo_ids(model, prompt)
        engine = await Engine.load(model, host_cache_mib=0, disk_cache_mib=0)
        stream = engine.generate(prompt, **PARAMS)
        return expected, engine, stream, (await stream.__anext__()).token_ids

    expected, engine, stream, head = trio.run(first)

    async def second() -> list[int]:
        try:
            with trio.fail_after(60):
                return await read_all(stream)
        finally:
            await engine.close()

    assert head + trio.run(second) == expected


def eventfds() -> int:
    """How many eventfds this process holds open (the stream dispatchers' doorbells among them)."""
    fds = Path("/proc/self/fd")
    count = 0
    for fd in fds.iterdir():
        try:
            count += os.readlink(fd) == "anon_inode:[eventfd]"
        except OSError:  # closed between the listing and the read
            continue
    return count


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts fds through /proc")
def test_finished_trio_runs_free_their_loop_and_eventfd(model_dir: MakeModel) -> None:
    """Each trio run gets a loop and a dispatcher with its own eventfd; when the run ends they
    go with it (the dispatcher lets go of the run's runner, which held the loop), however many
    runs stream from one engine."""
    import trio
    from strata_rs._async import _trio

    model = long_model(model_dir)
    prompt = [9, 10, 11]

    async def load() -> tuple[list[int], Engine]:
        expected = await solo_ids(model, prompt)
        return expected, await Engine.load(model, host_cache_mib=0, disk_cache_mib=0)

    expected, engine = trio.run(load)
    loops: list[weakref.ref[Any]] = []

    async def stream_once() -> list[int]:
        loops.append(weakref.ref(_trio.current_loop()))
        with trio.fail_after(60):
            return await read_all(engine.generate(prompt, **PARAMS))

    try:
        assert trio.run(stream_once) == expected
        gc.collect()
        after_one = eventfds()
        for _ in range(6):
            assert trio.run(stream_once) == expected
        gc.collect()
        assert [loop() for loop in loops] == [None] * 7
        assert eventfds() == after_one
    finally:

        async def close() -> None:
            await engine.close()

        trio.run(close)
