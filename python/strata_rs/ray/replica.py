"""One strata-rs engine as a Ray Serve replica: the OpenAI app (strata_rs.server.app) run in
process over each request the ingress forwards, the prefix summary the router routes by, and the
health check Ray replaces a dead engine by."""

from __future__ import annotations

import asyncio
import logging
import os
from array import array
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ray import serve

from strata_rs import Engine
from strata_rs.server.app import Settings, create_app

logger = logging.getLogger("strata_rs.ray")

# The response header naming the replica that answered (for operators and tests).
REPLICA_HEADER = b"x-strata-replica"


@dataclass(frozen=True)
class ForwardedRequest:
    """An HTTP request as the ingress read it, to be answered by a replica's app."""

    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None = None


@dataclass(frozen=True)
class ResponseStart:
    """The first item a replica's answer yields: the status, the headers and the body's first
    chunk, together, so that a replica dying before it is a clean retry and never half an
    answer (a JSON answer is whole in it); when `more`, the body's next chunks (bytes) follow."""

    status: int
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    more: bool = False


def encode_hashes(hashes: list[int]) -> bytes:
    """Block hashes as the compact summary a replica publishes: 8 bytes each."""
    return array("Q", hashes).tobytes()


def decode_hashes(data: bytes) -> list[int]:
    out = array("Q")
    out.frombytes(data)
    return out.tolist()


class EngineReplica:
    """A Ray Serve deployment class (`strata_rs.ray.build_app` makes it one): loads the engine
    once, then answers forwarded requests with the same app `strata-rs serve` runs."""

    async def __init__(self, model: str, engine_options: Mapping[str, Any], settings: Settings):
        self.engine = await Engine.load(model, **engine_options)
        self.app = create_app(self.engine, settings)
        info = self.engine.info
        self.routing_key = (int(info["prefix_salt"]), int(info["block_size"]))
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        logger.info("replica %s (pid %d): %s loaded", self.replica_id, os.getpid(), model)

    def prefix_key(self) -> tuple[int, int]:
        """(prefix_salt, block_size): what `prefix_block_hashes` needs to key a prompt as this
        model's engines key their blocks."""
        return self.routing_key

    def pid(self) -> int:
        return os.getpid()

    async def handle(
        self, request: ForwardedRequest, prefix_hashes: list[int] | None = None
    ) -> AsyncIterator[ResponseStart | bytes]:
        """Runs the request through the app: yields its ResponseStart, then its body's chunks.
        `prefix_hashes` is the router's (read from the call's arguments), unused here. When the
        caller goes away (the generator is closed), the app sees the client disconnect."""
        del prefix_hashes
        messages: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        disconnected = asyncio.Event()
        body_sent = False

        async def receive() -> dict[str, Any]:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            await messages.put(message)

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": request.method,
            "scheme": "http",
            "path": request.path,
            "raw_path": request.path.encode(),
            "query_string": request.query_string,
            "root_path": "",
            "headers": request.headers,
            "client": request.client,
            "server": None,
        }
        task = asyncio.ensure_future(self.app(scope, receive, send))
        task.add_done_callback(lambda _: messages.put_nowait(None))
        start: dict[str, Any] | None = None
        started = False
        try:
            while (message := await messages.get()) is not None:
                if message["type"] == "http.response.start":
                    start = message
                elif message["type"] == "http.response.body":
                    body = bytes(message.get("body", b""))
                    more = bool(message.get("more_body", False))
                    if not started and start is not None:
                        started = True
                        yield self._start(start, body, more)
                    elif body:
                        yield body
                    if not more:
                        break
            if not started and start is not None:
                yield self._start(start, b"", False)
        finally:
            disconnected.set()
            await asyncio.wait({task}, timeout=5.0)
            if not task.done():
                task.cancel()
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]

    def _start(self, message: dict[str, Any], body: bytes, more: bool) -> ResponseStart:
        headers = list(message.get("headers", []))
        headers.append((REPLICA_HEADER, self.replica_id.encode()))
        return ResponseStart(message["status"], headers, body, more)

    async def record_routing_stats(self) -> dict[str, Any]:
        """What the router reads (Ray Serve calls this every `request_routing_stats_period_s`):
        the hashes of the blocks this engine holds on its device and in host RAM, and its load."""
        hashes = await self.engine.cached_block_hashes()
        s = self.engine.stats()
        return {
            "hashes": encode_hashes(hashes),
            "running": s["running"],
            "waiting": s["waiting"],
            "kv_usage": s["kv_usage"],
            "prompt_tokens": s["prompt_tokens"],
            "prefix_hit_tokens": s["prefix_hit_tokens"],
            "generated_tokens": s["generated_tokens"],
            "pid": os.getpid(),
            # The replica's whole /metrics text, which the ingress shows labelled by replica.
            "metrics": self.app.state.strata.metrics.render().decode(),
        }

    def _inject_fault(self) -> None:
        """Makes the engine's next step fail as a bug would (`Engine._inject_fault`): for tests of
        the health check."""
        self.engine._inject_fault()

    def check_health(self) -> None:
        """Ray's health check: a stopped engine fails it, and Ray replaces the replica."""
        stopped = self.engine.stats()["stopped"]
        if stopped is not None:
            raise RuntimeError(f"the engine stopped: {stopped}")

    async def __del__(self) -> None:
        # A replica Ray stops (scale-down, redeploy): a clean close writes the cached K/V to the
        # disk tier, where another replica sharing the folder finds it.
        await self.engine.close()
