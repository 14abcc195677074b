"""`strata-rs serve --replicas N`: the OpenAI API on Ray Serve, over N engine replicas routed by
conversation affinity. Starts a local Ray, or joins the cluster `--ray-address` / `$RAY_ADDRESS`
names; SIGTERM or SIGINT shuts the application down (each replica closes its engine, writing its
cached K/V to the disk tier) and exits 0."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from strata_rs.server.app import Settings
from strata_rs.server.serve import configure_logging, resolve_model

logger = logging.getLogger("strata_rs.server")


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def serve_on_ray(
    model: Path | None,
    engine_options: dict[str, Any],
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    replicas: int = 1,
    ray_address: str | None = None,
    min_replicas: int | None = None,
    max_replicas: int | None = None,
    target_ongoing_requests: float | None = None,
    replica_cpus: float = 1.0,
    replica_gpus: float = 0.0,
    request_router: str = "affinity",
    health_check_seconds: float = 5.0,
    api_key: str | None = None,
    max_body_bytes: int = 4 * 1024 * 1024,
    log_level: str = "info",
    served_model_name: str | None = None,
    log_prompts: bool = False,
    reasoning_format: str = "separate",
) -> int:
    """What `strata-rs serve --replicas N` runs; returns the process's exit status."""
    configure_logging(log_level)
    try:
        import ray
        from ray import serve

        from strata_rs.ray import APP_NAME, build_app
    except ImportError as e:
        logger.error("--replicas needs Ray Serve: pip install 'strata-rs[ray]' (%s)", e)
        return 2
    demo = model is None
    resolved = resolve_model(model, served_model_name)
    if resolved is None:
        return 2
    model, served_model_name = resolved
    settings = Settings(
        served_model_name=served_model_name,
        api_key=api_key or None,
        max_body_bytes=max_body_bytes,
        demo=demo,
        log_prompts=log_prompts,
        reasoning_format=reasoning_format,
    )
    try:
        app = build_app(
            Path(model).resolve(),
            replicas=replicas,
            min_replicas=min_replicas,
            max_replicas=max_replicas,
            target_ongoing_requests=target_ongoing_requests,
            num_cpus=replica_cpus,
            num_gpus=replica_gpus,
            request_router=request_router,
            health_check_period_s=health_check_seconds,
            settings=settings,
            **engine_options,
        )
    except ValueError as e:
        logger.error("%s", e)
        return 2
    address = ray_address or os.environ.get("RAY_ADDRESS")
    port = port or _free_port(host)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        logger.info("signal %d: shutting down the replicas", signum)
        stop.set()

    context = ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
    logger.info("Ray cluster at %s", context.address_info.get("gcs_address", address))
    try:
        serve.start(http_options={"host": host, "port": port})
        # After Ray's start, which installs handlers of its own that would kill the process.
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        try:
            serve.run(app, name=APP_NAME, route_prefix="/")
        except Exception as e:  # any deployment failure (a replica that cannot load) ends it
            logger.error("the application failed to start: %s: %s", type(e).__name__, e)
            return 1
        where = f"[{host}]" if ":" in host else host
        logger.info(
            "listening on http://%s:%d (%d replicas on Ray Serve, %s router)",
            where,
            port,
            replicas,
            request_router,
        )
        while not stop.wait(1.0):
            pass
        if address:
            serve.delete(APP_NAME)  # a cluster's Serve may run others' applications
        else:
            serve.shutdown()
        return 0
    finally:
        ray.shutdown()
