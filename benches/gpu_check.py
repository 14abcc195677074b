"""The GPU checks of the CUDA backend, in one run on a machine with an NVIDIA GPU.

Imports the installed strata-rs wheel (nothing is built there) and runs, on `--device`
(default cuda:0), each against the CPU or the machine's limit measured in the same run:

1. logits: every family's tiny preset (f32 and bf16) against the CPU engine, every position of a
   64-token prompt; and 32 greedy tokens from both;
2. decode: tok/s of smollm-135m and of llama-1b (Llama-3.2-1B's shape), bf16, at batch 1, 8 and
   32; batch 1's weight bytes per second against the device-to-device copy bandwidth (torch, when
   installed, else cupy) measured in the same run;
3. graphs: the graph cache's count and bytes after those runs, and under `--soak-seconds` of
   random batch sizes: never above its bounds;
4. cache: a device -> host -> device round trip: conversations that leave the device pool and
   come back, their restore bandwidth against the pinned host-to-device copy bandwidth, and their
   greedy output against a cold engine;
5. faults: the conversation cache's fault kinds injected at every move, on the device: each
   request still right, the engine still serving, the faults counted;
6. with `--rust-tests DIR`: the carried Rust test binaries (the kernels against their CPU twins,
   the forward pass against the CPU's) with STRATA_REQUIRE_GPU=1.

Writes `gpu_check.json` and `gpu_check.md` into `--out`, and prints the summary. A check that
fails is reported as failed and the run goes on; the exit status is 1 when any failed.

`--device cpu --quick` runs the same flows on the CPU (no bandwidth ceilings, no Rust binaries):
the script's own test, where there is no GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np


def _find_cuda_libraries() -> None:
    """Points STRATA_NVRTC_PATH / STRATA_CUBLAS_PATH at the NVIDIA wheels of this Python (the
    machine's torch brings them), unless they are set already."""
    for env, name in (
        ("STRATA_NVRTC_PATH", "libnvrtc.so.*"),
        ("STRATA_CUBLAS_PATH", "libcublas.so.*"),
    ):
        if os.environ.get(env):
            continue
        found: list[str] = []
        for base in sys.path:
            found += glob.glob(os.path.join(base, "nvidia", "*", "lib", name))
        found = [f for f in found if f.rsplit(".so.", 1)[-1].isdigit()]
        if found:
            os.environ[env] = max(found, key=lambda f: int(f.rsplit(".so.", 1)[-1]))


_find_cuda_libraries()

from strata_rs import Engine  # noqa: E402
from strata_rs.testing.models import make_model  # noqa: E402

NO_TIERS = {"host_cache_mib": 0, "disk_cache_mib": 0}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Report:
    def __init__(self) -> None:
        self.results: dict[str, Any] = {}
        self.failed: list[str] = []

    async def check(self, name: str, fn: Callable[[], Awaitable[dict[str, Any]]]) -> None:
        log(f"== {name}")
        t0 = time.perf_counter()
        try:
            result = await fn()
            ok = bool(result.pop("ok", True))
        except Exception:  # a check that breaks is a failed check; the others still run
            result = {"error": traceback.format_exc()}
            ok = False
        result["ok"] = ok
        result["seconds"] = round(time.perf_counter() - t0, 2)
        self.results[name] = result
        if not ok:
            self.failed.append(name)
        log(f"   {'ok' if ok else 'FAILED'} ({result['seconds']} s): {json.dumps(result)[:600]}")


async def greedy(engine: Engine, prompt: list[int], n: int) -> list[int]:
    r = await engine.complete(prompt, max_tokens=n, temperature=0, ignore_eos=True)
    return list(r.token_ids)


def spread_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / max(float(want.max() - want.min()), 1e-30))


async def check_logits(device: str, models: Path) -> dict[str, Any]:
    """Every family's tiny preset on the device against the CPU."""
    rows = {}
    ok = True
    for family in ("llama", "mistral", "qwen2", "qwen3"):
        for dtype in ("f32", "bf16"):
            path = make_model(models / f"tiny-{family}-{dtype}", family, "tiny", dtype)
            prompt = [(i * 37 + 11) % 500 + 3 for i in range(64)]
            cpu = await Engine.load(path, device="cpu", max_batch_tokens=16, **NO_TIERS)
            try:
                want = await cpu.logits(prompt)
                want_tokens = await greedy(cpu, prompt[:20], 32)
            finally:
                await cpu.close()
            gpu = await Engine.load(path, device=device, max_batch_tokens=16, **NO_TIERS)
            try:
                got = await gpu.logits(prompt)
                got_tokens = await greedy(gpu, prompt[:20], 32)
            finally:
                await gpu.close()
            error = spread_error(got, want)
            agree = int((got.argmax(axis=1) == want.argmax(axis=1)).sum())
            same_prefix = next(
                (i for i, (a, b) in enumerate(zip(got_tokens, want_tokens, strict=True)) if a != b),
                32,
            )
            # Tolerances as tests/rust/gpu_forward.rs states them.
            good = error <= (2e-4 if dtype == "f32" else 5e-2) and agree >= (
                64 if dtype == "f32" else 57
            )
            ok &= good
            rows[f"{family} {dtype}"] = {
                "error_of_spread": error,
                "argmax_agree_of_64": agree,
                "greedy_tokens_equal_before_first_difference": same_prefix,
                "ok": good,
            }
    return {"ok": ok, "models": rows}


