"""Decode speed with n-gram drafts (`speculative="ngram"`) and, with `--draft`, a draft model,
against plain decoding, same engine build, same model, rounds interleaved; the outputs must be
equal (greedy).

    python scripts/speculative_bench.py [--model M.gguf] [--draft D.gguf] [--no-ngram]
        [--rounds 3] [--history CHARS] [--workloads edit,chat,batch] [--json out.json]

Three workloads: "edit" asks the model to repeat a ~150-token passage of its prompt with a small
change (where drafts are accepted most), "chat" asks ordinary questions (where they are not,
and adaptive draft lengths must keep decode at plain speed); "batch" streams all five at once
(`max_batch` 5), its speed the batch's tokens per second once every stream decodes. Decode
speed is the tokens after the first chunk over the time from the first chunk to the last
(prefill excluded); ratios are
medians of the per-round ratios. Each round loads fresh engines in a rotated order (`--aa`
adds a second plain engine: how far identical engines read apart). `--history CHARS` puts an
earlier exchange before every prompt (the source of Python's `json` and `textwrap` modules,
cut to that many characters): decoding at a long context, where attention is much of a step.
"""

from __future__ import annotations

import argparse
import inspect
import json
import json.decoder
import statistics
import textwrap
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


# "batch": every prompt above submitted at once (continuous batching; drafts weighed against the
# batch's steps).
BATCH = [*WORKLOADS["edit"], *WORKLOADS["chat"]]


def history(chars: int) -> list[dict[str, str]]:
    """An earlier exchange of about `chars` characters of real code (none for 0)."""
    if chars == 0:
        return []
    source = "".join(inspect.getsource(m) for m in (json.decoder, textwrap))
    return [
        {"role": "user", "content": "Keep this code in mind.\n\n" + source[:chars]},
        {"role": "assistant", "content": "Understood."},
    ]


async def decode_rate(
    engine: Engine, prompt: str, max_tokens: int, before: list[dict[str, str]]
) -> tuple[float, list[int]]:
    """Tokens per second after the first chunk, and the output ids."""
    stream = engine.chat(
        [*before, {"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0
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


async def batch_rate(
    engine: Engine, prompts: list[str], max_tokens: int, before: list[dict[str, str]]
) -> tuple[float, list[list[int]]]:
    """`prompts` streamed at once: the batch's tokens per second from the last stream's first
    chunk to the end (every stream decoding), and each output's ids."""
    outs: list[list[int]] = [[] for _ in prompts]
    firsts: list[float] = []
    lasts: list[float] = []

    async def one(i: int) -> None:
        stream = engine.chat(
            [*before, {"role": "user", "content": prompts[i]}],
            max_tokens=max_tokens,
            temperature=0,
        )
        async for chunk in stream:
            if not outs[i]:
                firsts.append(time.perf_counter())
            outs[i].extend(chunk.token_ids)
        lasts.append(time.perf_counter())

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return sum(map(len, outs)) / (max(lasts) - max(firsts)), outs


async def main(args: argparse.Namespace) -> dict[str, Any]:
    workload_names = args.workloads.split(",")
    max_batch = len(BATCH) if "batch" in workload_names else 1
    options: dict[str, Any] = {"host_cache_mib": 0, "disk_cache_mib": 0, "max_batch": max_batch}
    k = {"num_speculative_tokens": args.num_speculative_tokens}
    configs: dict[str, dict[str, Any]] = {"plain": {}}
    if args.aa:
        # A second plain engine: how far two identical engines read apart on this machine.
        configs["plain_again"] = {}
    methods = {} if args.no_ngram else {"ngram": "ngram"}
    if args.draft is not None:
        methods["draft"] = str(args.draft)
    for name, method in methods.items():
        # Drafts as many as the measured step times say pay (the default).
        configs[name] = {**k, "speculative": method}
        # Drafts whatever is proposed: what verifying drafts costs on this machine.
        configs[f"{name}_forced"] = {**k, "speculative": method, "speculative_adaptive": False}
    names = list(configs)
    workloads = {w: BATCH if w == "batch" else WORKLOADS[w] for w in workload_names}
    before = history(args.history)
    rates: dict[str, dict[str, list[float]]] = {w: {name: [] for name in names} for w in workloads}
    counted = (
        "spec_draft_tokens",
        "spec_accepted_tokens",
        "spec_draft_detached",
        "spec_draft_model_tokens",
        "steps",
    )
    totals: dict[str, dict[str, int]] = {name: dict.fromkeys(counted, 0) for name in names}
    equal = True
    plain_outs: dict[str, list[list[int]]] = {}
    for r in range(args.rounds):
        # Fresh engines each round, loaded and run in a rotated order: where an engine's
        # weights land in memory, and when it runs in the round, move its speed by several
        # percent, which a fixed set of engines would carry into every round.
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            engine = await Engine.load(args.model, **options, **configs[name])
            try:
                for workload, prompts in workloads.items():
                    if workload == "batch":
                        rate, outs = await batch_rate(engine, prompts, args.max_tokens, before)
                        rates[workload][name].append(rate)
                        expected = plain_outs.setdefault(workload, outs)
                        equal = equal and outs == expected
                        continue
                    outs = []
                    total_tokens = 0
                    total_time = 0.0
                    for p in prompts:
                        rate, ids = await decode_rate(engine, p, args.max_tokens, before)
                        outs.append(ids)
                        total_tokens += len(ids)
                        total_time += len(ids) / rate
                    rates[workload][name].append(total_tokens / total_time)
                    expected = plain_outs.setdefault(workload, outs)
                    equal = equal and outs == expected
                s = engine.stats()
                for key in totals[name]:
                    totals[name][key] += s.get(key, 0)
            finally:
                await engine.close()
    result: dict[str, Any] = {
        "model": str(args.model),
        "draft": None if args.draft is None else str(args.draft),
        "rounds": args.rounds,
        "history_chars": args.history,
        "outputs_equal": equal,
        "drafts": totals,
    }
    for workload, r in rates.items():
        plain = statistics.median(r["plain"])
        result[workload] = {"rounds": r, "plain": {"tok_s": plain}}
        line = [f"{workload}: plain {plain:.1f} tok/s"]
        for name in names:
            if name != "plain":
                speed = statistics.median(r[name])
                # The machine's speed drifts between rounds; each round's engines ran back to
                # back, so the ratio is taken per round, then its median.
                ratio = statistics.median(x / p for x, p in zip(r[name], r["plain"], strict=True))
                result[workload][name] = {"tok_s": speed, "ratio": ratio}
                line.append(f"{name} {speed:.1f} tok/s ({ratio:.2f}x)")
        print(", ".join(line))
    for name, d in result["drafts"].items():
        print(
            f"{name}: drafts accepted {d['spec_accepted_tokens']}/{d['spec_draft_tokens']}, "
            f"detached {d['spec_draft_detached']}, draft model fed {d['spec_draft_model_tokens']}"
        )
    print(f"outputs equal: {equal}")
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="default: the demo SmolLM2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--draft", type=Path, default=None, help="also a draft model's engines")
    parser.add_argument("--no-ngram", action="store_true", help="without the n-gram engines")
    parser.add_argument("--aa", action="store_true", help="also a second plain engine")
    parser.add_argument("--history", type=int, default=0, help="characters of earlier code")
    parser.add_argument("--workloads", default="edit,chat", help="of: edit, chat, batch")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.model is None:
        args.model = demo_model_path()
    result = anyio.run(main, args)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
