"""The OpenAPI 3.1 description of the server, served at ``GET /openapi.json``.

Request schemas are built from the validator's own tables in `protocol.py` (`_ENGINE_FIELDS`,
`_IGNORED`, `_UNSUPPORTED`, `_CHAT_FIELDS`, `_COMPLETION_FIELDS`, `MAX_LOGPROBS`): a field the
validator accepts and the schema lacks (or the reverse) fails when the document is built, so in
tests/test_openapi.py, not in a client. The
ranges are the engine's checks (`SamplingParams::validate` in rust/engine/request.rs, the
conversions in rust/python/sampling_params.rs); tests/test_openapi.py holds them to the engine.
Every request body has ``additionalProperties: false``: unknown fields get 400.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from strata_rs.server import protocol
from strata_rs.server.protocol import MAX_LOGPROBS, RESERVED_TEMPLATE_VARIABLES

# The engine's limits (rust/engine/request.rs: MAX_N, ROLES); tests/test_openapi.py checks them
# against the engine.
MAX_N = 64
ROLES = ("system", "developer", "user", "assistant", "tool")
# Sampling floats are 32-bit in the engine. Ranges are checked on the number sent; one larger than
# F32_MAX is refused; a positive one up to 2**-150 (half the smallest f32) rounds to 0, so a field
# that must be > 0 needs more than that.
F32_MAX = 3.4028234663852886e38
F32_ROUNDS_TO_ZERO = 2.0**-150
# Integers the engine reads as i64 (max_tokens, top_k); seeds as i128, folded into 64 bits.
I64_MAX = 2**63 - 1
SEED_MIN, SEED_MAX = -(2**127), 2**127 - 1
# Token ids are u32; with a loaded engine, they are below its vocabulary size.
U32_MAX = 2**32 - 1

_JSON = "application/json"
_SSE = "text/event-stream"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _or_null(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` or null: the validator reads null as "not given"."""
    return {"anyOf": [schema, {"type": "null"}]}


def _number(description: str, **bounds: float) -> dict[str, Any]:
    return {"type": ["number", "null"], "description": description, **bounds}


def _integer(description: str, **bounds: int) -> dict[str, Any]:
    return {"type": ["integer", "null"], "description": description, **bounds}


def _boolean(description: str) -> dict[str, Any]:
    return {"type": ["boolean", "null"], "description": description}


def _token_id(vocab_size: int | None) -> dict[str, Any]:
    top = vocab_size - 1 if vocab_size else U32_MAX
    return {"type": "integer", "minimum": 0, "maximum": top}


