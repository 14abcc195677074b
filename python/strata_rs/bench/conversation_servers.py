"""Returning conversations through the servers: `strata-rs serve` against llama.cpp's own
`llama-server`, on the same GGUF file, over loopback HTTP.

The scenario of `conversations.py`, as a chat application meets it: `conversations` histories of
`history` random ordinary token ids, each built by one untimed turn; then each conversation comes
back `rounds` times, in turn (0, 1, 2, 3, 0, 1, ...), with `new_tokens` fresh ids appended to its
previous prompt. Each server runs 2 sequences at once (`--max-batch 2`; llama-server `-np 2`), so
with 4 conversations a returning one has always been pushed out by the two before it:

- strata-rs: a device K/V pool of about 2.2 histories, the host tier on (disk tier off);
- llama-server: 2 slots of the same context, its host-RAM prompt cache at its default
  (`--cache-ram`, 8 GiB): a returning prompt is restored from it, then the rest is evaluated.

Both get the same request body at `/v1/completions`: the prompt as token ids, `max_tokens=gen`,
`temperature=0`, `ignore_eos`, streamed, usage included, each on its own connection. The answer
is not appended to the conversation (the servers do not return its ids), so each return extends
the previous prompt and both servers can reuse all of it. TTFT = from sending the request to the
first streamed event that carries a choice. The turns alternate which server goes first; the idle
one waits on its socket. Per turn: each server's `cached_tokens` (both report it in `usage`), and
the tokens strata-rs restored from its host tier (its `/metrics`, read outside the timing).
"""

from __future__ import annotations

import json
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from strata_rs import Engine
from strata_rs.bench.conversations import pool_sizes
from strata_rs.testing.server import Server, serve_argv

TARGET = 0.5  # issue 24: returning TTFT <= 0.5x llama-server's


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    """A `llama-server` subprocess on loopback; ready once `/health` answers 200."""

    def __init__(self, argv: list[str], timeout: float = 300.0) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [*argv, "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"llama-server exited with {self.proc.returncode}: {self.lines[-20:]}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"llama-server never became healthy: {self.lines[-20:]}")
            time.sleep(0.1)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(timeout=60)


async def timed_turn(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed completion: TTFT, the choices' text, and the final usage (and llama-server's
    `timings`, when it sends them)."""
    t0 = time.perf_counter()
    ttft = None
    text = ""
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("choices"):
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text += event["choices"][0].get("text") or ""
            usage = event.get("usage") or usage
            timings = event.get("timings") or timings
    if ttft is None or usage is None:
        raise RuntimeError(f"{url}: the stream ended without a choice or usage")
    return {"ttft_s": ttft, "text": text, "usage": usage, "timings": timings}


def _cached(turn: dict[str, Any]) -> int | None:
    details = turn["usage"].get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    return int(cached) if cached is not None else None


def _host_hits(url: str) -> float:
    """strata-rs serve's prompt tokens served from its host tier so far (its /metrics)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    m = re.search(r'^strata:prefix_cache_hits_total\{tier="host"\} (\S+)$', text, re.M)
    if m is None:
        raise RuntimeError("no host-tier hit counter in strata-rs serve's /metrics")
    return float(m.group(1))


def llama_server_version(path: str | Path) -> str:
    """`llama-server --version`'s version line."""
    out = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=60)
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.startswith("version:")]
    return lines[0].removeprefix("version:").strip() if lines else "unknown"


