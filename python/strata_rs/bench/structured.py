"""Structured output's cost: 8 concurrent greedy streams, all free, against the same 8 with half
of them constrained by a JSON schema (`structured_outputs`), in interleaved rounds.

Every stream decodes `gen` tokens from its own chat prompt. A constrained stream's schema holds
one string of at least `4 * gen` characters, so its grammar never completes before `gen` tokens
(checked: every stream ends by length). Per round:

- aggregate decode tok/s: the streams' tokens after their first, over the window from the moment
  every stream has its first token to the moment the last one ends (as `bench --serving`);
- per-token latency of a stream: (its last token's time - its first's) / (tokens - 1); the
  median over the free streams of the all-free round, and over the constrained ones of the mixed.

Medians over rounds; the ratios are issue 19's targets (aggregate >= 0.9x, a constrained
stream's per-token latency <= 1.1x a free one's).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from strata_rs import Engine

STREAMS = 8


def _schema(gen: int) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"story": {"type": "string", "minLength": 4 * gen}},
        "required": ["story"],
        "additionalProperties": False,
    }


async def _round(engine: Engine, gen: int, constrained: int, seed: int) -> dict[str, Any]:
    first: list[float] = [0.0] * STREAMS
    last: list[float] = [0.0] * STREAMS
    counts: list[int] = [0] * STREAMS
    finish: list[str | None] = [None] * STREAMS

    async def one(i: int) -> None:
        messages = [{"role": "user", "content": f"Tell story number {seed * STREAMS + i}."}]
        extra: dict[str, Any] = {}
        if i < constrained:
            extra["structured_outputs"] = {"json": _schema(gen)}
        stream = engine.chat(messages, max_tokens=gen, temperature=0, ignore_eos=True, **extra)
        async for chunk in stream:
            now = time.perf_counter()
            if counts[i] == 0:
                first[i] = now
            counts[i] += len(chunk.token_ids)
            last[i] = now
            finish[i] = chunk.finish_reason or finish[i]

    await asyncio.gather(*(one(i) for i in range(STREAMS)))
    if any(f != "length" for f in finish) or any(c != gen for c in counts):
        raise RuntimeError(f"every stream must decode {gen} tokens: {counts}, {finish}")
    window = max(last) - max(first)
    per_token = [(last[i] - first[i]) / (gen - 1) for i in range(STREAMS)]
    return {
        "decode_tok_s": STREAMS * (gen - 1) / window,
        "per_token_s_constrained": statistics.median(per_token[:constrained])
        if constrained
        else None,
        "per_token_s_free": statistics.median(per_token[constrained:]),
    }


async def run_structured(
    model: str, threads: int | None = None, rounds: int = 3, gen: int = 96
) -> dict[str, Any]:
    engine = await Engine.load(model, max_batch=STREAMS, threads=threads)
    try:
        await _round(engine, 8, STREAMS // 2, seed=999)  # warm-up: the grammar factory too
        free, mixed = [], []
        for r in range(rounds):
            free.append(await _round(engine, gen, 0, seed=2 * r))
            mixed.append(await _round(engine, gen, STREAMS // 2, seed=2 * r + 1))
        info = engine.info
    finally:
        await engine.close()

    def med(runs: list[dict[str, Any]], key: str) -> float:
        return statistics.median(x[key] for x in runs)

    agg = med(mixed, "decode_tok_s") / med(free, "decode_tok_s")
    lat = med(mixed, "per_token_s_constrained") / med(free, "per_token_s_free")
    return {
        "model": model,
        "threads": info["threads"],
        "streams": STREAMS,
        "gen": gen,
        "rounds": {"free": free, "mixed": mixed},
        "decode_tok_s": {"free": med(free, "decode_tok_s"), "mixed": med(mixed, "decode_tok_s")},
        "per_token_ms": {
            "free": med(free, "per_token_s_free") * 1e3,
            "constrained": med(mixed, "per_token_s_constrained") * 1e3,
        },
        "targets": [
            {
                "target": "aggregate decode, half constrained >= 0.9x",
                "value": agg,
                "met": agg >= 0.9,
            },
            {"target": "constrained per-token latency <= 1.1x", "value": lat, "met": lat <= 1.1},
        ],
    }


def print_structured(r: dict[str, Any]) -> None:
    d, p = r["decode_tok_s"], r["per_token_ms"]
    print(
        f"structured output, {r['streams']} greedy streams of {r['gen']} tokens, "
        f"{r['threads']} threads (medians of {len(r['rounds']['free'])} rounds):"
    )
    print(f"  aggregate decode: all free {d['free']:.1f} tok/s, half constrained {d['mixed']:.1f}")
    print(f"  per-token latency: free {p['free']:.2f} ms, constrained {p['constrained']:.2f} ms")
    for t in r["targets"]:
        print(f"  {t['target']}: {t['value']:.3f} ({'met' if t['met'] else 'NOT met'})")
