"""The soak: minutes of load with faults against a real `strata-rs serve`, then SIGKILLs while it
writes its disk tier. Prints the figures (docs/benchmarks.md, "Soak") and exits 1 when the run
broke a promise. The default tests run the same code for seconds (tests/test_soak.py).

    python benches/soak.py                      # 5 minutes of load, 20 kills
    python benches/soak.py --seconds 60 --json soak.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from strata_rs.testing.soak import LoadOptions, SoakReport, run_crashes, run_load


def print_load(load: SoakReport, seed: int) -> None:
    s = load.server
    print(f"load: {load.seconds:.0f} s, {load.clients} clients, seed {seed}")
    print(
        f"  requests: {load.accepted} accepted ({load.completed} answered, all checked; "
        f"{load.cancelled} cancelled, {load.disconnected} dropped), {load.rejected} refused "
        f"with 503 + Retry-After; {load.generated_tokens} tokens checked"
    )
    print(f"  wrong answers {len(load.mismatches)}, errors {len(load.errors)}")
    print(f"  /health: {load.health_checks} checks, {len(load.health_failures)} not 200")
    print(
        f"  RSS {load.rss_after_warmup / 2**20:.1f} MiB after warm-up, "
        f"{load.rss_at_end / 2**20:.1f} MiB at the end ({load.rss_ratio:.3f}x)"
    )
    print(f"  at the end: running {s['running']}, waiting {s['waiting']}, blocks used "
          f"{s['kv_blocks_used']}; preemptions {s['preemptions']}")  # fmt: skip
    print(f"  faults injected {s['faults_injected']}")
    print(f"  refusals {s['refusals']}, corrupt files {s['corrupt_files']}")
    print(f"  moves {s['moves']}")
    print(f"  hit tokens {s['hit_tokens']}")
    for e in load.events:
        print(f"  {e}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seconds", type=float, default=300.0, help="load after warm-up (default 300)")
    p.add_argument("--warmup", type=float, default=30.0, help="warm-up before the RSS baseline")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--no-faults", action="store_true", help="load only, no injected faults")
    p.add_argument("--kills", type=int, default=20, help="SIGKILL cycles (0: none)")
    p.add_argument("--no-load", action="store_true", help="the SIGKILL cycles only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", type=Path, default=None, help="default: the tiny test model")
    p.add_argument("--json", type=Path, default=None, help="also write the reports here")
    args = p.parse_args()

    t0 = time.monotonic()
    opts = LoadOptions(
        seconds=args.seconds,
        warmup=args.warmup,
        clients=args.clients,
        faults=not args.no_faults,
        seed=args.seed,
    )
    load = None if args.no_load else run_load(opts, model=args.model)
    if load is not None:
        print_load(load, args.seed)

    crashes = None
    if args.kills:
        crashes = run_crashes(cycles=args.kills, seed=args.seed, model=args.model)
        kills = crashes.cycles[:-1]
        print(f"crashes: {len(kills)} SIGKILLs")
        for c in crashes.cycles:
            print(
                f"  {c['cycle']:>2} {c['kill']:<10} after {c['killed_after_s']:>4} s: adopted "
                f"{c['adopted']} of {c['valid_before']} valid files ({c['temp_before']} temp, "
                f"{c['temp_deleted']} deleted, {len(c['invalid_before'])} invalid); "
                f"{c['answers_checked']} answers checked; disk hits {c['disk_hit_tokens']} tokens"
            )
        mid = sum(1 for c in kills if c["temp_after"])
        print(f"  kills that left a half-written temp file: {mid} of {len(kills)}")

    problems = (load.problems() if load else []) + (crashes.problems() if crashes else [])
    print(f"problems: {problems or 'none'} ({time.monotonic() - t0:.0f} s)")
    if args.json:
        out = {
            "load": load and load.as_dict(),
            "crashes": crashes and crashes.cycles,
            "problems": problems,
        }
        args.json.write_text(json.dumps(out, indent=1, default=str))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