def copy_bandwidth_gb_s() -> dict[str, float]:
    """Device-to-device (bytes read + written) and pinned host-to-device copy bandwidth."""
    try:
        import torch
    except ImportError:
        return {}
    if not torch.cuda.is_available():
        return {}
    out = {}
    n = 2 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        b.copy_(a)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    out["device_copy_read_plus_write"] = 2 * n / float(np.median(times)) / 1e9
    host = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
    dev = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(5):
        start.record()
        dev.copy_(host, non_blocking=True)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    out["pinned_host_to_device"] = (1 << 30) / float(np.median(times)) / 1e9
    times = []
    for _ in range(5):
        start.record()
        host.copy_(dev, non_blocking=True)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    out["pinned_device_to_host"] = (1 << 30) / float(np.median(times)) / 1e9
    del a, b, host, dev
    torch.cuda.empty_cache()
    return out


async def aggregate_decode(engine: Engine, streams: int, tokens: int) -> float:
    """Decode tok/s of `streams` sequences at once (after their prefill)."""

    async def one(seed: int) -> int:
        prompt = [(seed * 7919 + i * 31) % 40000 + 300 for i in range(64)]
        n = 0
        async for chunk in engine.generate(
            prompt, max_tokens=tokens, ignore_eos=True, temperature=0
        ):
            n += len(chunk.token_ids)
        return n

    await asyncio.gather(*(one(s) for s in range(streams)))  # warm-up: graphs, prefix cache
    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(s + 1000) for s in range(streams)))
    return sum(counts) / (time.perf_counter() - t0)


async def check_decode(
    device: str, models: Path, quick: bool, ceilings: dict[str, float]
) -> dict[str, Any]:
    presets = ["smollm-135m"] if quick else ["smollm-135m", "llama-1b"]
    batches = [1, 8] if quick else [1, 8, 32]
    out: dict[str, Any] = {}
    ok = True
    for preset in presets:
        log(f"   making {preset} bf16")
        path = make_model(models / preset, "llama", preset, "bf16")
        engine = await Engine.load(
            path, device=device, max_batch=max(batches), max_context=4096, **NO_TIERS
        )
        try:
            bench = await engine.benchmark(
                prefill_lens=[512], decode_contexts=[512], decode_steps=64, repeats=3
            )
            row: dict[str, Any] = {
                "prefill_512_tok_s": bench["prefill_tok_s"][512],
                "decode_batch1_ctx512_tok_s": bench["decode_tok_s"][512],
                "decode_weight_bytes": bench["decode_weight_bytes"],
            }
            bw = bench["decode_tok_s"][512] * bench["decode_weight_bytes"] / 1e9
            row["batch1_weight_gb_s"] = bw
            if "device_copy_read_plus_write" in ceilings:
                row["batch1_of_copy_bandwidth"] = bw / ceilings["device_copy_read_plus_write"]
            for b in batches:
                row[f"aggregate_decode_batch{b}_tok_s"] = await aggregate_decode(
                    engine, b, 16 if quick else 128
                )
            row["graphs"] = engine.stats()["graphs"]
            row["memory"] = engine.stats()["memory"]
        finally:
            await engine.close()
        if preset == "llama-1b" and "batch1_of_copy_bandwidth" in row:
            row["target_batch1_at_least_0.7_of_bandwidth"] = row["batch1_of_copy_bandwidth"] >= 0.7
        out[preset] = row
    return {"ok": ok, **out}


