"""The HTTP ingress of a Ray Serve deployment of strata-rs: reads each request, keys its prompt by
the prefix hashes the engines cache K/V under, and forwards it to the replica the router picks
(strata_rs.ray.router), retrying on another replica when the one picked died before answering."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from strata_rs import StrataError, Tokenizer, prefix_block_hashes
from strata_rs.ray import metrics
from strata_rs.ray.replica import ForwardedRequest, ResponseStart

logger = logging.getLogger("strata_rs.ray")

# Tries of a request whose replica died before its first byte (each on a replica the router
# picks again, after Ray has seen the death): about 10 s of backoff in all.
ATTEMPTS = 6
RETRY_BACKOFF_SECONDS = 0.5
_REPLICA_GONE = (ActorDiedError, ActorUnavailableError, RayActorError)


def _error(status: int, message: str, code: str) -> Response:
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return Response(json.dumps(body), status, media_type="application/json")


class Ingress:
    """A Ray Serve deployment class: the OpenAI API's front door for the replicas."""

    def __init__(
        self,
        replicas: DeploymentHandle,
        model: str,
        max_body_bytes: int,
        api_key: str | None,
    ) -> None:
        self.replicas = replicas
        self.tokenizer = Tokenizer.load(model)
        self.max_body_bytes = max_body_bytes
        self.api_key = api_key
        self.prefix_key: tuple[int, int] | None = None

    async def _key(self) -> tuple[int, int]:
        if self.prefix_key is None:
            self.prefix_key = await self.replicas.prefix_key.remote()
        return self.prefix_key

    def _prompt_tokens(self, path: str, body: bytes) -> list[int]:
        """The prompt's token ids as the replica will see them, best effort: a request the
        ingress cannot key is routed by load, and the replica reports what was wrong."""
        try:
            req = json.loads(body)
            if path == "/v1/chat/completions":
                kwargs = dict(req.get("chat_template_kwargs") or {})
                text = self.tokenizer.apply_chat_template(req["messages"], True, **kwargs)
                return self.tokenizer.encode(text, add_special_tokens=False)
            if path == "/v1/completions":
                prompt = req["prompt"]
                if isinstance(prompt, str):
                    return self.tokenizer.encode(prompt)
                if isinstance(prompt, list) and all(type(t) is int for t in prompt):
                    return prompt
        except (ValueError, KeyError, TypeError, AttributeError, StrataError):
            pass
        return []

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        if path == "/metrics":
            return self._metrics(request)
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                return _error(
                    413, f"request body over {self.max_body_bytes} bytes", "body_too_large"
                )
        hashes: list[int] = []
        tokens = self._prompt_tokens(path, body) if request.method == "POST" else []
        if tokens:
            try:
                salt, block_size = await self._key()
                hashes = prefix_block_hashes(tokens, salt, block_size)
            except (StrataError, *_REPLICA_GONE) as e:
                logger.warning("routing by load: no prefix key (%s)", e)
        forwarded = ForwardedRequest(
            method=request.method,
            path=path,
            query_string=request.url.query.encode(),
            headers=[(k.lower(), v) for k, v in request.headers.raw],
            body=body,
            client=(request.client.host, request.client.port) if request.client else None,
        )
        for attempt in range(ATTEMPTS):
            answer = self.replicas.options(stream=True).handle.remote(
                forwarded, prefix_hashes=hashes
            )
            try:
                start = await answer.__anext__()
            except _REPLICA_GONE as e:
                logger.warning("replica gone before answering (try %d): %s", attempt + 1, e)
                metrics.retries += 1
                await asyncio.sleep(RETRY_BACKOFF_SECONDS * (attempt + 1))
                continue
            assert isinstance(start, ResponseStart)
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start.headers}
            rest = answer if start.more else None
            return StreamingResponse(_body(start.body, rest), start.status, headers=headers)
        return _error(503, "no replica could answer the request; retry later", "unavailable")

    def _metrics(self, request: Request) -> Response:
        if self.api_key:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), self.api_key.encode()
            ):
                return _error(401, "incorrect or missing API key", "invalid_api_key")
        return Response(metrics.render_metrics(), media_type="text/plain; version=0.0.4")


async def _body(first: bytes, rest: Any) -> AsyncIterator[bytes]:
    if first:
        yield first
    if rest is not None:
        async for chunk in rest:
            yield chunk
