"""The OpenAI wire format: request validation, response bodies, SSE chunks and error bodies.

Nothing here touches the network or the engine's state: `parse_chat` / `parse_completion` turn a
JSON body into a `GenerationRequest` (or raise `ApiError`), `engine_error` maps an engine
exception to an `ApiError`, and the `*_response` / `*_chunk` functions build the JSON that goes
back. The engine validates every sampling parameter itself (type, range) and names the field; this
module checks what the engine never sees (model, stream, stream_options, logprobs flags, prompt and
message shapes, unknown fields) and renames the engine's field names back to the OpenAI ones the
client sent (max_completion_tokens, top_logprobs).
"""

from __future__ import annotations

import json
import math
import re
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from strata_rs import (
    ContextOverflow,
    EngineBusy,
    EngineStopped,
    InvalidRequest,
    StrataError,
    Usage,
)

if TYPE_CHECKING:
    from strata_rs.server.message import MessageDelta
    from strata_rs.server.tools import ToolRequest

# Sampling fields passed to the engine under the same name; the engine checks type and range.
_ENGINE_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "n",
    # Extensions (as vLLM's): pass them with the openai client's `extra_body`.
    "ignore_eos",
    "stop_token_ids",
    "skip_special_tokens",
    "structured_outputs",
    "logit_bias",
    "speculative",
)
# Accepted and ignored: they do not change the output.
_IGNORED = (
    "user",
    "store",
    "metadata",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
)
# OpenAI fields this server does not implement, with the values that mean "not used".
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
}
_COMMON = (
    "model",
    "max_tokens",
    "stream",
    "stream_options",
    "logprobs",
    "response_format",
    "prompt_logprobs",
    *_ENGINE_FIELDS,
)
_CHAT_FIELDS = frozenset(
    (
        *_COMMON,
        "messages",
        "max_completion_tokens",
        "top_logprobs",
        "chat_template_kwargs",
        "add_generation_prompt",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
    )
)
_COMPLETION_FIELDS = frozenset((*_COMMON, "prompt", "echo"))
# /tokenize and /detokenize (vLLM's): their fields, all of them.
TOKENIZE_FIELDS = (
    "model",
    "prompt",
    "messages",
    "add_special_tokens",
    "add_generation_prompt",
    "chat_template_kwargs",
    "tools",
)
DETOKENIZE_FIELDS = ("model", "tokens", "skip_special_tokens")

# Every field name a request may carry (generation, /tokenize, /detokenize): the only `param`
# values the log may show, since an unrecognized field's name is text the client wrote.
_KNOWN_PARAMS = frozenset(
    (
        *_CHAT_FIELDS,
        *_COMPLETION_FIELDS,
        *_IGNORED,
        *_UNSUPPORTED,
        *TOKENIZE_FIELDS,
        *DETOKENIZE_FIELDS,
    )
)


def loggable_param(param: str | None) -> str | None:
    """`param` when it is (inside) a field this server knows, else a placeholder."""
    if param is None:
        return None
    head = param.split("[", 1)[0].split(".", 1)[0]
    return param if head in _KNOWN_PARAMS else "(unrecognized field)"


# OpenAI's default for /v1/completions; chat has no default (until EOS or the context's end).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# Most alternatives per token (chat's top_logprobs, completions' logprobs): OpenAI's limit, and the
# engine's MAX_LOGPROBS (rust/engine/request.rs).
MAX_LOGPROBS = 20
# Template variables the chat template sets itself; chat_template_kwargs may not override them.
RESERVED_TEMPLATE_VARIABLES = ("messages", "add_generation_prompt")


class ApiError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def invalid(param: str | None, reason: str, code: str | None = None) -> ApiError:
    """A 400 whose message starts with the field's name, as the engine's do."""
    message = f"{param}: {reason}" if param else reason
    return ApiError(400, message, param=param, code=code)


def unavailable(message: str, code: str, retry_after: int | None = None) -> ApiError:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return ApiError(503, message, type="server_error", code=code, headers=headers)