def _engine_fields(vocab_size: int | None) -> dict[str, dict[str, Any]]:
    """Sampling fields the engine checks (SamplingParams::validate)."""
    stop_string = {"type": "string", "minLength": 1}
    return {
        "temperature": _number("0 picks the most likely token", minimum=0, maximum=F32_MAX),
        "top_p": _number(
            "nucleus sampling; 1 keeps all", exclusiveMinimum=F32_ROUNDS_TO_ZERO, maximum=1
        ),
        "top_k": _integer("keep the k most likely tokens; 0 keeps all", minimum=0, maximum=I64_MAX),
        "min_p": _number("drop tokens under min_p times the top one", minimum=0, maximum=1),
        "presence_penalty": _number("OpenAI's presence penalty", minimum=-2, maximum=2),
        "frequency_penalty": _number("OpenAI's frequency penalty", minimum=-2, maximum=2),
        "repetition_penalty": _number(
            "divides logits of seen tokens; 1 is off",
            exclusiveMinimum=F32_ROUNDS_TO_ZERO,
            maximum=F32_MAX,
        ),
        "seed": _integer(
            "any integer; folded into 64 bits (choice i uses seed + i)",
            minimum=SEED_MIN,
            maximum=SEED_MAX,
        ),
        "stop": {
            "description": "stop strings (not in the output)",
            "anyOf": [
                stop_string,
                {"type": "array", "items": stop_string},
                {"type": "null"},
            ],
        },
        "n": _integer("choices per prompt", minimum=1, maximum=MAX_N),
        "ignore_eos": _boolean("extension: generate past EOS"),
        "speculative": _boolean(
            "extension: false decodes this request without drafts on a server started with "
            "--speculative"
        ),
        "stop_token_ids": {
            "description": "extension: token ids that end a choice",
            **_or_null({"type": "array", "items": _token_id(vocab_size)}),
        },
        "skip_special_tokens": _boolean("extension: leave special tokens out of the text"),
        "logit_bias": {
            "description": "token id (a decimal string) -> bias added to its logit, in [-100, 100]",
            **_or_null(
                {
                    "type": "object",
                    "propertyNames": {"pattern": "^[0-9]+$"},
                    "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                }
            ),
        },
        "structured_outputs": {
            "description": "extension (vLLM's): exactly one of json (a JSON schema or its text), "
            "json_object (true), regex, choice (strings) or grammar (Lark); the output follows it",
            **_or_null({"type": "object"}),
        },
        "response_format": {
            "description": "text, json_object, or json_schema with json_schema.schema (an object "
            "or a bool): the output follows it; not with structured_outputs",
            **_or_null(
                {
                    "type": "object",
                    "required": ["type"],
                    "properties": {
                        "type": {"enum": ["text", "json_object", "json_schema"]},
                        "json_schema": {"description": "name, schema, strict (schema is used)"},
                    },
                }
            ),
        },
    }


def _ignored_fields() -> dict[str, dict[str, Any]]:
    fields: dict[str, dict[str, Any]] = {
        name: {"description": "accepted and ignored"} for name in protocol._IGNORED
    }
    fields["user"] = {"type": ["string", "null"], "description": "accepted and ignored"}
    return fields


def _unsupported_fields() -> dict[str, dict[str, Any]]:
    return {
        name: {
            "description": "not implemented: only its off value is accepted",
            "enum": list(values),
        }
        for name, values in protocol._UNSUPPORTED.items()
    }


def _object(
    properties: Mapping[str, dict[str, Any]],
    known: Iterable[str],
    required: Iterable[str] = (),
    **extra: Any,
) -> dict[str, Any]:
    """A closed request object: exactly the fields in `known` (the validator's table)."""
    fields = set(known)
    missing = fields - set(properties)
    unknown = set(properties) - fields
    if missing or unknown:
        raise RuntimeError(
            f"schema and validator disagree: no schema for {sorted(missing)}, "
            f"schema only for {sorted(unknown)}"
        )
    return {
        "type": "object",
        "properties": {name: properties[name] for name in sorted(fields)},
        "required": list(required),
        "additionalProperties": False,
        **extra,
    }


def _model_field(served_model: str) -> dict[str, Any]:
    return {
        "description": f"optional; another name gets 404 (this server serves `{served_model}`)",
        "enum": [served_model, None],
    }


def _max_tokens(max_context: int | None, description: str, minimum: int = 1) -> dict[str, Any]:
    bounds: dict[str, int] = {"minimum": minimum, "maximum": I64_MAX}
    if max_context:
        # The prompt has at least one token, and prompt + max_tokens must fit the context.
        bounds["maximum"] = max(1, max_context - 1)
    return _integer(description + "; prompt + max_tokens must fit the context", **bounds)


def _template_fields() -> dict[str, dict[str, Any]]:
    return {
        "chat_template_kwargs": {
            "description": "extension: extra variables for the chat template",
            **_or_null(
                {
                    "type": "object",
                    "propertyNames": {"not": {"enum": list(RESERVED_TEMPLATE_VARIABLES)}},
                }
            ),
        },
        "add_generation_prompt": _boolean("extension: end with the assistant's header (default)"),
    }


def _tools_field() -> dict[str, Any]:
    function = {
        "type": "object",
        "required": ["name"],
        "properties": {
            "name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
            "description": {"type": ["string", "null"]},
            "parameters": {"type": ["object", "null"], "description": "a JSON schema"},
            "strict": {"type": ["boolean", "null"]},
        },
    }
    tool = {
        "type": "object",
        "required": ["type", "function"],
        "properties": {"type": {"const": "function"}, "function": function},
    }
    return {
        "description": "functions the model may call, rendered by its chat template (names unique)",
        **_or_null({"type": "array", "items": tool}),
    }


def _tool_fields() -> dict[str, dict[str, Any]]:
    named = {
        "type": "object",
        "required": ["type", "function"],
        "properties": {
            "type": {"const": "function"},
            "function": {
                "type": "object",
                "required": ["name"],
                "properties": {"name": {"type": "string"}},
            },
        },
    }
    return {
        "tools": _tools_field(),
        "tool_choice": {
            "description": "none, auto (the default with tools), required, or a function of "
            "tools by name; required and a named function constrain the arguments to the "
            "function's schema, and cannot be combined with response_format",
            "anyOf": [{"enum": ["none", "auto", "required", None]}, named],
        },
        "parallel_tool_calls": _boolean("more than one call in an answer (default true)"),
    }


def _needs(field: str, kind: str, flag: str) -> dict[str, Any]:
    """`field` (when not null) needs `flag` to be true, as the validator says."""
    return {
        "if": {"required": [field], "properties": {field: {"type": kind}}},
        "then": {"required": [flag], "properties": {flag: {"const": True}}},
    }


def _stream_fields() -> dict[str, dict[str, Any]]:
    return {
        "stream": _boolean("answer as server-sent events"),
        "stream_options": {
            "description": "only with stream: true",
            **_or_null(
                {
                    "type": "object",
                    "properties": {"include_usage": {"type": ["boolean", "null"]}},
                }
            ),
        },
    }


def _request_schemas(
    served_model: str, max_context: int | None, vocab_size: int | None
) -> dict[str, dict[str, Any]]:
    common = {
        "model": _model_field(served_model),
        "prompt_logprobs": _integer(
            "extension (vLLM's): each prompt token's logprob, rank and this many alternatives",
            minimum=0,
            maximum=MAX_LOGPROBS,
        ),
        **_stream_fields(),
        **_engine_fields(vocab_size),
        **_ignored_fields(),
        **_unsupported_fields(),
    }
    accepted_extra = (*protocol._IGNORED, *protocol._UNSUPPORTED)
    top = {"minimum": 0, "maximum": MAX_LOGPROBS}
    chat = _object(
        {
            **common,
            "messages": {"type": "array", "minItems": 1, "items": _ref("ChatMessage")},
            "max_tokens": _max_tokens(max_context, "most tokens to generate (default: EOS)"),
            "max_completion_tokens": _max_tokens(
                max_context, "max_tokens by its newer name (if both are sent, they must be equal)"
            ),
            "logprobs": _boolean("return each token's logprob"),
            "top_logprobs": _integer("alternatives per token; needs logprobs: true", **top),
            **_template_fields(),
            **_tool_fields(),
        },
        (*protocol._CHAT_FIELDS, *accepted_extra),
        required=["messages"],
        allOf=[
            _needs("stream_options", "object", "stream"),
            _needs("top_logprobs", "integer", "logprobs"),
        ],
    )
    ids = {"type": "array", "minItems": 1, "items": _token_id(vocab_size)}
    text = {"type": "string", "minLength": 1}
    completion = _object(
        {
            **common,
            "prompt": {
                "description": "text, token ids, or an array of either (one request per entry). "
                "Text must encode to at least one token: an empty string works only with a "
                "tokenizer that adds a BOS token",
                "anyOf": [
                    text,
                    ids,
                    {"type": "array", "minItems": 1, "items": {"anyOf": [text, ids]}},
                ],
            },
            "max_tokens": _max_tokens(
                max_context,
                f"most tokens to generate (default {protocol.COMPLETIONS_DEFAULT_MAX_TOKENS}); "
                "0 only with echo: the prompt is scored, nothing generated",
                minimum=0,
            ),
            "logprobs": _integer("alternatives per token, with each token's logprob", **top),
            "echo": _boolean(
                "the answer starts with the prompt, and with logprobs its tokens' logprobs "
                "(the first null); streamed, in each choice's first event"
            ),
        },
        (*protocol._COMPLETION_FIELDS, *accepted_extra),
        required=["prompt"],
        allOf=[_needs("stream_options", "object", "stream")],
    )
    tokenize = _object(
        {
            "model": _model_field(served_model),
            "prompt": {"type": ["string", "null"]},
            "messages": _or_null({"type": "array", "minItems": 1, "items": _ref("ChatMessage")}),
            "add_special_tokens": _boolean(
                "add the tokenizer's special tokens (default: true for a prompt, false for "
                "messages, whose template writes them)"
            ),
            **_template_fields(),
            "tools": _tools_field(),
        },
        protocol.TOKENIZE_FIELDS,
        description="exactly one of prompt and messages",
        oneOf=[
            {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
            {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
        ],
    )
    detokenize = _object(
        {
            "model": _model_field(served_model),
            "tokens": {"type": "array", "items": _token_id(vocab_size)},
            "skip_special_tokens": _boolean("leave special tokens out (default false)"),
        },
        protocol.DETOKENIZE_FIELDS,
        required=["tokens"],
    )
    return {
        "ChatCompletionRequest": chat,
        "CompletionRequest": completion,
        "TokenizeRequest": tokenize,
        "DetokenizeRequest": detokenize,
        "ChatMessage": {
            "type": "object",
            "description": "a role and a content: text, a list of text parts (joined with "
            "newlines), or null for an assistant message with tool_calls. Other keys (name, "
            "tool_calls, ...) go to the chat template",
            "required": ["role"],
            "properties": {
                "role": {"type": "string", "enum": list(ROLES)},
                "content": {
                    "anyOf": [
                        {"type": "string"},
                        {"type": "array", "items": _ref("TextPart")},
                        {"type": "null"},
                    ]
                },
            },
            "anyOf": [
                {"required": ["content"], "properties": {"content": {"type": ["string", "array"]}}},
                {"required": ["tool_calls"], "properties": {"role": {"const": "assistant"}}},
            ],
        },
        "TextPart": {
            "type": "object",
            "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
        },
    }


def _response_schemas() -> dict[str, dict[str, Any]]:
    count = {"type": "integer", "minimum": 0}
    finish = {"enum": ["stop", "length", "cancelled", "tool_calls", None]}
    top_entry = {
        "type": "object",
        "required": ["token", "logprob", "bytes"],
        "properties": {
            "token": {"type": "string"},
            "logprob": {"type": "number"},
            "bytes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255}},
        },
    }
    chat_logprobs = {
        "type": "object",
        "required": ["content"],
        "properties": {
            "content": {
                "type": "array",
                "items": {
                    **top_entry,
                    "required": ["token", "logprob", "bytes", "top_logprobs"],
                    "properties": {
                        **top_entry["properties"],
                        "top_logprobs": {"type": "array", "items": top_entry},
                    },
                },
            }
        },
    }
    completion_logprobs = {
        "type": "object",
        "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
        "properties": {
            "tokens": {"type": "array", "items": {"type": "string"}},
            # null for an echoed prompt's first token, which has nothing before it.
            "token_logprobs": {"type": "array", "items": {"type": ["number", "null"]}},
            "top_logprobs": {
                "type": "array",
                "items": {
                    "type": ["object", "null"],
                    "additionalProperties": {"type": "number"},
                },
            },
            "text_offset": {"type": "array", "items": count},
        },
    }
    head = {
        "id": {"type": "string"},
        "created": {"type": "integer"},
        "model": {"type": "string"},
    }
    head_required = ["id", "object", "created", "model", "choices"]

    prompt_logprobs = {
        "description": "with the prompt_logprobs extension: null for the first prompt token, then "
        "{token id: {logprob, rank, decoded_token}}",
        "type": "array",
        "items": {
            "type": ["object", "null"],
            "additionalProperties": {
                "type": "object",
                "required": ["logprob", "rank", "decoded_token"],
                "properties": {
                    "logprob": {"type": "number"},
                    "rank": {"type": "integer", "minimum": 1},
                    "decoded_token": {"type": "string"},
                },
            },
        },
    }

    def completion_object(
        kind: str,
        choice: dict[str, Any],
        streamed: bool,
        optional: dict[str, Any] | None = None,
        optional_choice: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """`choice`'s fields are required in each choice, `optional_choice`'s may be there;
        `optional` fields may be on the object."""
        usage = _or_null(_ref("Usage")) if streamed else _ref("Usage")
        schema = {
            "type": "object",
            "required": head_required if streamed else [*head_required, "usage"],
            "properties": {
                **head,
                "object": {"const": kind},
                "choices": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["index", *choice, "finish_reason"],
                        "properties": {
                            "index": count,
                            **choice,
                            **(optional_choice or {}),
                            "finish_reason": finish,
                        },
                    },
                },
                # Present with stream_options.include_usage: null, then the totals last.
                "usage": usage,
                **(optional or {}),
            },
        }
        if not streamed:
            schema["properties"]["system_fingerprint"] = {"type": "null"}
        return schema

    function = {
        "type": "object",
        "required": ["name", "arguments"],
        "properties": {
            "name": {"type": "string"},
            "arguments": {"type": "string", "description": "a JSON object's text"},
        },
    }
    tool_call = {
        "type": "object",
        "required": ["id", "type", "function"],
        "properties": {
            "id": {"type": "string"},
            "type": {"const": "function"},
            "function": function,
        },
    }
    tool_call_delta = {
        "type": "object",
        "description": "a call's first piece has its id, type and name; the next add to its "
        "arguments",
        "required": ["index", "function"],
        "properties": {
            "index": count,
            "id": {"type": "string"},
            "type": {"const": "function"},
            "function": {
                "type": "object",
                "required": ["arguments"],
                "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
            },
        },
    }
    reasoning = {
        "type": "string",
        "description": "the model's thinking (<think>...</think>), unless served with "
        "--reasoning-format inline",
    }
    chat_message = {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"const": "assistant"},
            "content": {"type": ["string", "null"], "description": "null with only tool calls"},
            "reasoning_content": reasoning,
            "tool_calls": {"type": "array", "items": tool_call},
        },
    }
    chat_delta = {
        "type": "object",
        "properties": {
            "role": {"const": "assistant"},
            "content": {"type": "string"},
            "reasoning_content": reasoning,
            "tool_calls": {"type": "array", "items": tool_call_delta},
        },
    }
    chat_lp = {"logprobs": _or_null(chat_logprobs)}
    completion_lp = {"logprobs": _or_null(completion_logprobs)}
    return {
        "Error": {
            "type": "object",
            "description": "OpenAI's error body",
            "required": ["error"],
            "additionalProperties": False,
            "properties": {
                "error": {
                    "type": "object",
                    "required": ["message", "type", "param", "code"],
                    "additionalProperties": False,
                    "properties": {
                        "message": {"type": "string", "minLength": 1},
                        "type": {
                            "type": "string",
                            "description": "invalid_request_error or server_error",
                        },
                        "param": {"type": ["string", "null"], "description": "the field at fault"},
                        "code": {
                            "type": ["string", "null"],
                            "description": "context_length_exceeded, invalid_api_key, "
                            "model_not_found, not_found, request_too_large, engine_busy, "
                            "model_loading, engine_stopped, shutting_down",
                        },
                    },
                }
            },
        },
        "Usage": {
            "type": "object",
            "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
            "properties": {
                "prompt_tokens": count,
                "completion_tokens": count,
                "total_tokens": count,
                "prompt_tokens_details": {
                    "type": "object",
                    "required": ["cached_tokens"],
                    "properties": {"cached_tokens": count},
                },
                # Only for a request that decoded with drafts (--speculative).
                "completion_tokens_details": {
                    "type": "object",
                    "required": ["accepted_prediction_tokens", "rejected_prediction_tokens"],
                    "properties": {
                        "accepted_prediction_tokens": count,
                        "rejected_prediction_tokens": count,
                    },
                },
            },
        },
        "ChatCompletion": completion_object(
            "chat.completion",
            {"message": chat_message, **chat_lp},
            streamed=False,
            optional={"prompt_logprobs": prompt_logprobs},
        ),
        "ChatCompletionChunk": completion_object(
            "chat.completion.chunk",
            {"delta": chat_delta, **chat_lp},
            streamed=True,
            optional={"prompt_logprobs": prompt_logprobs},
        ),
        "Completion": completion_object(
            "text_completion",
            {"text": {"type": "string"}, **completion_lp},
            streamed=False,
            optional_choice={"prompt_logprobs": prompt_logprobs},
        ),
        "CompletionChunk": completion_object(
            "text_completion",
            {"text": {"type": "string"}, **completion_lp},
            streamed=True,
            optional_choice={"prompt_logprobs": prompt_logprobs},
        ),
        "Model": {
            "type": "object",
            "required": ["id", "object", "created", "owned_by"],
            "properties": {
                "id": {"type": "string"},
                "object": {"const": "model"},
                "created": {"type": "integer"},
                "owned_by": {"type": "string"},
                "root": {"type": "string", "description": "the model folder"},
                "max_model_len": {"type": "integer", "minimum": 1},
                "demo": {"type": "boolean"},
                "description": {"type": "string"},
            },
        },
        "ModelList": {
            "type": "object",
            "required": ["object", "data"],
            "properties": {
                "object": {"const": "list"},
                "data": {"type": "array", "items": _ref("Model")},
            },
        },
        "TokenizeResponse": {
            "type": "object",
            "required": ["count", "max_model_len", "tokens"],
            "properties": {
                "count": count,
                "max_model_len": {"type": "integer", "minimum": 1},
                "tokens": {"type": "array", "items": count},
            },
        },
        "DetokenizeResponse": {
            "type": "object",
            "required": ["prompt"],
            "properties": {"prompt": {"type": "string"}},
        },
        "Health": {
            "type": "object",
            "description": "ok: the engine serves; otherwise (503) a status and a reason",
            "required": ["status"],
            "properties": {
                "status": {"enum": ["ok", "loading", "failed", "stopped", "shutting_down"]},
                "reason": {"type": "string"},
                "model": {"type": "string"},
                "demo": {"type": "boolean"},
                "running": count,
                "waiting": count,
                "kv_usage": {"type": "number", "minimum": 0, "maximum": 1},
            },
        },
        "CacheReport": {
            "type": "object",
            "required": [
                "object",
                "block_size",
                "entry_bytes",
                "tiers",
                "hit_tokens",
                "query_tokens",
                "hit_rate",
                "moves",
                "refusals",
                "corrupt_files",
                "adopted_files",
                "last_restore",
            ],
            "properties": {
                "object": {"const": "cache"},
                "block_size": count,
                "entry_bytes": count,
                "tiers": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": [
                            "tier",
                            "enabled",
                            "bytes",
                            "capacity_bytes",
                            "entries",
                            "hit_tokens",
                        ],
                        "properties": {
                            "tier": {"enum": ["device", "host", "disk"]},
                            "enabled": {"type": "boolean"},
                            "bytes": count,
                            "capacity_bytes": count,
                            "entries": count,
                            "hit_tokens": count,
                            "dir": {"type": ["string", "null"]},
                        },
                    },
                },
                "hit_tokens": count,
                "query_tokens": count,
                "hit_rate": {"type": "number", "minimum": 0, "maximum": 1},
                "moves": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["from", "to", "result", "blocks", "bytes"],
                        "properties": {
                            "from": {"type": "string"},
                            "to": {"type": "string"},
                            "result": {"type": "string"},
                            "blocks": count,
                            "bytes": count,
                        },
                    },
                },
                "refusals": {"type": "object", "additionalProperties": count},
                "corrupt_files": count,
                "adopted_files": count,
                "last_restore": _or_null(
                    {
                        "type": "object",
                        "required": ["tokens", "from_host", "from_disk", "bytes", "seconds"],
                        "properties": {
                            "tokens": count,
                            "from_host": count,
                            "from_disk": count,
                            "bytes": count,
                            "seconds": {"type": "number", "minimum": 0},
                        },
                    }
                ),
            },
        },
    }


