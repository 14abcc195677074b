"""Stream delivery on each async library: asyncio, asyncio with uvloop, and trio.

What a token costs the event loop's thread between the engine sending it and the consumer's
`async for` body seeing it: the wake-up (the doorbell's eventfd, watched by `add_reader` on
asyncio, by a system task in `trio.lowlevel.wait_readable` on trio), the dispatcher's drain,
settling the future, resuming the task, building the chunk. Two figures per library:

- **loop CPU per token**: the loop thread's CPU time (`time.thread_time`) while N streams are
  read to the end, over the tokens delivered; the engine computes on its own threads, so this is
  the delivery's cost alone, and a busy machine stretches it less than it stretches wall time;
- **wall overhead per token**: one stream; the consumer's time per token minus the engine's mean
  step time over the same steps (as `bench/serving.py`'s stream overhead).

Each round runs every library once, in a rotating order, each in a fresh `anyio.run` with its
own engine; medians over the rounds.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import anyio

from strata_rs import Engine

BACKENDS: dict[str, tuple[str, dict[str, Any]]] = {
    "asyncio": ("asyncio", {}),
    "uvloop": ("asyncio", {"use_uvloop": True}),
    "trio": ("trio", {}),
}


def _prompt(i: int, vocab: int) -> list[int]:
    # Distinct prompts (no prefix sharing), away from the special tokens at the lowest ids.
    return [3 + (i * 7 + k * 13) % (vocab - 3) for k in range(16)]


async def _read(engine: Engine, prompt: list[int], gen: int) -> tuple[int, int]:
    tokens = chunks = 0
    async for chunk in engine.generate(prompt, max_tokens=gen, temperature=0, ignore_eos=True):
        tokens += len(chunk.token_ids)
        chunks += 1
    return tokens, chunks


async def _measure(model: str, threads: int | None, streams: int, gen: int) -> dict[str, float]:
    async with Engine.load(
        model, threads=threads, max_batch=streams, host_cache_mib=0, disk_cache_mib=0
    ) as engine:
        vocab = engine.info["vocab_size"]
        await _read(engine, _prompt(0, vocab), 8)  # warm-up: the dispatcher, the first step

        counts: list[tuple[int, int]] = []

        async def one(i: int) -> None:
            counts.append(await _read(engine, _prompt(100 + i, vocab), gen))

        cpu0 = time.thread_time()
        async with anyio.create_task_group() as tg:
            for i in range(streams):
                tg.start_soon(one, i)
        cpu = time.thread_time() - cpu0
        tokens = sum(t for t, _ in counts)
        chunks = sum(c for _, c in counts)

        # One stream: consumer time per token minus the engine's step time.
        stream = engine.generate(_prompt(1, vocab), max_tokens=gen, temperature=0, ignore_eos=True)
        await stream.__anext__()
        t0 = time.perf_counter()
        s0 = engine.stats()["step_seconds"]
        one_tokens = 0
        async for chunk in stream:
            one_tokens += len(chunk.token_ids)
        wall = (time.perf_counter() - t0) / one_tokens
        s1 = engine.stats()["step_seconds"]
        step = (s1["sum"] - s0["sum"]) / max(1, s1["count"] - s0["count"])
        return {
            "loop_cpu_us_per_token": cpu / tokens * 1e6,
            "tokens_per_chunk": tokens / chunks,
            "wall_overhead_us_per_token": (wall - step) * 1e6,
        }


def run_backends(
    model: str,
    threads: int | None = None,
    streams: int = 8,
    gen: int = 256,
    rounds: int = 5,
) -> dict[str, Any]:
    names = list(BACKENDS)
    per_round: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            print(f"backends round {r + 1}/{rounds}: {name}", file=sys.stderr, flush=True)
            backend, options = BACKENDS[name]
            per_round[name].append(
                anyio.run(
                    _measure, model, threads, streams, gen, backend=backend, backend_options=options
                )
            )
    medians = {
        name: {k: statistics.median(m[k] for m in rows) for k in rows[0]}
        for name, rows in per_round.items()
    }
    base = medians["asyncio"]["loop_cpu_us_per_token"]
    return {
        "streams": streams,
        "tokens_per_stream": gen,
        "rounds": rounds,
        "median": medians,
        "loop_cpu_vs_asyncio": {n: m["loop_cpu_us_per_token"] / base for n, m in medians.items()},
        "per_round": per_round,
    }


def print_backends(r: dict[str, Any]) -> None:
    print(
        f"stream delivery ({r['streams']} streams x {r['tokens_per_stream']} tokens; "
        f"medians of {r['rounds']} rounds):"
    )
    print("  library   loop CPU/token  vs asyncio  tokens/chunk  wall overhead/token (1 stream)")
    for name, m in r["median"].items():
        ratio = r["loop_cpu_vs_asyncio"][name]
        print(
            f"  {name:<8} {m['loop_cpu_us_per_token']:11.1f} us {ratio:10.2f}x"
            f" {m['tokens_per_chunk']:13.2f} {m['wall_overhead_us_per_token']:17.1f} us"
        )
