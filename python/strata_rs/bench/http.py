"""The HTTP server's cost: the same workload through the Python API and through `strata-rs serve`
on loopback (an httpx streaming client), in interleaved rounds (API, HTTP, API, HTTP, ...).

Workload per round: `streams` concurrent greedy requests of `prompt_len` fresh random tokens (a new
seed each round, so the prefix cache serves nothing) generating `gen` tokens each; then one request
alone on the idle engine. Reported, as medians over rounds:

- aggregate decode tokens/s: streams * (gen - 1) / (from the moment every stream has its first
  token to the moment the last one ends), as `bench --serving` defines it;
- TTFT: the median over the concurrent streams, and the median TTFT of the requests alone.

Both engines are loaded with the same options; the one not being measured is idle (its thread
blocks on its channel). The client runs in this process, the server in a subprocess, as users run
them: the HTTP figures include the client's own parsing, on the same cores.
"""

from __future__ import annotations

import asyncio
import json
import queue
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import numpy as np

from strata_rs import Engine


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(min(300, vocab // 2), vocab, size=n)]


class _Times:
    def __init__(self, count: int) -> None:
        self.t0 = time.perf_counter()
        self.first: list[float] = [0.0] * count
        self.last: list[float] = [0.0] * count

    def result(self, streams: int, gen: int) -> dict[str, float]:
        window = max(self.last) - max(self.first)
        return {
            "decode_tok_s": streams * (gen - 1) / window,
            "ttft_s": statistics.median(f - self.t0 for f in self.first),
        }


async def _api_round(engine: Engine, prompts: list[list[int]], gen: int) -> dict[str, float]:
    times = _Times(len(prompts))

    async def one(i: int) -> None:
        got = 0
        async for chunk in engine.generate(
            prompts[i], max_tokens=gen, temperature=0, ignore_eos=True
        ):
            if got == 0 and chunk.token_ids:
                times.first[i] = time.perf_counter()
            got += len(chunk.token_ids)
        times.last[i] = time.perf_counter()

    await asyncio.gather(*[one(i) for i in range(len(prompts))])
    return times.result(len(prompts), gen)


async def _http_round(
    client: httpx.AsyncClient, prompts: list[list[int]], gen: int
) -> dict[str, float]:
    times = _Times(len(prompts))

    async def one(i: int) -> None:
        body = {
            "prompt": prompts[i],
            "max_tokens": gen,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        seen = False
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()}")
            async for line in r.aiter_lines():
                if not seen and line.startswith("data: {"):
                    seen = True
                    times.first[i] = time.perf_counter()
        times.last[i] = time.perf_counter()

    await asyncio.gather(*[one(i) for i in range(len(prompts))])
    return times.result(len(prompts), gen)


async def _api_alone(engine: Engine, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    stream = engine.generate(prompt, max_tokens=2, temperature=0, ignore_eos=True)
    await stream.__anext__()
    t = time.perf_counter() - t0
    async for _ in stream:
        pass
    return t


async def _http_alone(client: httpx.AsyncClient, prompt: list[int]) -> float:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    t = 0.0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not t and line.startswith("data: {"):
                t = time.perf_counter() - t0
    return t


class _ServerProcess:
    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def url(self, timeout: float = 120.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            if line is None:
                raise RuntimeError("the server exited before listening")
            if "listening on " in line:
                return line.split("listening on ")[1].split()[0]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


async def run_http(
    model: str,
    device: str = "cpu",
    threads: int | None = None,
    streams: int = 16,
    prompt_len: int = 128,
    gen: int = 64,
    rounds: int = 3,
    alone_len: int = 16,
    alone_repeats: int = 8,
) -> dict[str, Any]:
    options: dict[str, Any] = {
        "device": device,
        "threads": threads,
        "max_batch": streams,
        "max_context": 4096,
    }
    argv = [sys.executable, "-m", "strata_rs.cli", "serve", "--model", model, "--port", "0"]
    argv += ["--device", device, "--max-batch", str(streams), "--max-context", "4096"]
    if threads is not None:
        argv += ["--threads", str(threads)]
    server = _ServerProcess(argv)
    engine = await Engine.load(model, **options)
    info = engine.info
    try:
        url = server.url()
        vocab = engine.info["vocab_size"]
        limits = httpx.Limits(max_connections=2 * streams)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as client:
            while (await client.get("/health")).status_code != 200:
                await asyncio.sleep(0.05)
            # Warm both paths (first-touch of the weights, connection pool).
            await _api_round(engine, [_prompt(prompt_len, vocab, 1)], 4)
            await _http_round(client, [_prompt(prompt_len, vocab, 2)] * 2, 4)
            api: list[dict[str, float]] = []
            http: list[dict[str, float]] = []
            for r in range(rounds):
                seed = 1000 * (r + 1)
                print(f"http round {r + 1}/{rounds}: API", file=sys.stderr, flush=True)
                ps = [_prompt(prompt_len, vocab, seed + i) for i in range(streams)]
                api.append(await _api_round(engine, ps, gen))
                print(f"http round {r + 1}/{rounds}: HTTP", file=sys.stderr, flush=True)
                ps = [_prompt(prompt_len, vocab, seed + 100 + i) for i in range(streams)]
                http.append(await _http_round(client, ps, gen))
                print(f"http round {r + 1}/{rounds}: TTFT alone", file=sys.stderr, flush=True)
                a: list[float] = []
                h: list[float] = []
                for k in range(alone_repeats):
                    a.append(await _api_alone(engine, _prompt(alone_len, vocab, seed + 500 + k)))
                    h.append(await _http_alone(client, _prompt(alone_len, vocab, seed + 700 + k)))
                api[-1]["alone_ttft_s"] = statistics.median(a)
                http[-1]["alone_ttft_s"] = statistics.median(h)
    finally:
        await engine.close()
        server.stop()

    def med(runs: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    out: dict[str, Any] = {
        "engine": info,
        "streams": streams,
        "prompt_tokens": prompt_len,
        "generated_tokens": gen,
        "rounds": rounds,
        "alone_prompt_tokens": alone_len,
        "alone_repeats": alone_repeats,
    }
    for key in ("decode_tok_s", "ttft_s", "alone_ttft_s"):
        out[f"api_{key}"] = med(api, key)
        out[f"http_{key}"] = med(http, key)
    out["tok_s_ratio"] = out["http_decode_tok_s"] / out["api_decode_tok_s"]
    out["ttft_added_ms"] = (out["http_ttft_s"] - out["api_ttft_s"]) * 1e3
    out["alone_ttft_added_ms"] = (out["http_alone_ttft_s"] - out["api_alone_ttft_s"]) * 1e3
    out["per_round"] = {"api": api, "http": http}
    return out


def print_http(r: dict[str, Any]) -> None:
    print(
        f"HTTP vs Python API: {r['streams']} streams, {r['prompt_tokens']}-token prompts, "
        f"{r['generated_tokens']} tokens each, medians of {r['rounds']} interleaved rounds"
    )
    print(f"{'':34}{'API':>10}{'HTTP':>10}{'HTTP/API':>10}")
    print(
        f"{'aggregate decode tok/s':34}{r['api_decode_tok_s']:10.1f}{r['http_decode_tok_s']:10.1f}"
        f"{r['tok_s_ratio']:10.3f}"
    )
    print(
        f"{'TTFT, median of the streams (ms)':34}{r['api_ttft_s'] * 1e3:10.1f}"
        f"{r['http_ttft_s'] * 1e3:10.1f}{r['ttft_added_ms']:+9.1f}ms"
    )
    label = f"TTFT alone, {r['alone_prompt_tokens']} tokens (ms)"
    print(
        f"{label:34}{r['api_alone_ttft_s'] * 1e3:10.1f}"
        f"{r['http_alone_ttft_s'] * 1e3:10.1f}{r['alone_ttft_added_ms']:+9.1f}ms"
    )
    print(json.dumps({"per_round": r["per_round"]}))
