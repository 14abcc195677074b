"""How stream chunks reach the event loop: each loop's dispatcher polls the streams waiting on it
when the engine rings its eventfd (rust/python/dispatch.rs). These tests hold it to the same
outputs as a solo run under the ways callers await: concurrent `__anext__` calls, calls that time
out, and streams read from other threads' event loops, asyncio's and uvloop's.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import uvloop
from strata_rs import Engine
from streams import PARAMS, read_all, solo_ids

pytestmark = pytest.mark.anyio

MakeModel = Callable[..., Path]


async def test_concurrent_anext_calls_get_the_chunks_in_order(model_dir: MakeModel) -> None:
    model = model_dir("llama")
    prompt = [5, 6, 7, 8]
    expected = await solo_ids(model, prompt)
    engine = await Engine.load(model, host_cache_mib=0, disk_cache_mib=0)
    try:
        stream = engine.generate(prompt, **PARAMS)
        # Six calls pending at once: each must get the chunk after the previous call's. A stream
        # merges the deltas waiting for a call, so a fast engine can finish in fewer than six
        # chunks: then the calls after the last chunk, and only those, end the iteration.
        first = await asyncio.gather(
            *(stream.__anext__() for _ in range(6)), return_exceptions=True
        )
        chunks = [r for r in first if not isinstance(r, BaseException)]
        ends = first[len(chunks) :]
        assert first[: len(chunks)] == chunks, f"a call after the end got a chunk: {first!r}"
        assert all(isinstance(e, StopAsyncIteration) for e in ends), f"not the end: {ends!r}"
        ids = [t for chunk in chunks for t in chunk.token_ids]
        ids += await read_all(stream)
        assert ids == expected
    finally:
        await engine.close()


async def test_anext_calls_that_time_out_lose_no_token(model_dir: MakeModel) -> None:
    model = model_dir("llama")
    prompt = [9, 10, 11]
    expected = await solo_ids(model, prompt)
    engine = await Engine.load(model, host_cache_mib=0, disk_cache_mib=0)
    try:
        stream = engine.generate(prompt, **PARAMS)
        ids: list[int] = []
        timeouts = 0
        while True:
            try:
                chunk = await asyncio.wait_for(stream.__anext__(), timeout=0)
            except TimeoutError:
                timeouts += 1  # the call was cancelled while waiting; its chunk stays queued
                continue
            except StopAsyncIteration:
                break
            ids += chunk.token_ids
        assert timeouts > 0, "no call timed out: the test did not test cancellation"
        assert ids == expected
    finally:
        await engine.close()


async def test_streams_read_from_other_threads_event_loops(model_dir: MakeModel) -> None:
    model = model_dir("llama")
    prompts = [[20 + i, 30 + i, 40 + i] for i in range(4)]
    expected = [await solo_ids(model, p) for p in prompts]
    engine = await Engine.load(model, host_cache_mib=0, disk_cache_mib=0)
    results: dict[int, list[int] | BaseException] = {}

    def run(i: int, runner: Callable[[Coroutine[Any, Any, list[int]]], list[int]]) -> None:
        try:
            results[i] = runner(read_all(engine.generate(prompts[i], **PARAMS)))
        except BaseException as e:  # reported by the assertion below
            results[i] = e

    try:
        threads = [
            threading.Thread(target=run, args=(0, asyncio.run)),
            threading.Thread(target=run, args=(1, uvloop.run)),
            threading.Thread(target=run, args=(2, asyncio.run)),
        ]
        for t in threads:
            t.start()
        # One more on this test's own loop, at the same time.
        results[3] = await read_all(engine.generate(prompts[3], **PARAMS))
        for t in threads:
            await asyncio.to_thread(t.join, 60)
        assert [results.get(i) for i in range(4)] == expected
    finally:
        await engine.close()


async def test_a_new_event_loop_after_the_old_one_closed_still_gets_chunks(
    model_dir: MakeModel,
) -> None:
    """A dispatcher belongs to its loop: a stream read on a fresh loop gets a fresh one."""
    model = model_dir("llama")
    prompt = [12, 13, 14]
    expected = await solo_ids(model, prompt)
    engine = await Engine.load(model, host_cache_mib=0, disk_cache_mib=0)
    try:

        def twice() -> list[list[int]]:
            return [asyncio.run(read_all(engine.generate(prompt, **PARAMS))) for _ in range(2)]

        assert await asyncio.to_thread(twice) == [expected, expected]
    finally:
        await engine.close()


async def test_many_streams_on_one_loop_all_finish(model_dir: MakeModel) -> None:
    """Many streams, many short steps: a wake-up lost between the engine's ring and the loop's
    drain would leave streams waiting forever (this test caught one), so it must finish."""
    model = model_dir("llama")
    engine = await Engine.load(model, max_batch=32, host_cache_mib=0, disk_cache_mib=0)
    try:
        for round_ in range(3):
            streams = [
                engine.generate([3 + i, 4 + round_], max_tokens=150, temperature=0, ignore_eos=True)
                for i in range(48)
            ]
            outs = await asyncio.wait_for(asyncio.gather(*(read_all(s) for s in streams)), 120)
            assert [len(o) for o in outs] == [150] * 48
    finally:
        await engine.close()
