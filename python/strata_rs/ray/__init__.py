"""strata-rs on Ray Serve: replicas of the engine behind one OpenAI API, each conversation routed
to the replica that holds its history (docs/operations.md, "Several replicas on Ray Serve").

`build_app(model, ...)` gives the application `serve.run` (or `serve run`) deploys; `strata-rs
serve --replicas N` runs it. Needs `ray[serve]` (the package's "ray" extra)."""

from __future__ import annotations

from typing import Any

__all__ = ["APP_NAME", "build_app"]

APP_NAME = "strata"


def __getattr__(name: str) -> Any:
    # Imported on use: strata_rs.ray.affinity (the policy alone) imports without Ray.
    if name == "build_app":
        from strata_rs.ray.app import build_app

        return build_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