def engine_error(
    e: StrataError, renames: Mapping[str, str] | None = None, retry_after: int = 1
) -> ApiError:
    """Maps an engine exception to its HTTP answer. `renames` maps the engine's field names to the
    ones the client used (max_tokens -> max_completion_tokens)."""
    message = str(e)
    if isinstance(e, InvalidRequest):
        param, sep, rest = message.partition(": ")
        if not sep or " " in param:
            param = None
        elif renames and param.split("[")[0] in renames:
            head = param.split("[")[0]
            param = renames[head] + param[len(head) :]
            message = f"{param}: {rest}"
        code = "context_length_exceeded" if isinstance(e, ContextOverflow) else None
        return ApiError(400, message, param=param, code=code)
    if isinstance(e, EngineBusy):
        return unavailable(message, "engine_busy", retry_after)
    if isinstance(e, EngineStopped):
        return unavailable(message, "engine_stopped")
    # A fault in the engine loop: the engine is gone; the process is about to exit.
    return unavailable(message, "engine_stopped")


# A `\\uD800`-`\\uDFFF` escape: the only way a JSON text can carry a UTF-16 surrogate (raw
# surrogate bytes are invalid UTF-8 and fail to decode).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate(value: Any) -> tuple[str | None, str] | None:
    """Where in `value` a string holds an unpaired surrogate: (path, reason), else None. A loop,
    not a recursion: the body may be nested as deep as json.loads allows."""
    todo: list[tuple[str, Any]] = [("", value)]
    while todo:
        path, v = todo.pop()
        if isinstance(v, str):
            m = _SURROGATE.search(v)
            if m is not None:
                char = f"\\u{ord(m.group()):04x}"
                return (
                    path or None,
                    f"must be valid Unicode text, got the unpaired surrogate {char}",
                )
        elif isinstance(v, dict):
            for key in v:
                m = _SURROGATE.search(key)
                if m is not None:
                    char = f"\\u{ord(m.group()):04x}"
                    reason = f"a key holds the unpaired surrogate {char}; it must be valid Unicode"
                    return path or None, reason
            # Reversed onto the stack: the first field is looked at first.
            todo.extend((f"{path}.{k}" if path else k, x) for k, x in reversed(v.items()))
        elif isinstance(v, list):
            todo.extend((f"{path}[{i}]", x) for i, x in reversed(list(enumerate(v))))
    return None


def parse_json(body: bytes) -> dict[str, Any]:
    try:
        value = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise invalid(None, f"the request body is not valid JSON ({e})") from None
    except RecursionError:
        # json.loads recurses once per nesting level; Python's stack limit ends it.
        raise invalid(None, "the request body is nested too deeply") from None
    if not isinstance(value, dict):
        raise invalid(None, "the request body must be a JSON object")
    # json.loads keeps an unpaired surrogate escape as a lone surrogate, which is no Unicode text:
    # the engine (Rust strings) and the UTF-8 answer could not carry it. Walked only when the raw
    # body has such an escape (paired ones, as emoji, pass the walk).
    if _SURROGATE_ESCAPE.search(body):
        found = _lone_surrogate(value)
        if found is not None:
            where, reason = found
            raise invalid(where, reason)
    return value


def type_name(value: Any) -> str:
    return {
        type(None): "null",
        bool: "boolean",
        int: "integer",
        float: "number",
        str: "string",
        list: "array",
        dict: "object",
    }.get(type(value), type(value).__name__)


