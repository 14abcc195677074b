"""The conversation-affinity policy: which replica a prompt goes to. Pure Python, no Ray: the
request router (`strata_rs.ray.router`) runs it on live replicas, and `scripts/simulate_routing.py`
runs the same code over a simulated trace (docs/scaling.md).

A prompt is the chain of its full blocks' prefix hashes (`strata_rs.prefix_block_hashes`), the
keys under which every engine caches K/V. A replica's view is what it last published (the hashes
it holds on its device and in its host RAM, `Engine.cached_block_hashes`) plus what this router
sent it recently (its engine will hold those once the request ran; publishing lags); a routed
hash the replica still does not hold `routed_ttl` seconds later is dropped (evicted, or never
computed). The policy:

1. A replica is overloaded when its load (ongoing requests) exceeds the mean load by more than
   `imbalance` (default 8, a whole batch of the engine's default `max_batch`; in the simulation
   of docs/scaling.md, 4 sent enough returning turns away at 4 replicas to tip the cluster past
   its prefill capacity). Among the others (never none: the least loaded is at most the mean),
   the one holding the longest prefix of the prompt (most leading blocks) gets it ("prefix")
   when that prefix is at least `min_match` of the prompt's blocks (a returning conversation's
   history is most of its prompt; a system prompt that many conversations share is not, and
   following it would pile them all onto one replica). Ties go to the less loaded.
2. Otherwise the less loaded of two random replicas that are not overloaded, and of two equally
   loaded ones the one holding fewer blocks, which spreads new conversations evenly over idle
   replicas: "overloaded" when only an overloaded replica held enough of the prompt, else
   "no_prefix".
"""

from __future__ import annotations

import random
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

# The routing decisions, as counted.
REASONS = ("prefix", "overloaded", "no_prefix")


@dataclass
class _View:
    published: frozenset[int] = frozenset()
    # Hashes of prompts routed here and not published yet, with when (oldest first); bounded,
    # so a replica that never publishes cannot grow the router without limit.
    routed: OrderedDict[int, float] = field(default_factory=OrderedDict)

    def holds(self, h: int) -> bool:
        return h in self.published or h in self.routed


@dataclass(frozen=True)
class Decision:
    """The replica chosen, why, the blocks of the prompt it holds, and the others by preference
    (fallbacks when the chosen one cannot take the request)."""

    replica: Hashable
    reason: str
    matched_blocks: int
    fallbacks: tuple[Hashable, ...]


class AffinityPolicy:
    def __init__(
        self,
        imbalance: int = 8,
        min_match: float = 0.5,
        routed_capacity: int = 1 << 16,
        routed_ttl: float = 60.0,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if imbalance < 0:
            raise ValueError(f"imbalance: must be >= 0, got {imbalance}")
        if not 0.0 <= min_match <= 1.0:
            raise ValueError(f"min_match: must be in [0, 1], got {min_match}")
        if routed_capacity < 1:
            raise ValueError(f"routed_capacity: must be >= 1, got {routed_capacity}")
        self.imbalance = imbalance
        self.min_match = min_match
        self.routed_capacity = routed_capacity
        self.routed_ttl = routed_ttl
        self.clock = clock
        self.rng = rng or random.Random()
        self.views: dict[Hashable, _View] = {}
        self.counts: Counter[str] = Counter()

    def set_replicas(self, replicas: Iterable[Hashable]) -> None:
        """The replicas that exist now: new ones start empty, gone ones are forgotten."""
        keep = set(replicas)
        for r in list(self.views):
            if r not in keep:
                del self.views[r]
        for r in keep:
            self.views.setdefault(r, _View())

    def publish(self, replica: Hashable, hashes: Iterable[int]) -> None:
        """What `replica` reports holding now (replaces its last report). Routed hashes it holds
        are now known from the report; those routed more than `routed_ttl` ago that it does not
        hold, it no longer has."""
        view = self.views.setdefault(replica, _View())
        view.published = frozenset(hashes)
        cutoff = self.clock() - self.routed_ttl
        view.routed = OrderedDict(
            (h, t) for h, t in view.routed.items() if t >= cutoff and h not in view.published
        )

    def held_blocks(self, replica: Hashable) -> int:
        """Blocks the router believes the replica holds: published, plus routed since (which
        may count a block twice; it only breaks ties)."""
        view = self.views.get(replica)
        return 0 if view is None else len(view.published) + len(view.routed)

    def matched_blocks(self, replica: Hashable, hashes: Sequence[int]) -> int:
        """How many leading blocks of the prompt the replica holds, as far as the router knows."""
        view = self.views.get(replica)
        if view is None:
            return 0
        n = 0
        for h in hashes:
            if not view.holds(h):
                break
            n += 1
        return n

    def choose(
        self, hashes: Sequence[int], loads: Mapping[Hashable, int], count: bool = True
    ) -> Decision:
        """The replica for a prompt with these block hashes, among `loads`' keys (each
        replica's ongoing requests). Raises ValueError when there is none."""
        candidates = list(loads)
        if not candidates:
            raise ValueError("loads: no replica to route to")
        mean = sum(loads.values()) / len(candidates)
        fits = [r for r in candidates if loads[r] - mean <= self.imbalance]
        matches = {r: self.matched_blocks(r, hashes) for r in candidates}
        need = max(1.0, self.min_match * len(hashes))

        def holder(among: list[Hashable]) -> Hashable | None:
            best = max(among, key=lambda r: (matches[r], -loads[r]))
            return best if matches[best] >= need else None

        chosen = holder(fits)
        if chosen is not None:
            reason = "prefix"
        else:
            reason = "overloaded" if holder(candidates) is not None else "no_prefix"
            two = self.rng.sample(fits, min(2, len(fits)))
            chosen = min(two, key=lambda r: (loads[r], self.held_blocks(r)))
        if count:
            self.counts[reason] += 1
        rest = sorted((r for r in candidates if r != chosen), key=lambda r: loads[r])
        return Decision(chosen, reason, matches[chosen], tuple(rest))

    def record(self, replica: Hashable, hashes: Sequence[int]) -> None:
        """The prompt went to `replica`: its engine will hold these blocks."""
        view = self.views.setdefault(replica, _View())
        now = self.clock()
        for h in hashes:
            if h not in view.published:
                view.routed[h] = now
                view.routed.move_to_end(h)
        while len(view.routed) > self.routed_capacity:
            view.routed.popitem(last=False)