async def run_server_conversations(
    gguf: str | Path,
    llama_server: str | Path | None,
    *,
    conversations: int = 4,
    history: int = 2400,
    new_tokens: int = 60,
    rounds: int = 3,
    gen: int = 8,
    threads: int | None = None,
    seed: int = 0,
    log: Callable[[str], None] = _log,
) -> dict[str, Any]:
    """Runs the scenario through `strata-rs serve` and, unless `llama_server` is None, through
    that llama-server binary; returns every turn, medians, the ratio and the target."""
    gguf = Path(gguf)
    probe = await Engine.load(gguf, threads=threads, host_cache_mib=0, disk_cache_mib=0)
    info = probe.info
    await probe.close()
    threads = int(info["threads"])
    bs, block_bytes = int(info["block_size"]), int(info["kv_block_bytes"])
    vocab = int(info["vocab_size"])
    final_len = history + gen + rounds * new_tokens
    kv_memory_mib, max_context, _, host_cache_mib = pool_sizes(
        conversations, history, final_len, bs, block_bytes
    )
    strata_argv = serve_argv(
        "--model", str(gguf),
        "--max-batch", "2",
        "--max-context", str(max_context),
        "--kv-memory-mib", str(kv_memory_mib),
        "--host-cache-mib", str(host_cache_mib),
        "--disk-cache-mib", "0",
        "--threads", str(threads),
    )  # fmt: skip
    llama_argv = None
    if llama_server is not None:
        llama_argv = [
            str(llama_server),
            "-m", str(gguf),
            "-np", "2",
            "-c", str(2 * max_context),
            "-t", str(threads),
            "-tb", str(threads),
        ]  # fmt: skip

    rng = np.random.default_rng(seed)
    lo = min(300, vocab // 2)  # skip the ids where vocabularies keep their special tokens

    def ids(n: int) -> list[int]:
        return [int(t) for t in rng.integers(lo, vocab, size=n)]

    def body(prompt: list[int]) -> dict[str, Any]:
        return {
            "prompt": prompt,
            "max_tokens": gen,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    histories = [ids(history) for _ in range(conversations)]
    log(f"servers: starting strata-rs serve{'' if llama_argv is None else ' and llama-server'}")
    strata = Server(strata_argv, echo=False)
    llama: LlamaServer | None = None
    turns: list[dict[str, Any]] = []
    try:
        servers = {"strata-rs": strata.url}
        if llama_argv is not None:
            llama = LlamaServer(llama_argv)
            servers["llama-server"] = llama.url
        # A connection per request: a kept-alive one can be closed by the server's idle timeout
        # while a turn of the other server runs (uvicorn's is 5 s).
        limits = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            for url in servers.values():  # warm-up: an unrelated prompt each
                await timed_turn(client, url, body(ids(16)))
            log(f"servers: building {conversations} histories of {history} tokens")
            for c in range(conversations):
                for url in servers.values():
                    await timed_turn(client, url, body(histories[c]))
            for r in range(1, rounds + 1):
                for c in range(conversations):
                    log(f"servers: round {r}/{rounds}, conversation {c}")
                    prompt = histories[c] + ids(new_tokens)
                    order = list(servers) if len(turns) % 2 == 0 else list(servers)[::-1]
                    got: dict[str, dict[str, Any]] = {}
                    host_hits = 0.0
                    for name in order:
                        before = _host_hits(strata.url) if name == "strata-rs" else 0.0
                        got[name] = await timed_turn(client, servers[name], body(prompt))
                        if name == "strata-rs":
                            host_hits = _host_hits(strata.url) - before
                    histories[c] = prompt
                    llama_turn = got.get("llama-server")
                    turns.append(
                        {
                            "round": r,
                            "conversation": c,
                            "prompt_tokens": len(prompt),
                            "first": order[0],
                            "ttft_s": {n: t["ttft_s"] for n, t in got.items()},
                            "cached_tokens": {n: _cached(t) for n, t in got.items()},
                            "strata-rs host-tier tokens": int(host_hits),
                            "llama-server timings": llama_turn and llama_turn["timings"],
                        }
                    )
    finally:
        if llama is not None:
            llama.stop()
        strata.stop()

    med = {
        name: statistics.median(t["ttft_s"][name] for t in turns)
        for name in ("strata-rs", "llama-server")
        if all(name in t["ttft_s"] for t in turns)
    }
    ratio = med["strata-rs"] / med["llama-server"] if "llama-server" in med else None
    return {
        "turns": turns,
        "median_ttft_s": med,
        "ratio": ratio,
        "target": {
            "target": f"returning TTFT <= {TARGET}x llama-server",
            "limit": TARGET,
            "value": ratio,
            "met": None if ratio is None else ratio <= TARGET,
        },
        "setup": {
            "gguf": str(gguf),
            "conversations": conversations,
            "history_tokens": history,
            "new_tokens": new_tokens,
            "answer_tokens": gen,
            "rounds": rounds,
            "threads": threads,
            "strata-rs": strata_argv[2:],
            "llama-server": llama_argv,
            "llama-server version": None
            if llama_server is None
            else llama_server_version(llama_server),
            "kv_memory_mib": kv_memory_mib,
            "host_cache_mib": host_cache_mib,
            "cpu": _cpu_name(),
        },
    }


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return os.uname().machine


def print_server_conversations(r: dict[str, Any]) -> None:
    s = r["setup"]
    names = list(r["turns"][0]["ttft_s"]) if r["turns"] else []
    names.sort(key=lambda n: n != "strata-rs")
    peer = f"; llama-server {s['llama-server version']}" if s["llama-server"] else ""
    print(
        f"through the servers: {s['conversations']} conversations, {s['history_tokens']}-token "
        f"histories, +{s['new_tokens']} per return, 2 sequences at once, {s['threads']} threads"
        f"{peer}"
    )
    print(
        f"{'rnd':>4}{'conv':>5}{'prompt':>7}"
        + "".join(f"{n:>15}{'cached':>8}" for n in names)
        + f"{'host tier':>10}"
    )
    for t in r["turns"]:
        cells = "".join(
            f"{t['ttft_s'][n] * 1e3:>12.1f} ms{t['cached_tokens'][n]!s:>8}" for n in names
        )
        print(
            f"{t['round']:>4}{t['conversation']:>5}{t['prompt_tokens']:>7}{cells}"
            f"{t['strata-rs host-tier tokens']:>10}"
        )
    med = r["median_ttft_s"]
    line = "median TTFT: " + ", ".join(f"{n} {v * 1e3:.1f} ms" for n, v in med.items())
    if r["ratio"] is not None:
        verdict = "met" if r["target"]["met"] else "NOT met"
        line += f": {r['ratio']:.3f}x ({r['target']['target']}: {verdict})"
    print(line)
