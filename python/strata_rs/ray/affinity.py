"""The conversation-affinity policy: which replica a prompt goes to. Pure Python, no Ray: the
request router (`strata_rs.ray.router`) runs it on live replicas, and `scripts/simulate_routing.py`
runs the same code over a simulated trace (docs/scaling.md).

A prompt is the chain of its full blocks' prefix hashes (`strata_rs.prefix_block_hashes`), the
keys under which every engine caches K/V. A replica's view is what it last published (the hashes
it holds on its device and in its host RAM, `Engine.cached_block_hashes`) plus what this router
sent it since (its engine will hold those once the request ran; publishing lags). The policy:

1. The replica holding the longest prefix of the prompt (most leading blocks) gets it ("prefix")
   when that prefix is at least `min_match` of the prompt's blocks (a returning conversation's
   history is most of its prompt; a system prompt that many conversations share is not, and
   following it would pile them all onto one replica). Ties go to the less loaded. When the
   holder's load exceeds the least loaded replica's by more than `imbalance` requests, it is
   "overloaded" and the prompt goes as in 2.
2. Otherwise ("no_prefix"): the less loaded of two random replicas (power of two choices), and
   of two equally loaded ones the one holding fewer blocks, which spreads new conversations
   evenly over idle replicas.
"""

from __future__ import annotations

import random
from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

# The routing decisions, as counted.
REASONS = ("prefix", "overloaded", "no_prefix")


@dataclass
class _View:
    published: frozenset[int] = frozenset()
    # Hashes of prompts routed here since, oldest first; bounded, so a replica that never
    # publishes cannot grow the router without limit.
    routed: OrderedDict[int, None] = field(default_factory=OrderedDict)

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
        imbalance: int = 4,
        min_match: float = 0.5,
        routed_capacity: int = 1 << 16,
        rng: random.Random | None = None,
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
        """What `replica` reports holding now (replaces its last report)."""
        self.views.setdefault(replica, _View()).published = frozenset(hashes)

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
        matches = {r: self.matched_blocks(r, hashes) for r in candidates}
        least = min(loads.values())
        best = max(candidates, key=lambda r: (matches[r], -loads[r]))
        enough = matches[best] > 0 and matches[best] >= self.min_match * len(hashes)
        if enough and loads[best] - least <= self.imbalance:
            reason, chosen = "prefix", best
        else:
            reason = "overloaded" if enough else "no_prefix"
            two = self.rng.sample(candidates, min(2, len(candidates)))
            chosen = min(two, key=lambda r: (loads[r], self.held_blocks(r)))
        if count:
            self.counts[reason] += 1
        rest = sorted((r for r in candidates if r != chosen), key=lambda r: loads[r])
        return Decision(chosen, reason, matches[chosen], tuple(rest))

    def record(self, replica: Hashable, hashes: Sequence[int]) -> None:
        """The prompt went to `replica`: its engine will hold these blocks."""
        view = self.views.setdefault(replica, _View())
        for h in hashes:
            view.routed[h] = None
            view.routed.move_to_end(h)
        while len(view.routed) > self.routed_capacity:
            view.routed.popitem(last=False)