def _event_stream(chunk: str) -> dict[str, Any]:
    """One server-sent event: a chunk, an error (the engine failed mid-stream), or [DONE]."""
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {
                "anyOf": [
                    {"const": "[DONE]"},
                    {
                        "type": "string",
                        "contentMediaType": _JSON,
                        "contentSchema": {"anyOf": [_ref(chunk), _ref("Error")]},
                    },
                ]
            }
        },
    }


def _error_response(description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    response: dict[str, Any] = {
        "description": description,
        "content": {_JSON: {"schema": _ref("Error")}},
    }
    if headers:
        response["headers"] = headers
    return response


def _responses() -> dict[str, dict[str, Any]]:
    return {
        "BadRequest": _error_response(
            "an invalid field (param names it), invalid JSON, an unknown field, or a prompt over "
            "the context (code context_length_exceeded)"
        ),
        "Unauthorized": _error_response(
            "the server runs with --api-key and the bearer token is missing or wrong "
            "(code invalid_api_key)",
            {"WWW-Authenticate": {"required": True, "schema": {"const": "Bearer"}}},
        ),
        "ModelNotFound": _error_response("another model than the served one (model_not_found)"),
        "PayloadTooLarge": _error_response(
            "the body is over --max-body-bytes (code request_too_large)"
        ),
        "ServiceUnavailable": _error_response(
            "the queue is full (engine_busy) or the model is loading (model_loading), both with "
            "Retry-After; the engine stopped (engine_stopped) or the server is shutting down "
            "(shutting_down)",
            {
                "Retry-After": {
                    "required": False,
                    "description": "seconds to wait before retrying",
                    "schema": {"type": "string", "pattern": "^[0-9]+$"},
                }
            },
        ),
    }


def _response(schema: str, description: str) -> dict[str, Any]:
    return {"description": description, "content": {_JSON: {"schema": _ref(schema)}}}


def _errors(*names: str) -> dict[str, Any]:
    codes = {
        "BadRequest": "400",
        "Unauthorized": "401",
        "ModelNotFound": "404",
        "PayloadTooLarge": "413",
        "ServiceUnavailable": "503",
    }
    return {codes[n]: {"$ref": f"#/components/responses/{n}"} for n in names}


def _paths(auth: bool) -> dict[str, Any]:
    body_errors = _errors("BadRequest", "ModelNotFound", "PayloadTooLarge", "ServiceUnavailable")
    # Every operation but /health answers 401 when the server has an API key.
    guarded = _errors("Unauthorized") if auth else {}

    def post(op: str, summary: str, request: str, ok: dict[str, Any]) -> dict[str, Any]:
        return {
            "post": {
                "operationId": op,
                "summary": summary,
                "requestBody": {
                    "required": True,
                    "content": {_JSON: {"schema": _ref(request)}},
                },
                "responses": {"200": ok, **body_errors, **guarded},
            }
        }

    def get(op: str, summary: str, ok: dict[str, Any], *errors: str) -> dict[str, Any]:
        return {
            "get": {
                "operationId": op,
                "summary": summary,
                "responses": {"200": ok, **_errors(*errors), **guarded},
            }
        }

    def generation(schema: str, chunk: str, what: str) -> dict[str, Any]:
        return {
            "description": f"the {what}; with stream: true, server-sent events (one chunk per "
            "event, then data: [DONE])",
            "headers": {"x-request-id": {"required": True, "schema": {"type": "string"}}},
            "content": {
                _JSON: {"schema": _ref(schema)},
                _SSE: {"schema": _event_stream(chunk)},
            },
        }

    paths: dict[str, Any] = {
        "/v1/chat/completions": post(
            "createChatCompletion",
            "chat",
            "ChatCompletionRequest",
            generation("ChatCompletion", "ChatCompletionChunk", "assistant's answer"),
        ),
        "/v1/completions": post(
            "createCompletion",
            "text or token-id prompts",
            "CompletionRequest",
            generation("Completion", "CompletionChunk", "continuations"),
        ),
        "/v1/models": get(
            "listModels",
            "the served model",
            _response("ModelList", "one model"),
            "ServiceUnavailable",
        ),
        "/v1/models/{model}": {
            "parameters": [
                {
                    "name": "model",
                    "in": "path",
                    "required": True,
                    "schema": {"type": "string"},
                }
            ],
            **get(
                "retrieveModel",
                "the served model by name",
                _response("Model", "the model"),
                "ModelNotFound",
                "ServiceUnavailable",
            ),
        },
        "/v1/cache": get(
            "getCache",
            "the conversation cache, per tier",
            _response("CacheReport", "the cache"),
            "ServiceUnavailable",
        ),
        "/tokenize": post(
            "tokenize",
            "token ids of a prompt or of rendered messages",
            "TokenizeRequest",
            _response("TokenizeResponse", "the ids"),
        ),
        "/detokenize": post(
            "detokenize",
            "the text of token ids",
            "DetokenizeRequest",
            _response("DetokenizeResponse", "the text"),
        ),
        "/health": {
            "get": {
                "operationId": "health",
                "summary": "200 only while the engine loop serves; never needs the API key",
                "security": [],
                "responses": {
                    "200": _response("Health", "serving"),
                    "503": _response("Health", "loading, failed, stopped or shutting down"),
                },
            }
        },
        "/metrics": get(
            "metrics",
            "Prometheus text format",
            {
                "description": "the metrics",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            },
        ),
        "/openapi.json": get(
            "openapi",
            "this document",
            {
                "description": "the OpenAPI document",
                "content": {
                    _JSON: {
                        "schema": {
                            "type": "object",
                            "required": ["openapi", "info", "paths"],
                        }
                    }
                },
            },
        ),
    }
    return paths


def openapi_schema(
    served_model: str,
    *,
    api_key: bool = False,
    info: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The OpenAPI 3.1 document of a server serving `served_model`. `api_key`: the server has one
    (every operation but /health declares bearer auth and 401). `info`: the loaded engine's
    `Engine.info`, for the bounds that depend on the model (token ids below the vocabulary size,
    max_tokens below the context); without it those bounds are the engine's types'."""
    info = info or {}
    max_context = info.get("max_context")
    vocab_size = info.get("vocab_size")
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "strata-rs",
            "version": "0.1.0",
            "description": "An OpenAI-compatible server. Every error is "
            '{"error": {"message", "type", "param", "code"}}. Strings must be valid Unicode '
            "(an unpaired surrogate escape is refused); integers are written without a "
            "fraction (1, not 1.0).",
        },
        "paths": _paths(api_key),
        "components": {
            "schemas": {
                **_request_schemas(served_model, max_context, vocab_size),
                **_response_schemas(),
            },
            "responses": _responses(),
            "securitySchemes": {
                "bearerAuth": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "the server's --api-key",
                }
            },
        },
    }
    if api_key:
        doc["security"] = [{"bearerAuth": []}]
    return doc
