"""`strata-rs serve`: the app under uvicorn, with the process's exit status telling the truth.

- The listening socket is bound before the model loads, so /health answers 503 "loading" at once.
- SIGTERM / SIGINT: stop admitting (/health and new requests answer 503), let in-flight requests
  finish for up to `grace_seconds`, close the engine, exit 0. A second SIGINT forces the exit.
- A fatal engine error (the loop stopped, the model failed to load): in-flight requests end with an
  error, then the process exits 1, so that a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Coroutine
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn
from starlette.applications import Starlette

from strata_rs.server.app import ServerState

logger = logging.getLogger("strata_rs.server")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DEMO_MODEL_NAME = "strata-rs-demo"


def cache_dir() -> Path:
    """`$XDG_CACHE_HOME/strata-rs`, else `~/.cache/strata-rs`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "strata-rs"


def demo_model() -> Path:
    """The built-in demo model (tiny llama, random weights), written once into the user's cache
    directory and reused after. Written to a temporary folder first and renamed, so that an
    interrupted first run never leaves half a model behind."""
    out = cache_dir() / "demo-model"
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        return out
    from strata_rs.testing.models import make_model

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-model-", dir=out.parent))
    try:
        make_model(tmp, "llama", "tiny")
        try:
            tmp.rename(out)
        except OSError:
            if not (out / "config.json").is_file():  # not a concurrent first run: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("wrote the demo model to %s", out)
    return out


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, force=True)


class _Server(uvicorn.Server):
    """uvicorn's server, told that a signal means "drain", and without re-raising the signal after
    a graceful shutdown (uvicorn does, which would make the exit status 143 instead of 0)."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.strata_state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.strata_state.begin_shutdown()
        super().handle_exit(sig, frame)
        self._captured_signals.clear()


def bind(host: str, port: int) -> socket.socket:
    """The listening socket. Its protocol must say TCP: asyncio sets TCP_NODELAY on accepted
    connections only then, and without it Nagle's algorithm meets the client's delayed ACK and
    every response on a kept-alive connection waits ~40 ms."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


async def serve_app(
    app: Starlette,
    host: str = "127.0.0.1",
    port: int = 8000,
    grace_seconds: float = 30.0,
    log_level: str = "info",
) -> int:
    """Runs `app` (from `create_app`) until a signal or a fatal engine error; returns the exit
    status: 0 after a signal, 1 after a fatal error."""
    state: ServerState = app.state.strata
    sock = bind(host, port)
    bound = sock.getsockname()
    shown = f"[{bound[0]}]" if sock.family == socket.AF_INET6 else bound[0]
    config = uvicorn.Config(
        app,
        log_config=None,
        log_level=log_level.lower(),
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=grace_seconds,
    )
    server = _Server(config, state)
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    logger.info("listening on http://%s:%d (model %s)", shown, bound[1], state.model_name)
    fatal = asyncio.ensure_future(state.fatal_event.wait())
    done, _ = await asyncio.wait({serving, fatal}, return_when=asyncio.FIRST_COMPLETED)
    if fatal in done:
        server.should_exit = True
        await serving
        return 1
    fatal.cancel()
    serving.result()
    return 1 if state.fatal is not None else 0


def serve(
    model: Path | None,
    engine_options: dict[str, Any],
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_body_bytes: int = 4 * 1024 * 1024,
    grace_seconds: float = 30.0,
    log_level: str = "info",
    served_model_name: str | None = None,
    log_prompts: bool = False,
) -> int:
    """What `strata-rs serve` runs; returns the process's exit status."""
    from strata_rs import Engine
    from strata_rs.server.app import Settings, create_app

    configure_logging(log_level)
    demo = model is None
    if model is None:
        model = demo_model()
        served_model_name = served_model_name or DEMO_MODEL_NAME
        logger.warning(
            "no --model given: serving the built-in demo model from %s. Its weights are random, "
            "so its answers are gibberish; pass --model DIR to serve a real model",
            model,
        )
    path = model

    async def load() -> Engine:
        logger.info("loading %s", path)
        return await Engine.load(path, **engine_options)

    settings = Settings(
        served_model_name=served_model_name or Path(path).resolve().name,
        api_key=api_key or None,
        max_body_bytes=max_body_bytes,
        demo=demo,
        log_prompts=log_prompts,
    )
    if settings.api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning(
            "listening on %s without --api-key: anyone who can reach it can use it", host
        )
    app = create_app(load, settings)
    return _run(serve_app(app, host, port, grace_seconds, log_level))


def _run(main: Coroutine[Any, Any, int]) -> int:
    """Runs the server's event loop: uvloop's when installed (it spends less CPU per event, and
    on a small machine that CPU comes out of the forward pass), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
