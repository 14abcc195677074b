"""Returning conversations: the TTFT of a turn whose history is in the conversation cache.

`conversations` histories of `history` random ordinary token ids are built once (turn 0,
untimed); then each conversation comes back `rounds` times, one request at a time, in turn
(0, 1, 2, 3, 0, 1, ...), each time with its previous answer (`gen` greedy tokens) and
`new_tokens` fresh ids appended. The engine runs with `max_batch=2` and a device K/V pool sized
for about 2.2 histories, so by the time a conversation returns its K/V has left the device.

Time to first token (TTFT) = from the `generate` call to the first streamed chunk. Per returning
turn, in this order:

- **host**: the long-lived engine (host tier on, large enough for every conversation);
- **device**: the reference without any move: a second long-lived engine whose pool holds every
  conversation (tiers below off), fed the same turns; the new tokens' prefill at this context is
  all it does. Its answers must equal the host engine's (`answers_differ`, expected 0);
- **llama.cpp** (with a GGUF and llama-cpp-python): the same prompt ids through
  `Llama.create_completion(stream=True, max_tokens=1)` with a `LlamaRAMCache`, which is what
  llama-cpp-python's server does with `--cache true` (it restores the longest cached prefix's
  saved state, then evaluates the rest); time to its first chunk;
- **llama.cpp KV state**: llama.cpp's own mechanism without llama-cpp-python's extras (its state
  object also copies a 100 MB logits array): `llama_state_seq_set_data` of the K/V saved after
  the conversation's previous turn, `eval` of the rest, argmax of the last logits;
- **cold**: a fresh engine with every tier below the device off (`host_cache_mib=0,
  disk_cache_mib=0`), warmed up with one unrelated 16-token prompt, then the same prompt: it has
  never seen any of it, so the whole prompt is prefilled (checked: `cached_tokens == 0`).

Then the engine is closed (a clean close writes every cached block to the disk tier) and a new
engine is started on the same folder with the same options (**disk**: the first returning turn of
each conversation after a restart, warmed up as above), next to a fresh `Llama` (**llama.cpp
restart**: its RAM cache died with the process, so it reads the whole history). Then the same
once more after dropping the tier's files from the OS page cache (`posix_fadvise(DONTNEED)`):
**disk, page cache dropped**, the case of a machine restart rather than a process restart.

The restore itself is logged per move by the engine and read back from
`stats()["cache"]["last_restore"]` (tokens, bytes, seconds); its GB/s is compared with this
machine's memcpy bandwidth in the same run: `np.copyto` of a 256 MiB array into a preallocated
one, one thread like the engine's restore, median of 5, GB/s = bytes copied (counted once, not
read + write) / seconds; measured at the start and at the end. The same copy at the size of one
restore (one history's blocks) is reported next to it: glibc's memcpy switches to non-temporal
stores above a size threshold (on the machine of docs/benchmarks.md, between 96 and 128 MiB), so
the two differ by up to 2x, and a restore moves one 360 KB block at a time.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from strata_rs import Engine

DEVICE_CONVERSATIONS = 2.2  # histories the device K/V pool holds
WARMUP_TOKENS = 16


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def memcpy_gb_s(size: int = 256 << 20, repeats: int = 5) -> float:
    """One-thread memcpy bandwidth: bytes copied (counted once) per second, median of `repeats`."""
    src = np.ones(size, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault both arrays' pages in
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return size / statistics.median(times) / 1e9


def pool_sizes(
    conversations: int, history: int, final_len: int, block_size: int, block_bytes: int
) -> tuple[int, int, int, int]:
    """(device pool MiB for `DEVICE_CONVERSATIONS` histories, max_context, one conversation's
    bytes at its longest, host tier MiB for every conversation with room to spare)."""
    bs = block_size
    kv_memory_mib = math.ceil(DEVICE_CONVERSATIONS * history / bs * block_bytes / 2**20)
    max_context = -(-(final_len + 1) // bs) * bs
    per_conv = -(-final_len // bs) * block_bytes
    host_cache_mib = max(16, math.ceil(1.5 * conversations * per_conv / 2**20))
    return kv_memory_mib, max_context, per_conv, host_cache_mib


def _drop_page_cache(folder: Path) -> int:
    """Asks the OS to drop the folder's files from its page cache; returns the bytes dropped."""
    total = 0
    for p in folder.iterdir():
        if not p.is_file():
            continue
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


