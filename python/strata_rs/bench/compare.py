"""`strata-rs bench --compare PEER,PEER,...`: strata-rs and its peers on the same weights, in the
same run, interleaved.

Each round runs every scenario group, and within a group every engine in turn (strata-rs, then
each peer in the order given), so that a busy moment of a shared machine slows all engines
alike; every figure is the median over rounds. The groups:

- **prefill and decode**: prefill tok/s of cold prompts of N tokens; decode tok/s at contexts
  C (strata-rs: `Engine.benchmark`; the peers: the same token ids, see `peers.py`);
- **streams**: aggregate greedy decode tok/s with S concurrent streams (default 1, 4, 8) of
  `stream_prompt` fresh ids each, `stream_tokens` tokens each: S x (tokens - 1) over the window
  from the moment every stream has its first token to the end of the last one;
- **conversation**: two conversations A and B with `history` ids each are served (one answer
  of `answer_tokens` greedy tokens each, untimed); then A returns with its answer and
  `new_tokens` new ids: TTFT **returning**; the same prompt on a state that has never seen it:
  TTFT **cold**; then the engine restarts and B returns the same way: TTFT **after restart**.
  strata-rs runs this on its own engine with the conversation cache: a device K/V pool that
  holds about one conversation (so A's blocks go to the host tier while B is served), the host
  tier, and a disk tier in a temporary folder (closing the engine writes it; the new engine
  adopts it). Every engine gets the same ids, built from strata-rs's answers.

The machine's read bandwidth (strata-rs's streaming-read measurement, on the same compute
threads) is measured in every round, so the table can say how close decode is to the ceiling.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from strata_rs import Engine
from strata_rs.bench.conversations import cold_turn_ttft, greedy_turn
from strata_rs.bench.peers import (
    DECODE_SEED,
    INSTALL,
    PEERS,
    PREFILL_SEED,
    TextTokenizer,
    canonical_ids,
    decode_ids,
    missing,
    prefill_ids,
    skip_line,
    stream_prompts,
)
from strata_rs.bench.progress import Progress
from strata_rs.bench.serving import decode_rate

SCENARIOS = ("prefill", "decode", "streams", "conversation")
US = "strata-rs"
WARMUP_TOKENS = 16


@dataclass
class CompareSpec:
    model: Path
    peers: list[str]
    scenarios: list[str] = field(default_factory=lambda: list(SCENARIOS))
    rounds: int = 3
    prefill: list[int] = field(default_factory=lambda: [512, 2048])
    decode_contexts: list[int] = field(default_factory=lambda: [512, 2048])
    steps: int = 32
    repeats: int = 3
    streams: list[int] = field(default_factory=lambda: [1, 4, 8])
    stream_prompt: int = 128
    stream_tokens: int = 64
    history: int = 2400
    new_tokens: int = 60
    answer_tokens: int = 8
    threads: int | None = None
    device: str = "cpu"
    gguf: Path | None = None
    disk_dir: Path | None = None
    # strata-rs's quantize= (the peers run the --gguf file, or the folder's bf16 export).
    quantize: str | None = None
    # strata-rs's bf16_dot= (bf16 weights: the CPU's bf16 dot products on rounded inputs).
    bf16_dot: bool = False


def parse_scenarios(text: str) -> list[str]:
    """`prefill,streams` -> in SCENARIOS order; `all` -> every one. ValueError names a bad one."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise ValueError(f"expected a comma-separated list of scenarios ({', '.join(SCENARIOS)})")
    for n in names:
        if n != "all" and n not in SCENARIOS:
            raise ValueError(f"unknown scenario {n!r}; choose from {', '.join(SCENARIOS)} (or all)")
    return [s for s in SCENARIOS if s in names or "all" in names]


# -- metric keys, labels, units ---------------------------------------------------------------


