"""The ingress's /metrics: the router's decisions by reason and each replica's engine figures as
it last published them (labelled by replica)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from strata_rs.ray.router import ConversationAffinityRouter

# The routers of this process (one per deployment handle), which register themselves here: Ray
# Serve ships a custom router's own module by value, so a registry there would be a copy.
ROUTERS: list[ConversationAffinityRouter] = []

# Requests the ingress sent again because their replica died before answering.
retries = 0


def render_metrics() -> str:
    """The router's decisions by reason, and each replica's engine figures as it last published
    them (labelled by replica), in Prometheus' text format."""
    lines = [
        "# HELP strata_router_requests_total Requests routed, by the router's reason.",
        "# TYPE strata_router_requests_total counter",
    ]
    reasons = ("prefix", "overloaded", "no_prefix", "fallback")
    for reason in reasons:
        n = sum(r.routed[reason] for r in ROUTERS)
        lines.append(f'strata_router_requests_total{{reason="{reason}"}} {n}')
    lines.append("# HELP strata_ingress_retries_total Requests sent again: their replica died.")
    lines.append("# TYPE strata_ingress_retries_total counter")
    lines.append(f"strata_ingress_retries_total {retries}")
    stats = {rid: s for r in ROUTERS for rid, s in r.replica_stats().items()}
    lines.append("# HELP strata_replica_info A replica the router knows, and its process.")
    lines.append("# TYPE strata_replica_info gauge")
    for rid, s in sorted(stats.items()):
        lines.append(f'strata_replica_info{{replica="{rid}",pid="{s.get("pid", "")}"}} 1')
    for name, kind, doc in (
        ("running", "gauge", "Sequences the replica's engine is running."),
        ("waiting", "gauge", "Requests waiting for the replica's engine."),
        ("kv_usage", "gauge", "Fraction of the replica's K/V blocks in use."),
        ("prompt_tokens", "counter", "Prompt tokens the replica's engine received."),
        ("prefix_hit_tokens", "counter", "Prompt tokens the replica found cached on its device."),
        ("generated_tokens", "counter", "Tokens the replica's engine generated."),
    ):
        metric = f"strata_replica_{name}" + ("_total" if kind == "counter" else "")
        lines.append(f"# HELP {metric} {doc} As the replica last published it.")
        lines.append(f"# TYPE {metric} {kind}")
        for rid, s in sorted(stats.items()):
            if name in s:
                lines.append(f'{metric}{{replica="{rid}"}} {s[name]}')
    return "\n".join(lines) + "\n"