async def greedy_turn(engine: Engine, prompt: list[int], gen: int) -> tuple[float, list[int], Any]:
    """(TTFT, the answer's ids, the last chunk's usage) of one greedy request."""
    t0 = time.perf_counter()
    stream = engine.generate(prompt, max_tokens=gen, temperature=0, ignore_eos=True)
    first = await stream.__anext__()
    ttft = time.perf_counter() - t0
    ids = list(first.token_ids)
    usage = first.usage
    async for chunk in stream:
        ids += chunk.token_ids
        usage = chunk.usage or usage
    return ttft, ids, usage


async def cold_turn_ttft(
    model: str | Path, opts: dict[str, Any], warmup: list[int], prompt: list[int]
) -> float:
    """TTFT of `prompt` on a fresh engine with `opts` and the tiers off, warmed up with an
    unrelated prompt first: the whole prompt is prefilled (checked: nothing cached)."""
    cold = {k: v for k, v in opts.items() if k != "disk_cache_dir"}
    engine = await Engine.load(model, **cold, host_cache_mib=0, disk_cache_mib=0)
    try:
        await greedy_turn(engine, warmup, 1)
        t, _, usage = await greedy_turn(engine, prompt, 1)
        if usage is not None and usage.cached_tokens != 0:
            raise RuntimeError(f"cold prompt found {usage.cached_tokens} tokens cached")
        return t
    finally:
        await engine.close()


class _CacheLog(logging.Handler):
    """Collects the engine's cache log lines (one per restore, at info) with their time."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.t0 = time.perf_counter()
        self.lines: list[str] = []
        self.logger = logging.getLogger("strata_rs.cache")
        self.level_before = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{time.perf_counter() - self.t0:8.2f} s  {record.getMessage()}")

    def close(self) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level_before)
        super().close()


def _cache_view(engine: Engine) -> dict[str, Any]:
    s = engine.stats()
    return {"hit": dict(s["cache"]["hit_tokens"]), "restore": s["cache"]["last_restore"]}


async def _measured_turn(engine: Engine, prompt: list[int], gen: int) -> dict[str, Any]:
    before = _cache_view(engine)
    ttft, answer, usage = await greedy_turn(engine, prompt, gen)
    after = _cache_view(engine)
    hit = {t: after["hit"][t] - before["hit"][t] for t in after["hit"]}
    restore = None
    if hit["host"] + hit["disk"] > 0 and after["restore"] is not None:
        r = after["restore"]
        restore = {**r, "gb_s": r["bytes"] / max(r["seconds"], 1e-9) / 1e9}
    return {
        "ttft_s": ttft,
        "answer": answer,
        "cached_tokens": usage.cached_tokens if usage is not None else None,
        "hit_tokens": hit,
        "restore": restore,
    }


class _Llama:
    """llama-cpp-python on the same prompt ids: its server's RAM-cache path, its bare K/V state
    save/restore, and a fresh instance after a restart."""

    def __init__(self, gguf: Path, threads: int, n_ctx: int) -> None:
        import llama_cpp

        self.lib = llama_cpp
        self.gguf, self.threads, self.n_ctx = gguf, threads, n_ctx
        self.version = llama_cpp.__version__
        self.llm = self._new()
        # conversation -> (tokens, its sequence state, the state's bytes)
        self.states: dict[int, tuple[int, Any, int]] = {}

    def _new(self) -> Any:
        from strata_rs.bench.peer_llama_cpp import new_llama

        return new_llama(self.lib, self.gguf, self.n_ctx, self.threads)

    @staticmethod
    def completion_ttft(llm: Any, prompt: list[int]) -> float:
        """Submit -> first streamed chunk of create_completion (the server's path); the state
        save into the RAM cache happens after the last chunk, untimed."""
        t0 = time.perf_counter()
        it = llm.create_completion(prompt, max_tokens=1, temperature=0.0, stream=True)
        next(it)
        t = time.perf_counter() - t0
        for _ in it:
            pass
        return t

    def save(self, conv: int, n_tokens: int) -> None:
        """Keeps the K/V of the context's sequence 0 (its first n_tokens) for `conv`."""
        lib, ctx = self.lib, self.llm.ctx
        size = lib.llama_state_seq_get_size(ctx, 0)
        buf = (lib.ctypes.c_uint8 * size)()
        n = lib.llama_state_seq_get_data(ctx, buf, size, 0)
        self.states[conv] = (n_tokens, buf, n)

    def state_ttft(self, conv: int, prompt: list[int]) -> float:
        """Restore the K/V saved after `conv`'s last turn, evaluate the rest, pick a token."""
        lib, llm = self.lib, self.llm
        n_cached, buf, n = self.states[conv]
        t0 = time.perf_counter()
        llm._ctx.kv_cache_clear()
        if lib.llama_state_seq_set_data(llm.ctx, buf, n, 0) == 0:
            raise RuntimeError("llama_state_seq_set_data failed")
        llm.n_tokens = n_cached
        llm.input_ids[:n_cached] = prompt[:n_cached]
        llm.eval(prompt[n_cached:])
        logits = np.ctypeslib.as_array(
            lib.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),)
        )
        int(np.argmax(logits))
        t = time.perf_counter() - t0
        self.save(conv, len(prompt))
        return t

    def restart(self, warmup: list[int]) -> None:
        self.llm.close()
        self.llm = self._new()
        self.completion_ttft(self.llm, warmup)

    def close(self) -> None:
        self.llm.close()


