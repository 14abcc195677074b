"""Long-context figures of docs/benchmarks.md that `strata-rs bench` cannot afford at 32K tokens
(its prefill and decode scenarios would prefill the 32K history once per scenario and round, and
llama.cpp's 32K prefill of a 1B model takes tens of minutes):

1. Prefill of one N-token prompt, strata-rs then llama.cpp (llama-cpp-python, the bench's peer
   settings), same GGUF file, each once.
2. Decode at context N: `--rounds` interleaved bursts of `--steps` greedy tokens on each engine,
   continuing the same sequence (strata-rs's continuation prompt is served from its prefix
   cache; the burst's rate is timed from its first token). The machine's read bandwidth (memcpy
   of 256 MiB) is measured before and after, and the bytes a step reads are reported.
3. A returning turn on an N-token history from the host tier against the same turn with the
   history resident: strata-rs's pool holds one such conversation, so a second one (B) pushes
   the first (A) to the host tier; A then returns (restored from host), and returns again
   (resident); then B likewise, `--rounds` times.

    python scripts/long_context_bench.py --gguf llama-1b-q4_k_m.gguf --tokens 32768
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import numpy as np
from strata_rs import Engine
from strata_rs.bench.conversations import _measured_turn, memcpy_gb_s
from strata_rs.bench.peer_llama_cpp import new_llama

NEW_TOKENS = 60
GEN = 8


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


async def strata_burst(engine: Engine, ids: list[int], steps: int) -> tuple[float, list[int]]:
    """(tok/s after the first token, the burst's tokens) of `steps` + 1 greedy tokens."""
    stream = engine.generate(ids, max_tokens=steps + 1, temperature=0, ignore_eos=True)
    first = await stream.__anext__()
    t0 = time.perf_counter()
    out = list(first.token_ids)
    async for chunk in stream:
        out += chunk.token_ids
    return (len(out) - len(first.token_ids)) / (time.perf_counter() - t0), out


def llama_burst(llm: Any, lib: Any, token: int, steps: int) -> tuple[float, int]:
    """(1 / median step time, the next token) of `steps` one-token evals."""
    n_vocab = llm.n_vocab()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        llm.eval([token])
        times.append(time.perf_counter() - t0)
        logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
        token = int(np.argmax(logits))
    return 1.0 / statistics.median(times), token


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip-llama", action="store_true")
    args = ap.parse_args()
    n = args.tokens
    rng = np.random.default_rng(0)
    result: dict[str, Any] = {"tokens": n, "memcpy_gb_s": [memcpy_gb_s()]}

    per_conv = n + (args.rounds * 2 + 2) * (NEW_TOKENS + GEN) + args.rounds * (args.steps + 1) + 64
    probe = await Engine.load(args.gguf, host_cache_mib=0, disk_cache_mib=0, max_context=64)
    info = probe.info
    await probe.close()
    vocab = int(info["vocab_size"])
    bs, block_bytes = int(info["block_size"]), int(info["kv_block_bytes"])
    conv_mib = -(-per_conv // bs) * block_bytes / 2**20
    engine = await Engine.load(
        args.gguf,
        threads=args.threads,
        max_context=per_conv + bs,
        # One conversation and a little: a second one pushes the first to the host tier.
        kv_memory_mib=int(conv_mib * 1.03) + 1,
        host_cache_mib=int(conv_mib * 2.5) + 1,
        disk_cache_mib=0,
    )
    threads = int(engine.info["threads"])
    result["engine"] = engine.info

    def ids(count: int) -> list[int]:
        return [int(t) for t in rng.integers(300, vocab, size=count)]

    history = {"A": ids(n), "B": ids(n)}
    await engine.complete(ids(64), max_tokens=2, ignore_eos=True)

    log(f"strata-rs: prefill {n}")
    t0 = time.perf_counter()
    first = await engine.complete(history["A"], max_tokens=1, temperature=0, ignore_eos=True)
    result["strata_prefill_s"] = time.perf_counter() - t0
    history["A"] += first.token_ids
    log(f"strata-rs: {n / result['strata_prefill_s']:.1f} tok/s")

    lib = llm = None
    token = 0
    if not args.skip_llama:
        import llama_cpp

        lib = llama_cpp
        llm = new_llama(lib, args.gguf, -(-(per_conv + 512) // 256) * 256, threads)
        llm.set_cache(None)
        llm.eval(ids(64))
        llm.reset()
        log(f"llama.cpp {lib.__version__}: prefill {n}")
        t0 = time.perf_counter()
        llm.eval(history["A"][:n])
        result["llama_prefill_s"] = time.perf_counter() - t0
        log(f"llama.cpp: {n / result['llama_prefill_s']:.1f} tok/s")
        logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))
        token = int(np.argmax(logits))

    result["strata_decode_tok_s"], result["llama_decode_tok_s"] = [], []
    for r in range(args.rounds):
        rate, out = await strata_burst(engine, history["A"], args.steps)
        history["A"] += out
        result["strata_decode_tok_s"].append(rate)
        line = f"decode round {r + 1}: strata-rs {rate:.2f} tok/s"
        if llm is not None:
            rate, token = llama_burst(llm, lib, token, args.steps)
            result["llama_decode_tok_s"].append(rate)
            line += f", llama.cpp {rate:.2f} tok/s"
        log(line)
    result["memcpy_gb_s"].append(memcpy_gb_s())
    if llm is not None:
        llm.close()

    log(f"strata-rs: prefill conversation B ({n}), pushing A to the host tier")
    await engine.complete(history["B"], max_tokens=1, ignore_eos=True)
    result["returning"] = []
    for _ in range(args.rounds):
        for c in ("A", "B"):
            for where in ("host", "resident"):
                prompt = history[c] + ids(NEW_TOKENS)
                turn = await _measured_turn(engine, prompt, GEN)
                history[c] = prompt + turn.pop("answer")
                turn.update(conversation=c, expected=where, prompt_tokens=len(prompt))
                result["returning"].append(turn)
                gbs = (turn["restore"] or {}).get("gb_s")
                log(
                    f"{c} from {where}: TTFT {turn['ttft_s'] * 1e3:.0f} ms, "
                    f"hits {turn['hit_tokens']}, restore {gbs and round(gbs, 2)} GB/s"
                )
    result["stats"] = engine.stats()
    await engine.close()

    host = [t["ttft_s"] for t in result["returning"] if t["expected"] == "host"]
    res = [t["ttft_s"] for t in result["returning"] if t["expected"] == "resident"]
    summary = {
        "prefill_tok_s": {
            "strata-rs": n / result["strata_prefill_s"],
            "llama.cpp": n / result["llama_prefill_s"] if llm is not None else None,
        },
        "decode_tok_s_median": {
            "strata-rs": statistics.median(result["strata_decode_tok_s"]),
            "llama.cpp": statistics.median(result["llama_decode_tok_s"]) if llm else None,
        },
        "returning_ttft_ms_median": {
            "host": statistics.median(host) * 1e3,
            "resident": statistics.median(res) * 1e3,
            "host/resident": statistics.median(host) / statistics.median(res),
        },
        "memcpy_gb_s": result["memcpy_gb_s"],
        "weights_bytes_per_step": info.get("decode_weight_bytes"),
        "kv_bytes_per_step_at_n": n // bs * block_bytes,
    }
    result["summary"] = summary
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2, default=str)


if __name__ == "__main__":
    asyncio.run(main())
