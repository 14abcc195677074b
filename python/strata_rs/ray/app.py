"""`build_app`: the Ray Serve application of strata-rs (an ingress over engine replicas routed
by conversation affinity)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from strata_rs.ray.ingress import Ingress
from strata_rs.ray.replica import EngineReplica
from strata_rs.ray.router import ConversationAffinityRouter
from strata_rs.server.app import Settings

ROUTERS = ("affinity", "power_of_two")


def build_app(
    model: str | Path,
    *,
    replicas: int = 1,
    min_replicas: int | None = None,
    max_replicas: int | None = None,
    target_ongoing_requests: float | None = None,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
    max_ongoing_requests: int = 64,
    routing_stats_period_s: float = 1.0,
    imbalance: int = 8,
    min_match: float = 0.5,
    request_router: str = "affinity",
    settings: Settings | None = None,
    health_check_period_s: float = 5.0,
    **engine_options: Any,
) -> Application:
    """The Ray Serve application: an ingress (HTTP, the OpenAI API) over `replicas` engines of
    `model`, routed by conversation affinity. Keyword arguments not named here are
    `Engine.load`'s (max_batch, disk_cache_dir, ...); `disk_write_when_idle` defaults to True so
    that a replica's conversations survive it on a shared disk_cache_dir.

    min_replicas / max_replicas turn on Ray's autoscaling (between them, `replicas` to start,
    aiming at `target_ongoing_requests` per replica). num_cpus / num_gpus: each replica's
    resources. routing_stats_period_s: how often replicas publish their prefix summary.
    imbalance: requests by which the replica holding a prefix may exceed the mean load before
    the router sends the prompt elsewhere. min_match: the fraction of a prompt's blocks a
    replica must hold for the prompt to follow them (strata_rs.ray.affinity).
    request_router: "affinity" (ConversationAffinityRouter), or "power_of_two" (Ray Serve's
    default, which ignores where conversations are cached: for comparisons)."""
    if replicas < 1:
        raise ValueError(f"replicas: must be >= 1, got {replicas}")
    if (min_replicas is None) != (max_replicas is None):
        raise ValueError("min_replicas and max_replicas: give both for autoscaling, or neither")
    if request_router not in ROUTERS:
        raise ValueError(
            f"request_router: expected one of {sorted(ROUTERS)}, got {request_router!r}"
        )
    settings = settings or Settings()
    options: Mapping[str, Any] = {"disk_write_when_idle": True, **engine_options}
    deployment_options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": num_cpus, "num_gpus": num_gpus},
        "max_ongoing_requests": max_ongoing_requests,
        "health_check_period_s": health_check_period_s,
    }
    if request_router == "affinity":
        deployment_options["request_router_config"] = RequestRouterConfig(
            request_router_class=ConversationAffinityRouter,
            request_router_kwargs={"imbalance": imbalance, "min_match": min_match},
            request_routing_stats_period_s=routing_stats_period_s,
        )
    if min_replicas is not None and max_replicas is not None:
        if not 0 <= min_replicas <= max_replicas or max_replicas < 1:
            raise ValueError(
                f"min_replicas, max_replicas: need 0 <= min <= max and max >= 1, got "
                f"{min_replicas}, {max_replicas}"
            )
        autoscaling: dict[str, Any] = {
            "min_replicas": min_replicas,
            "max_replicas": max_replicas,
            "initial_replicas": min(max(replicas, min_replicas), max_replicas),
        }
        if target_ongoing_requests is not None:
            autoscaling["target_ongoing_requests"] = target_ongoing_requests
        deployment_options["autoscaling_config"] = autoscaling
    else:
        deployment_options["num_replicas"] = replicas
    engines = serve.deployment(EngineReplica, name="EngineReplica").options(**deployment_options)
    ingress = serve.deployment(Ingress, name="Ingress").options(ray_actor_options={"num_cpus": 0})
    return ingress.bind(
        engines.bind(str(model), dict(options), settings),
        str(model),
        settings.max_body_bytes,
        settings.api_key,
    )