def metric_rows(spec: CompareSpec) -> list[tuple[str, str, str]]:
    """(key, label, unit) of every figure the table shows, in order. Unit "tok/s": higher is
    better; "s": lower is better."""
    rows: list[tuple[str, str, str]] = []
    if "prefill" in spec.scenarios:
        rows += [(f"prefill_{n}", f"prefill {n} tokens", "tok/s") for n in spec.prefill]
    if "decode" in spec.scenarios:
        rows += [(f"decode_{c}", f"decode at context {c}", "tok/s") for c in spec.decode_contexts]
    if "streams" in spec.scenarios:
        rows += [
            (f"streams_{s}", f"aggregate decode, {s} stream{'s' if s > 1 else ''}", "tok/s")
            for s in spec.streams
        ]
    if "conversation" in spec.scenarios:
        rows += [
            ("conversation_cold", "conversation TTFT: cold", "s"),
            ("conversation_returning", "conversation TTFT: returning", "s"),
            ("conversation_restart", "conversation TTFT: after restart", "s"),
        ]
    return rows


def groups(spec: CompareSpec) -> list[str]:
    out = []
    if "prefill" in spec.scenarios or "decode" in spec.scenarios:
        out.append(" and ".join(s for s in ("prefill", "decode") if s in spec.scenarios))
    if "streams" in spec.scenarios:
        out.append("streams " + "/".join(str(s) for s in spec.streams))
    if "conversation" in spec.scenarios:
        out.append("conversation")
    return out