async def run_conversations(
    model: str | Path,
    *,
    conversations: int = 4,
    history: int = 2400,
    new_tokens: int = 60,
    rounds: int = 3,
    gen: int = 8,
    threads: int | None = None,
    disk_dir: str | Path,
    llama_cpp_gguf: str | Path | None = None,
    device: str = "cpu",
    seed: int = 0,
    memcpy_mib: int = 256,
    log: Callable[[str], None] = _log,
) -> dict[str, Any]:
    """Runs the scenario; returns every turn's figures, medians, ratios and the targets.

    `disk_dir` is the disk tier's folder: emptied at the start (`disk_cache_days=0`).
    `memcpy_mib`: the array the memcpy bandwidth is measured on."""
    disk_dir = Path(disk_dir)
    disk_dir.mkdir(parents=True, exist_ok=True)
    total_turns = rounds + 2  # host rounds, then disk, then disk with the page cache dropped
    final_len = history + gen + total_turns * (new_tokens + gen)
    probe = await Engine.load(
        model, device=device, threads=threads, host_cache_mib=0, disk_cache_mib=0
    )
    info = probe.info
    await probe.close()
    block_bytes = int(info["kv_block_bytes"])
    bs = int(info["block_size"])
    restore_size = history // bs * block_bytes
    memcpy = {
        "start": memcpy_gb_s(memcpy_mib << 20),
        "start_restore_size": memcpy_gb_s(restore_size),
    }
    vocab = int(info["vocab_size"])
    kv_memory_mib, max_context, per_conv, host_cache_mib = pool_sizes(
        conversations, history, final_len, bs, block_bytes
    )
    disk_cache_mib = 2 * host_cache_mib
    engine_opts: dict[str, Any] = {
        "device": device,
        "threads": threads,
        "max_batch": 2,
        "max_context": max_context,
        "kv_memory_mib": kv_memory_mib,
    }
    tiers = {
        "host_cache_mib": host_cache_mib,
        "disk_cache_dir": disk_dir,
        "disk_cache_mib": disk_cache_mib,
    }

    rng = np.random.default_rng(seed)
    # Skip the lowest ids, where test and real vocabularies keep their special tokens.
    lo = min(300, vocab // 2)

    warm_rng = np.random.default_rng(seed + 1)

    def ids(n: int, source: np.random.Generator = rng) -> list[int]:
        return [int(t) for t in source.integers(lo, vocab, size=n)]

    def warmup() -> list[int]:
        # Unrelated to every conversation, and drawn apart so the prompts stay the same.
        return ids(WARMUP_TOKENS, warm_rng)

    histories = [ids(history) for _ in range(conversations)]

    async def cold_ttft(prompt: list[int]) -> float:
        return await cold_turn_ttft(model, engine_opts, warmup(), prompt)

    llama: _Llama | None = None
    if llama_cpp_gguf is not None:
        llama = _Llama(Path(llama_cpp_gguf), int(info["threads"]), max(4096, max_context))

    turns: list[dict[str, Any]] = []
    cache_log = _CacheLog()
    engine = await Engine.load(model, **engine_opts, **tiers, disk_cache_days=0.0)
    run_info = engine.info
    # The reference: a pool that holds every conversation, no tiers below (nothing is evicted).
    resident_opts = {
        **engine_opts,
        "kv_memory_mib": math.ceil((conversations + 1) * per_conv / 2**20),
    }
    resident = await Engine.load(model, **resident_opts, host_cache_mib=0, disk_cache_mib=0)
    answers_differ = 0
    try:
        log(f"conversations: building {conversations} histories of {history} tokens")
        for c in range(conversations):
            _, answer, _ = await greedy_turn(engine, histories[c], gen)
            _, same, _ = await greedy_turn(resident, histories[c], gen)
            answers_differ += same != answer
            if llama is not None:
                llama.completion_ttft(llama.llm, histories[c])
                llama.save(c, len(histories[c]))
            histories[c] = histories[c] + answer
        for r in range(1, rounds + 1):
            for c in range(conversations):
                log(f"conversations: round {r}/{rounds}, conversation {c}")
                prompt = histories[c] + ids(new_tokens)
                turn = await _measured_turn(engine, prompt, gen)
                ttft = {"strata-rs": turn["ttft_s"]}
                t_res, same, usage = await greedy_turn(resident, prompt, gen)
                ttft["device"] = t_res
                turn["device_cached_tokens"] = usage.cached_tokens if usage is not None else None
                # Batch-invariant kernels: restored K/V must give the resident engine's tokens.
                answers_differ += same != turn["answer"]
                if llama is not None:
                    ttft["llama.cpp"] = llama.completion_ttft(llama.llm, prompt)
                    ttft["llama.cpp KV state"] = llama.state_ttft(c, prompt)
                ttft["cold"] = await cold_ttft(prompt)
                histories[c] = prompt + turn.pop("answer")
                turns.append(
                    {
                        "phase": "host",
                        "round": r,
                        "conversation": c,
                        "prompt_tokens": len(prompt),
                        **turn,
                        "ttft_s": ttft,
                    }
                )
        host_stats = engine.stats()
    finally:
        await resident.close()
        await engine.close()

    for phase, r in (("disk", rounds + 1), ("disk_uncached", rounds + 2)):
        files = [p for p in disk_dir.iterdir() if p.is_file()]
        disk_bytes = sum(p.stat().st_size for p in files)
        if phase == "disk_uncached":
            _drop_page_cache(disk_dir)
        log(f"conversations: restart ({phase}): {len(files)} files, {disk_bytes / 2**20:.0f} MiB")
        engine = await Engine.load(model, **engine_opts, **tiers)
        try:
            adopted = engine.stats()["cache"]["adopted_files"]
            await greedy_turn(engine, warmup(), 1)
            if llama is not None and phase == "disk":
                llama.restart(warmup())
            for c in range(conversations):
                log(f"conversations: {phase}, conversation {c}")
                prompt = histories[c] + ids(new_tokens)
                turn = await _measured_turn(engine, prompt, gen)
                ttft = {"strata-rs": turn["ttft_s"]}
                if llama is not None and phase == "disk":
                    ttft["llama.cpp restart"] = llama.completion_ttft(llama.llm, prompt)
                ttft["cold"] = await cold_ttft(prompt)
                histories[c] = prompt + turn.pop("answer")
                turns.append(
                    {
                        "phase": phase,
                        "round": r,
                        "conversation": c,
                        "prompt_tokens": len(prompt),
                        "adopted_files": adopted,
                        **turn,
                        "ttft_s": ttft,
                    }
                )
        finally:
            await engine.close()
    if llama is not None:
        llama.close()
    memcpy["end"] = memcpy_gb_s(memcpy_mib << 20)
    memcpy["end_restore_size"] = memcpy_gb_s(restore_size)
    cache_log.close()

    result = _summarize(turns, memcpy)
    result["memcpy_bytes"] = {"reference": memcpy_mib << 20, "restore_size": restore_size}
    result["setup"] = {
        "model": str(model),
        "engine": run_info,
        "conversations": conversations,
        "history_tokens": history,
        "new_tokens": new_tokens,
        "answer_tokens": gen,
        "rounds": rounds,
        "max_batch": 2,
        "kv_memory_mib": kv_memory_mib,
        "kv_blocks": run_info["kv_blocks"],
        "kv_block_bytes": block_bytes,
        "device_holds_histories": run_info["kv_blocks"] * bs / history,
        "host_cache_mib": host_cache_mib,
        "disk_cache_mib": disk_cache_mib,
        "threads": run_info["threads"],
        "llama.cpp": llama.version if llama is not None else None,
        "resident_kv_memory_mib": resident_opts["kv_memory_mib"],
        "host_phase_moves": host_stats["cache"]["moves"],
    }
    result["answers_differ"] = answers_differ
    result["cache_log"] = cache_log.lines
    return result


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _summarize(turns: list[dict[str, Any]], memcpy_runs: dict[str, float]) -> dict[str, Any]:
    def ttfts(phase: str, who: str) -> list[float]:
        return [t["ttft_s"][who] for t in turns if t["phase"] == phase and who in t["ttft_s"]]

    def gbs(phase: str) -> list[float]:
        return [t["restore"]["gb_s"] for t in turns if t["phase"] == phase and t["restore"]]

    med = {
        "cold": _median([t["ttft_s"]["cold"] for t in turns]),
        "cold_host_turns": _median(ttfts("host", "cold")),
        "cold_disk_turns": _median(ttfts("disk", "cold")),
        "cold_disk_uncached_turns": _median(ttfts("disk_uncached", "cold")),
        "host": _median(ttfts("host", "strata-rs")),
        "device": _median(ttfts("host", "device")),
        "disk": _median(ttfts("disk", "strata-rs")),
        "disk_uncached": _median(ttfts("disk_uncached", "strata-rs")),
        "llama.cpp": _median(ttfts("host", "llama.cpp")),
        "llama.cpp KV state": _median(ttfts("host", "llama.cpp KV state")),
        "llama.cpp restart": _median(ttfts("disk", "llama.cpp restart")),
    }
    memcpy = statistics.median([memcpy_runs["start"], memcpy_runs["end"]])
    memcpy_small = statistics.median(
        [memcpy_runs["start_restore_size"], memcpy_runs["end_restore_size"]]
    )
    restore = {p: _median(gbs(p)) for p in ("host", "disk", "disk_uncached")}
    ratios = {
        "host/cold": _ratio(med["host"], med["cold_host_turns"]),
        "device/cold": _ratio(med["device"], med["cold_host_turns"]),
        "disk/cold": _ratio(med["disk"], med["cold_disk_turns"]),
        "disk_uncached/cold": _ratio(med["disk_uncached"], med["cold_disk_uncached_turns"]),
        "host/llama.cpp": _ratio(med["host"], med["llama.cpp"]),
        "host/llama.cpp KV state": _ratio(med["host"], med["llama.cpp KV state"]),
        "disk/llama.cpp restart": _ratio(med["disk"], med["llama.cpp restart"]),
        "host restore/memcpy": _ratio(restore["host"], memcpy),
        "host restore/memcpy of its size": _ratio(restore["host"], memcpy_small),
    }
    targets = [
        ("host TTFT <= 5% of cold", ratios["host/cold"], 0.05),
        ("host TTFT <= 0.5x llama.cpp returning", ratios["host/llama.cpp"], 0.5),
        ("disk TTFT after a restart <= 10% of cold", ratios["disk/cold"], 0.10),
        ("host restore GB/s >= 50% of memcpy", ratios["host restore/memcpy"], 0.5),
    ]
    return {
        "turns": turns,
        "median_ttft_s": med,
        "restore_gb_s": restore,
        "memcpy_gb_s": memcpy,
        "memcpy_restore_size_gb_s": memcpy_small,
        "memcpy_runs_gb_s": memcpy_runs,
        "ratios": ratios,
        "targets": [
            {
                "target": name,
                "value": v,
                "limit": lim,
                "met": None if v is None else (v >= lim if ">=" in name else v <= lim),
            }
            for name, v, lim in targets
        ],
    }


# Plot: TTFT per returning turn, one series per source, log-scale y.
SERIES = [  # (name, phase, key in ttft_s, colour)
    ("cold", None, "cold", "#d62728"),
    ("host tier", "host", "strata-rs", "#1f77b4"),
    ("device (pool holds all)", "host", "device", "#7f7f7f"),
    ("disk tier after a restart", "disk", "strata-rs", "#2ca02c"),
    ("disk tier, page cache dropped", "disk_uncached", "strata-rs", "#17becf"),
    ("llama.cpp RAM prompt cache", "host", "llama.cpp", "#ff7f0e"),
    ("llama.cpp KV state restore", "host", "llama.cpp KV state", "#bcbd22"),
    ("llama.cpp after a restart", "disk", "llama.cpp restart", "#9467bd"),
]


def plot_series(result: dict[str, Any]) -> dict[str, list[tuple[int, float]]]:
    """Series name -> [(returning turn number, TTFT ms)]; only series that were measured."""
    out: dict[str, list[tuple[int, float]]] = {}
    for name, phase, key, _ in SERIES:
        pts = [
            (i + 1, t["ttft_s"][key] * 1e3)
            for i, t in enumerate(result["turns"])
            if (phase is None or t["phase"] == phase) and key in t["ttft_s"]
        ]
        if pts:
            out[name] = pts
    return out


def write_svg(result: dict[str, Any], path: str | Path, title: str = "") -> Path:
    """TTFT per returning turn, log-scale y, one polyline with markers per series, a legend."""
    series = plot_series(result)
    colour = {name: c for name, _, _, c in SERIES}
    turns = result["turns"]
    w, h, left, right, top, bottom = 760, 420, 70, 250, 40, 50
    ys = [y for pts in series.values() for _, y in pts]
    lo, hi = math.floor(math.log10(min(ys))), math.ceil(math.log10(max(ys)))
    hi = max(hi, lo + 1)
    n = len(turns)

    def px(x: float) -> float:
        return left + (x - 0.5) / n * (w - left - right)

    def py(y: float) -> float:
        return top + (hi - math.log10(y)) / (hi - lo) * (h - top - bottom)

    e = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
        f'font-family="sans-serif" font-size="11">',
        f'<rect width="{w}" height="{h}" fill="white"/>',
        f'<text x="{left}" y="20" font-size="13">{title}</text>',
    ]
    for k in range(lo, hi + 1):
        y = py(10.0**k)
        label = f"{10.0**k:g} ms" if k < 3 else f"{10.0 ** (k - 3):g} s"
        e.append(f'<line x1="{left}" y1="{y:.1f}" x2="{w - right}" y2="{y:.1f}" stroke="#ddd"/>')
        e.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{label}</text>')
    for i, t in enumerate(turns):
        x = px(i + 1)
        e.append(f'<text x="{x:.1f}" y="{h - bottom + 14}" text-anchor="middle">{i + 1}</text>')
        if i and t["phase"] != turns[i - 1]["phase"]:
            xs = px(i + 0.5)
            label = "restart" if t["phase"] == "disk" else "restart, page cache dropped"
            e.append(
                f'<line x1="{xs:.1f}" y1="{top}" x2="{xs:.1f}" y2="{h - bottom}" '
                'stroke="#888" stroke-dasharray="4,3"/>'
            )
            e.append(f'<text x="{xs + 3:.1f}" y="{top + 10}" fill="#666">{label}</text>')
    e.append(
        f'<line x1="{left}" y1="{h - bottom}" x2="{w - right}" y2="{h - bottom}" stroke="black"/>'
    )
    e.append(f'<line x1="{left}" y1="{top}" x2="{left}" y2="{h - bottom}" stroke="black"/>')
    e.append(
        f'<text x="{(left + w - right) / 2:.0f}" y="{h - 12}" text-anchor="middle">'
        "returning turn (conversations 0-3 in turn, round by round)</text>"
    )
    e.append(
        f'<text transform="translate(16 {(top + h - bottom) / 2:.0f}) rotate(-90)" '
        'text-anchor="middle">time to first token (log scale)</text>'
    )
    for j, (name, pts) in enumerate(series.items()):
        c = colour[name]
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        e.append(f'<polyline points="{coords}" fill="none" stroke="{c}" stroke-width="1.5"/>')
        e += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{c}"/>' for x, y in pts]
        ly = top + 34 + 18 * j  # below the phase labels, which may reach the margin
        e.append(
            f'<line x1="{w - right + 12}" y1="{ly}" x2="{w - right + 32}" y2="{ly}" '
            f'stroke="{c}" stroke-width="2"/>'
        )
        e.append(f'<text x="{w - right + 38}" y="{ly + 4}">{name}</text>')
    e.append("</svg>")
    path = Path(path)
    path.write_text("\n".join(e) + "\n", encoding="utf-8")
    return path


