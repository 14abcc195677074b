"""Ray Serve's request router running the conversation-affinity policy (strata_rs.ray.affinity)
on live replicas. It runs inside the process that holds the deployment handle (the ingress)."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from strata_rs.ray import metrics
from strata_rs.ray.affinity import AffinityPolicy, Decision
from strata_rs.ray.replica import decode_hashes

logger = logging.getLogger("strata_rs.ray")

MAX_PENDING_DECISIONS = 4096


class ConversationAffinityRouter(RequestRouter):
    """Sends a prompt to the replica holding the longest prefix of it (`prefix_hashes`, the
    call's keyword argument), unless that replica is overloaded; else the less loaded of two.
    Counts each routed request by reason (the policy's, or "fallback" when the first choice
    could not take it and another did)."""

    def initialize_state(
        self, imbalance: int = 8, min_match: float = 0.5, routed_capacity: int = 1 << 16
    ) -> None:
        self.policy = AffinityPolicy(
            imbalance=imbalance, min_match=min_match, routed_capacity=routed_capacity
        )
        self.decisions: dict[str, tuple[list[int], Decision]] = {}
        self.routed: Counter[str] = Counter()
        # The routing stats object each replica last published, to parse each one once.
        self.published: dict[ReplicaID, Any] = {}
        metrics.ROUTERS.append(self)

    def _refresh(self, candidates: list[RunningReplica]) -> None:
        self.policy.set_replicas(self.curr_replicas)
        for gone in set(self.published) - set(self.curr_replicas):
            del self.published[gone]
        for r in candidates:
            stats = r.routing_stats
            if stats and stats is not self.published.get(r.replica_id):
                self.published[r.replica_id] = stats
                self.policy.publish(r.replica_id, decode_hashes(stats.get("hashes", b"")))

    def _load(self, r: RunningReplica) -> int:
        queued = self.replica_queue_len_cache.get(r.replica_id)
        if queued is not None:
            return int(queued)
        stats = r.routing_stats or {}
        return int(stats.get("running", 0)) + int(stats.get("waiting", 0))

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        self._refresh(candidate_replicas)
        hashes: list[int] = []
        if pending_request is not None:
            hashes = list(pending_request.kwargs.get("prefix_hashes") or [])
        by_id = {r.replica_id: r for r in candidate_replicas}
        loads = {rid: self._load(r) for rid, r in by_id.items()}
        decision = self.policy.choose(hashes, loads, count=False)
        # Only the requests the ingress forwards are counted and remembered (not its own calls).
        if pending_request is not None and pending_request.metadata.call_method == "handle":
            key = pending_request.metadata.internal_request_id
            self.decisions[key] = (hashes, decision)
            # Requests cancelled before they were routed leave theirs: keep the newest only.
            while len(self.decisions) > MAX_PENDING_DECISIONS:
                del self.decisions[next(iter(self.decisions))]
        ranks = [[by_id[decision.replica]]]
        if decision.fallbacks:
            ranks.append([by_id[r] for r in decision.fallbacks])
        return ranks

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        key = pending_request.metadata.internal_request_id
        entry = self.decisions.pop(key, None)
        if entry is None:
            return
        hashes, decision = entry
        reason = decision.reason if replica_id == decision.replica else "fallback"
        self.routed[reason] += 1
        self.policy.counts[reason] += 1
        self.policy.record(replica_id, hashes)

    def replica_stats(self) -> dict[str, dict[str, Any]]:
        """Each replica's last published stats (without the hashes), by replica id."""
        # Read from Ray's replica records, which it updates as replicas publish, not from what
        # the last routing decision saw.
        return {
            rid.unique_id: {k: v for k, v in (r.routing_stats or {}).items() if k != "hashes"}
            for rid, r in self.curr_replicas.items()
        }
