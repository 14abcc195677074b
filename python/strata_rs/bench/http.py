"""The HTTP server's cost: the same workload through the Python API and through `strata-rs serve`
on loopback, in interleaved rounds (API, HTTP, API, HTTP, ...).

Workload per round: `streams` concurrent greedy requests of `prompt_len` fresh random tokens (a new
seed each round, so the prefix cache serves nothing) generating `gen` tokens each; then one request
alone on the idle engine. Reported, as medians over rounds:

- aggregate decode tokens/s: streams * (gen - 1) / (from the moment every stream has its first
  token to the moment the last one ends), as `bench --serving` defines it;
- TTFT: the median over the concurrent streams, and the median TTFT of the requests alone.

Both engines are loaded with the same options; the one not being measured is idle (its thread
blocks on its channel). The client runs in this process, the server in a subprocess, on the same
cores: the client's CPU is taken from the engine's, which a remote client's would not be. Two
clients: `raw` (the default: one connection per request, each HTTP chunk taken as one event,
as little CPU as an SSE client can spend) and `httpx` (a full client, as applications use). The
CPU time each process spends per streamed token is reported too: the server's against the API
path's (engine and consumer in one process) is the HTTP path's own cost, whatever the machine's
load.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

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


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all threads (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Client(Protocol):
    def events(self, body: dict[str, Any]) -> AsyncIterator[bytes]: ...


class _RawClient:
    """A streaming request on its own connection, read with as little work as SSE allows: the
    server sends one event per HTTP chunk, so each chunk is taken whole."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.host, self.port = host, int(port)

    async def events(self, body: dict[str, Any]) -> AsyncIterator[bytes]:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            data = json.dumps(body).encode()
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nhost: bench\r\nconnection: close\r\n"
                + b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(data)
                + data
            )
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"{head[:12]!r}: {(await reader.read()).decode()}")
            if b"transfer-encoding: chunked" not in head.lower():
                while event := await reader.read(65536):
                    yield event
                return
            while size := int(await reader.readuntil(b"\r\n"), 16):
                yield (await reader.readexactly(size + 2))[:-2]
            await reader.readuntil(b"\r\n")
        finally:
            writer.close()


class _HttpxClient:
    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def events(self, body: dict[str, Any]) -> AsyncIterator[bytes]:
        async with self.client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()}")
            async for line in r.aiter_lines():
                if line:
                    yield line.encode()


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


async def _http_round(client: _Client, prompts: list[list[int]], gen: int) -> dict[str, float]:
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
        async for event in client.events(body):
            if not seen and event.startswith(b"data: {"):
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


async def _http_alone(client: _Client, prompt: list[int]) -> float:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    t = 0.0
    async for event in client.events(body):
        if not t and event.startswith(b"data: {"):
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
    client_kind: str = "raw",
) -> dict[str, Any]:
    if client_kind not in ("raw", "httpx"):
        raise ValueError(f"client_kind: must be raw or httpx, got {client_kind!r}")
    options: dict[str, Any] = {
        "device": device,
        "threads": threads,
        "max_batch": streams,
        "max_context": 4096,
        # No disk tier on either side: a run's prompts would be restored by the next run.
        "disk_cache_mib": 0,
    }
    argv = [sys.executable, "-m", "strata_rs.cli", "serve", "--model", model, "--port", "0"]
    argv += ["--device", device, "--max-batch", str(streams), "--max-context", "4096"]
    argv += ["--disk-cache-mib", "0"]
    if threads is not None:
        argv += ["--threads", str(threads)]
    server = _ServerProcess(argv)
    engine = await Engine.load(model, **options)
    info = engine.info
    try:
        url = server.url()
        vocab = engine.info["vocab_size"]
        limits = httpx.Limits(max_connections=2 * streams)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as pool:
            while (await pool.get("/health")).status_code != 200:
                await asyncio.sleep(0.05)
            client: _Client = _RawClient(url) if client_kind == "raw" else _HttpxClient(pool)
            # Warm both paths (first-touch of the weights, connection pool).
            await _api_round(engine, [_prompt(prompt_len, vocab, 1)], 4)
            await _http_round(client, [_prompt(prompt_len, vocab, 2)] * 2, 4)
            tokens = streams * gen
            me, server_pid = os.getpid(), server.proc.pid
            api: list[dict[str, float]] = []
            http: list[dict[str, float]] = []
            for r in range(rounds):
                seed = 1000 * (r + 1)
                print(f"http round {r + 1}/{rounds}: API", file=sys.stderr, flush=True)
                ps = [_prompt(prompt_len, vocab, seed + i) for i in range(streams)]
                cpu = _cpu_seconds(me)
                api.append(await _api_round(engine, ps, gen))
                # This process: the engine's threads and the stream's consumer.
                api[-1]["cpu_us_per_token"] = (_cpu_seconds(me) - cpu) / tokens * 1e6
                print(f"http round {r + 1}/{rounds}: HTTP", file=sys.stderr, flush=True)
                ps = [_prompt(prompt_len, vocab, seed + 100 + i) for i in range(streams)]
                cpu, server_cpu = _cpu_seconds(me), _cpu_seconds(server_pid)
                http.append(await _http_round(client, ps, gen))
                # The server: its engine's threads and the HTTP path; this process: the client.
                http[-1]["cpu_us_per_token"] = (
                    (_cpu_seconds(server_pid) - server_cpu) / tokens * 1e6
                )
                http[-1]["client_cpu_us_per_token"] = (_cpu_seconds(me) - cpu) / tokens * 1e6
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
        "client": client_kind,
    }
    for key in ("decode_tok_s", "ttft_s", "alone_ttft_s", "cpu_us_per_token"):
        out[f"api_{key}"] = med(api, key)
        out[f"http_{key}"] = med(http, key)
    out["http_client_cpu_us_per_token"] = med(http, "client_cpu_us_per_token")
    out["tok_s_ratio"] = out["http_decode_tok_s"] / out["api_decode_tok_s"]
    out["ttft_added_ms"] = (out["http_ttft_s"] - out["api_ttft_s"]) * 1e3
    out["alone_ttft_added_ms"] = (out["http_alone_ttft_s"] - out["api_alone_ttft_s"]) * 1e3
    out["per_round"] = {"api": api, "http": http}
    return out


def print_http(r: dict[str, Any]) -> None:
    print(
        f"HTTP vs Python API: {r['streams']} streams, {r['prompt_tokens']}-token prompts, "
        f"{r['generated_tokens']} tokens each, medians of {r['rounds']} interleaved rounds, "
        f"{r['client']} client"
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
    added = r["http_cpu_us_per_token"] - r["api_cpu_us_per_token"]
    print(
        f"{'CPU per token, engine side (us)':34}{r['api_cpu_us_per_token']:10.1f}"
        f"{r['http_cpu_us_per_token']:10.1f}{added:+9.1f}us"
    )
    print(f"{'CPU per token, HTTP client (us)':34}{'':10}{r['http_client_cpu_us_per_token']:10.1f}")
    print(json.dumps({"per_round": r["per_round"]}))