def machine_info() -> dict[str, Any]:
    """What the run ran on: CPU model, cores, memory, load, software."""
    cpu = platform.processor() or platform.machine()
    mem_gib = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "memory_gib": mem_gib,
        "load_start": os.getloadavg()[0],
        "python": platform.python_version(),
        "system": platform.platform(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


# -- strata-rs ---------------------------------------------------------------------------------


class _Strata:
    """strata-rs's side: the engine of the prefill/decode/streams groups, and engines of its own
    for the conversation group."""

    def __init__(self, spec: CompareSpec, engine: Engine) -> None:
        self.spec = spec
        self.engine = engine
        self.info = engine.info

    async def prefill_decode(self) -> dict[str, Any]:
        s = self.spec
        r = await self.engine.benchmark(
            prefill_lens=s.prefill if "prefill" in s.scenarios else [],
            decode_contexts=s.decode_contexts if "decode" in s.scenarios else [],
            decode_steps=s.steps,
            repeats=s.repeats,
        )
        return dict(r)

    async def bandwidth(self) -> dict[str, Any]:
        r = await self.engine.benchmark(
            prefill_lens=[], decode_contexts=[], decode_steps=1, repeats=1
        )
        return dict(r)

    async def streams(self, prompts: list[list[int]]) -> float:
        return await decode_rate(self.engine, prompts, self.spec.stream_tokens)

    def _conversation_options(self) -> dict[str, Any]:
        s = self.spec
        bs = int(self.info["block_size"])
        block_bytes = int(self.info["kv_block_bytes"])
        final = s.history + 2 * s.answer_tokens + s.new_tokens + 1
        blocks = -(-final // bs) + 1
        return {
            "device": s.device,
            "threads": s.threads,
            "max_batch": 2,
            "max_context": -(-final // bs) * bs,
            # About one conversation: serving B pushes A's blocks below the device.
            "kv_memory_mib": max(1, math.ceil(blocks * block_bytes / 2**20)),
            "host_cache_mib": max(16, math.ceil(3 * blocks * block_bytes / 2**20)),
            "disk_cache_mib": max(32, math.ceil(6 * blocks * block_bytes / 2**20)),
            "quantize": s.quantize,
            "bf16_dot": s.bf16_dot,
        }

    async def conversation(
        self, prompts: dict[str, list[int]], disk_dir: Path, warmup: list[int]
    ) -> tuple[dict[str, Any], dict[str, list[int]]]:
        """Runs the conversation scenario; returns (figures, the answers A0, B0)."""
        opts = {**self._conversation_options(), "disk_cache_dir": disk_dir}
        gen = self.spec.answer_tokens
        out: dict[str, Any] = {"kv_memory_mib": opts["kv_memory_mib"]}
        engine = await Engine.load(self.spec.model, **opts, disk_cache_days=0.0)
        try:
            _, a0, _ = await greedy_turn(engine, prompts["A0"], gen)
            _, b0, _ = await greedy_turn(engine, prompts["B0"], gen)
            returning = prompts["A0"] + a0 + prompts["A1"]
            before = engine.stats()["cache"]["hit_tokens"]
            t, _, usage = await greedy_turn(engine, returning, gen)
            after = engine.stats()["cache"]["hit_tokens"]
            out["conversation_returning"] = t
            out["returning_hit_tokens"] = {k: after[k] - before[k] for k in after}
            out["returning_cached_tokens"] = usage.cached_tokens if usage is not None else None
        finally:
            await engine.close()
        tiered = {k: v for k, v in opts.items() if k not in ("host_cache_mib", "disk_cache_mib")}
        out["conversation_cold"] = await cold_turn_ttft(self.spec.model, tiered, warmup, returning)
        engine = await Engine.load(self.spec.model, **opts)
        try:
            out["adopted_files"] = engine.stats()["cache"]["adopted_files"]
            await greedy_turn(engine, warmup, 1)
            before = engine.stats()["cache"]["hit_tokens"]
            t, _, usage = await greedy_turn(engine, prompts["B0"] + b0 + prompts["B1"], gen)
            after = engine.stats()["cache"]["hit_tokens"]
            out["conversation_restart"] = t
            out["restart_hit_tokens"] = {k: after[k] - before[k] for k in after}
        finally:
            await engine.close()
        return out, {"A0": a0, "B0": b0}


# -- peers -------------------------------------------------------------------------------------


def load_peer(name: str, spec: CompareSpec, threads: int, dtype: str, workdir: Path) -> Any:
    """Constructs the peer (imports it). llama.cpp runs a GGUF model's own file, and a folder
    as a GGUF export of it; the other peers read Hugging Face folders only."""
    model_is_gguf = Path(spec.model).suffix == ".gguf"
    if model_is_gguf and name != "llama.cpp":
        raise ValueError(f"{name} reads Hugging Face folders, not GGUF files")
    if name == "transformers":
        from strata_rs.bench.peer_transformers import TransformersPeer

        return TransformersPeer(spec.model, threads)
    if name == "mistralrs":
        from strata_rs.bench.peer_mistralrs import MistralrsPeer

        return MistralrsPeer(spec.model, threads)
    if name == "llama.cpp":
        from strata_rs.bench.peer_llama_cpp import LlamaCppPeer

        gguf = spec.gguf or (Path(spec.model) if model_is_gguf else None)
        if gguf is None:
            from strata_rs.bench.gguf_export import export_gguf

            gguf = export_gguf(spec.model, workdir / "model.gguf", dtype=dtype)
        need = max(
            [
                *spec.prefill,
                *(c + spec.steps + 1 for c in spec.decode_contexts),
                spec.history + 2 * spec.answer_tokens + spec.new_tokens + 1,
            ]
        )
        return LlamaCppPeer(gguf, threads, need)
    raise ValueError(f"unknown peer {name!r}; choose from {', '.join(PEERS)}")


def _peer_conversation(
    peer: Any,
    prompts: dict[str, list[int]],
    answers: dict[str, list[int]],
    gen: int,
    warmup: list[int],
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    restart_na = peer.na.get("conversation_restart")
    peer.turn("A", prompts["A0"], gen)
    peer.turn("B", prompts["B0"], gen)
    if restart_na is None:
        peer.save("B")
    returning = prompts["A0"] + answers["A0"] + prompts["A1"]
    out["conversation_returning"] = peer.turn("A", returning, gen)
    out["returning_cached_tokens"] = getattr(peer, "last_cached_tokens", None)
    out["conversation_cold"] = peer.cold_ttft(returning)
    if restart_na is None:
        peer.restart(warmup)
        out["conversation_restart"] = peer.turn(
            "B", prompts["B0"] + answers["B0"] + prompts["B1"], gen
        )
        out["restart_cached_tokens"] = getattr(peer, "last_cached_tokens", None)
    return out


# -- the run -----------------------------------------------------------------------------------


async def run_compare(
    spec: CompareSpec,
    progress_stream: Any = None,
    *,
    tty: bool | None = None,
) -> dict[str, Any]:
    """Runs every scenario group round by round, strata-rs then each installed peer; returns
    the rounds, the medians, the ratios, the n/a reasons and the machine. Progress goes to
    `progress_stream` (default stderr; `tty` None: ask the stream)."""
    machine = machine_info()
    available: list[str] = []
    skipped: dict[str, str] = {}
    for name in spec.peers:
        reason = missing(name)
        if reason is None:
            available.append(name)
        else:
            skipped[name] = reason
    engines = [US, *available]
    grps = groups(spec)
    need_bandwidth = not ("prefill" in spec.scenarios or "decode" in spec.scenarios)
    total = len(engines) + spec.rounds * (len(grps) * len(engines) + int(need_bandwidth))
    progress = Progress(total, progress_stream, tty=tty)
    for name, reason in skipped.items():
        progress.note(skip_line(name, reason))

    rows = metric_rows(spec)
    runs: dict[str, list[dict[str, Any]]] = {e: [] for e in engines}
    na: dict[str, dict[str, str]] = {e: {} for e in engines}
    peers: dict[str, Any] = {}
    versions: dict[str, str] = {}
    strata_runs: list[dict[str, Any]] = []
    tmp = tempfile.TemporaryDirectory(prefix="strata-compare-")
    workdir = Path(tmp.name)
    engine: Engine | None = None
    try:
        progress.step(f"loading {US}")
        engine = await _load_engine(spec)
        strata = _Strata(spec, engine)
        info = engine.info
        threads = int(info["threads"])
        versions[US] = _our_version()
        vocab = int(info["vocab_size"])
        tok = engine.tokenizer
        warm = canonical_ids(tok, WARMUP_TOKENS, np.random.default_rng(99))
        for name in available:
            progress.step(f"loading {name}")
            try:
                peer = load_peer(name, spec, threads, str(info["dtype"]), workdir)
                peer.warmup(canonical_ids(tok, 64, np.random.default_rng(98)))
            except Exception as e:  # a peer that cannot load is reported, the run goes on
                reason = f"failed to load: {type(e).__name__}: {e}"
                progress.note(f"{name}: {reason}")
                na[name] = {key: reason for key, _, _ in rows}
                skipped[name] = reason
                continue
            peers[name] = peer
            versions[name] = peer.version
            na[name].update({k: v for k, v in peer.na.items() if k in {r[0] for r in rows}})

        prompts = {
            "prefill": {n: prefill_ids(n, vocab) for n in spec.prefill},
            "decode": {c: decode_ids(c, vocab) for c in spec.decode_contexts},
        }
        # Same lengths for an engine that takes text (rust/bench.rs's ids do not survive it).
        text_prompts = {
            "prefill": {
                n: canonical_ids(tok, n, np.random.default_rng(PREFILL_SEED + n))
                for n in spec.prefill
            },
            "decode": {
                c: canonical_ids(tok, c, np.random.default_rng(DECODE_SEED + c))
                for c in spec.decode_contexts
            },
        }
        for r in range(1, spec.rounds + 1):
            figures: dict[str, dict[str, Any]] = {e: {} for e in engines}
            label = f"round {r}/{spec.rounds}"
            for group in grps:
                inputs = _group_inputs(group, spec, tok, r)
                for name in engines:
                    progress.step(f"{label}, {name}: {group}")
                    if name != US and name not in peers:
                        continue  # failed to load: its n/a reason is already set
                    try:
                        if name == US:
                            got = await _run_ours(
                                strata, group, spec, inputs, workdir / f"kv-{r}", warm
                            )
                            if "_bench" in got:
                                strata_runs.append(got.pop("_bench"))
                        else:
                            peer = peers[name]
                            fixed = prompts if peer.takes_token_ids else text_prompts
                            got = _run_peer(peer, group, spec, fixed, inputs, warm)
                    except Exception as e:  # one failed measurement must not end the run
                        reason = f"failed in {label}: {type(e).__name__}: {e}"
                        progress.note(f"{name}, {group}: {reason}")
                        for key in _group_keys(group, rows):
                            na[name].setdefault(key, reason)
                        continue
                    figures[name].update(got)
            if need_bandwidth:
                progress.step(f"{label}, {US}: read bandwidth")
                strata_runs.append(await strata.bandwidth())
            for name in engines:
                runs[name].append(figures[name])
    finally:
        progress.done()
        for peer in peers.values():
            peer.close()
        if engine is not None:
            await engine.close()
        tmp.cleanup()
    machine["load_end"] = os.getloadavg()[0]
    return summarize(spec, info, machine, engines, versions, runs, na, skipped, strata_runs)


def _group_inputs(group: str, spec: CompareSpec, tok: TextTokenizer, r: int) -> dict[str, Any]:
    """The prompts of one group in round r, the same for every engine."""
    if group.startswith("streams"):
        return {
            "streams": {
                s: stream_prompts(s, spec.stream_prompt, tok, seed=1000 * r + s)
                for s in spec.streams
            }
        }
    if group == "conversation":
        rng = np.random.default_rng(7000 + r)
        return {
            "conversation": {
                "A0": canonical_ids(tok, spec.history, rng),
                "B0": canonical_ids(tok, spec.history, rng),
                "A1": canonical_ids(tok, spec.new_tokens, rng),
                "B1": canonical_ids(tok, spec.new_tokens, rng),
            }
        }
    return {}


def _group_keys(group: str, rows: list[tuple[str, str, str]]) -> list[str]:
    if group.startswith("streams"):
        prefix = ("streams_",)
    elif group == "conversation":
        prefix = ("conversation_",)
    else:
        prefix = ("prefill_", "decode_")
    return [k for k, _, _ in rows if k.startswith(prefix)]


async def _run_ours(
    strata: _Strata,
    group: str,
    spec: CompareSpec,
    inputs: dict[str, Any],
    disk_dir: Path,
    warm: list[int],
) -> dict[str, Any]:
    if group.startswith("streams"):
        return {f"streams_{s}": await strata.streams(p) for s, p in inputs["streams"].items()}
    if group == "conversation":
        figures, answers = await strata.conversation(
            inputs["conversation"], spec.disk_dir or disk_dir, warm
        )
        inputs["answers"] = answers  # the peers' prompts include strata-rs's answers
        return figures
    bench = await strata.prefill_decode()
    out: dict[str, Any] = {f"prefill_{n}": v for n, v in bench["prefill_tok_s"].items()}
    out.update({f"decode_{c}": v for c, v in bench["decode_tok_s"].items()})
    out["_bench"] = bench
    return out


def _run_peer(
    peer: Any,
    group: str,
    spec: CompareSpec,
    prompts: dict[str, dict[int, list[int]]],
    inputs: dict[str, Any],
    warm: list[int],
) -> dict[str, Any]:
    if group.startswith("streams"):
        return {
            f"streams_{s}": peer.streams(p, spec.stream_tokens)
            for s, p in inputs["streams"].items()
        }
    if group == "conversation":
        if "answers" not in inputs:
            raise RuntimeError(
                "strata-rs's conversation failed, and every engine's prompts include its answers"
            )
        return _peer_conversation(
            peer, inputs["conversation"], inputs["answers"], spec.answer_tokens, warm
        )
    r = peer.prefill_decode(
        prompts["prefill"] if "prefill" in spec.scenarios else {},
        prompts["decode"] if "decode" in spec.scenarios else {},
        spec.steps,
        spec.repeats,
    )
    out: dict[str, Any] = {f"prefill_{n}": v for n, v in r["prefill_tok_s"].items()}
    out.update({f"decode_{c}": v for c, v in r["decode_tok_s"].items()})
    if "prompt_tokens" in r:
        out["prompt_tokens"] = r["prompt_tokens"]
    return out


async def _load_engine(spec: CompareSpec) -> Engine:
    """The engine of the prefill/decode/streams groups: context for the longest prefill or
    decode, a batch of the most streams, and a pool that holds them all."""
    need = max(
        [
            *spec.prefill,
            *(c + spec.steps for c in spec.decode_contexts),
            spec.stream_prompt + spec.stream_tokens,
        ]
    )
    opts: dict[str, Any] = {
        "device": spec.device,
        "threads": spec.threads,
        "max_context": need,
        "max_batch": max([8, *spec.streams]),
        # No disk tier: a run's prompts would be restored by the next run.
        "disk_cache_mib": 0,
        "quantize": spec.quantize,
        "bf16_dot": spec.bf16_dot,
    }
    engine = await Engine.load(spec.model, **opts)
    info = engine.info
    bs = int(info["block_size"])
    stream_blocks = max(spec.streams) * -(-(spec.stream_prompt + spec.stream_tokens) // bs)
    if int(info["kv_blocks"]) >= stream_blocks + 1:
        return engine
    await engine.close()
    mib = math.ceil((stream_blocks + 2) * int(info["kv_block_bytes"]) / 2**20)
    return await Engine.load(spec.model, **opts, kv_memory_mib=mib)


def _our_version() -> str:
    from strata_rs import __version__

    return __version__


# -- medians, ratios ---------------------------------------------------------------------------


def summarize(
    spec: CompareSpec,
    info: dict[str, Any],
    machine: dict[str, Any],
    engines: list[str],
    versions: dict[str, str],
    runs: dict[str, list[dict[str, Any]]],
    na: dict[str, dict[str, str]],
    skipped: dict[str, str],
    strata_runs: list[dict[str, Any]],
) -> dict[str, Any]:
    rows = metric_rows(spec)
    medians: dict[str, dict[str, float | None]] = {}
    for e in engines:
        medians[e] = {}
        for key, _, _ in rows:
            values = [float(f[key]) for f in runs[e] if f.get(key) is not None]
            medians[e][key] = statistics.median(values) if values else None
            if not values and key not in na[e]:
                na[e][key] = "not measured"
    units = {key: unit for key, _, unit in rows}
    ratios: dict[str, dict[str, float | None]] = {}
    for e in engines[1:]:
        ratios[e] = {}
        for key, _, unit in rows:
            ours, theirs = medians[US][key], medians[e][key]
            if ours is None or theirs is None or ours <= 0 or theirs <= 0:
                ratios[e][key] = None
            else:
                ratios[e][key] = ours / theirs if unit == "tok/s" else theirs / ours
    sizes = sorted({int(size) for run in strata_runs for size in run["read_bandwidth_gb_s"]})
    bandwidth = {
        size: statistics.median(
            float(run["read_bandwidth_gb_s"][size])
            for run in strata_runs
            if size in run["read_bandwidth_gb_s"]
        )
        for size in sizes
    }
    weight_bytes = next(
        (int(r["decode_weight_bytes"]) for r in strata_runs if "decode_weight_bytes" in r), None
    )
    ceiling = None
    if bandwidth:
        ceiling = bandwidth.get(weight_bytes or -1) or next(iter(bandwidth.values()))
    bound: dict[str, dict[str, float]] = {}
    if ceiling and weight_bytes:
        for e in engines:
            bound[e] = {
                key: weight_bytes * v / 1e9 / ceiling
                for key, v in medians[e].items()
                if key.startswith("decode_") and v is not None
            }
    return {
        "engine": info,
        "machine": machine,
        "spec": {k: (str(v) if isinstance(v, Path) else v) for k, v in spec.__dict__.items()},
        "engines": engines,
        "versions": versions,
        "peers": {name: _peer_status(name, skipped, versions, na) for name in spec.peers},
        "rows": [{"key": k, "label": label, "unit": u} for k, label, u in rows],
        "units": units,
        "medians": medians,
        "ratios": ratios,
        "na": na,
        "read_bandwidth_gb_s": bandwidth,
        "decode_weight_bytes": weight_bytes,
        "decode_fraction_of_bandwidth": bound,
        "rounds": runs,
    }


def _peer_status(
    name: str, skipped: dict[str, str], versions: dict[str, str], na: dict[str, dict[str, str]]
) -> dict[str, Any]:
    if name in versions:
        return {"status": "ran", "version": versions[name], "na": na.get(name, {})}
    if skipped.get(name, "").startswith("failed to load"):
        return {"status": "failed", "reason": skipped[name]}
    return {"status": "skipped", "reason": skipped.get(name), "install": INSTALL[name]}


# -- the table ---------------------------------------------------------------------------------


def _cell(value: float | None, unit: str) -> str:
    if value is None:
        return "n/a"
    if unit == "s":
        return f"{value * 1e3:.1f} ms"
    return f"{value:.1f}"


def format_table(r: dict[str, Any]) -> list[str]:
    """The compare table's lines: medians per engine, each peer's ratio, n/a reasons below."""
    engines: list[str] = r["engines"]
    m = r["machine"]
    info = r["engine"]
    lines = [
        f"machine: {m['cpu']}, {m['cpus']} CPUs, {m['memory_gib']} GiB; load "
        f"{m['load_start']:.1f} -> {m.get('load_end', float('nan')):.1f}; {m['date']}",
        f"model {info['model_dir']} ({info['model_type']}, {info['dtype']}, "
        f"{info['num_layers']} layers), {info['threads']} threads; medians of "
        f"{len(r['rounds'][engines[0]])} interleaved rounds",
        "engines: " + ", ".join(f"{e} {r['versions'].get(e, '')}".strip() for e in engines),
    ]
    head = f"{'':40}{US:>12}"
    for e in engines[1:]:
        head += f"{e[:14]:>15}{'x':>7}"
    lines.append(head)
    notes: dict[str, int] = {}
    note_lines: list[str] = []
    for row in r["rows"]:
        key, label, unit = row["key"], row["label"], row["unit"]
        shown = f"{label} ({'ms' if unit == 's' else unit})"
        line = f"{shown[:40]:40}"
        for e in engines:
            value = r["medians"][e].get(key)
            cell = _cell(value, unit)
            if value is None:
                reason = r["na"][e].get(key, "not measured")
                if reason not in notes:
                    notes[reason] = len(notes) + 1
                    note_lines.append(f"  [{notes[reason]}] {reason}")
                cell = f"n/a[{notes[reason]}]"
            if e == US:
                line += f"{cell:>12}"
            else:
                ratio = r["ratios"][e].get(key)
                line += f"{cell:>15}{(f'{ratio:.2f}' if ratio is not None else '-'):>7}"
        lines.append(line)
    bw = r["read_bandwidth_gb_s"]
    if bw:
        lines.append(
            "read bandwidth (same run): "
            + ", ".join(f"{gbs:.1f} GB/s over {size / 2**20:.0f} MiB" for size, gbs in bw.items())
        )
    for e, fractions in r["decode_fraction_of_bandwidth"].items():
        if fractions:
            lines.append(
                f"{e}: decode reads weights at "
                + ", ".join(
                    f"{frac:.0%} of it (context {k.split('_')[1]})" for k, frac in fractions.items()
                )
            )
    if len(engines) > 1:
        lines.append(
            "x: how many times faster strata-rs is (tok/s: ours / theirs; TTFT: theirs / ours)"
        )
    if note_lines:
        lines.append("n/a:")
        lines += note_lines
    return lines


def print_compare(r: dict[str, Any]) -> None:
    for line in format_table(r):
        print(line)


def write_plot(r: dict[str, Any], path: str | Path, title: str = "") -> Path:
    """PNG (or any format matplotlib writes) with two panels: each peer's ratio per figure
    (log scale, 1 = parity) and the conversation's TTFT per round and kind, per engine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines: list[str] = r["engines"]
    rows = r["rows"]
    peers = engines[1:]
    conv_keys = [
        ("conversation_cold", "cold"),
        ("conversation_returning", "returning"),
        ("conversation_restart", "after restart"),
    ]
    has_conv = any(row["key"].startswith("conversation_") for row in rows)
    fig, axes = plt.subplots(1, 2 if has_conv else 1, figsize=(13 if has_conv else 7, 6.5))
    ax_ratio = axes[0] if has_conv else axes
    labels = [row["label"] for row in rows]
    y = np.arange(len(rows))
    height = 0.8 / max(1, len(peers))
    for j, peer in enumerate(peers):
        values = [r["ratios"][peer].get(row["key"]) for row in rows]
        ys = [yy + j * height for yy, v in zip(y, values, strict=True) if v is not None]
        xs = [v for v in values if v is not None]
        bars = ax_ratio.barh(ys, xs, height=height, label=f"vs {peer}", color=f"C{j + 1}")
        ax_ratio.bar_label(bars, labels=[f"{v:.2f}" for v in xs], fontsize=7, padding=2)
        for yy, v in zip(y, values, strict=True):
            if v is None:
                ax_ratio.text(1.0, yy + j * height, f" n/a ({peer})", va="center", fontsize=7)
    ax_ratio.axvline(1.0, color="black", linewidth=1)
    ax_ratio.set_xscale("log")
    ax_ratio.set_yticks(y + height * (len(peers) - 1) / 2)
    ax_ratio.set_yticklabels(labels, fontsize=8)
    ax_ratio.set_ylim(len(rows), -0.5)  # first row on top, room below the last
    ax_ratio.set_xlabel("strata-rs speed / peer speed (> 1: strata-rs faster; log scale)")
    if peers:
        ax_ratio.legend(fontsize=8, loc="lower right")
    if has_conv:
        ax = axes[1]
        markers = {"cold": "o", "returning": "s", "after restart": "^"}
        for e in engines:
            for key, kind in conv_keys:
                pts = [
                    (i * len(conv_keys) + k + 1, f[key] * 1e3)
                    for i, f in enumerate(r["rounds"][e])
                    for k, (kk, _) in enumerate(conv_keys)
                    if kk == key and f.get(key) is not None
                ]
                if pts:
                    xs, ys2 = zip(*pts, strict=True)
                    ax.plot(
                        xs,
                        ys2,
                        marker=markers[kind],
                        linestyle="none",
                        label=f"{e}: {kind}",
                        color="C0" if e == US else f"C{engines.index(e)}",
                    )
        ax.set_yscale("log")
        ax.set_ylabel("time to first token (ms, log scale)")
        ax.set_xlabel("turn (per round: cold, returning, after restart)")
        ax.set_xticks(range(1, len(conv_keys) * len(r["rounds"][engines[0]]) + 1))
        ax.grid(True, axis="y", color="#ddd")
        ax.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    fig.suptitle(title or "strata-rs and its peers, same weights, same run")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
