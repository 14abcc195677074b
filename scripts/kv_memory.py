"""The K/V memory an engine takes and the context it serves, for a list of load options.

    python scripts/kv_memory.py --model M.gguf [--json out.json] [--held TOKENS]

For each set of options (max_context, kv_memory_mib, max_batch), loads the engine, reads
`info()` (the served context and the pool's blocks) and `stats()` (the K/V bytes in use, the
window slots of sliding-window layers), and closes it. No token is computed. With `--held`, one
conversation of that many (random) prompt tokens then runs to its first token, and the blocks
it left cached and the window slots they keep are reported: what a conversation holds.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import anyio
from strata_rs import Engine

CASES: list[dict[str, int]] = [
    {"max_context": 8192},
    {"max_context": 32768},
    {"max_context": 131072},
    {"kv_memory_mib": 256},
    {"kv_memory_mib": 256, "max_batch": 4},
]


async def measure(model: str, options: dict[str, int]) -> dict[str, Any]:
    engine = await Engine.load(model, host_cache_mib=0, disk_cache_mib=0, **options)
    try:
        info, stats = engine.info, engine.stats()
        return {
            "options": options,
            "max_context": info["max_context"],
            "kv_blocks": info["kv_blocks"],
            "kv_mib": stats["memory"]["cpu"]["in_use_bytes"]["kv"] / 2**20,
            "window_slots": stats.get("kv_window_slots_total"),
        }
    finally:
        await engine.close()


async def held(model: str, tokens: int) -> dict[str, Any]:
    engine = await Engine.load(model, max_context=tokens + 16, host_cache_mib=0, disk_cache_mib=0)
    try:
        vocab = engine.info["vocab_size"]
        prompt = [(i * 7919 + 13) % (vocab - 10) + 5 for i in range(tokens)]
        await engine.complete(prompt, max_tokens=1, temperature=0)
        s = engine.stats()
        return {
            "held_tokens": tokens,
            "kv_blocks_cached": s["kv_blocks_cached"],
            "kv_window_slots_used": s["kv_window_slots_used"],
            "kv_window_slots_passed": s["kv_window_slots_passed"],
        }
    finally:
        await engine.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--json")
    parser.add_argument("--held", type=int)
    args = parser.parse_args()
    rows = []
    if args.held:
        row = await held(args.model, args.held)
        print(json.dumps(row))
        rows.append(row)
    for options in CASES:
        row = await measure(args.model, options)
        print(json.dumps(row))
        rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    anyio.run(main)
