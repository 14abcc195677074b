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
import socket
from collections.abc import Coroutine
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn
from starlette.applications import Starlette

from strata_rs.server.app import ServerState
from strata_rs.server.http_limits import BoundedHttpToolsProtocol

logger = logging.getLogger("strata_rs.server")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def model_name(path: Path) -> str:
    """The name a model is served as: its folder's, or its GGUF file's without `.gguf`
    (a split set's first file without its `-00001-of-0000N`)."""
    path = path.resolve()
    if path.suffix != ".gguf":
        return path.name
    stem = path.stem
    head, sep, tail = stem.rpartition("-of-")
    if sep and tail.isdigit() and head[-6:-5] == "-" and head[-5:].isdigit():
        return head[:-6]
    return stem


def resolve_model(model: Path | None, served_model_name: str | None) -> tuple[Path, str] | None:
    """The model to serve and its name: `model` and its file or folder name, or without one the
    demo model (logged); None, logged, when there is no model and the demo is not installed."""
    if model is not None:
        return model, served_model_name or model_name(Path(model))
    from strata_rs.demo import DEMO_MODEL_NAME, DemoNotInstalled, demo_model_path

    try:
        model = demo_model_path()
    except DemoNotInstalled as e:
        logger.error("no --model given, and %s", e)
        return None
    logger.warning(
        "no --model given: serving the demo model %s from %s; pass --model to serve another",
        DEMO_MODEL_NAME,
        model,
    )
    return model, served_model_name or DEMO_MODEL_NAME


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, force=True)


# How long an idle kept-alive connection stays open. Longer than clients keep theirs (httpx, and
# so the openai client, 5 s; load balancers 60 s), so that the client always closes an idle
# connection first: in the other order a request sent just as the server closes is reset
# (uvicorn's own default equals httpx's, and that race failed the soak).
KEEP_ALIVE_SECONDS = 75.0


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
    keep_alive_seconds: float = KEEP_ALIVE_SECONDS,
) -> int:
    """Runs `app` (from `create_app`) until a signal or a fatal engine error; returns the exit
    status: 0 after a signal, 1 after a fatal error."""
    state: ServerState = app.state.strata
    sock = bind(host, port)
    bound = sock.getsockname()
    shown = f"[{bound[0]}]" if sock.family == socket.AF_INET6 else bound[0]
    config = uvicorn.Config(
        app,
        http=BoundedHttpToolsProtocol,
        log_config=None,
        log_level=log_level.lower(),
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=grace_seconds,
        timeout_keep_alive=keep_alive_seconds,
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
    keep_alive_seconds: float | None = None,
    served_model_name: str | None = None,
    log_prompts: bool = False,
    allowed_origins: tuple[str, ...] = (),
    reasoning_format: str = "separate",
) -> int:
    """What `strata-rs serve` runs; returns the process's exit status."""
    from strata_rs import Engine
    from strata_rs.server.app import Settings, create_app

    configure_logging(log_level)
    demo = model is None
    resolved = resolve_model(model, served_model_name)
    if resolved is None:
        return 2
    model, served_model_name = resolved
    path = model

    async def load() -> Engine:
        logger.info("loading %s", path)
        return await Engine.load(path, **engine_options)

    settings = Settings(
        served_model_name=served_model_name,
        api_key=api_key or None,
        max_body_bytes=max_body_bytes,
        demo=demo,
        log_prompts=log_prompts,
        allowed_origins=allowed_origins,
        reasoning_format=reasoning_format,
    )
    if settings.api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning(
            "listening on %s without --api-key: anyone who can reach it can use it", host
        )
    app = create_app(load, settings)
    return _run(
        serve_app(
            app,
            host,
            port,
            grace_seconds,
            log_level,
            KEEP_ALIVE_SECONDS if keep_alive_seconds is None else keep_alive_seconds,
        )
    )


def _run(main: Coroutine[Any, Any, int]) -> int:
    """Runs the server's event loop: uvloop's when installed (it spends less CPU per event, and
    on a small machine that CPU comes out of the forward pass), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