async def check_graph_bounds(device: str, models: Path, seconds: float) -> dict[str, Any]:
    """Random batch sizes for `seconds`: the graph cache never holds more than its bounds."""
    path = make_model(models / "tiny-graphs", "llama", "tiny", "bf16")
    engine = await Engine.load(path, device=device, max_batch=32, **NO_TIERS)
    rng = random.Random(5)
    worst = {"graphs": 0, "bytes": 0}
    steps = 0
    try:
        t_end = time.perf_counter() + seconds
        while time.perf_counter() < t_end:
            n = rng.randint(1, 32)
            await asyncio.gather(
                *(
                    greedy(
                        engine,
                        [rng.randrange(3, 500) for _ in range(rng.randint(1, 40))],
                        rng.randint(1, 12),
                    )
                    for _ in range(n)
                )
            )
            g = engine.stats()["graphs"]
            worst = {k: max(worst[k], g[k]) for k in worst}
            steps += 1
        g = engine.stats()["graphs"]
        pool = engine.stats()["memory"]
    finally:
        await engine.close()
    budget = 256 << 20
    ok = worst["graphs"] <= 6 and worst["bytes"] <= budget  # padded sizes of 32: 1,2,4,8,16,32
    return {"ok": ok, "rounds": steps, "worst": worst, "final": g, "memory": pool}


HISTORY, NEW, ANSWER, ROUNDS = 1500, 40, 8, 3  # --quick: 400-token histories
# smollm-135m's K/V per 16-token block (30 layers, 3 K/V heads of 64, f16).
SMOLLM_BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 2


def _mib_for(histories: float) -> int:
    blocks = histories * (HISTORY + ROUNDS * (NEW + ANSWER)) / 16
    return -(-int(blocks * SMOLLM_BLOCK_BYTES) // (1 << 20))


async def conversation_run(
    path: Path, device: str, faults: str | None, tiers: bool, host_mib: int = 1024
) -> tuple[list[list[int]], dict[str, Any]]:
    """4 conversations of `HISTORY` tokens alternate, `ROUNDS` rounds of 8 greedy tokens and 40 new
    ones. With `tiers`, through a device pool that holds about 2 of them, so each returns from
    the host tier (or disk); without, a pool that holds all 4 and no tiers: the reference, where
    nothing moves and every turn computes the same rows as a restored one (the same full blocks
    hit, the same rest prefilled). `host_mib` 0 sends every move through the disk tier. Returns
    every answer and the engine's stats."""
    if tiers:
        kwargs: dict[str, Any] = {
            "host_cache_mib": host_mib,
            "disk_cache_dir": tempfile.mkdtemp(prefix="gpu-check-kv-"),
            "disk_cache_mib": 2048,
            "kv_memory_mib": _mib_for(2.2),
        }
        if faults:
            kwargs["cache_faults"] = faults
    else:
        kwargs = {**NO_TIERS, "kv_memory_mib": _mib_for(4.5)}
    engine = await Engine.load(path, device=device, max_batch=2, max_context=4096, **kwargs)
    histories = [[(c * 7919 + i * 31) % 40000 + 300 for i in range(HISTORY)] for c in range(4)]
    answers = []
    try:
        for r in range(ROUNDS):
            for c in range(4):
                tokens = await greedy(engine, histories[c], ANSWER)
                answers.append(tokens)
                new = [(c * 131 + r * 17 + i * 7) % 40000 + 300 for i in range(NEW)]
                histories[c] = histories[c] + tokens + new
        stats = engine.stats()
    finally:
        await engine.close()
    return answers, stats


def _smollm(models: Path) -> Path:
    path = models / "smollm-cache"
    return path if path.exists() else make_model(path, "llama", "smollm-135m", "bf16")


def _equal(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b, strict=True))


async def check_cache(device: str, models: Path, ceilings: dict[str, float]) -> dict[str, Any]:
    path = _smollm(models)
    answers, stats = await conversation_run(path, device, None, tiers=True)
    want, _ = await conversation_run(path, device, None, tiers=False)
    restore = stats["cache"]["last_restore"] or {}
    seconds = restore.get("seconds")
    gb_s = restore["bytes"] / seconds / 1e9 if seconds else None
    out: dict[str, Any] = {
        "answers_equal_reference": _equal(answers, want),
        "turns": len(want),
        "hit_tokens": stats["cache"]["hit_tokens"],
        "moves": stats["cache"]["moves"],
        "last_restore": restore,
        "restore_gb_s": gb_s,
        "copy_streams": stats["copy_streams"],
    }
    if gb_s and "pinned_host_to_device" in ceilings:
        out["restore_of_pinned_copy"] = gb_s / ceilings["pinned_host_to_device"]
        out["target_at_least_0.7_of_pinned"] = out["restore_of_pinned_copy"] >= 0.7
    out["ok"] = (
        out["answers_equal_reference"] == out["turns"] and stats["cache"]["hit_tokens"]["host"] > 0
    )
    return out


