"""Simulate conversation routing across replicas, running the router's own policy code.

A discrete-event simulation of a chat workload (conversations that return after think times)
over N replicas of one model, each with its own K/V cache (device pool + host tier, LRU). It
compares three ways to pick a replica for each request:

- `AffinityPolicy` from `python/strata_rs/ray/affinity.py`: the code the Ray Serve request
  router runs, loaded here by path so it runs without the compiled extension or Ray;
- round-robin;
- consistent hashing on the conversation id (a ring with 100 virtual nodes per replica).

Every figure it assumes (prefill and decode speed, restore bandwidth, block bytes, cache sizes)
is a constant below with its source; docs/scaling.md gives the setup, the results and what they
mean. Deterministic for a given `--seed`. Pure standard library.

    python3 scripts/simulate_routing.py [--replicas 4,16,64] [--json OUT]
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import importlib.util
import itertools
import json
import math
import multiprocessing
import random
import statistics
import sys
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

ROOT = Path(__file__).resolve().parent.parent
AFFINITY_PATH = ROOT / "python" / "strata_rs" / "ray" / "affinity.py"

# --- Measured figures (docs/benchmarks.md, AMD EPYC, 2 vCPUs, 1B Llama = Llama-3.2-1B's shape) ---
# "GGUF models with quantized weights", rerun 2026-12-03 16:40 UTC: 1B Q4_K_M, prefill 512
# tokens 141.1 / 140.4 / 144.9 tok/s over three runs; decode at context 512 34.0 / 30.1 / 33.1.
PREFILL_TOK_S = 141.1
DECODE_1_STREAM_TOK_S = 33.1
# 8 streams decode 3.8-4.25x one stream ("The engine: concurrent streams", smollm-135m; not
# measured on the 1B). A request's tokens are charged at a full batch's per-stream rate.
BATCH_SPEEDUP_8 = 4.0
# "Conversation cache: returning turns", rerun on the AMD EPYC: restore from host 8.2 / 8.9 GB/s
# (runs H, I).
RESTORE_BYTES_S = 8.2e9
# docs/operations.md, "Long conversations": Llama-3.2-1B f16 K/V is 32 KiB a token, so a
# 16-token block is 512 KiB.
BLOCK_TOKENS = 16
BLOCK_BYTES = 16 * 32 * 1024

# --- Replica model ---
SLOTS = 8  # requests a replica serves at once (the engine's max_batch in the serving bench)
DEVICE_BLOCKS = 1024 * 1024 * 1024 // BLOCK_BYTES  # a 1 GiB K/V pool: 2,048 blocks
HOST_BLOCKS = 4096 * 1024 * 1024 // BLOCK_BYTES  # --host-cache-mib's default 4096: 8,192 blocks

# --- Workload ---
SYSTEM_PROMPTS = 20
SYSTEM_ZIPF_S = 1.1  # popularity of the system prompts
TURNS_ZIPF_A = 1.5  # P(turns = k) ~ k^-a
MAX_TURNS = 30
THINK_MEDIAN_S = 45.0
THINK_SIGMA = 1.0  # lognormal: p90 ~ 3.6x the median, p99 ~ 10x
USER_TOKENS = (50, 300)
ANSWER_TOKENS = (100, 300)
SYSTEM_TOKENS = (250, 350)
TARGET_LOAD = 0.65  # of the binding resource, with every reusable prefix a hit


def load_affinity() -> ModuleType:
    """affinity.py by path: it imports only the standard library, so neither the compiled
    extension nor Ray is needed."""
    spec = importlib.util.spec_from_file_location("strata_affinity", AFFINITY_PATH)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {AFFINITY_PATH}")
    module = importlib.util.module_from_spec(spec)
    # dataclasses resolves the module's annotations through sys.modules.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def zipf_weights(n: int, s: float) -> list[float]:
    return [k**-s for k in range(1, n + 1)]


@dataclass
class Conversation:
    cid: int
    start: float
    system: int
    system_len: int
    users: list[int]
    answers: list[int]
    thinks: list[float]  # before turns 2.. (len = turns - 1)
    hashes: list[int] = field(default_factory=list)  # full blocks of the final sequence

    def prompt_len(self, turn: int) -> int:
        """Tokens of turn `turn`'s prompt (0-based): system, then each earlier user message
        and answer, then this turn's user message."""
        return self.system_len + sum(self.users[: turn + 1]) + sum(self.answers[:turn])