def bool_field(body: Mapping[str, Any], name: str, default: bool, where: str | None = None) -> bool:
    """`body[name]` as a bool (`default` when absent or null); 400 naming it otherwise, as
    `where` when given (a nested field's whole path)."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(where or name, f"must be a boolean, got {type_name(value)}")
    return value


def _check_fields(body: Mapping[str, Any], known: frozenset[str]) -> None:
    for key, value in body.items():
        if key in known or key in _IGNORED:
            continue
        if key in _UNSUPPORTED:
            if any(value == ok and type(value) is type(ok) for ok in _UNSUPPORTED[key]):
                continue
            raise invalid(key, "not supported by this server")
        raise invalid(key, "unrecognized request argument")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise invalid("user", f"must be a string, got {type_name(user)}")


def check_model(body: Mapping[str, Any], served: str) -> None:
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise invalid("model", f"must be a string, got {type_name(model)}")
    if model != served:
        raise ApiError(
            404,
            f"The model `{model}` does not exist; this server serves `{served}`",
            param="model",
            code="model_not_found",
        )


@dataclass
class GenerationRequest:
    """A validated request: what to send to the engine and how to answer."""

    kind: Literal["chat", "completion"]
    request_id: str
    model: str
    created: int
    stream: bool
    include_usage: bool
    # chat: the messages, and `prompts` their rendering's ids once app.py has rendered them;
    # completion: one prompt per entry (str or token ids).
    messages: list[dict[str, Any]] | None = None
    prompts: list[str | list[int]] = field(default_factory=list)
    # Keyword arguments of Engine.generate / Engine.chat.
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    # chat: logprobs=true; completion: logprobs=k. None: no logprobs in the answer.
    logprobs: int | None = None
    n: int = 1
    # Engine field name -> the name the client used, for error messages.
    renames: dict[str, str] = field(default_factory=dict)
    # completions: the answer starts with the prompt (and its logprobs, when asked for).
    echo: bool = False
    # False for echo with max_tokens 0: the prompt is scored, nothing is generated.
    generate: bool = True
    # completions with echo or prompt_logprobs: each text prompt's text (its ids are now in
    # `prompts`), None for a prompt sent as ids.
    prompt_texts: list[str | None] = field(default_factory=list)
    # vLLM's prompt_logprobs: alternatives per prompt token (None: not asked for).
    prompt_logprobs: int | None = None
    # chat: how the messages are rendered (app.py renders them: tools need the template's format).
    add_generation_prompt: bool = True
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    # chat: tools (None without them), and whether `<think>` goes to reasoning_content.
    tools: ToolRequest | None = None
    tool_format: str = "generic"
    split_reasoning: bool = True
    # chat: the rendered prompt ends with `<think>`: the answer starts inside the thinking.
    thinking: bool = False


def _common(body: Mapping[str, Any], kind: str, served: str) -> GenerationRequest:
    check_model(body, served)
    stream = bool_field(body, "stream", False)
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise invalid("stream_options", "only allowed when stream is true")
        if not isinstance(options, dict):
            raise invalid("stream_options", f"must be an object, got {type_name(options)}")
        include_usage = bool_field(options, "include_usage", False)
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    req = GenerationRequest(
        kind="chat" if kind == "chat" else "completion",
        request_id=f"{prefix}-{secrets.token_hex(12)}",
        model=served,
        created=int(time.time()),
        stream=stream,
        include_usage=include_usage,
    )
    kwargs = req.engine_kwargs
    for name in _ENGINE_FIELDS:
        value = body.get(name)
        if value is not None:
            kwargs[name] = value
    n = kwargs.get("n", 1)
    req.n = n if isinstance(n, int) and not isinstance(n, bool) else 1
    _response_format(body, req)
    req.prompt_logprobs = _logprobs_count(body, "prompt_logprobs")
    return req


def _logprobs_count(body: Mapping[str, Any], name: str) -> int | None:
    """An alternatives count in [0, MAX_LOGPROBS], or None when absent."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise invalid(name, f"must be an integer, got {type_name(value)}")
    if not 0 <= value <= MAX_LOGPROBS:
        raise invalid(name, f"must be in [0, {MAX_LOGPROBS}], got {value}")
    return value


def _response_format(body: Mapping[str, Any], req: GenerationRequest) -> None:
    """OpenAI's `response_format` as the engine's `structured_outputs` (vLLM's extension, which
    the engine checks and compiles; its errors are renamed back to this field)."""
    fmt = body.get("response_format")
    if fmt is None:
        return
    if not isinstance(fmt, dict):
        raise invalid("response_format", f"must be an object, got {type_name(fmt)}")
    kind = fmt.get("type")
    if kind == "text":
        return
    if "structured_outputs" in req.engine_kwargs:
        raise invalid("response_format", "cannot be combined with structured_outputs")
    if kind == "json_object":
        req.engine_kwargs["structured_outputs"] = {"json_object": True}
        req.renames["structured_outputs.json_object"] = "response_format"
    elif kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise invalid(
                "response_format.json_schema", f"must be an object, got {type_name(spec)}"
            )
        schema = spec.get("schema")
        if schema is None:
            raise invalid("response_format.json_schema.schema", "required")
        if not isinstance(schema, dict | bool):
            raise invalid(
                "response_format.json_schema.schema",
                f"must be an object or a boolean, got {type_name(schema)}",
            )
        req.engine_kwargs["structured_outputs"] = {"json": schema}
        req.renames["structured_outputs.json"] = "response_format.json_schema.schema"
    else:
        raise invalid(
            "response_format.type", f"must be text, json_object or json_schema, got {kind!r}"
        )


