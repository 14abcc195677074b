"""Returning conversations on `strata-rs serve --replicas N`: the affinity router against Ray
Serve's own (power of two choices, blind to where a history is cached), with and without a
shared disk tier, and one plain `strata-rs serve` (no Ray) as the baseline of the path.
Conversations with long histories return in turn, one request at a time,
streamed; each returning turn's time to first token (TTFT) and the cached share of its prompt
are measured. Prints a table (docs/benchmarks.md, "Replicas on Ray Serve"); --json keeps all.

    python benches/ray_routing.py --model M.gguf --rounds 3 --json ray.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import openai
from strata_rs.testing.server import Server, serve_argv

# (router, shared disk); "none": one plain `strata-rs serve` (no Ray), the path's baseline.
CONFIGS = (
    ("none", False),
    ("affinity", False),
    ("power_of_two", False),
    ("power_of_two", True),
    ("affinity", True),
)


def _filler(i: int, words: int) -> str:
    # Distinct text per conversation, so that nothing one conversation caches helps another.
    return " ".join(f"fact{i}-{w} is noted." for w in range(words))


def run_config(
    model: Path, router: str, shared_disk: bool, args: argparse.Namespace
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        flags = ["--model", str(model), "--threads", "1", "--max-context", str(args.max_context)]
        if router != "none":
            flags += ["--replicas", str(args.replicas), "--request-router", router]
        flags += ["--served-model-name", "model"]
        if shared_disk:
            flags += ["--disk-cache-dir", str(Path(tmp) / "kv")]
        else:
            flags += ["--disk-cache-mib", "0"]
        server = Server(serve_argv(*flags), echo=False)
        server.wait_healthy()  # a plain server listens before its model has loaded
        try:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
            chats = [
                [{"role": "system", "content": _filler(i, args.system_words)}]
                for i in range(args.conversations)
            ]
            ttfts: list[float] = []
            cached: list[float] = []
            t0 = time.perf_counter()
            for turn in range(args.turns):
                for i, messages in enumerate(chats):
                    messages.append({"role": "user", "content": _filler(100 * turn + i, 8)})
                    start = time.perf_counter()
                    first = None
                    text = ""
                    usage = None
                    stream = client.chat.completions.create(
                        model="model",
                        messages=messages,  # type: ignore[arg-type]
                        max_tokens=args.max_tokens,
                        temperature=0.0,
                        stream=True,
                        stream_options={"include_usage": True},
                    )
                    for chunk in stream:
                        if chunk.choices and chunk.choices[0].delta.content and first is None:
                            first = time.perf_counter() - start
                        if chunk.choices:
                            text += chunk.choices[0].delta.content or ""
                        if chunk.usage is not None:
                            usage = chunk.usage
                    messages.append({"role": "assistant", "content": text})
                    if turn > 0 and first is not None and usage is not None:
                        ttfts.append(first)
                        details = usage.prompt_tokens_details
                        hit = (details.cached_tokens or 0) if details else 0
                        cached.append(hit / usage.prompt_tokens)
            total = time.perf_counter() - t0
        finally:
            server.stop()
    return {
        "router": router,
        "shared_disk": shared_disk,
        "returning_turns": len(ttfts),
        "ttft_median_s": statistics.median(ttfts),
        "ttft_p90_s": sorted(ttfts)[math.ceil(0.9 * len(ttfts)) - 1],  # nearest rank
        "cached_share_median": statistics.median(cached),
        "cached_share_mean": statistics.fmean(cached),
        "total_s": total,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-words", type=int, default=120, help="about 6 tokens a word")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--configs", default=None, help="router:disk pairs to run, e.g. none:0,affinity:1"
    )
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    configs = CONFIGS
    if args.configs:
        configs = tuple((c.split(":")[0], c.split(":")[1] == "1") for c in args.configs.split(","))
    results: list[dict[str, Any]] = []
    for r in range(args.rounds):  # interleaved rounds: a slow minute hurts every config alike
        for router, disk in configs:
            res = run_config(args.model, router, disk, args)
            res["round"] = r
            results.append(res)
            print(json.dumps(res), flush=True)
    print()
    print("| router | shared disk | returning-turn TTFT median (s) | p90 (s) | cached share "
          "| total (s) |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- |")
    for router, disk in configs:
        runs = [x for x in results if x["router"] == router and x["shared_disk"] == disk]
        med = statistics.median
        print(
            f"| {router} | {'yes' if disk else 'no'} | "
            f"{med(x['ttft_median_s'] for x in runs):.3f} | "
            f"{med(x['ttft_p90_s'] for x in runs):.3f} | "
            f"{med(x['cached_share_median'] for x in runs):.2f} | "
            f"{med(x['total_s'] for x in runs):.1f} |"
        )
    if args.json is not None:
        run = {"args": {k: str(v) for k, v in vars(args).items()}, "results": results}
        args.json.write_text(json.dumps(run, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
