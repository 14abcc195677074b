"""Serving benchmarks through the public async API: what an application sees.

- aggregate decode tok/s with 1, 2, 4, 8 concurrent streams;
- TTFT of a request that arrives while 7 others decode, against its TTFT on an idle engine;
- the Python stream's per-token overhead: the consumer's inter-token time minus the engine's
  step time over the same tokens.

Rounds of each scenario alternate so that a noisy machine affects all alike; medians reported.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from typing import Any

import numpy as np

from strata_rs import Engine


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    # Skip the lowest ids, where test and real vocabularies keep their special tokens.
    return [int(t) for t in rng.integers(min(300, vocab // 2), vocab, size=n)]


async def _decode_rate(engine: Engine, streams: int, prompt_len: int, gen: int, seed: int) -> float:
    """Tokens per second over the window in which all `streams` are decoding."""
    vocab = engine.info["vocab_size"]
    prompts = [_prompt(prompt_len, vocab, seed * 100 + i) for i in range(streams)]
    return await decode_rate(engine, prompts, gen)


async def decode_rate(engine: Engine, prompts: list[list[int]], gen: int) -> float:
    """Aggregate greedy decode tok/s of one stream per prompt, all submitted at once: the
    streams' tokens after their first, over the window from the moment every stream has its
    first token to the moment the last one ends."""
    first: list[float] = []
    last: list[float] = []

    async def one(prompt: list[int]) -> None:
        got = 0
        async for chunk in engine.generate(prompt, max_tokens=gen, temperature=0, ignore_eos=True):
            if got == 0:
                first.append(time.perf_counter())
            got += len(chunk.token_ids)
        last.append(time.perf_counter())

    await asyncio.gather(*[one(p) for p in prompts])
    window = max(last) - max(first)
    return len(prompts) * (gen - 1) / window


async def _ttft(engine: Engine, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    stream = engine.generate(prompt, max_tokens=2, temperature=0, ignore_eos=True)
    await stream.__anext__()
    t = time.perf_counter() - t0
    stream.cancel()
    async for _ in stream:
        pass
    return t


async def _ttft_busy(engine: Engine, prompt: list[int], others: int, seed: int) -> float:
    vocab = engine.info["vocab_size"]
    background = [
        engine.generate(
            _prompt(64, vocab, seed * 100 + i), max_tokens=None, temperature=0, ignore_eos=True
        )
        for i in range(others)
    ]
    # Wait until every background stream decodes, then send the new request.
    for s in background:
        await s.__anext__()
    consumers = [asyncio.ensure_future(_drain(s)) for s in background]
    await asyncio.sleep(0.05)
    t = await _ttft(engine, prompt)
    for s in background:
        s.cancel()
    await asyncio.gather(*consumers)
    return t


async def _drain(stream: Any) -> None:
    async for _ in stream:
        pass


async def _stream_overhead(engine: Engine, prompt_len: int, gen: int, seed: int) -> float:
    """Seconds per token that the consumer's inter-token time exceeds the engine's step time,
    over the decode steps of one stream (the prefill step is left out of both)."""
    vocab = engine.info["vocab_size"]
    stream = engine.generate(
        _prompt(prompt_len, vocab, seed), max_tokens=gen, temperature=0, ignore_eos=True
    )
    await stream.__anext__()
    t0 = time.perf_counter()
    s0 = engine.stats()["step_seconds"]
    tokens = 0
    async for chunk in stream:
        tokens += len(chunk.token_ids)
    t1 = time.perf_counter()
    s1 = engine.stats()["step_seconds"]
    consumer = (t1 - t0) / tokens
    engine_step = (s1["sum"] - s0["sum"]) / max(1, s1["count"] - s0["count"])
    return consumer - engine_step


async def run_serving(
    model: str,
    device: str = "cpu",
    threads: int | None = None,
    streams: tuple[int, ...] = (1, 2, 4, 8),
    prompt_len: int = 128,
    gen: int = 64,
    ttft_prompt: int = 256,
    rounds: int = 3,
) -> dict[str, Any]:
    # No disk tier: it would keep this run's prompts for the next run, whose "fresh" TTFT prompts
    # (the same seeds) would then be restored instead of read.
    engine = await Engine.load(
        model,
        device=device,
        threads=threads,
        max_batch=max(max(streams), 8),
        max_context=4096,
        disk_cache_mib=0,
    )
    try:
        vocab = engine.info["vocab_size"]
        rates: dict[int, list[float]] = {n: [] for n in streams}
        alone: list[float] = []
        busy: list[float] = []
        overhead: list[float] = []
        for r in range(rounds):
            for n in streams:
                print(f"serving round {r + 1}/{rounds}: {n} streams", file=sys.stderr, flush=True)
                rates[n].append(await _decode_rate(engine, n, prompt_len, gen, seed=r))
            print(f"serving round {r + 1}/{rounds}: TTFT", file=sys.stderr, flush=True)
            # A fresh prompt each time, so that the prefix cache cannot serve it.
            alone.append(await _ttft(engine, _prompt(ttft_prompt, vocab, 10_000 + 2 * r)))
            busy.append(
                await _ttft_busy(
                    engine, _prompt(ttft_prompt, vocab, 10_001 + 2 * r), 7, seed=50 + r
                )
            )
            overhead.append(await _stream_overhead(engine, prompt_len, 4 * gen, seed=90 + r))
        agg = {n: statistics.median(v) for n, v in rates.items()}
        return {
            "engine": engine.info,
            "prompt_tokens": prompt_len,
            "generated_tokens": gen,
            "ttft_prompt_tokens": ttft_prompt,
            "aggregate_decode_tok_s": agg,
            "scaling_vs_1": {n: agg[n] / agg[streams[0]] for n in streams},
            "ttft_alone_s": statistics.median(alone),
            "ttft_with_7_decoding_s": statistics.median(busy),
            "ttft_ratio": statistics.median(busy) / statistics.median(alone),
            "stream_overhead_us": statistics.median(overhead) * 1e6,
            "rounds": {
                "decode": rates,
                "ttft_alone": alone,
                "ttft_busy": busy,
                "overhead": overhead,
            },
        }
    finally:
        await engine.close()


def print_serving(r: dict[str, Any]) -> None:
    print(
        f"aggregate decode (greedy, {r['prompt_tokens']}-token prompts, "
        f"{r['generated_tokens']} tokens each):"
    )
    for n, rate in r["aggregate_decode_tok_s"].items():
        print(f"  {n:>2} streams: {rate:9.1f} tok/s  ({r['scaling_vs_1'][n]:.2f}x one stream)")
    print(
        f"TTFT of a {r['ttft_prompt_tokens']}-token prompt: "
        f"{r['ttft_alone_s'] * 1e3:.1f} ms alone, "
        f"{r['ttft_with_7_decoding_s'] * 1e3:.1f} ms while 7 streams decode "
        f"({r['ttft_ratio']:.2f}x)"
    )
    print(f"Python stream overhead per token: {r['stream_overhead_us']:.1f} us")