def _flatten_content(i: int, content: Any) -> Any:
    """A list of text parts becomes one string (parts joined by newlines), so that every chat
    template, even one that only knows strings, can render it."""
    if not isinstance(content, list):
        return content
    texts = []
    for j, part in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        if not isinstance(part, dict):
            raise invalid(where, f"must be an object, got {type_name(part)}")
        kind = part.get("type")
        if kind != "text":
            raise invalid(f"{where}.type", f"only text parts are supported, got {kind!r}")
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid(f"{where}.text", f"must be a string, got {type_name(text)}")
        texts.append(text)
    return "\n".join(texts)


def parse_chat(body: Mapping[str, Any], served: str) -> GenerationRequest:
    _check_fields(body, _CHAT_FIELDS)
    req = _common(body, "chat", served)
    messages = body.get("messages")
    if messages is None:
        raise invalid("messages", "required")
    if not isinstance(messages, list):
        raise invalid("messages", f"must be an array of messages, got {type_name(messages)}")
    if not messages:
        raise invalid("messages", "must not be empty")
    flat: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if isinstance(m, dict) and isinstance(m.get("content"), list):
            m = {**m, "content": _flatten_content(i, m["content"])}
        flat.append(m)
    req.messages = flat  # the engine checks roles and content types
    req.renames["prompt"] = "messages"  # the engine's prompt is the rendered messages

    kwargs = req.engine_kwargs
    max_tokens = body.get("max_tokens")
    newer = body.get("max_completion_tokens")
    if newer is not None:
        # One limit under two names: a max_tokens that disagrees would otherwise go unchecked.
        if max_tokens is not None and not (type(max_tokens) is type(newer) and max_tokens == newer):
            raise invalid("max_tokens", "differs from max_completion_tokens, its newer name")
        max_tokens = newer
        req.renames["max_tokens"] = "max_completion_tokens"
    if max_tokens is not None:
        kwargs["max_tokens"] = max_tokens

    logprobs = bool_field(body, "logprobs", False)
    top = body.get("top_logprobs")
    if top is not None:
        if not isinstance(top, int) or isinstance(top, bool):
            raise invalid("top_logprobs", f"must be an integer, got {type_name(top)}")
        if not 0 <= top <= MAX_LOGPROBS:
            raise invalid("top_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {top}")
        if not logprobs:
            raise invalid("top_logprobs", "requires logprobs to be true")
    if logprobs:
        kwargs["logprobs"] = top or 0
        req.logprobs = top or 0
        req.renames["logprobs"] = "top_logprobs"

    req.add_generation_prompt, template_kwargs = template_options(body)
    req.template_kwargs = template_kwargs or {}
    return req


def template_options(body: Mapping[str, Any]) -> tuple[bool, dict[str, Any] | None]:
    """add_generation_prompt (default true) and chat_template_kwargs, checked."""
    add_generation_prompt = bool_field(body, "add_generation_prompt", True)
    template_kwargs = body.get("chat_template_kwargs")
    if template_kwargs is None:
        return add_generation_prompt, None
    if not isinstance(template_kwargs, dict):
        raise invalid(
            "chat_template_kwargs", f"must be an object, got {type_name(template_kwargs)}"
        )
    # Checked here, not left to the engine: /tokenize passes these as keyword arguments, where a
    # reserved name would be a TypeError.
    for name in RESERVED_TEMPLATE_VARIABLES:
        if name in template_kwargs:
            raise invalid(
                "chat_template_kwargs", f'"{name}" cannot be set as an extra template variable'
            )
    return add_generation_prompt, template_kwargs


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def parse_completion(body: Mapping[str, Any], served: str) -> GenerationRequest:
    _check_fields(body, _COMPLETION_FIELDS)
    req = _common(body, "completion", served)
    prompt = body.get("prompt")
    if prompt is None:
        raise invalid("prompt", "required")
    shape = "must be a string, an array of token ids, or an array of either"
    if isinstance(prompt, str) or (_is_ids(prompt) and prompt):
        req.prompts = [prompt]
    elif isinstance(prompt, list):
        if not prompt:
            raise invalid("prompt", "must not be empty")
        for i, p in enumerate(prompt):
            if not (isinstance(p, str) or _is_ids(p)):
                raise invalid(f"prompt[{i}]", f"{shape}, got {type_name(p)}")
        req.prompts = list(prompt)
    else:
        raise invalid("prompt", f"{shape}, got {type_name(prompt)}")

    kwargs = req.engine_kwargs
    max_tokens = body.get("max_tokens")
    kwargs["max_tokens"] = COMPLETIONS_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    req.echo = bool_field(body, "echo", False)
    if req.echo and type(max_tokens) is int and max_tokens == 0:
        # Scoring a prompt (lm-eval's loglikelihood): nothing to generate.
        req.generate = False
    logprobs = _logprobs_count(body, "logprobs")
    if logprobs is not None:
        kwargs["logprobs"] = logprobs
        req.logprobs = logprobs
    return req


