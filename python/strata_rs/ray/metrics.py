"""The ingress's /metrics: the router's decisions by reason, and every replica's own metrics (the
text its server's /metrics would give) as it last published them, each sample labelled with its
replica."""

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
    """The router's decisions by reason, the ingress's retries, the replicas it knows (with their
    pids), and every replica's own metrics as it last published them (labelled by replica), in
    Prometheus' text format."""
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
    texts = {rid: s["metrics"] for rid, s in sorted(stats.items()) if "metrics" in s}
    lines.append("# HELP strata_replica_info A replica the router knows, and its process.")
    lines.append("# TYPE strata_replica_info gauge")
    for rid, s in sorted(stats.items()):
        lines.append(f'strata_replica_info{{replica="{rid}",pid="{s.get("pid", "")}"}} 1')
    lines.extend(merge_labelled(texts))
    return "\n".join(lines) + "\n"


def _labelled(sample: str, replica: str) -> str:
    """A Prometheus sample line with `replica="..."` as its first label."""
    label = f'replica="{replica}"'
    name, brace, rest = sample.partition("{")
    if brace:
        return f"{name}{{{label},{rest}" if not rest.startswith("}") else f"{name}{{{label}{rest}"
    name, space, value = sample.partition(" ")
    return f"{name}{{{label}}}{space}{value}"


def merge_labelled(texts: dict[str, str]) -> list[str]:
    """Several replicas' metrics texts (Prometheus' text format) as one: each family's HELP and
    TYPE once, then every replica's samples of it, labelled with the replica."""
    headers: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for replica, text in texts.items():
        family = ""
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split(" ", 3)[2]
                known = headers.setdefault(family, [])
                if len(known) < 2 and line not in known:
                    known.append(line)
                samples.setdefault(family, [])
            elif line and not line.startswith("#"):
                samples.setdefault(family, []).append(_labelled(line, replica))
    out: list[str] = []
    for family, header in headers.items():
        out.extend(header)
        out.extend(samples.get(family, []))
    return out