def write_png(result: dict[str, Any], path: str | Path, title: str = "") -> Path:
    """The SVG's plot drawn by matplotlib: a PNG (or any format matplotlib writes, by suffix)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = plot_series(result)
    colour = {name: c for name, _, _, c in SERIES}
    turns = result["turns"]
    fig, ax = plt.subplots(figsize=(9.5, 5))
    for name, pts in series.items():
        xs, ys = zip(*pts, strict=True)
        ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.5, color=colour[name], label=name)
    for i in range(1, len(turns)):
        if turns[i]["phase"] != turns[i - 1]["phase"]:
            label = "restart" if turns[i]["phase"] == "disk" else "restart, page cache dropped"
            ax.axvline(i + 0.5, color="#888", linestyle="--", linewidth=1)
            ax.annotate(
                label,
                (i + 0.55, 1.0),
                xycoords=("data", "axes fraction"),
                va="top",
                fontsize=8,
                color="#666",
            )
    ax.set_yscale("log")
    ax.set_xlim(0.5, len(turns) + 0.5)
    ax.set_xticks(range(1, len(turns) + 1))
    ax.set_xlabel("returning turn (conversations in turn, round by round)")
    ax.set_ylabel("time to first token (ms, log scale)")
    ax.grid(True, which="major", axis="y", color="#ddd")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    if title:
        ax.set_title(title, fontsize=11)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def print_conversations(r: dict[str, Any]) -> None:
    s = r["setup"]
    print(
        f"{s['conversations']} conversations, {s['history_tokens']}-token histories, "
        f"+{s['new_tokens']} new tokens and a {s['answer_tokens']}-token answer per turn; "
        f"max_batch {s['max_batch']}, device pool {s['kv_memory_mib']} MiB "
        f"({s['device_holds_histories']:.1f} histories), host tier {s['host_cache_mib']} MiB, "
        f"{s['threads']} threads"
    )
    keys = ["strata-rs", "device", "cold", "llama.cpp", "llama.cpp KV state", "llama.cpp restart"]
    shown = [k for k in keys if any(k in t["ttft_s"] for t in r["turns"])]
    print(
        f"{'phase':<14}{'rnd':>4}{'conv':>5}{'prompt':>7}"
        + "".join(f"{k[:18]:>19}" for k in shown)
        + f"{'restored':>10}{'GB/s':>7}"
    )
    for t in r["turns"]:
        cells = "".join(
            f"{t['ttft_s'][k] * 1e3:>16.1f} ms" if k in t["ttft_s"] else f"{'':>19}" for k in shown
        )
        rest = t["restore"]
        tail = f"{rest['tokens']:>10}{rest['gb_s']:>7.1f}" if rest else f"{'-':>10}{'':>7}"
        print(
            f"{t['phase']:<14}{t['round']:>4}{t['conversation']:>5}{t['prompt_tokens']:>7}"
            + cells
            + tail
        )
    print("\nmedian TTFT:")
    for k, v in r["median_ttft_s"].items():
        if v is not None:
            print(f"  {k:<26}{v * 1e3:10.1f} ms")
    rg = r["restore_gb_s"]
    print(
        "restore GB/s (median): "
        + ", ".join(f"{k} {v:.1f}" for k, v in rg.items() if v is not None)
        + f"; memcpy {r['memcpy_gb_s']:.1f} GB/s over {r['memcpy_bytes']['reference'] >> 20} MiB, "
        f"{r['memcpy_restore_size_gb_s']:.1f} GB/s over one restore's "
        f"{r['memcpy_bytes']['restore_size'] / 1e6:.1f} MB"
    )
    print("ratios: " + ", ".join(f"{k} {v:.3f}" for k, v in r["ratios"].items() if v is not None))
    for t in r["targets"]:
        if t["value"] is None:
            print(f"  {t['target']}: not measured")
        else:
            verdict = "met" if t["met"] else "NOT met"
            print(f"  {t['target']}: {t['value']:.3f} ({verdict})")
