"""The OpenAI-compatible HTTP server: `create_app(engine, settings)` returns a Starlette app;
`strata-rs serve` runs it under uvicorn (`strata_rs.server.serve`)."""

from strata_rs.server.app import Settings, create_app

__all__ = ["Settings", "create_app"]
