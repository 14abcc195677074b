"""The engine under load: continuous batching, sampling, streaming, cancellation, preemption,
prefix reuse and argument errors, through the public async API.

Every output check compares against the same prompt run alone on a fresh engine: batching,
chunking, preemption and the prefix cache must not change a single token.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from strata_rs import (
    Completion,
    ContextOverflow,
    Engine,
    EngineBusy,
    EngineStopped,
    InvalidRequest,
    SamplingParams,
    StrataError,
)

pytestmark = pytest.mark.anyio

MakeModel = Callable[..., Path]


def prompts(count: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    """Random prompts of lengths in [lo, hi) over the tiny vocabulary, avoiding ids 0-2 (special
    tokens)."""
    rng = np.random.default_rng(seed)
    return [
        [int(t) for t in rng.integers(3, 512, size=int(rng.integers(lo, hi)))] for _ in range(count)
    ]


async def solo(model: Path, prompt: Sequence[int] | str, **params: Any) -> Completion:
    """The prompt alone on a fresh engine, with no cache below the device (a cold prefill): the
    reference every batched output must equal."""
    engine = await Engine.load(
        model,
        max_batch=1,
        max_context=params.pop("max_context", None),
        host_cache_mib=0,
        disk_cache_mib=0,
    )
    try:
        return await engine.complete(
            list(prompt) if not isinstance(prompt, str) else prompt, **params
        )
    finally:
        await engine.close()


async def consume(stream: Any) -> tuple[list[int], str, str | None, Any]:
    ids: list[int] = []
    text = ""
    finish = None
    usage = None
    async for chunk in stream:
        ids += chunk.token_ids
        text += chunk.text
        if chunk.finish_reason is not None:
            finish = chunk.finish_reason
        if chunk.usage is not None:
            usage = chunk.usage
    return ids, text, finish, usage


async def wait_for(
    engine: Engine, pred: Callable[[dict[str, Any]], bool], timeout: float = 20.0
) -> dict[str, Any]:
    """Polls stats until `pred` holds; the engine publishes them after every step."""
    deadline = anyio.current_time() + timeout
    while True:
        s = engine.stats()
        if pred(s):
            return s
        if anyio.current_time() > deadline:
            raise AssertionError(f"stats never matched: {s}")
        await anyio.sleep(0.005)


# The tests of the API's own behaviour under load (EngineBusy, close, a cancel scope) run on both
# backends; the rest compare outputs, which the backend does not touch, on asyncio only.
BOTH_BACKENDS = pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])


async def test_32_concurrent_streams_equal_their_solo_runs(model_dir: MakeModel) -> None:
    model = model_dir("llama", max_position_embeddings=512)
    ps = prompts(32, 3, 70, seed=1)
    lengths = [5 + (i * 7) % 36 for i in range(32)]
    expected = [
        await solo(model, p, max_tokens=n, temperature=0, ignore_eos=True)
        for p, n in zip(ps, lengths, strict=True)
    ]
    engine = await Engine.load(model, max_batch=8, kv_memory_mib=8, max_batch_tokens=64)
    try:
        got = await asyncio.gather(
            *[
                consume(engine.generate(p, max_tokens=n, temperature=0, ignore_eos=True))
                for p, n in zip(ps, lengths, strict=True)
            ]
        )
        for i, ((ids, text, finish, usage), exp) in enumerate(zip(got, expected, strict=True)):
            assert ids == exp.token_ids, f"stream {i}"
            assert text == exp.text, f"stream {i}"
            assert finish == "length"
            assert usage.completion_tokens == lengths[i]
            assert usage.prompt_tokens == len(ps[i])
        s = engine.stats()
        assert s["requests_finished"] == 32
        assert s["generated_tokens"] == sum(lengths)
        assert s["running"] == 0 and s["waiting"] == 0
        assert s["kv_blocks_used"] == 0
    finally:
        await engine.close()


async def test_seeded_sampling_is_the_same_alone_and_in_a_busy_batch(model_dir: MakeModel) -> None:
    model = model_dir("qwen2")
    p = prompts(1, 20, 21, seed=2)[0]
    kwargs: dict[str, Any] = {
        "max_tokens": 40,
        "temperature": 0.8,
        "top_p": 0.9,
        "top_k": 50,
        "ignore_eos": True,
    }
    params = SamplingParams(seed=1234, **kwargs)
    alone = await solo(model, p, seed=1234, **kwargs)
    other_seed = await solo(model, p, seed=99, **kwargs)
    assert other_seed.token_ids != alone.token_ids, "the seed must matter"
    engine = await Engine.load(model, max_batch=8)
    try:
        noise = [
            consume(engine.generate(q, max_tokens=30, temperature=1.0, seed=i))
            for i, q in enumerate(prompts(7, 5, 40, seed=3))
        ]
        results = await asyncio.gather(consume(engine.generate(p, params)), *noise)
        assert results[0][0] == alone.token_ids
        assert results[0][1] == alone.text
    finally:
        await engine.close()


async def test_cancellation_frees_blocks_and_others_are_unaffected(model_dir: MakeModel) -> None:
    model = model_dir("llama", max_position_embeddings=512)
    ps = prompts(4, 10, 30, seed=4)
    expected = [await solo(model, p, max_tokens=60, temperature=0, ignore_eos=True) for p in ps[2:]]
    engine = await Engine.load(model, max_batch=8, kv_memory_mib=8)
    try:
        # Stream 0: the consumer breaks out of its loop after 3 chunks.
        async def breaks_early() -> int:
            seen = 0
            async for chunk in engine.generate(
                ps[0], max_tokens=400, temperature=0, ignore_eos=True
            ):
                seen += len(chunk.token_ids)
                if seen >= 3:
                    break
            return seen

        # Stream 1: the consuming task is cancelled.
        started = asyncio.Event()

        async def cancelled_task() -> None:
            async for _ in engine.generate(ps[1], max_tokens=400, temperature=0, ignore_eos=True):
                started.set()

        task = asyncio.create_task(cancelled_task())
        others = [
            asyncio.create_task(
                consume(engine.generate(p, max_tokens=60, temperature=0, ignore_eos=True))
            )
            for p in ps[2:]
        ]
        assert await breaks_early() >= 3
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        s = await wait_for(engine, lambda s: s["requests_cancelled"] == 2)
        assert s["running"] <= 2
        results = await asyncio.gather(*others)
        for (ids, text, _, _), exp in zip(results, expected, strict=True):
            assert ids == exp.token_ids
            assert text == exp.text
        s = await wait_for(engine, lambda s: s["running"] == 0)
        assert s["kv_blocks_used"] == 0
        assert s["requests_cancelled"] == 2
        assert s["requests_finished"] == 2
    finally:
        await engine.close()


async def test_explicit_cancel_ends_the_stream_with_cancelled(model_dir: MakeModel) -> None:
    model = model_dir("llama")
    engine = await Engine.load(model)
    try:
        stream = engine.generate([5, 6, 7], max_tokens=200, temperature=0, ignore_eos=True)
        first = await stream.__anext__()
        assert first.finish_reason is None
        stream.cancel()
        chunks = [c async for c in stream]
        assert chunks[-1].finish_reason == "cancelled"
        assert chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens >= 1
        s = await wait_for(engine, lambda s: s["running"] == 0)
        assert s["kv_blocks_used"] == 0
    finally:
        await engine.close()


async def test_preemption_under_a_small_kv_budget_changes_no_output(model_dir: MakeModel) -> None:
    model = model_dir("qwen3")
    # max_context=128 sizes the pool to 8 blocks of 16 tokens: one sequence's worth.
    ps = prompts(6, 15, 35, seed=5)
    expected = [
        await solo(model, p, max_tokens=60, temperature=0, ignore_eos=True, max_context=128)
        for p in ps
    ]
    engine = await Engine.load(model, max_batch=8, max_context=128)
    assert engine.info["kv_blocks"] == 8
    try:
        results = await asyncio.gather(
            *[
                consume(engine.generate(p, max_tokens=60, temperature=0, ignore_eos=True))
                for p in ps
            ]
        )
        for (ids, text, finish, _), exp in zip(results, expected, strict=True):
            assert ids == exp.token_ids
            assert text == exp.text
            assert finish == "length"
        s = engine.stats()
        assert s["preemptions"] > 0
        assert s["kv_blocks_used"] == 0
    finally:
        await engine.close()


async def test_prefix_reuse_shows_in_cached_tokens_and_changes_nothing(
    model_dir: MakeModel,
) -> None:
    model = model_dir("mistral")
    base = prompts(1, 50, 51, seed=6)[0]
    cold_base = await solo(model, base, max_tokens=20, temperature=0, ignore_eos=True)
    # The next turn of the conversation: the first turn's prompt and answer, then more.
    longer = base + cold_base.token_ids + prompts(1, 10, 11, seed=7)[0]
    cold_longer = await solo(model, longer, max_tokens=20, temperature=0, ignore_eos=True)
    assert cold_base.usage.cached_tokens == 0
    engine = await Engine.load(model)
    try:
        first = await engine.complete(base, max_tokens=20, temperature=0, ignore_eos=True)
        assert first.usage.cached_tokens == 0
        again = await engine.complete(base, max_tokens=20, temperature=0, ignore_eos=True)
        # 50 tokens: 3 full blocks are cached; the last token is always fed to the model.
        assert again.usage.cached_tokens == 48
        extended = await engine.complete(longer, max_tokens=20, temperature=0, ignore_eos=True)
        # The first turn fed its prompt and 19 of its 20 answer tokens: 4 full blocks.
        assert extended.usage.cached_tokens == 64
        assert first.token_ids == again.token_ids == cold_base.token_ids
        assert extended.token_ids == cold_longer.token_ids
        assert extended.text == cold_longer.text
        s = engine.stats()
        assert s["prefix_hit_tokens"] == 48 + 64
        assert s["prefix_query_tokens"] == 50 + 50 + 80
    finally:
        await engine.close()


async def test_n_choices_share_the_prompt_blocks(model_dir: MakeModel) -> None:
    model = model_dir("llama")
    p = prompts(1, 40, 41, seed=8)[0]
    engine = await Engine.load(model)
    try:
        r = await engine.complete(p, n=3, max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
        assert len(r.choices) == 3
        assert [c.index for c in r.choices] == [0, 1, 2]
        assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in r.choices)
        assert r.usage.completion_tokens == 36
        assert r.usage.prompt_tokens == 40
        # Choices 1 and 2 found the 2 full prompt blocks choice 0 computed.
        assert engine.stats()["prefix_hit_tokens"] == 2 * 32
        assert len({tuple(c.token_ids) for c in r.choices}) > 1, "choices are sampled independently"
        assert (r.text, r.token_ids) == (r.choices[0].text, r.choices[0].token_ids)
        one = await engine.complete(p, max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
        assert one.token_ids == r.choices[0].token_ids, "choice 0 uses the request's seed"
    finally:
        await engine.close()


async def test_streamed_text_equals_complete_and_the_full_decode(model_dir: MakeModel) -> None:
    model = model_dir("qwen2")
    engine = await Engine.load(model)
    try:
        p = "hello world, this is a test"
        full = await engine.complete(p, max_tokens=30, temperature=0, ignore_eos=True)
        ids, text, finish, usage = await consume(
            engine.generate(p, max_tokens=30, temperature=0, ignore_eos=True)
        )
        assert (ids, text, finish) == (full.token_ids, full.text, "length")
        assert text == engine.tokenizer.decode(ids, skip_special_tokens=True)
        assert usage.prompt_tokens == len(engine.tokenizer.encode(p))
    finally:
        await engine.close()


async def test_stop_strings_stop_ids_and_eos(model_dir: MakeModel) -> None:
    model = model_dir("llama")
    engine = await Engine.load(model)
    try:
        p = prompts(1, 12, 13, seed=9)[0]
        ref = await engine.complete(p, max_tokens=40, temperature=0, ignore_eos=True)
        tok = engine.tokenizer
        pieces = [tok.decode(ref.token_ids[: i + 1], skip_special_tokens=True) for i in range(40)]
        # A stop string that straddles the boundary between two tokens' text.
        k = next(
            i
            for i in range(5, 39)
            if len(pieces[i]) > len(pieces[i - 1]) > 0 and len(pieces[i - 1]) > len(pieces[i - 2])
        )
        stop = pieces[k][len(pieces[k - 1]) - 1 : len(pieces[k - 1]) + 1]
        assert len(stop) == 2
        r = await engine.complete(
            p, max_tokens=40, temperature=0, ignore_eos=True, stop=[stop, "\x00never"]
        )
        cut = ref.text.index(stop)
        assert r.text == ref.text[:cut]
        assert r.finish_reason == "stop"
        assert stop not in r.text
        streamed = await consume(
            engine.generate(p, max_tokens=40, temperature=0, ignore_eos=True, stop=stop)
        )
        assert streamed[1] == r.text and streamed[2] == "stop"

        # A stop token id: generation ends on it; its id is the last one, its text is not emitted.
        stop_id = ref.token_ids[6]
        first = ref.token_ids.index(stop_id)
        r = await engine.complete(p, max_tokens=40, temperature=0, stop_token_ids=[stop_id])
        assert r.token_ids == ref.token_ids[: first + 1]
        assert r.text == tok.decode(ref.token_ids[:first], skip_special_tokens=True)
        assert r.finish_reason == "stop"

        # EOS ends generation unless ignore_eos. The test models' generation_config names two
        # EOS ids; find a prompt whose greedy continuation emits one of them.
        eos = tok.eos_token_ids
        assert eos == [2, 0]
        for seed in range(100):
            q = prompts(1, 5, 20, seed=100 + seed)[0]
            free = await engine.complete(q, max_tokens=40, temperature=0, ignore_eos=True)
            if any(t in eos for t in free.token_ids):
                break
        else:
            pytest.fail("no prompt led the model to EOS")
        at = next(i for i, t in enumerate(free.token_ids) if t in eos)
        r = await engine.complete(q, max_tokens=40, temperature=0)
        assert r.token_ids == free.token_ids[: at + 1]
        assert r.finish_reason == "stop"
        assert r.text == tok.decode(free.token_ids[:at], skip_special_tokens=True)
    finally:
        await engine.close()


async def test_logprobs_match_the_model_logits(model_dir: MakeModel) -> None:
    model = model_dir("qwen3")
    engine = await Engine.load(model)
    try:
        p = prompts(1, 10, 11, seed=10)[0]
        r = await engine.complete(p, max_tokens=6, temperature=0, logprobs=3, ignore_eos=True)
        assert len(r.logprobs) == 6
        for i, entry in enumerate(r.logprobs):
            logits = (await engine.logits(p + r.token_ids[:i]))[-1].astype(np.float64)
            lsm = logits - (logits.max() + math.log(np.exp(logits - logits.max()).sum()))
            assert entry["token_id"] == r.token_ids[i]
            assert entry["logprob"] == pytest.approx(lsm[r.token_ids[i]], abs=1e-4)
            top = entry["top_logprobs"]
            assert [t["token_id"] for t in top] == list(np.argsort(-lsm, kind="stable")[:3])
            assert [t["logprob"] for t in top] == pytest.approx(sorted(lsm)[::-1][:3], abs=1e-4)
            assert top[0]["token_id"] == r.token_ids[i], "greedy picks the most likely token"
        none = await engine.complete(p, max_tokens=2, temperature=0)
        assert none.logprobs is None
    finally:
        await engine.close()


async def test_chat_renders_the_template(model_dir: MakeModel) -> None:
    model = model_dir("qwen2")
    engine = await Engine.load(model)
    try:
        messages = [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi there"},
        ]
        ids, text, _, usage = await consume(
            engine.chat(messages, max_tokens=8, temperature=0, ignore_eos=True)
        )
        rendered = engine.tokenizer.apply_chat_template(messages)
        prompt_ids = engine.tokenizer.encode(rendered, add_special_tokens=False)
        direct = await engine.complete(prompt_ids, max_tokens=8, temperature=0, ignore_eos=True)
        assert usage.prompt_tokens == len(prompt_ids)
        assert (ids, text) == (direct.token_ids, direct.text)
    finally:
        await engine.close()


async def test_bad_arguments_raise_and_the_engine_keeps_serving(model_dir: MakeModel) -> None:
    model = model_dir("llama")
    p = prompts(1, 10, 11, seed=11)[0]
    expected = await solo(model, p, max_tokens=30, temperature=0, ignore_eos=True)
    engine = await Engine.load(model, max_context=64)
    try:
        running = asyncio.create_task(
            consume(engine.generate(p, max_tokens=30, temperature=0, ignore_eos=True))
        )
        cases: list[tuple[dict[str, Any], type[Exception], str]] = [
            ({"max_tokens": -1}, InvalidRequest, "max_tokens: must be >= 1, got -1"),
            ({"max_tokens": 0}, InvalidRequest, "max_tokens: must be >= 1, got 0"),
            (
                {"temperature": float("nan")},
                InvalidRequest,
                "temperature: must be a finite number, got NaN",
            ),
            ({"temperature": -1.0}, InvalidRequest, "temperature: must be >= 0, got -1"),
            ({"temperature": "hot"}, InvalidRequest, "temperature: must be a number, got str"),
            ({"top_p": 0.0}, InvalidRequest, "top_p: must be in (0, 1], got 0"),
            ({"top_p": 1.01}, InvalidRequest, "top_p: must be in (0, 1], got 1.01"),
            ({"top_k": -3}, InvalidRequest, "top_k: must be >= 0, got -3"),
            ({"min_p": 2.0}, InvalidRequest, "min_p: must be in [0, 1], got 2"),
            ({"stop": 5}, InvalidRequest, "stop: must be a string or a list of strings, got int"),
            (
                {"stop": ["a", 1]},
                InvalidRequest,
                "stop: must be a string or a list of strings, got a int in the list",
            ),
            ({"stop": [""]}, InvalidRequest, "stop: must not contain an empty string"),
            (
                {"stop_token_ids": [512]},
                InvalidRequest,
                "stop_token_ids: token id 512 is outside the vocabulary (size 512)",
            ),
            ({"logprobs": 21}, InvalidRequest, "logprobs: must be at most 20, got 21"),
            ({"n": 0}, InvalidRequest, "n: must be >= 1, got 0"),
            ({"seed": "x"}, InvalidRequest, "seed: must be an integer, got str"),
            ({"temprature": 0.5}, InvalidRequest, "temprature: unknown sampling parameter"),
            (
                {"max_tokens": 60},
                ContextOverflow,
                "max_tokens: 10 prompt tokens + 60 exceed the context of 64 tokens",
            ),
        ]
        for kwargs, cls, message in cases:
            with pytest.raises(cls) as e:
                engine.generate(p, **kwargs)
            assert str(e.value) == message, kwargs
            with pytest.raises(cls) as e:
                await engine.complete(p, **kwargs)
            assert str(e.value) == message, kwargs
        with pytest.raises(InvalidRequest) as e:
            SamplingParams(top_p=-1)
        assert str(e.value) == "top_p: must be in (0, 1], got -1"
        with pytest.raises(InvalidRequest) as e:
            SamplingParams(colour="red")
        assert str(e.value) == "colour: unknown sampling parameter"
        with pytest.raises(InvalidRequest) as e:
            engine.generate(p, SamplingParams(max_tokens=3), max_tokens=4)
        assert str(e.value) == "params: pass either a SamplingParams or keyword arguments, not both"
        with pytest.raises(ContextOverflow) as e:
            engine.generate(list(range(3, 67)))
        assert (
            str(e.value)
            == "prompt: 64 tokens leave no room to generate in the context of 64 tokens"
        )
        with pytest.raises(InvalidRequest) as e:
            engine.generate(3.5)
        assert str(e.value) == "prompt: must be a string or a list of token ids"
        with pytest.raises(InvalidRequest) as e:
            engine.generate([])
        assert str(e.value) == "prompt: must not be empty"
        with pytest.raises(InvalidRequest) as e:
            engine.generate([5, 600])
        assert str(e.value) == "prompt: token id 600 is outside the vocabulary (size 512)"
        with pytest.raises(InvalidRequest) as e:
            engine.chat([])
        assert str(e.value) == "messages: must not be empty"
        with pytest.raises(InvalidRequest) as e:
            engine.chat([{"role": "wizard", "content": "hi"}])
        assert str(e.value).startswith('messages[0].role: unknown role "wizard"')
        ids, text, _, _ = await running
        assert ids == expected.token_ids and text == expected.text
        assert engine.stats()["requests_finished"] == 1
    finally:
        await engine.close()


@BOTH_BACKENDS
async def test_a_full_queue_refuses_with_engine_busy(model_dir: MakeModel) -> None:
    model = model_dir("llama")
    engine = await Engine.load(model, max_batch=1, max_waiting=2)
    try:
        first = engine.generate([5, 6, 7], max_tokens=200, temperature=0, ignore_eos=True)
        await wait_for(engine, lambda s: s["running"] == 1)
        queued = [engine.generate([8, 9], max_tokens=5, temperature=0) for _ in range(2)]
        with pytest.raises(EngineBusy) as e:
            engine.generate([10, 11], max_tokens=5)
        assert str(e.value) == "2 requests are already waiting (max_waiting); retry later"
        assert engine.stats()["requests_refused"] == 1
        first.cancel()
        for q in queued:
            ids, _, finish, _ = await consume(q)
            assert len(ids) >= 1 and finish in ("stop", "length")
        # Room again once the queue drained.
        r = await engine.complete([10, 11], max_tokens=3, temperature=0, ignore_eos=True)
        assert len(r.token_ids) == 3
    finally:
        await engine.close()


@BOTH_BACKENDS
async def test_close_ends_open_streams_with_engine_stopped(model_dir: MakeModel) -> None:
    model = model_dir("llama")
    engine = await Engine.load(model, max_batch=1)
    running = engine.generate([5, 6, 7], max_tokens=200, temperature=0, ignore_eos=True)
    waiting = engine.generate([5, 6, 8], max_tokens=200, temperature=0, ignore_eos=True)
    await running.__anext__()
    with anyio.fail_after(10):
        await engine.close()
    for stream in (running, waiting):
        with pytest.raises(EngineStopped):
            async for _ in stream:
                pass
    with pytest.raises(EngineStopped) as e:
        engine.generate([5], max_tokens=2)
    assert str(e.value) == "the engine is closed"
    with pytest.raises(EngineStopped):
        await engine.complete([5], max_tokens=2)
    assert engine.stats()["stopped"] == "the engine was closed"


async def test_ids_past_the_tokenizer_vocabulary_stream_without_text(
    model_dir: MakeModel,
) -> None:
    # Real models pad vocab_size past the tokenizer (Qwen2: 151936 rows, 151665 tokens); a
    # sampled padding id must not stop the engine.
    model = model_dir("llama", tokenizer_vocab_size=400)
    engine = await Engine.load(model)
    try:
        tok = engine.tokenizer
        assert (tok.vocab_size, engine.info["vocab_size"]) == (400, 512)
        r = await engine.complete(
            [5, 6, 7], max_tokens=64, temperature=5.0, seed=3, ignore_eos=True
        )
        past = [t for t in r.token_ids if t >= tok.vocab_size]
        assert past, "the high temperature samples padding ids"
        known = [t for t in r.token_ids if t < tok.vocab_size]
        assert r.text == tok.decode(known, skip_special_tokens=True)
        assert r.finish_reason == "length"
        assert engine.stats()["stopped"] is None
    finally:
        await engine.close()


async def test_a_fault_in_the_engine_loop_ends_streams_and_stops_the_engine(
    model_dir: MakeModel,
) -> None:
    engine = await Engine.load(model_dir("llama"))
    stream = engine.generate([5, 6, 7], max_tokens=200, temperature=0, ignore_eos=True)
    await stream.__anext__()
    engine._inject_fault()
    with pytest.raises(StrataError) as e:
        async for _ in stream:
            pass
    assert str(e.value) == "engine fault: panic: injected fault"
    assert engine.stats()["stopped"] == "engine fault: panic: injected fault"
    with pytest.raises(EngineStopped) as e:
        engine.generate([5], max_tokens=2)
    assert str(e.value) == "the engine stopped: engine fault: panic: injected fault"
    await engine.close()


@BOTH_BACKENDS
async def test_anyio_cancel_scope_cancels_the_request(model_dir: MakeModel) -> None:
    engine = await Engine.load(model_dir("llama"))
    try:
        got: list[int] = []

        async def consumer() -> None:
            async for chunk in engine.generate([5, 6, 7], max_tokens=200, ignore_eos=True):
                got.extend(chunk.token_ids)

        async with anyio.create_task_group() as tg:
            tg.start_soon(consumer)
            with anyio.fail_after(10):
                while len(got) < 3:
                    await anyio.sleep(0.001)
            tg.cancel_scope.cancel()
        s = await wait_for(engine, lambda s: s["requests_cancelled"] == 1)
        assert s["running"] == 0 and s["kv_blocks_used"] == 0
        assert 3 <= len(got) < 200
    finally:
        await engine.close()
