"""The ``strata-rs`` command: serve, make-model, bench, info."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="strata-rs",
        description="strata-rs: an LLM inference engine with a tiered conversation cache.",
    )
    sub = p.add_subparsers(dest="command", required=True)

    m = sub.add_parser("make-model", help="write a random-weight model folder (for tests, demos)")
    m.add_argument("out", type=Path, help="folder to write")
    m.add_argument("--family", choices=("llama", "mistral", "qwen2", "qwen3"), default="llama")
    m.add_argument("--preset", choices=("tiny", "smollm-135m"), default="tiny")
    m.add_argument("--dtype", choices=("f32", "bf16", "f16"), default="f32")
    m.add_argument("--seed", type=int, default=0)

    b = sub.add_parser("bench", help="time prefill and decode of a model on this machine")
    b.add_argument("--model", type=Path, required=True, help="Hugging Face model folder")
    b.add_argument("--device", default="cpu")
    b.add_argument("--threads", type=int, default=None, help="compute threads (default: all cores)")
    b.add_argument("--prefill", type=_int_list, default=[512, 2048], help="prompt lengths")
    b.add_argument(
        "--decode-context", type=_int_list, default=[512, 2048], help="contexts to decode at"
    )
    b.add_argument("--steps", type=int, default=32, help="decode steps timed per context")
    b.add_argument("--repeats", type=int, default=3, help="repeats per prefill (median shown)")
    b.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    b.add_argument(
        "--compare",
        choices=("llama.cpp",),
        default=None,
        help="also run this peer on the same weights, interleaved with strata-rs round by round",
    )
    b.add_argument("--rounds", type=int, default=3, help="interleaved rounds with --compare")
    b.add_argument(
        "--http",
        action="store_true",
        help="also run 16 streams through the Python API and through the HTTP server on loopback, "
        "interleaved, and compare tokens/s and TTFT",
    )
    b.add_argument(
        "--serving",
        action="store_true",
        help="also time the async API: aggregate decode with 1/2/4/8 streams, TTFT under load, "
        "the Python stream's per-token overhead",
    )
    b.add_argument(
        "--conversations",
        type=int,
        nargs="?",
        const=4,
        default=None,
        metavar="N",
        help="instead of prefill/decode: N conversations (default 4) return in turn through "
        "max_batch=2; TTFT of returning turns from the host tier, from disk after a restart, and "
        "cold (--rounds returning rounds; with --compare llama.cpp, its RAM prompt cache too)",
    )
    b.add_argument(
        "--history", type=int, default=2400, help="with --conversations: history tokens each"
    )
    b.add_argument(
        "--new-tokens", type=int, default=60, help="with --conversations: new tokens per turn"
    )
    b.add_argument(
        "--disk-dir",
        type=Path,
        default=None,
        help="with --conversations: the disk tier's folder, emptied first (default: a temp dir)",
    )
    b.add_argument(
        "--gguf",
        type=Path,
        default=None,
        help="with --compare llama.cpp: use this GGUF of the model instead of exporting one",
    )
    b.add_argument(
        "--plot", type=Path, default=None, help="with --conversations: write an SVG plot here"
    )

    s = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server (without --model: the built-in demo model)",
    )
    s.add_argument(
        "--model",
        type=Path,
        default=None,
        help="Hugging Face model folder (default: a tiny random-weight demo model)",
    )
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port)")
    s.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (default cpu)")
    s.add_argument("--max-batch", type=int, default=8, help="sequences decoding at once")
    s.add_argument(
        "--max-context", type=int, default=None, help="longest sequence (default: the model's)"
    )
    s.add_argument(
        "--kv-memory-mib",
        type=int,
        default=None,
        help="K/V pool budget (default: one max-context sequence, at most 2 GiB)",
    )
    s.add_argument(
        "--max-batch-tokens", type=int, default=512, help="tokens per step (prefill chunk size)"
    )
    s.add_argument(
        "--max-waiting", type=int, default=256, help="queued requests before 503 (default 256)"
    )
    s.add_argument("--threads", type=int, default=None, help="compute threads (default: all cores)")
    s.add_argument(
        "--host-cache-mib",
        type=int,
        default=4096,
        help="host RAM tier of the conversation cache: budget in MiB (default 4096; 0: off)",
    )
    s.add_argument(
        "--host-min-free-mib",
        type=int,
        default=1024,
        help="the host tier takes a copy only when this much RAM stays available after it "
        "(default 1024)",
    )
    s.add_argument(
        "--disk-cache-dir",
        type=Path,
        default=None,
        help="disk tier folder (default: $XDG_CACHE_HOME/strata-rs/kv or ~/.cache/strata-rs/kv)",
    )
    s.add_argument(
        "--disk-cache-mib",
        type=int,
        default=16384,
        help="disk tier budget in MiB (default 16384; 0: off)",
    )
    s.add_argument(
        "--disk-cache-days",
        type=float,
        default=7.0,
        help="disk tier files older than this are deleted at start (default 7; 0: start empty)",
    )
    s.add_argument(
        "--cache-faults",
        default=None,
        help="fault injection for tests, e.g. copy_in:2,read:* (kinds alloc, copy_out, copy_in, "
        "write, read; default: $STRATA_CACHE_FAULTS)",
    )
    s.add_argument(
        "--api-key",
        default=os.environ.get("STRATA_API_KEY"),
        help="require `Authorization: Bearer KEY` on every endpoint but /health "
        "(default: $STRATA_API_KEY)",
    )
    s.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send (default: the model folder's name)",
    )
    s.add_argument(
        "--max-body-bytes",
        type=int,
        default=4 * 1024 * 1024,
        help="larger request bodies get 413 (default 4 MiB)",
    )
    s.add_argument(
        "--grace-seconds",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, how long in-flight requests may take to finish (default 30)",
    )
    s.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default="info",
        help="default info: one line per request",
    )

    i = sub.add_parser("info", help="show what a model folder is and how it would load")
    i.add_argument("--model", type=Path, required=True)
    i.add_argument("--device", default="cpu")
    return p


async def _bench(args: argparse.Namespace) -> dict[str, Any]:
    from strata_rs import Engine

    need = max(args.prefill + args.decode_context) + args.steps
    engine = await Engine.load(
        args.model, device=args.device, threads=args.threads, max_context=need
    )
    try:
        info = engine.info
        if args.compare is None:
            result = await engine.benchmark(
                prefill_lens=args.prefill,
                decode_contexts=args.decode_context,
                decode_steps=args.steps,
                repeats=args.repeats,
            )
            return {"engine": info, **result}
        return {"engine": info, **await _compare(args, engine, info)}
    finally:
        await engine.close()


async def _compare(args: argparse.Namespace, engine: Any, info: dict[str, Any]) -> dict[str, Any]:
    """strata-rs and the peer alternate round by round (A B A B ...), so that a noisy machine
    slows both alike; each figure is the median over rounds."""
    import statistics
    import tempfile

    from strata_rs.bench.gguf_export import export_gguf
    from strata_rs.bench.peers import llama_cpp_available, llama_cpp_bench

    hint = llama_cpp_available()
    if hint is not None:
        raise SystemExit(f"strata-rs: llama.cpp is not installed; {hint}")
    threads = info["threads"]
    ours: list[dict[str, Any]] = []
    peer: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        gguf = export_gguf(args.model, Path(tmp) / "model.gguf", dtype=info["dtype"])
        for r in range(args.rounds):
            print(f"round {r + 1}/{args.rounds}: strata-rs", file=sys.stderr, flush=True)
            ours.append(
                await engine.benchmark(
                    prefill_lens=args.prefill,
                    decode_contexts=args.decode_context,
                    decode_steps=args.steps,
                    repeats=args.repeats,
                )
            )
            print(f"round {r + 1}/{args.rounds}: llama.cpp", file=sys.stderr, flush=True)
            peer.append(
                llama_cpp_bench(
                    gguf, threads, args.prefill, args.decode_context, args.steps, args.repeats
                )
            )

    def med(runs: list[dict[str, Any]], key: str) -> dict[int, float]:
        return {int(n): statistics.median(float(r[key][n]) for r in runs) for n in runs[0][key]}

    result: dict[str, Any] = {
        "prefill_tok_s": med(ours, "prefill_tok_s"),
        "decode_tok_s": med(ours, "decode_tok_s"),
        "decode_weight_bytes": ours[0]["decode_weight_bytes"],
        "read_bandwidth_gb_s": {
            n: statistics.median(r["read_bandwidth_gb_s"][n] for r in ours)
            for n in ours[0]["read_bandwidth_gb_s"]
        },
        "peer": {
            "name": "llama.cpp",
            "version": peer[0]["version"],
            "prefill_tok_s": med(peer, "prefill_tok_s"),
            "decode_tok_s": med(peer, "decode_tok_s"),
        },
        "rounds": {"strata-rs": ours, "llama.cpp": peer},
    }
    return result


def _print_bench(r: dict[str, Any]) -> None:
    info = r["engine"]
    weight_bytes = r["decode_weight_bytes"]
    bw = r["read_bandwidth_gb_s"]
    print(
        f"model {info['model_dir']} ({info['model_type']}, {info['dtype']}, "
        f"{info['num_layers']} layers), {info['threads']} threads on {info['device']}"
    )
    for n, rate in r["prefill_tok_s"].items():
        print(f"prefill {n:>6} tokens: {rate:9.1f} tok/s")
    ceiling = bw.get(weight_bytes) or next(iter(bw.values()))
    for ctx, rate in r["decode_tok_s"].items():
        frac = weight_bytes * rate / 1e9 / ceiling
        print(
            f"decode at context {ctx:>6}: {rate:9.1f} tok/s "
            f"({weight_bytes * rate / 1e9:.1f} GB/s of weights, {frac:.0%} of read bandwidth)"
        )
    for size, gbs in bw.items():
        print(f"read bandwidth over {size / 2**20:8.0f} MiB: {gbs:6.1f} GB/s")
    peer = r.get("peer")
    if peer is not None:
        name = f"{peer['name']} {peer['version']}"
        print(f"\nmedians of {len(r['rounds']['strata-rs'])} interleaved rounds (tok/s):")
        print(f"{'':24}{'strata-rs':>12}{name:>20}{'ratio':>8}")
        for kind, label in (("prefill_tok_s", "prefill"), ("decode_tok_s", "decode at context")):
            for n, ours in r[kind].items():
                theirs = peer[kind][n]
                print(f"{label + ' ' + str(n):24}{ours:12.1f}{theirs:20.1f}{ours / theirs:8.2f}")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "make-model":
        from strata_rs.testing.models import make_model

        out = make_model(args.out, args.family, args.preset, args.dtype, args.seed)
        print(f"wrote {args.family} {args.preset} ({args.dtype}) to {out}")
        return 0

    if args.command == "serve":
        return _serve(args)

    from strata_rs import StrataError

    try:
        if args.command == "bench" and args.conversations is not None:
            return _bench_conversations(args)
        if args.command == "bench":
            result = asyncio.run(_bench(args))
            _print_bench(result)
            if args.serving:
                from strata_rs.bench.serving import print_serving, run_serving

                result["serving"] = asyncio.run(
                    run_serving(str(args.model), args.device, args.threads, rounds=args.rounds)
                )
                print()
                print_serving(result["serving"])
            if args.http:
                from strata_rs.bench.http import print_http, run_http

                result["http"] = asyncio.run(
                    run_http(str(args.model), args.device, args.threads, rounds=args.rounds)
                )
                print()
                print_http(result["http"])
            if args.json is not None:
                args.json.write_text(json.dumps(result, indent=2, default=str))
            return 0
        if args.command == "info":
            return asyncio.run(_info(args))
    except StrataError as e:
        print(f"strata-rs: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    return 1


def _bench_conversations(args: argparse.Namespace) -> int:
    import tempfile

    from strata_rs.bench.conversations import print_conversations, run_conversations, write_svg

    with tempfile.TemporaryDirectory(prefix="strata-conversations-") as tmp:
        gguf = None
        if args.compare == "llama.cpp":
            from strata_rs.bench.gguf_export import export_gguf
            from strata_rs.bench.peers import llama_cpp_available

            hint = llama_cpp_available()
            if hint is not None:
                raise SystemExit(f"strata-rs: llama.cpp is not installed; {hint}")
            gguf = args.gguf
            if gguf is None:
                dtype = json.loads((args.model / "config.json").read_text()).get("torch_dtype")
                dtype = {"bfloat16": "bf16", "float16": "f16"}.get(dtype, "f32")
                gguf = export_gguf(args.model, Path(tmp) / "model.gguf", dtype=dtype)
        result = asyncio.run(
            run_conversations(
                args.model,
                conversations=args.conversations,
                history=args.history,
                new_tokens=args.new_tokens,
                rounds=args.rounds,
                threads=args.threads,
                device=args.device,
                disk_dir=args.disk_dir or Path(tmp) / "kv",
                llama_cpp_gguf=gguf,
            )
        )
    print_conversations(result)
    if args.plot is not None:
        write_svg(result, args.plot, f"{args.model.name}: time to first token per returning turn")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    return 0


def _serve(args: argparse.Namespace) -> int:
    from strata_rs.server.serve import serve

    options = {
        "device": args.device,
        "max_batch": args.max_batch,
        "max_context": args.max_context,
        "kv_memory_mib": args.kv_memory_mib,
        "max_batch_tokens": args.max_batch_tokens,
        "max_waiting": args.max_waiting,
        "threads": args.threads,
        "host_cache_mib": args.host_cache_mib,
        "host_min_free_mib": args.host_min_free_mib,
        "disk_cache_dir": args.disk_cache_dir,
        "disk_cache_mib": args.disk_cache_mib,
        "disk_cache_days": args.disk_cache_days,
        "cache_faults": args.cache_faults,
    }
    return serve(
        args.model,
        options,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        grace_seconds=args.grace_seconds,
        log_level=args.log_level,
        served_model_name=args.served_model_name,
    )


async def _info(args: argparse.Namespace) -> int:
    from strata_rs import Engine, cuda_devices

    engine = await Engine.load(args.model, device=args.device)
    try:
        for key, value in engine.info.items():
            print(f"{key}: {value}")
    finally:
        await engine.close()
    print(f"cuda_devices: {cuda_devices()}")
    return 0


def run() -> int:
    """The console-script entry point: main(), quiet when stdout is closed early (`| head`)."""
    try:
        return main()
    except BrokenPipeError:
        # Python's documented way out: point stdout at devnull so the exit flush cannot fail.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(run())
