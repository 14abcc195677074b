"""Decode speed with n-gram drafts (`speculative="ngram"`) against plain decoding, same engine
build, same model, rounds interleaved; the outputs must be equal (greedy).

    python scripts/speculative_bench.py [--model M.gguf] [--rounds 3] [--json out.json]

Two workloads: "edit" asks the model to repeat a ~150-token passage of its prompt with a small
change (where drafts are accepted most), "chat" asks ordinary questions (where they are not,
and adaptive draft lengths must keep decode at plain speed). Decode speed is the tokens after
the first chunk over the time from the first chunk to the last (prefill excluded); ratios are
medians of the per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import anyio
from strata_rs import Engine
from strata_rs.demo import demo_model_path

PASSAGE = """def merge_sorted(left, right):
    result = []
    i = j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            result.append(left[i])
            i += 1
        else:
            result.append(right[j])
            j += 1
    result.extend(left[i:])
    result.extend(right[j:])
    return result


def merge_sort(items):
    if len(items) <= 1:
        return items
    middle = len(items) // 2
    return merge_sorted(merge_sort(items[:middle]), merge_sort(items[middle:]))
"""

WORKLOADS: dict[str, list[str]] = {
    "edit": [
        "Repeat this code exactly, but rename `result` to `merged`. Show only the code.\n\n"
        + PASSAGE,
        "Copy this code exactly as it is, in a code block.\n\n" + PASSAGE,
    ],
    "chat": [
        "Write a short story about a cat who learns to sail.",
        "What are three good habits for staying healthy? Explain each briefly.",
        "Explain how a bicycle stays upright while moving.",
    ],
}


async def decode_rate(engine: Engine, prompt: str, max_tokens: int) -> tuple[float, list[int]]:
    """Tokens per second after the first chunk, and the output ids."""
    stream = engine.chat(
        [{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0
    )
    ids: list[int] = []
    first = last = 0.0
    async for chunk in stream:
        now = time.perf_counter()
        if not ids:
            first = now
            head = len(chunk.token_ids)
        ids += chunk.token_ids
        last = now
    return (len(ids) - head) / max(last - first, 1e-9), ids


async def main(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {"host_cache_mib": 0, "disk_cache_mib": 0, "max_batch": 1}
    spec = {"speculative": "ngram", "num_speculative_tokens": args.num_speculative_tokens}
    engines = {
        "plain": await Engine.load(args.model, **options),
        # Drafts as many as the measured step times say pay (the default).
        "ngram": await Engine.load(args.model, **options, **spec),
        # Drafts whatever lookup proposes: what verifying drafts costs on this machine.
        "ngram_forced": await Engine.load(
            args.model, **options, **spec, speculative_adaptive=False
        ),
    }
    rates: dict[str, dict[str, list[float]]] = {
        w: {name: [] for name in engines} for w in WORKLOADS
    }
    equal = True
    try:
        for _ in range(args.rounds):
            for workload, prompts in WORKLOADS.items():
                for name, engine in engines.items():
                    outs = []
                    total_tokens = 0
                    total_time = 0.0
                    for p in prompts:
                        rate, ids = await decode_rate(engine, p, args.max_tokens)
                        outs.append(ids)
                        total_tokens += len(ids)
                        total_time += len(ids) / rate
                    rates[workload][name].append(total_tokens / total_time)
                    if name == "plain":
                        plain_outs = outs
                    elif outs != plain_outs:
                        equal = False
        stats = {name: dict(e.stats()) for name, e in engines.items()}
    finally:
        for engine in engines.values():
            await engine.close()
    result: dict[str, Any] = {
        "model": str(args.model),
        "rounds": args.rounds,
        "outputs_equal": equal,
        "drafts": {
            name: {k: s[k] for k in ("spec_draft_tokens", "spec_accepted_tokens", "steps")}
            for name, s in stats.items()
        },
    }
    for workload, r in rates.items():
        plain = statistics.median(r["plain"])
        result[workload] = {"rounds": r, "plain": {"tok_s": plain}}
        line = [f"{workload}: plain {plain:.1f} tok/s"]
        for name in engines:
            if name != "plain":
                speed = statistics.median(r[name])
                # The machine's speed drifts between rounds; each round's engines ran back to
                # back, so the ratio is taken per round, then its median.
                ratio = statistics.median(x / p for x, p in zip(r[name], r["plain"], strict=True))
                result[workload][name] = {"tok_s": speed, "ratio": ratio}
                line.append(f"{name} {speed:.1f} tok/s ({ratio:.2f}x)")
        print(", ".join(line))
    for name, d in result["drafts"].items():
        print(f"{name}: drafts accepted {d['spec_accepted_tokens']}/{d['spec_draft_tokens']}")
    print(f"outputs equal: {equal}")
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="default: the demo SmolLM2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.model is None:
        args.model = demo_model_path()
    result = anyio.run(main, args)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