# Each fault kind, with the host tier's budget that makes its moves happen (writes and reads are
# the disk tier's: without a host tier every move goes through them).
FAULTS = (
    ("alloc:3", 1024),
    ("copy_out:2-40", 1024),
    ("copy_in:1-30", 1024),
    ("ram_gate:*", 1024),
    ("write:2-20", 0),
    ("read:*", 0),
    ("copy_out:30%,copy_in:30%,read:30%,write:30%", 0),
)


async def check_faults(device: str, models: Path) -> dict[str, Any]:
    path = _smollm(models)
    want, _ = await conversation_run(path, device, None, tiers=False)
    out: dict[str, Any] = {}
    ok = True
    for faults, host_mib in FAULTS:
        answers, stats = await conversation_run(path, device, faults, True, host_mib)
        equal = _equal(answers, want)
        injected = stats["cache"]["faults_injected"]
        good = equal == len(want) and stats["stopped"] is None and sum(injected.values()) > 0
        ok &= good
        out[faults] = {
            "answers_equal_reference": equal,
            "turns": len(want),
            "faults_injected": injected,
            "ok": good,
        }
    return {"ok": ok, **out}


def run_rust_tests(directory: Path) -> dict[str, Any]:
    env = dict(os.environ, STRATA_REQUIRE_GPU="1", STRATA_REQUIRE_NVRTC="1")
    out: dict[str, Any] = {}
    ok = True
    for binary in sorted(directory.iterdir()):
        if not os.access(binary, os.X_OK) or binary.is_dir():
            continue
        # The library's tests: only the GPU ones (the rest ran in CI).
        filters = ["device::cuda"] if binary.name.startswith("strata_rs") else []
        p = subprocess.run(
            # The GPU tests are #[ignore]d (cargo reports them so on machines without a GPU).
            [str(binary), *filters, "--include-ignored", "--test-threads=1"],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        tail = (p.stdout + p.stderr)[-4000:]
        out[binary.name] = {"returncode": p.returncode, "tail": tail}
        ok &= p.returncode == 0
    return {"ok": ok, **out}


def markdown(report: Report, header: dict[str, Any]) -> str:
    lines = ["# gpu_check", "", "```", json.dumps(header, indent=2), "```", ""]
    for name, result in report.results.items():
        lines += [
            f"## {name}: {'ok' if result['ok'] else 'FAILED'}",
            "",
            "```",
            json.dumps(result, indent=2, default=str)[:20000],
            "```",
            "",
        ]
    return "\n".join(lines)


async def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--quick", action="store_true", help="smaller models and fewer batches")
    ap.add_argument(
        "--soak-seconds", type=float, default=60.0, help="random batch sizes for the graph bounds"
    )
    ap.add_argument(
        "--rust-tests", type=Path, default=None, help="folder of carried Rust test binaries"
    )
    ap.add_argument("--only", default=None, help="comma-separated checks to run")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.quick:
        global HISTORY
        HISTORY = 400
    import strata_rs

    header: dict[str, Any] = {
        "device": args.device,
        "cuda_devices": [
            dict(d) if isinstance(d, dict) else str(d) for d in strata_rs.cuda_devices()
        ],
        "STRATA_NVRTC_PATH": os.environ.get("STRATA_NVRTC_PATH"),
        "STRATA_CUBLAS_PATH": os.environ.get("STRATA_CUBLAS_PATH"),
    }
    try:
        header["nvidia_smi"] = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                "--format=csv",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        header["nvidia_smi"] = f"not available: {e}"
    log(json.dumps(header))
    ceilings = copy_bandwidth_gb_s() if args.device.startswith("cuda") else {}
    header["ceilings_gb_s"] = ceilings
    only = set(args.only.split(",")) if args.only else None
    report = Report()
    models = Path(tempfile.mkdtemp(prefix="gpu-check-models-"))
    checks: list[tuple[str, Callable[[], Awaitable[dict[str, Any]]]]] = [
        ("logits", lambda: check_logits(args.device, models)),
        ("decode", lambda: check_decode(args.device, models, args.quick, ceilings)),
        ("graphs", lambda: check_graph_bounds(args.device, models, args.soak_seconds)),
        ("cache", lambda: check_cache(args.device, models, ceilings)),
        ("faults", lambda: check_faults(args.device, models)),
    ]
    if args.rust_tests:
        rust_dir = args.rust_tests

        async def rust() -> dict[str, Any]:
            return run_rust_tests(rust_dir)

        checks.insert(0, ("rust_tests", rust))
    for name, fn in checks:
        if only is None or name in only:
            await report.check(name, fn)
    (args.out / "gpu_check.json").write_text(
        json.dumps({"header": header, **report.results}, indent=2, default=str)
    )
    (args.out / "gpu_check.md").write_text(markdown(report, header))
    log(f"failed: {report.failed}" if report.failed else "all checks passed")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