def make_trace(conversations: int, rng: random.Random) -> list[Conversation]:
    sys_lens = [rng.randint(*SYSTEM_TOKENS) for _ in range(SYSTEM_PROMPTS)]
    sys_w = zipf_weights(SYSTEM_PROMPTS, SYSTEM_ZIPF_S)
    turn_w = zipf_weights(MAX_TURNS, TURNS_ZIPF_A)
    trace = []
    for cid in range(conversations):
        system = rng.choices(range(SYSTEM_PROMPTS), sys_w)[0]
        turns = rng.choices(range(1, MAX_TURNS + 1), turn_w)[0]
        conv = Conversation(
            cid=cid,
            start=0.0,
            system=system,
            system_len=sys_lens[system],
            users=[rng.randint(*USER_TOKENS) for _ in range(turns)],
            answers=[rng.randint(*ANSWER_TOKENS) for _ in range(turns)],
            thinks=[
                rng.lognormvariate(math.log(THINK_MEDIAN_S), THINK_SIGMA) for _ in range(turns - 1)
            ],
        )
        # The chain property is what matters: block i's hash covers blocks 0..i, so two prompts
        # share exactly their common leading blocks. A block wholly inside the system prompt has
        # content (0, system, i), shared by every conversation with that system prompt; any
        # other block is this conversation's own. Tuples of ints hash the same in every process.
        total = conv.prompt_len(turns - 1) + conv.answers[-1]
        parent = 0
        for i in range(total // BLOCK_TOKENS):
            if (i + 1) * BLOCK_TOKENS <= conv.system_len:
                content = (0, system, i)
            else:
                content = (1, cid, i)
            parent = hash((parent, content))
            conv.hashes.append(parent)
        trace.append(conv)
    return trace


def ideal_cached(conv: Conversation, turn: int) -> int:
    """Prompt tokens any cache could hold (unbounded, one replica): the previous turn's whole
    sequence in full blocks, or the system prompt's full blocks on a first turn."""
    n = conv.prompt_len(turn)
    if turn == 0:
        blocks = conv.system_len // BLOCK_TOKENS
    else:
        blocks = (conv.prompt_len(turn - 1) + conv.answers[turn - 1]) // BLOCK_TOKENS
    return min(blocks * BLOCK_TOKENS, n - 1)


def per_stream_decode() -> float:
    return DECODE_1_STREAM_TOK_S * BATCH_SPEEDUP_8 / SLOTS


def arrival_rate(trace: list[Conversation], replicas: int) -> tuple[float, dict[str, float]]:
    """Conversations per second such that the binding resource (the prefill server or the
    slots) is TARGET_LOAD busy when every reusable prefix hits."""
    prefill_s, slot_s, requests = 0.0, 0.0, 0
    for conv in trace:
        for t in range(len(conv.users)):
            p = (conv.prompt_len(t) - ideal_cached(conv, t)) / PREFILL_TOK_S
            prefill_s += p
            slot_s += p + conv.answers[t] / per_stream_decode()
            requests += 1
    per_req_prefill = prefill_s / requests
    per_req_slot = slot_s / requests
    req_rate = TARGET_LOAD * replicas * min(1 / per_req_prefill, SLOTS / per_req_slot)
    conv_rate = req_rate * len(trace) / requests
    info = {
        "requests": requests,
        "mean_turns": requests / len(trace),
        "prefill_s_per_request_ideal": per_req_prefill,
        "slot_s_per_request_ideal": per_req_slot,
        "requests_per_s": req_rate,
        "conversations_per_s": conv_rate,
    }
    return conv_rate, info


class Router(Protocol):
    name: str

    def route(self, conv: Conversation, hashes: list[int], loads: dict[int, int]) -> int: ...
    def routed(self, replica: int, hashes: list[int]) -> None: ...
    def publish(self, replica: int, hashes: frozenset[int]) -> None: ...


class RoundRobin:
    def __init__(self, replicas: int) -> None:
        self.name = "round-robin"
        self.n = replicas
        self.next = 0

    def route(self, conv: Conversation, hashes: list[int], loads: dict[int, int]) -> int:
        r = self.next
        self.next = (self.next + 1) % self.n
        return r

    def routed(self, replica: int, hashes: list[int]) -> None:
        pass

    def publish(self, replica: int, hashes: frozenset[int]) -> None:
        pass


class ConsistentHash:
    """Conversation id onto a ring of 100 virtual nodes per replica. The OpenAI API carries no
    conversation id: a deployment would need a header or the `user` field for it."""

    def __init__(self, replicas: int, vnodes: int = 100) -> None:
        self.name = "consistent hash"
        ring = sorted((hash((0xC0FFEE, r, v)), r) for r in range(replicas) for v in range(vnodes))
        self.points = [p for p, _ in ring]
        self.owners = [r for _, r in ring]

    def route(self, conv: Conversation, hashes: list[int], loads: dict[int, int]) -> int:
        i = bisect.bisect(self.points, hash((0xBEEF, conv.cid))) % len(self.points)
        return self.owners[i]

    def routed(self, replica: int, hashes: list[int]) -> None:
        pass

    def publish(self, replica: int, hashes: frozenset[int]) -> None:
        pass


class Affinity:
    """The router's own `AffinityPolicy`, timed per `choose`. With `routers` > 1 there are that
    many ingress routers (Ray Serve runs one in each proxy), each with its own policy: a request
    lands on a random one, which records only what it routed itself; every router receives every
    replica's publications. Loads are exact and global (optimistic for several routers)."""

    def __init__(
        self,
        module: ModuleType,
        replicas: int,
        imbalance: int,
        seed: int,
        period: float,
        routers: int,
    ) -> None:
        self.name = f"affinity, {routers} router{'s' if routers > 1 else ''}, P={period:g} s"
        self.name += f", imbalance {imbalance}"
        # The policy's clock (routed hashes expire) is the simulation's.
        self.now = 0.0
        self.policies = [
            module.AffinityPolicy(
                imbalance=imbalance,
                rng=random.Random(seed * 1000 + i),
                clock=lambda: self.now,
            )
            for i in range(routers)
        ]
        for policy in self.policies:
            policy.set_replicas(range(replicas))
        self.rng = random.Random(seed)
        self.current = self.policies[0]
        self.choose_ns: list[int] = []
        self.view_hashes_max = 0

    def route(self, conv: Conversation, hashes: list[int], loads: dict[int, int]) -> int:
        self.current = self.policies[self.rng.randrange(len(self.policies))]
        t0 = time.perf_counter_ns()
        decision = self.current.choose(hashes, loads)
        self.choose_ns.append(time.perf_counter_ns() - t0)
        return decision.replica

    def routed(self, replica: int, hashes: list[int]) -> None:
        self.current.record(replica, hashes)

    def publish(self, replica: int, hashes: frozenset[int]) -> None:
        for policy in self.policies:
            policy.publish(replica, hashes)

    def view_hashes(self) -> int:
        """Hashes one router holds (the first): published sets plus routed entries."""
        return sum(len(v.published) + len(v.routed) for v in self.policies[0].views.values())

    def counts(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for policy in self.policies:
            total.update(policy.counts)
        return total


@dataclass
class Request:
    conv: Conversation
    turn: int
    arrival: float
    blocks: list[int]
    prompt_len: int
    queued_ahead: int = 0


class Replica:
    """A device pool and a host tier, both LRU over blocks; a block pushed out of the pool goes
    to the host tier, one pushed out of the host tier is dropped (no shared disk at scale). One
    prefill at a time (FIFO), at most SLOTS requests admitted; decode rides along."""

    def __init__(self) -> None:
        self.device: OrderedDict[int, None] = OrderedDict()
        self.host: OrderedDict[int, None] = OrderedDict()
        self.active = 0
        self.waiting: deque[Request] = deque()
        self.prefill_free_at = 0.0
        self.prefill_busy = 0.0
        self.served = 0
        self.dirty = True

    def insert(self, blocks: list[int]) -> None:
        """These blocks become the most recent on the device (each leaves the host tier)."""
        device, host = self.device, self.host
        for h in blocks:
            if h in device:
                device.move_to_end(h)
                continue
            host.pop(h, None)
            device[h] = None
            if len(device) > DEVICE_BLOCKS:
                old, _ = device.popitem(last=False)
                host[old] = None
                if len(host) > HOST_BLOCKS:
                    host.popitem(last=False)
        self.dirty = True

    def lookup(self, blocks: list[int]) -> tuple[int, int]:
        """Leading blocks held (on the device, restored from the host); the prompt's blocks
        are then the most recent on the device."""
        on_device = from_host = 0
        for h in blocks:
            if h in self.device:
                on_device += 1
            elif h in self.host:
                from_host += 1
            else:
                break
        self.insert(blocks)
        return on_device, from_host

    def held(self) -> frozenset[int]:
        return frozenset(itertools.chain(self.device, self.host))


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def simulate(
    trace: list[Conversation],
    router: Router,
    replicas: int,
    conv_rate: float,
    period: float,
    seed: int,
) -> dict[str, Any]:
    rng = random.Random(seed)
    reps = [Replica() for _ in range(replicas)]
    # Events: (time, seq, kind, payload). seq keeps the order stable for equal times.
    events: list[tuple[float, int, str, Any]] = []
    seq = 0

    def push(t: float, kind: str, payload: Any) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, payload))
        seq += 1

    t = 0.0
    last_arrival = 0.0
    for conv in trace:
        t += rng.expovariate(conv_rate)
        conv.start = t
        push(t, "arrive", (conv, 0))
    horizon = t
    if period > 0:
        # Each replica publishes on its own phase, as Ray Serve's replicas do.
        for r in range(replicas):
            push(rng.uniform(0, period), "publish", r)

    ttft: list[float] = []
    prompt_tokens = cached_tokens = restored_tokens = ideal_tokens = 0
    queue_seen: list[int] = []
    pending = len(trace)

    def admit(r: int, req: Request, now: float) -> None:
        nonlocal prompt_tokens, cached_tokens, restored_tokens, ideal_tokens
        rep = reps[r]
        rep.active += 1
        rep.served += 1
        on_device, from_host = rep.lookup(req.blocks)
        cached = min((on_device + from_host) * BLOCK_TOKENS, req.prompt_len - 1)
        restored = min(from_host * BLOCK_TOKENS, cached)
        prompt_tokens += req.prompt_len
        cached_tokens += cached
        restored_tokens += restored
        ideal_tokens += ideal_cached(req.conv, req.turn)
        work = (req.prompt_len - cached) / PREFILL_TOK_S + from_host * BLOCK_BYTES / RESTORE_BYTES_S
        start = max(now, rep.prefill_free_at)
        rep.prefill_free_at = start + work
        rep.prefill_busy += work
        first = start + work
        ttft.append(first - req.arrival)
        answer = req.conv.answers[req.turn]
        push(first + answer / per_stream_decode(), "done", (r, req))

    while events:
        now, _, kind, payload = heapq.heappop(events)
        if isinstance(router, Affinity):
            router.now = now
        if kind == "arrive":
            conv, turn = payload
            last_arrival = now
            n = conv.prompt_len(turn)
            blocks = conv.hashes[: n // BLOCK_TOKENS]
            loads = {r: reps[r].active + len(reps[r].waiting) for r in range(replicas)}
            r = router.route(conv, blocks, loads)
            router.routed(r, blocks)
            req = Request(conv, turn, now, blocks, n, len(reps[r].waiting))
            queue_seen.append(len(reps[r].waiting))
            if reps[r].active < SLOTS:
                admit(r, req, now)
            else:
                reps[r].waiting.append(req)
        elif kind == "done":
            r, req = payload
            rep = reps[r]
            # The whole sequence's full blocks stay cached: the prompt's went in at admission,
            # the answer's (with the prompt's last partial block) go in now.
            conv = req.conv
            rep.insert(
                conv.hashes[
                    req.prompt_len // BLOCK_TOKENS : (req.prompt_len + conv.answers[req.turn])
                    // BLOCK_TOKENS
                ]
            )
            rep.active -= 1
            if rep.waiting:
                admit(r, rep.waiting.popleft(), now)
            if req.turn + 1 < len(conv.users):
                push(now + conv.thinks[req.turn], "arrive", (conv, req.turn + 1))
            else:
                pending -= 1
        elif kind == "publish":
            r = payload
            if reps[r].dirty:
                router.publish(r, reps[r].held())
                reps[r].dirty = False
            if isinstance(router, Affinity):
                router.view_hashes_max = max(router.view_hashes_max, router.view_hashes())
            if pending:
                push(now + period, "publish", r)

    served = [rep.served for rep in reps]
    busy = [rep.prefill_busy for rep in reps]
    out: dict[str, Any] = {
        "policy": router.name,
        "replicas": replicas,
        "requests": len(ttft),
        "horizon_s": horizon,
        "hit_rate": cached_tokens / prompt_tokens,
        "ideal_hit_rate": ideal_tokens / prompt_tokens,
        "restored_share": restored_tokens / max(1, cached_tokens),
        # Prefill work over the time requests arrived in: the offered load per replica.
        "prefill_util_mean": statistics.fmean(busy) / last_arrival,
        "imbalance_requests": max(served) / statistics.fmean(served),
        "imbalance_busy": max(busy) / statistics.fmean(busy),
        "queue_p99": percentile([float(q) for q in queue_seen], 0.99),
        "ttft_p50_s": percentile(ttft, 0.50),
        "ttft_p99_s": percentile(ttft, 0.99),
    }
    if isinstance(router, Affinity):
        ns = router.choose_ns
        out["reasons"] = dict(router.counts())
        out["choose_us_mean"] = statistics.fmean(ns) / 1e3
        out["choose_us_p99"] = percentile([float(x) for x in ns], 0.99) / 1e3
        out["view_hashes_end"] = router.view_hashes()
        out["view_hashes_max"] = router.view_hashes_max
        views = router.policies[0].views.values()
        out["published_hashes_per_replica_mean"] = statistics.fmean(len(v.published) for v in views)
    return out


def run_case(
    trace: list[Conversation],
    module: ModuleType,
    policy: str,
    replicas: int,
    conv_rate: float,
    seed: int,
) -> dict[str, Any]:
    router: Router
    period = 0.0
    if policy == "rr":
        router = RoundRobin(replicas)
    elif policy == "chash":
        router = ConsistentHash(replicas)
    else:
        # "aff:PERIOD:IMBALANCE:ROUTERS"
        _, p, imb, nr = policy.split(":")
        period = float(p)
        router = Affinity(module, replicas, int(imb), seed, period, int(nr))
    t0 = time.perf_counter()
    res = simulate(trace, router, replicas, conv_rate, period, seed)
    res["wall_s"] = time.perf_counter() - t0
    return res


def fmt_table(results: list[dict[str, Any]]) -> str:
    head = (
        "| replicas | policy | hit rate | prefill busy | imbalance (requests / prefill time) "
        "| queue p99 | TTFT p50 | TTFT p99 | decisions (prefix / overloaded / no_prefix) |"
    )
    lines = [head, "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in results:
        reasons = r.get("reasons")
        dec = (
            " / ".join(str(reasons.get(k, 0)) for k in ("prefix", "overloaded", "no_prefix"))
            if reasons is not None
            else ""
        )
        lines.append(
            f"| {r['replicas']} | {r['policy']} | {r['hit_rate']:.1%} "
            f"| {r['prefill_util_mean']:.0%} "
            f"| {r['imbalance_requests']:.2f} / {r['imbalance_busy']:.2f} | {r['queue_p99']:.0f} "
            f"| {r['ttft_p50_s']:.2f} s | {r['ttft_p99_s']:.1f} s | {dec} |"
        )
    return "\n".join(lines)


def fmt_router_cost(results: list[dict[str, Any]]) -> str:
    lines = [
        "| replicas | policy | `choose` mean | `choose` p99 | hashes in one router's views (max) "
        "| published per replica |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        if "choose_us_mean" not in r:
            continue
        lines.append(
            f"| {r['replicas']} | {r['policy']} | {r['choose_us_mean']:.0f} µs "
            f"| {r['choose_us_p99']:.0f} µs "
            f"| {r['view_hashes_max']:,} | {r['published_hashes_per_replica_mean']:,.0f} |"
        )
    return "\n".join(lines)


_TRACE: list[Conversation] = []
_MODULE: ModuleType | None = None


def _case(policy: str, replicas: int, conv_rate: float, seed: int) -> dict[str, Any]:
    assert _MODULE is not None
    return run_case(_TRACE, _MODULE, policy, replicas, conv_rate, seed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=10_000)
    ap.add_argument("--replicas", default="4,16,64")
    ap.add_argument(
        "--policies",
        default="aff:10:4:1,aff:10:8:1,aff:10:4:4,aff:1:4:4,rr,chash",
        help="comma-separated: aff:PERIOD_S:IMBALANCE:ROUTERS (AffinityPolicy), rr, chash",
    )
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=2, help="cases run in parallel (processes)")
    ap.add_argument("--json", type=Path, help="write every figure here")
    args = ap.parse_args()

    global _TRACE, _MODULE
    # Loaded once, before the workers fork: every case runs the same version of the policy.
    _MODULE = load_affinity()
    _TRACE = make_trace(args.conversations, random.Random(args.seed))
    meta: dict[str, Any] = {}
    cases = []
    for replicas in (int(x) for x in args.replicas.split(",")):
        conv_rate, info = arrival_rate(_TRACE, replicas)
        meta[str(replicas)] = info
        print(
            f"# {replicas} replicas: {info['requests']} requests ({info['mean_turns']:.2f} turns a "
            f"conversation), {info['requests_per_s']:.3f} requests/s, "
            f"ideal prefill {info['prefill_s_per_request_ideal']:.2f} s/request",
            file=sys.stderr,
        )
        cases += [(policy, replicas, conv_rate, args.seed) for policy in args.policies.split(",")]
    # Worker processes inherit the trace (fork); every case is independent and deterministic.
    with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
        results = pool.starmap(_case, cases, chunksize=1)
    for res in results:
        print(
            f"#   {res['replicas']} x {res['policy']}: {res['wall_s']:.1f} s wall", file=sys.stderr
        )
    print(fmt_table(results))
    print()
    print(fmt_router_cost(results))
    if args.json:
        args.json.write_text(json.dumps({"workload": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