# ---- responses ---------------------------------------------------------------------------------


def usage_body(
    prompt: int, completion: int, cached: int, drafts: int = 0, accepted: int = 0
) -> dict[str, Any]:
    """OpenAI's usage object; a request that decoded with drafts also gets OpenAI's counts of
    predicted tokens (`completion_tokens_details`), which drafts are."""
    body: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    if drafts > 0:
        body["completion_tokens_details"] = {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": drafts - accepted,
        }
    return body


def sum_usage(usages: Sequence[Usage | None]) -> dict[str, Any]:
    got = [u for u in usages if u is not None]
    return usage_body(
        sum(u.prompt_tokens for u in got),
        sum(u.completion_tokens for u in got),
        sum(u.cached_tokens for u in got),
        sum(u.draft_tokens for u in got),
        sum(u.accepted_draft_tokens for u in got),
    )


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8"))


def _lp(x: float) -> float:
    """JSON has no -inf: an impossible token gets -9999.0, as vLLM reports it."""
    return x if math.isfinite(x) else -9999.0


def chat_logprobs(entries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": e["token"],
                "logprob": _lp(e["logprob"]),
                "bytes": _bytes(e["token"]),
                "top_logprobs": [
                    {"token": t["token"], "logprob": _lp(t["logprob"]), "bytes": _bytes(t["token"])}
                    for t in e["top_logprobs"]
                ],
            }
            for e in entries
        ]
    }


