"""The ``strata-rs`` command: serve, make-model, bench, info."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

KV_DTYPES = ("f32", "f16", "bf16", "q8_0")
QUANTIZE_TYPES = ("q8_0", "q4_k", "q6_k")
QUANTIZE_HELP = (
    "quantize a Hugging Face folder's weight matrices at load to this ggml block type (the "
    "head to q6_k, or q8_0 with q8_0); default: as stored"
)
BF16_DOT_HELP = (
    "bf16 weights: use the CPU's bf16 dot products (AVX512_BF16) on input rows rounded to bf16, "
    "as llama.cpp does: about twice the prefill speed, at the rounding's error; default: f32 "
    "inputs"
)
KV_DTYPE_HELP = (
    "K/V cache format: f32, f16, bf16 or q8_0 (8-bit, 34 bytes per 32 values: about half of "
    "f16's memory, so twice the context and conversations in every cache tier); default: f32 "
    "for f32 weights, else f16"
)


def _origin_list(text: str) -> tuple[str, ...]:
    """`https://a.example,http://localhost:5173` -> its origins; `*` alone allows any."""
    origins = tuple(o.strip().rstrip("/") for o in text.split(",") if o.strip())
    if not origins:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of origins, got {text!r}"
        )
    for o in origins:
        if o != "*" and not re.fullmatch(r"https?://[^/\s]+", o):
            raise argparse.ArgumentTypeError(
                f"expected origins such as https://app.example (scheme and host), got {o!r}"
            )
    if "*" in origins and len(origins) > 1:
        raise argparse.ArgumentTypeError("* allows any origin: give it alone")
    return origins


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


def _peer_list(text: str) -> list[str]:
    from strata_rs.bench.peers import parse_peers

    try:
        return parse_peers(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _scenario_list(text: str) -> list[str]:
    from strata_rs.bench.compare import parse_scenarios

    try:
        return parse_scenarios(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="strata-rs",
        description="strata-rs: an LLM inference engine with a tiered conversation cache.",
    )
    sub = p.add_subparsers(dest="command", required=True)

    m = sub.add_parser("make-model", help="write a random-weight model folder (for tests, demos)")
    m.add_argument("out", type=Path, help="folder to write")
    m.add_argument(
        "--family",
        choices=("llama", "mistral", "qwen2", "qwen3", "gemma3", "qwen3_moe", "mixtral", "phi3"),
        default=None,
        help="default: the preset's (llama for the generic ones)",
    )
    m.add_argument(
        "--preset",
        choices=(
            "tiny",
            "smollm-135m",
            "llama-1b",
            "qwen3-moe-1b",
            "qwen3-dense-0.3b",
            "gemma3-1b",
        ),
        default="tiny",
    )
    m.add_argument("--dtype", choices=("f32", "bf16", "f16"), default="f32")
    m.add_argument("--seed", type=int, default=0)

    b = sub.add_parser("bench", help="time prefill and decode of a model on this machine")
    b.add_argument(
        "--model", type=Path, required=True, help="Hugging Face model folder or GGUF file"
    )
    b.add_argument("--device", default="cpu")
    b.add_argument("--threads", type=int, default=None, help="compute threads (default: all cores)")
    b.add_argument("--kv-dtype", choices=KV_DTYPES, default=None, help=KV_DTYPE_HELP)
    b.add_argument("--quantize", choices=QUANTIZE_TYPES, default=None, help=QUANTIZE_HELP)
    b.add_argument("--bf16-dot", action="store_true", help=BF16_DOT_HELP)
    b.add_argument("--prefill", type=_int_list, default=[512, 2048], help="prompt lengths")
    b.add_argument(
        "--decode-context", type=_int_list, default=[512, 2048], help="contexts to decode at"
    )
    b.add_argument("--steps", type=int, default=32, help="decode steps timed per context")
    b.add_argument("--repeats", type=int, default=3, help="repeats per prefill (median shown)")
    b.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    b.add_argument(
        "--compare",
        type=_peer_list,
        default=None,
        metavar="PEER,...",
        help="also run these peers on the same weights, interleaved with strata-rs round by "
        "round, and print a table of medians and ratios: llama.cpp, transformers, mistralrs "
        "(or all); a peer that is not installed is skipped with its install command",
    )
    b.add_argument(
        "--scenario",
        type=_scenario_list,
        default=None,
        metavar="NAME,...",
        help="what the compare table measures: prefill, decode, streams, conversation (or all; "
        "default with --compare: all)",
    )
    b.add_argument(
        "--streams",
        type=_int_list,
        default=[1, 4, 8],
        help="the streams scenario's concurrent streams (default 1,4,8)",
    )
    b.add_argument(
        "--stream-prompt", type=int, default=128, help="the streams scenario's prompt tokens"
    )
    b.add_argument(
        "--stream-tokens", type=int, default=64, help="the streams scenario's tokens per stream"
    )
    b.add_argument("--rounds", type=int, default=3, help="interleaved rounds with --compare")
    b.add_argument(
        "--http",
        action="store_true",
        help="also run 16 streams through the Python API and through the HTTP server on loopback, "
        "interleaved, and compare tokens/s and TTFT",
    )
    b.add_argument(
        "--http-client",
        choices=("raw", "httpx"),
        default="raw",
        help="the --http benchmark's client: raw (a minimal SSE reader; default) or httpx",
    )
    b.add_argument(
        "--backends",
        action="store_true",
        help="also time stream delivery on asyncio, uvloop and trio (8 streams of 256 tokens, "
        "--rounds rounds): the event loop's CPU time and wall overhead per token",
    )
    b.add_argument(
        "--structured",
        action="store_true",
        help="also time structured output: 8 greedy streams all free against half of them "
        "constrained by a JSON schema (aggregate decode, per-token latency)",
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
        "--history",
        type=int,
        default=2400,
        help="with --conversations or the conversation scenario: history tokens each",
    )
    b.add_argument(
        "--new-tokens",
        type=int,
        default=60,
        help="with --conversations or the conversation scenario: new tokens per turn",
    )
    b.add_argument(
        "--disk-dir",
        type=Path,
        default=None,
        help="with --conversations or the conversation scenario: the disk tier's folder, emptied "
        "first (default: a temp dir)",
    )
    b.add_argument(
        "--gguf",
        type=Path,
        default=None,
        help="with --compare llama.cpp: use this GGUF of the model instead of exporting one",
    )
    b.add_argument(
        "--llama-server",
        type=Path,
        default=None,
        metavar="PATH",
        help="with --conversations: run the turns through `strata-rs serve` and this "
        "llama-server binary over loopback HTTP instead of the Python API, on the same GGUF "
        "(--model FILE.gguf or --gguf; scripts/build_llama_server.py builds one)",
    )
    b.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="with --compare: the ratios and the conversation's TTFT per turn (matplotlib: "
        ".png, .svg, .pdf); with --conversations: TTFT per returning turn (.svg: built in, "
        "no matplotlib; .png: matplotlib)",
    )

    s = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server (without --model: the demo model, SmolLM2)",
    )
    s.add_argument(
        "--model",
        type=Path,
        default=None,
        help="model folder or GGUF file (default: the demo model, SmolLM2-135M-Instruct)",
    )
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port)")
    s.add_argument(
        "--device",
        default="cpu",
        help="cpu | cpu:0,1 | cuda | cuda:N | cuda:N,M (a list splits the layers; default cpu)",
    )
    s.add_argument(
        "--device-memory-mib",
        default=None,
        help="each device's memory capacity in MiB, one per device of --device, e.g. 300,120 "
        "(default: a CPU's pool is not bounded)",
    )
    s.add_argument(
        "--layer-split",
        default=None,
        help="layers per device of --device, e.g. 20,10; must sum to the model's layers "
        "(default: in proportion to each device's free memory, evenly when unknown)",
    )
    s.add_argument(
        "--vram-reserve-mib",
        type=int,
        default=1024,
        help="on a GPU, memory left free beside what the engine accounts (default 1024)",
    )
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
    s.add_argument("--kv-dtype", choices=KV_DTYPES, default=None, help=KV_DTYPE_HELP)
    s.add_argument("--quantize", choices=QUANTIZE_TYPES, default=None, help=QUANTIZE_HELP)
    s.add_argument("--bf16-dot", action="store_true", help=BF16_DOT_HELP)
    s.add_argument(
        "--speculative",
        default=None,
        metavar="ngram|DRAFT_MODEL",
        help="decode with drafts: ngram proposes what followed the longest earlier occurrence "
        "of the sequence's suffix (prompt lookup); a model path (GGUF file or folder with the "
        "target's tokenizer) proposes its greedy picks; outputs are unchanged; default: off",
    )
    s.add_argument(
        "--num-speculative-tokens", type=int, default=4, help="most drafts per step (1-16)"
    )
    s.add_argument("--ngram-min", type=int, default=2, help="shortest suffix looked up")
    s.add_argument("--ngram-max", type=int, default=4, help="longest suffix looked up")
    s.add_argument(
        "--no-speculative-adaptive",
        dest="speculative_adaptive",
        action="store_false",
        help="draft whatever is proposed, even where the measured step times say drafts "
        "cost more than they save (for measurements)",
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
        "--disk-write-when-idle",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="whenever the engine falls idle, write its cached K/V not on disk yet to the disk "
        "tier, so conversations survive a killed process (default: off; on with --replicas)",
    )
    s.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="serve N engine replicas on Ray Serve, each conversation routed to the replica "
        "holding its history (starts a local Ray, or joins --ray-address / $RAY_ADDRESS; needs "
        "the 'ray' extra)",
    )
    s.add_argument(
        "--ray-address",
        default=None,
        help="the Ray cluster to join with --replicas (default: $RAY_ADDRESS, else a local one)",
    )
    s.add_argument("--min-replicas", type=int, default=None, help="autoscaling's lower bound")
    s.add_argument("--max-replicas", type=int, default=None, help="autoscaling's upper bound")
    s.add_argument(
        "--target-ongoing-requests",
        type=float,
        default=None,
        help="autoscaling's target of ongoing requests per replica (default: Ray's)",
    )
    s.add_argument(
        "--request-router",
        choices=("affinity", "power_of_two"),
        default=None,
        help="with --replicas: affinity (default) sends a conversation to the replica holding "
        "its history; power_of_two is Ray Serve's own, blind to it (for comparisons)",
    )
    s.add_argument(
        "--health-check-seconds",
        type=float,
        default=None,
        help="with --replicas: how often Ray checks each replica's engine (default 5); a "
        "replica whose engine stopped is replaced",
    )
    s.add_argument(
        "--replica-cpus",
        type=float,
        default=1.0,
        help="CPUs Ray reserves for each replica (default 1)",
    )
    s.add_argument(
        "--replica-gpus",
        type=float,
        default=0.0,
        help="GPUs Ray reserves for each replica (default 0)",
    )
    s.add_argument(
        "--cache-faults",
        default=None,
        help="fault injection for tests, e.g. copy_in:2,read:5%%,ram_gate:100-200 (kinds alloc, "
        "copy_out, copy_in, write, read, ram_gate; default: $STRATA_CACHE_FAULTS)",
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
        "--keep-alive-seconds",
        type=float,
        default=None,
        help="how long an idle kept-alive connection stays open; keep it longer than the "
        "clients' and proxies' idle timeouts (default 75)",
    )
    s.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default="info",
        help="default info: one line per request",
    )
    s.add_argument(
        "--log-prompts",
        action="store_true",
        help="also log each request's prompt and the full error messages, which can quote it "
        "(off by default: the log never holds what users wrote)",
    )
    s.add_argument(
        "--allowed-origins",
        type=_origin_list,
        default=(),
        metavar="ORIGIN,...",
        help="browser origins whose pages may call the API (CORS), e.g. "
        "https://app.example,http://localhost:5173, or * for any; default: none (no CORS headers)",
    )
    s.add_argument(
        "--reasoning-format",
        choices=("separate", "inline"),
        default="separate",
        help="separate (default): a chat answer's <think>...</think> goes to reasoning_content; "
        "inline: it stays in the content",
    )

    c = sub.add_parser(
        "chat", help="chat with a model in the terminal (without --model: the demo model)"
    )
    c.add_argument(
        "--model",
        type=Path,
        default=None,
        help="model folder or GGUF file (default: the demo model, SmolLM2-135M-Instruct)",
    )
    c.add_argument("--max-tokens", type=int, default=512, help="longest answer (default 512)")
    c.add_argument(
        "--temperature", type=float, default=0.7, help="sampling temperature (0: greedy)"
    )
    c.add_argument("--threads", type=int, default=None, help="compute threads (default: all)")
    c.add_argument(
        "--stats", action="store_true", help="after each answer: tokens, time, cached tokens"
    )

    i = sub.add_parser("info", help="show what a model folder is and how it would load")
    i.add_argument("--model", type=Path, required=True)
    i.add_argument("--device", default="cpu")
    return p


async def _bench(args: argparse.Namespace) -> dict[str, Any]:
    from strata_rs import Engine

    need = max(args.prefill + args.decode_context) + args.steps
    engine = await Engine.load(
        args.model,
        device=args.device,
        threads=args.threads,
        max_context=need,
        kv_dtype=args.kv_dtype,
        quantize=args.quantize,
        bf16_dot=args.bf16_dot,
    )
    try:
        result = await engine.benchmark(
            prefill_lens=args.prefill,
            decode_contexts=args.decode_context,
            decode_steps=args.steps,
            repeats=args.repeats,
        )
        return {"engine": engine.info, **result}
    finally:
        await engine.close()


def _compare_spec(args: argparse.Namespace) -> Any:
    from strata_rs.bench.compare import SCENARIOS, CompareSpec

    return CompareSpec(
        model=args.model,
        peers=args.compare or [],
        scenarios=args.scenario or list(SCENARIOS),
        rounds=args.rounds,
        prefill=args.prefill,
        decode_contexts=args.decode_context,
        steps=args.steps,
        repeats=args.repeats,
        streams=args.streams,
        stream_prompt=args.stream_prompt,
        stream_tokens=args.stream_tokens,
        history=args.history,
        new_tokens=args.new_tokens,
        threads=args.threads,
        device=args.device,
        gguf=args.gguf,
        disk_dir=args.disk_dir,
        quantize=args.quantize,
        bf16_dot=args.bf16_dot,
    )


def _check_plot(args: argparse.Namespace) -> str | None:
    """Why --plot cannot be written (checked before a long run), or None."""
    if args.plot is None:
        return None
    if args.compare is None and args.scenario is None and args.conversations is None:
        return "--plot needs --compare, --scenario or --conversations"
    if args.conversations is not None and args.plot.suffix.lower() == ".svg":
        return None  # the built-in SVG writer
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return (
            f"--plot {args.plot}: writing {args.plot.suffix or 'this format'} needs matplotlib; "
            "install it with: pip install matplotlib (or pip install 'strata-rs[bench]')"
        )
    return None


def _print_bench(r: dict[str, Any]) -> None:
    info = r["engine"]
    weight_bytes = r["decode_weight_bytes"]
    bw = r["read_bandwidth_gb_s"]
    print(
        f"model {info['model_dir']} ({info['model_type']}, {info['dtype']}, "
        f"{info['num_layers']} layers, {info['kv_dtype']} K/V), {info['threads']} threads on "
        f"{info['device']} (CPU kernels: {', '.join(info['cpu_levels']) or 'portable'})"
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


def _chat(args: argparse.Namespace) -> int:
    from strata_rs import StrataError
    from strata_rs.chat import chat_loop
    from strata_rs.demo import DemoNotInstalled, demo_model_path

    model = args.model
    if model is None:
        try:
            model = demo_model_path()
        except DemoNotInstalled as e:
            print(f"strata-rs chat: no --model given, and {e}", file=sys.stderr)
            return 2
    try:
        return asyncio.run(
            chat_loop(
                model,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                threads=args.threads,
                stats=args.stats,
            )
        )
    except StrataError as e:
        print(f"strata-rs: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "make-model":
        from strata_rs.testing.models import make_model, preset_family

        family = args.family or preset_family(args.preset)
        try:
            out = make_model(args.out, family, args.preset, args.dtype, args.seed)
        except ValueError as e:
            print(f"strata-rs make-model: {e}", file=sys.stderr)
            return 2
        print(f"wrote {family} {args.preset} ({args.dtype}) to {out}")
        return 0

    if args.command == "serve":
        return _serve(args)
    if args.command == "chat":
        return _chat(args)

    from strata_rs import StrataError

    try:
        if args.command == "bench":
            problem = _check_plot(args)
            if problem is not None:
                print(f"strata-rs: {problem}", file=sys.stderr)
                return 2
        if args.command == "bench" and args.llama_server is not None:
            problem = _check_llama_server(args)
            if problem is not None:
                print(f"strata-rs: {problem}", file=sys.stderr)
                return 2
            return _bench_server_conversations(args)
        if args.command == "bench" and args.conversations is not None:
            return _bench_conversations(args)
        if args.command == "bench":
            if args.compare is not None or args.scenario is not None:
                if args.device != "cpu":
                    print(
                        "strata-rs: --compare runs the peers on the CPU; use --device cpu",
                        file=sys.stderr,
                    )
                    return 2
                from strata_rs.bench.compare import print_compare, run_compare, write_plot

                result = asyncio.run(run_compare(_compare_spec(args)))
                print_compare(result)
                if args.json is not None:  # before the plot: a long run's figures come first
                    args.json.write_text(json.dumps(result, indent=2, default=str))
                if args.plot is not None:
                    write_plot(result, args.plot, f"{args.model.name}: strata-rs and its peers")
                    print(f"plot: {args.plot}")
            else:
                result = asyncio.run(_bench(args))
                _print_bench(result)
            if args.serving:
                from strata_rs.bench.serving import print_serving, run_serving

                result["serving"] = asyncio.run(
                    run_serving(str(args.model), args.device, args.threads, rounds=args.rounds)
                )
                print()
                print_serving(result["serving"])
            if args.structured:
                from strata_rs.bench.structured import print_structured, run_structured

                result["structured"] = asyncio.run(
                    run_structured(str(args.model), args.threads, rounds=args.rounds)
                )
                print()
                print_structured(result["structured"])
            if args.backends:
                from strata_rs.bench.backends import print_backends, run_backends

                result["backends"] = run_backends(str(args.model), args.threads, rounds=args.rounds)
                print()
                print_backends(result["backends"])
            if args.http:
                from strata_rs.bench.http import print_http, run_http

                result["http"] = asyncio.run(
                    run_http(
                        str(args.model),
                        args.device,
                        args.threads,
                        rounds=args.rounds,
                        client_kind=args.http_client,
                    )
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


def _given_gguf(args: argparse.Namespace) -> Path | None:
    """The GGUF given: the model itself, or --gguf."""
    if args.model.suffix.lower() == ".gguf":
        return args.model
    return args.gguf


def _check_llama_server(args: argparse.Namespace) -> str | None:
    """Why --llama-server cannot run (checked before a long run), or None."""
    if args.conversations is None:
        return "--llama-server needs --conversations"
    if args.compare is not None or args.plot is not None:
        return (
            "--llama-server runs the turns through the servers only; --compare and --plot "
            "belong to the in-process run (without --llama-server)"
        )
    if _given_gguf(args) is None:
        return "--llama-server needs a GGUF for both servers: --model FILE.gguf or --gguf FILE"
    if not os.access(args.llama_server, os.X_OK) or args.llama_server.is_dir():
        return f"--llama-server {args.llama_server}: not an executable file"
    return None


def _bench_server_conversations(args: argparse.Namespace) -> int:
    from strata_rs.bench.conversation_servers import (
        print_server_conversations,
        run_server_conversations,
    )

    gguf = _given_gguf(args)
    assert gguf is not None  # _check_llama_server
    result = asyncio.run(
        run_server_conversations(
            gguf,
            args.llama_server,
            conversations=args.conversations,
            history=args.history,
            new_tokens=args.new_tokens,
            rounds=args.rounds,
            threads=args.threads,
        )
    )
    print_server_conversations(result)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    return 0


def _bench_conversations(args: argparse.Namespace) -> int:
    import tempfile

    from strata_rs.bench.conversations import (
        print_conversations,
        run_conversations,
        write_png,
        write_svg,
    )

    peers = args.compare or []
    others = [p for p in peers if p != "llama.cpp"]
    if others:
        print(
            f"strata-rs: --conversations compares with llama.cpp only (its RAM prompt cache "
            f"and K/V state); {', '.join(others)}: use --compare without --conversations "
            "(the compare table's conversation scenario)",
            file=sys.stderr,
        )
        return 2
    with tempfile.TemporaryDirectory(prefix="strata-conversations-") as tmp:
        gguf = None
        if "llama.cpp" in peers:
            from strata_rs.bench.gguf_export import export_gguf
            from strata_rs.bench.peers import missing, skip_line

            reason = missing("llama.cpp")
            if reason is not None:
                print(skip_line("llama.cpp", reason), file=sys.stderr, flush=True)
            else:
                gguf = _given_gguf(args)
                if gguf is None:
                    config = json.loads((args.model / "config.json").read_text())
                    dtype = {"bfloat16": "bf16", "float16": "f16"}.get(
                        config.get("torch_dtype"), "f32"
                    )
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
        title = f"{args.model.name}: time to first token per returning turn"
        if args.plot.suffix.lower() == ".svg":
            write_svg(result, args.plot, title)
        else:
            write_png(result, args.plot, title)
        print(f"plot: {args.plot}")
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
        "kv_dtype": args.kv_dtype,
        "quantize": args.quantize,
        "bf16_dot": args.bf16_dot,
        "speculative": args.speculative,
        "num_speculative_tokens": args.num_speculative_tokens,
        "ngram_min": args.ngram_min,
        "ngram_max": args.ngram_max,
        "speculative_adaptive": args.speculative_adaptive,
        "max_batch_tokens": args.max_batch_tokens,
        "max_waiting": args.max_waiting,
        "threads": args.threads,
        "host_cache_mib": args.host_cache_mib,
        "host_min_free_mib": args.host_min_free_mib,
        "disk_cache_dir": args.disk_cache_dir,
        "disk_cache_mib": args.disk_cache_mib,
        "disk_cache_days": args.disk_cache_days,
        "cache_faults": args.cache_faults,
        "device_memory_mib": args.device_memory_mib,
        "layer_split": args.layer_split,
        "vram_reserve_mib": args.vram_reserve_mib,
    }
    # On by default with replicas (they share the disk tier), off for one server.
    write_when_idle = args.disk_write_when_idle
    options["disk_write_when_idle"] = (
        args.replicas is not None if write_when_idle is None else write_when_idle
    )
    ray_only = (
        "min_replicas",
        "max_replicas",
        "target_ongoing_requests",
        "ray_address",
        "request_router",
        "health_check_seconds",
    )
    if args.replicas is None:
        given = [f"--{k.replace('_', '-')}" for k in ray_only if getattr(args, k) is not None]
        if given:
            print(f"error: {', '.join(given)} need --replicas", file=sys.stderr)
            return 2
    else:
        from strata_rs.ray.launch import serve_on_ray

        return serve_on_ray(
            args.model,
            options,
            host=args.host,
            port=args.port,
            replicas=args.replicas,
            ray_address=args.ray_address,
            min_replicas=args.min_replicas,
            max_replicas=args.max_replicas,
            target_ongoing_requests=args.target_ongoing_requests,
            replica_cpus=args.replica_cpus,
            replica_gpus=args.replica_gpus,
            request_router=args.request_router or "affinity",
            health_check_seconds=args.health_check_seconds or 5.0,
            api_key=args.api_key,
            max_body_bytes=args.max_body_bytes,
            log_level=args.log_level,
            served_model_name=args.served_model_name,
            log_prompts=args.log_prompts,
            reasoning_format=args.reasoning_format,
        )
    return serve(
        args.model,
        options,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        max_body_bytes=args.max_body_bytes,
        grace_seconds=args.grace_seconds,
        keep_alive_seconds=args.keep_alive_seconds,
        log_level=args.log_level,
        served_model_name=args.served_model_name,
        log_prompts=args.log_prompts,
        allowed_origins=args.allowed_origins,
        reasoning_format=args.reasoning_format,
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
