"""`strata_rs.LLM`, the synchronous facade: batches equal solo runs, it serves several threads at
once, Ctrl-C cancels what it waits for, close() ends it."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from strata_rs import LLM, Engine, EngineStopped, InvalidRequest

MakeModel = Callable[..., Path]

PARAMS: dict[str, Any] = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}


def long_model(model_dir: MakeModel) -> Path:
    """The tiny llama with room for long streams (test_cache.py's, made once per session)."""
    return model_dir("llama", max_position_embeddings=8192)


def solo_runs(model: Path, prompts: list[Any], **params: Any) -> list[list[int]]:
    """Each prompt alone on a fresh async engine: the reference."""

    async def run() -> list[list[int]]:
        out = []
        for p in prompts:
            engine = await Engine.load(model, max_batch=1, host_cache_mib=0, disk_cache_mib=0)
            try:
                out.append((await engine.complete(p, **params)).token_ids)
            finally:
                await engine.close()
        return out

    return asyncio.run(run())


def test_a_batch_of_eight_equals_eight_solo_runs(model_dir: MakeModel) -> None:
    model = long_model(model_dir)
    prompts: list[Any] = [[10 + i, 20 + 2 * i, 30 + 3 * i, 7] for i in range(7)] + ["a text prompt"]
    seeded = {"max_tokens": 24, "temperature": 0.8, "seed": 11, "ignore_eos": True}
    expected = solo_runs(model, prompts, **PARAMS)
    expected_seeded = solo_runs(model, prompts, **seeded)
    with LLM(model, host_cache_mib=0, disk_cache_mib=0) as llm:
        out = llm.generate(prompts, **PARAMS)
        assert [c.token_ids for c in out] == expected
        # They ran as one batch: about one step per token, where one after the other would
        # take 8 * 24.
        assert llm.stats()["steps"] < 2 * 24
        assert [c.token_ids for c in llm.generate(prompts, **seeded)] == expected_seeded
        assert llm.stats()["requests_finished"] == 16
        # One prompt in, one Completion out; token ids are one prompt, not a batch.
        single = llm.generate(prompts[0], **PARAMS)
        assert single.token_ids == expected[0]
        assert llm.generate([], **PARAMS) == []
        streamed = [t for chunk in llm.stream(prompts[3], **PARAMS) for t in chunk.token_ids]
        assert streamed == expected[3]
        assert [c.text for c in out][7] == llm.generate("a text prompt", **PARAMS).text


def test_chat_and_its_batch_equal_the_async_engine(model_dir: MakeModel) -> None:
    model = long_model(model_dir)
    conversations = [[{"role": "user", "content": f"question {i}"}] for i in range(3)]

    async def reference() -> list[list[int]]:
        async with Engine.load(model, max_batch=1, host_cache_mib=0, disk_cache_mib=0) as e:
            return [(await e.chat_complete(c, **PARAMS)).token_ids for c in conversations]

    expected = asyncio.run(reference())
    with LLM(model, host_cache_mib=0, disk_cache_mib=0) as llm:
        assert [c.token_ids for c in llm.chat(conversations, **PARAMS)] == expected
        assert llm.chat(conversations[1], **PARAMS).token_ids == expected[1]
        chunks = list(llm.stream_chat(conversations[2], **PARAMS))
        assert [t for c in chunks for t in c.token_ids] == expected[2]
        assert chunks[-1].finish_reason == "length" and chunks[-1].usage is not None
        with pytest.raises(InvalidRequest) as e:
            llm.chat([{"role": "wizard", "content": "x"}], **PARAMS)
        assert str(e.value).startswith('messages[0].role: unknown role "wizard"')


def test_four_threads_at_once(model_dir: MakeModel) -> None:
    model = long_model(model_dir)
    prompts = [[40 + i, 50 + i, 60 + i] for i in range(4)]
    batches = [[[70 + i, 80 + j] for j in range(3)] for i in range(4)]
    expected = solo_runs(model, prompts, **PARAMS)
    expected_batches = [solo_runs(model, b, **PARAMS) for b in batches]
    results: dict[int, Any] = {}
    with LLM(model, max_batch=8, host_cache_mib=0, disk_cache_mib=0) as llm:

        def work(i: int) -> None:
            try:
                for _ in range(3):
                    one = llm.generate(prompts[i], **PARAMS).token_ids
                    many = [c.token_ids for c in llm.generate(batches[i], **PARAMS)]
                    streamed = [t for c in llm.stream(prompts[i], **PARAMS) for t in c.token_ids]
                    assert (one, many, streamed) == (expected[i], expected_batches[i], one)
                results[i] = "ok"
            except BaseException as e:  # reported by the assertion below
                results[i] = e

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a thread is stuck: deadlock"
        assert results == {i: "ok" for i in range(4)}


def test_ctrl_c_during_a_stream_cancels_it(model_dir: MakeModel) -> None:
    # A stream far longer than the press can be late: on a loaded machine the presser thread
    # can wait for a core while the tiny model streams thousands of tokens.
    model = model_dir("llama", max_position_embeddings=65536)
    # Python's own Ctrl-C handler, as a script has it, whatever an earlier test left installed.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        ctrl_c_cancels_a_stream(model)
    finally:
        signal.signal(signal.SIGINT, previous)


def ctrl_c_cancels_a_stream(model: Path) -> None:
    with LLM(model, host_cache_mib=0, disk_cache_mib=0) as llm:
        got: list[int] = []
        waiting = threading.Event()

        def press_ctrl_c() -> None:
            waiting.wait(30)
            time.sleep(0.05)
            # As the terminal does: SIGINT to the main thread, blocked in next().
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)

        presser = threading.Thread(target=press_ctrl_c)
        presser.start()
        stream = llm.stream([5, 6, 7], max_tokens=60000, ignore_eos=True)
        with pytest.raises(KeyboardInterrupt):
            for chunk in stream:
                got += chunk.token_ids
                waiting.set()
        presser.join()
        deadline = time.monotonic() + 20
        while (s := llm.stats())["requests_cancelled"] != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert s["requests_cancelled"] == 1 and s["running"] == 0 and s["kv_blocks_used"] == 0
        assert 1 <= len(got) < 60000
        assert list(stream) == []
        # The LLM goes on serving.
        assert len(llm.generate([5, 6, 7], **PARAMS).token_ids) == 24


def test_close_ends_calls_in_flight_and_refuses_later_ones(model_dir: MakeModel) -> None:
    llm = LLM(long_model(model_dir), max_batch=1)
    stream = llm.stream([5, 6, 7], max_tokens=6000, ignore_eos=True)
    assert next(stream).token_ids
    llm.close()
    llm.close()
    assert llm.closed
    with pytest.raises(EngineStopped):
        for _ in stream:
            pass
    with pytest.raises(EngineStopped) as e:
        llm.generate([5, 6], **PARAMS)
    assert str(e.value) == "the engine is closed"
    with pytest.raises(EngineStopped) as e:
        llm.stream([5, 6], **PARAMS)
    assert str(e.value) == "the engine is closed"