def completion_logprobs(entries: Sequence[Mapping[str, Any]], offset: int = 0) -> dict[str, Any]:
    """The legacy completions shape; text_offset counts characters of the token strings from
    `offset` (where this chunk starts in the choice's text)."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        # An echoed prompt's first token has no logprob (nothing before it): null.
        "token_logprobs": [None if e["logprob"] is None else _lp(e["logprob"]) for e in entries],
        "top_logprobs": [
            None
            if e["top_logprobs"] is None
            else {t["token"]: _lp(t["logprob"]) for t in e["top_logprobs"]}
            for e in entries
        ],
        "text_offset": offsets,
    }


@dataclass
class ChoiceResult:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    # chat: the message (content, reasoning_content, tool_calls); None: the text is the content.
    message: dict[str, Any] | None = None
    # The prompt's vLLM prompt_logprobs, when asked for.
    prompt_logprobs: list[dict[str, Any] | None] | None = None


def vllm_prompt_logprobs(
    entries: Sequence[Mapping[str, Any] | None], top: int
) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs` from `Engine.prompt_logprobs`' entries: null for the first token,
    then {token id: {logprob, rank, decoded_token}} for the `top` most likely tokens and the
    prompt's own token (with its rank)."""
    out: list[dict[str, Any] | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        alternatives = {
            str(t["token_id"]): {
                "logprob": _lp(t["logprob"]),
                "rank": r,
                "decoded_token": t["token"],
            }
            for r, t in enumerate(e["top_logprobs"][:top], start=1)
        }
        alternatives[str(e["token_id"])] = {
            "logprob": _lp(e["logprob"]),
            "rank": e["rank"],
            "decoded_token": e["token"],
        }
        out.append(alternatives)
    return out


def full_response(
    req: GenerationRequest, choices: Sequence[ChoiceResult], usage: dict[str, Any]
) -> dict[str, Any]:
    if req.kind == "chat":
        body_choices = [
            {
                "index": c.index,
                "message": c.message or {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(c.logprobs) if req.logprobs is not None else None,
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ]
        obj = "chat.completion"
    else:
        body_choices = [
            {
                "index": c.index,
                "text": c.text,
                "logprobs": completion_logprobs(c.logprobs) if req.logprobs is not None else None,
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ]
        if req.prompt_logprobs is not None:
            for body_choice, c in zip(body_choices, choices, strict=True):
                body_choice["prompt_logprobs"] = c.prompt_logprobs
        obj = "text_completion"
    out = {
        "id": req.request_id,
        "object": obj,
        "created": req.created,
        "model": req.model,
        "choices": body_choices,
        "usage": usage,
        "system_fingerprint": None,
    }
    if req.kind == "chat" and req.prompt_logprobs is not None:
        # vLLM's place for chat: the response's, one prompt for every choice.
        out["prompt_logprobs"] = choices[0].prompt_logprobs if choices else None
    return out


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse(obj: Any) -> bytes:
    return f"data: {_dumps(obj)}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


class ChunkWriter:
    """Builds the SSE events of one streaming response."""

    def __init__(self, req: GenerationRequest) -> None:
        self.req = req
        chat = req.kind == "chat"
        self._head = {
            "id": req.request_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": req.created,
            "model": req.model,
        }
        self._role_sent: set[int] = set()
        self._offsets: dict[int, int] = {}

    def _event(
        self,
        choices: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        **extra: Any,
    ) -> bytes:
        obj: dict[str, Any] = {**self._head, "choices": choices, **extra}
        if self.req.include_usage:
            obj["usage"] = usage
        return sse(obj)

    def delta(
        self,
        index: int,
        text: str,
        logprobs: Sequence[Mapping[str, Any]] | None,
        finish_reason: str | None,
        message: MessageDelta | None = None,
    ) -> bytes:
        """One choice's event. For chat, `message` (when given) is the text parsed into content,
        reasoning and tool calls, and `text` is not used."""
        return self._event([self._choice(index, text, logprobs, finish_reason, message)])

    def _choice(
        self,
        index: int,
        text: str,
        logprobs: Sequence[Mapping[str, Any]] | None,
        finish_reason: str | None,
        message: MessageDelta | None = None,
    ) -> dict[str, Any]:
        want_logprobs = self.req.logprobs is not None and logprobs is not None
        if self.req.kind == "chat":
            delta: dict[str, Any] = {}
            if index not in self._role_sent:
                self._role_sent.add(index)
                delta["role"] = "assistant"
            parsed = message is not None and (message.reasoning or message.tool_calls)
            if message is not None:
                text = message.content
                if message.reasoning:
                    delta["reasoning_content"] = message.reasoning
                if message.tool_calls:
                    delta["tool_calls"] = [c.body() for c in message.tool_calls]
            if text or (finish_reason is None and not parsed):
                delta["content"] = text
            choice = {
                "index": index,
                "delta": delta,
                "logprobs": chat_logprobs(logprobs) if want_logprobs and logprobs else None,
                "finish_reason": finish_reason,
            }
        else:
            offset = self._offsets.get(index, 0)
            choice = {
                "index": index,
                "text": text,
                "logprobs": (
                    completion_logprobs(logprobs, offset) if want_logprobs and logprobs else None
                ),
                "finish_reason": finish_reason,
            }
            self._offsets[index] = offset + sum(len(e["token"]) for e in logprobs or ())
        return choice

    def first(
        self,
        index: int,
        text: str,
        echo_entries: Sequence[Mapping[str, Any]] | None,
        prompt_logprobs: list[dict[str, Any] | None] | None,
    ) -> bytes:
        """A choice's opening event before its generated tokens: the echoed prompt (completions)
        and the prompt's prompt_logprobs (on the choice for completions, on the chunk for chat,
        as vLLM places them)."""
        wanted = self.req.prompt_logprobs is not None
        if self.req.kind == "chat":
            choice = self._choice(index, "", None, None)
            return self._event([choice], **({"prompt_logprobs": prompt_logprobs} if wanted else {}))
        choice = self._choice(index, text, echo_entries, None)
        if wanted:
            choice["prompt_logprobs"] = prompt_logprobs
        return self._event([choice])

    def usage(self, usage: dict[str, Any]) -> bytes:
        return self._event([], usage)

    @staticmethod
    def error(e: ApiError) -> bytes:
        return sse(e.body())
