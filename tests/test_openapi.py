"""The OpenAPI document against what it describes: the validator's tables (every field it accepts
is documented, and no other), the engine's ranges (each bound is where the engine starts to
refuse), the app's routes, and bearer auth. tests/test_fuzz_server.py then fuzzes a real server
with it."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from strata_rs import ContextOverflow, Engine, InvalidRequest, SamplingParams, validate_messages
from strata_rs.server import Settings, create_app, protocol
from strata_rs.server.openapi import (
    F32_ROUNDS_TO_ZERO,
    MAX_N,
    ROLES,
    openapi_schema,
)
from strata_rs.server.protocol import ApiError, parse_chat, parse_completion

MakeModel = Callable[..., Path]
INFO = {"max_context": 64, "vocab_size": 512}
DOC = openapi_schema("tiny", info=INFO)
SCHEMAS = DOC["components"]["schemas"]
MSG = [{"role": "user", "content": "hi"}]


def props(name: str) -> dict[str, Any]:
    return SCHEMAS[name]["properties"]


def test_request_fields_are_the_validators() -> None:
    extra = {*protocol._IGNORED, *protocol._UNSUPPORTED}
    assert set(props("ChatCompletionRequest")) == set(protocol._CHAT_FIELDS) | extra
    assert set(props("CompletionRequest")) == set(protocol._COMPLETION_FIELDS) | extra
    assert set(props("TokenizeRequest")) == set(protocol.TOKENIZE_FIELDS)
    assert set(props("DetokenizeRequest")) == set(protocol.DETOKENIZE_FIELDS)
    for name in ("ChatCompletionRequest", "CompletionRequest", "TokenizeRequest"):
        assert SCHEMAS[name]["additionalProperties"] is False, name
    assert SCHEMAS["DetokenizeRequest"]["additionalProperties"] is False
    assert SCHEMAS["ChatCompletionRequest"]["required"] == ["messages"]
    assert SCHEMAS["CompletionRequest"]["required"] == ["prompt"]
    assert SCHEMAS["DetokenizeRequest"]["required"] == ["tokens"]


@pytest.mark.parametrize(
    ("schema", "parse", "base"),
    [
        ("ChatCompletionRequest", parse_chat, {"messages": MSG}),
        ("CompletionRequest", parse_completion, {"prompt": "hi"}),
    ],
)
def test_every_documented_field_is_accepted_and_no_other(
    schema: str, parse: Callable[..., Any], base: dict[str, Any]
) -> None:
    for name in props(schema):
        if name in base:
            continue
        # null is "not given" for every optional field, in the schema as in the validator.
        parse({**base, name: None}, "tiny")
    with pytest.raises(ApiError) as e:
        parse({**base, "temprature": 0.5}, "tiny")
    assert (e.value.status, e.value.message) == (400, "temprature: unrecognized request argument")


def test_unsupported_fields_document_their_off_values() -> None:
    for schema, parse, base in [
        ("ChatCompletionRequest", parse_chat, {"messages": MSG}),
        ("CompletionRequest", parse_completion, {"prompt": "hi"}),
    ]:
        for name, values in protocol._UNSUPPORTED.items():
            assert props(schema)[name]["enum"] == list(values), name
            for value in values:
                parse({**base, name: value}, "tiny")
            with pytest.raises(ApiError) as e:
                parse({**base, name: "on"}, "tiny")
            assert e.value.message == f"{name}: not supported by this server"


def bounds(field: str) -> dict[str, Any]:
    schema = props("ChatCompletionRequest")[field]
    return {k: schema[k] for k in ("minimum", "maximum", "exclusiveMinimum") if k in schema}


def refused(field: str, value: Any) -> str:
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**{field: value})
    assert str(e.value).startswith(f"{field}: "), str(e.value)
    return str(e.value)


def test_sampling_bounds_are_where_the_engine_starts_to_refuse() -> None:
    floats = (
        "temperature",
        "top_p",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    )
    for field in floats:
        b = bounds(field)
        assert props("ChatCompletionRequest")[field]["type"] == ["number", "null"]
        top = b["maximum"]
        SamplingParams(**{field: top})
        refused(field, math.nextafter(top, math.inf))
        if "minimum" in b:
            SamplingParams(**{field: b["minimum"]})
            refused(field, math.nextafter(b["minimum"], -math.inf))
        else:
            low = b["exclusiveMinimum"]
            SamplingParams(**{field: math.nextafter(low, math.inf)})
            refused(field, low)
    assert bounds("top_p") == {"exclusiveMinimum": F32_ROUNDS_TO_ZERO, "maximum": 1}
    assert refused("top_p", 1.0000000000000002) == (
        "top_p: must be in (0, 1], got 1.0000000000000002"
    )
    assert refused("temperature", 1e39) == (
        "temperature: must be at most 3.4028235e38 (a 32-bit float), got 1e39"
    )

    for field in ("top_k", "n", "seed", "max_tokens"):
        b = bounds(field) if field != "max_tokens" else {"minimum": 1, "maximum": 2**63 - 1}
        SamplingParams(**{field: b["minimum"]})
        SamplingParams(**{field: b["maximum"]})
        refused(field, b["minimum"] - 1)
        refused(field, b["maximum"] + 1)
    assert bounds("n") == {"minimum": 1, "maximum": MAX_N}
    assert refused("n", MAX_N + 1) == f"n: must be in 1..={MAX_N}, got {MAX_N + 1}"


def test_logprob_bounds_are_the_validators() -> None:
    top = bounds("top_logprobs")
    assert top == {"minimum": 0, "maximum": protocol.MAX_LOGPROBS}
    assert props("CompletionRequest")["logprobs"]["maximum"] == protocol.MAX_LOGPROBS
    parse_chat({"messages": MSG, "logprobs": True, "top_logprobs": top["maximum"]}, "tiny")
    with pytest.raises(ApiError) as e:
        parse_chat({"messages": MSG, "logprobs": True, "top_logprobs": 21}, "tiny")
    assert e.value.message == "top_logprobs: must be in [0, 20], got 21"
    parse_completion({"prompt": "hi", "logprobs": 20}, "tiny")
    with pytest.raises(ApiError) as e:
        parse_completion({"prompt": "hi", "logprobs": -1}, "tiny")
    assert e.value.message == "logprobs: must be in [0, 20], got -1"
    # The engine's own limit is the same.
    SamplingParams(logprobs=20)
    assert refused("logprobs", 21) == "logprobs: must be at most 20, got 21"


def test_roles_are_the_engines() -> None:
    assert SCHEMAS["ChatMessage"]["properties"]["role"]["enum"] == list(ROLES)
    for role in ROLES:
        validate_messages([{"role": role, "content": "x"}])
    with pytest.raises(InvalidRequest) as e:
        validate_messages([{"role": "wizard", "content": "x"}])
    assert str(e.value) == (
        f'messages[0].role: unknown role "wizard" (expected one of {", ".join(ROLES)})'
    )


@pytest.mark.anyio
async def test_model_bounds_are_the_loaded_engines(model_dir: MakeModel) -> None:
    engine = await Engine.load(model_dir("llama"), max_context=64, disk_cache_mib=0)
    try:
        doc = openapi_schema("tiny", info=engine.info)
        chat = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
        completion = doc["components"]["schemas"]["CompletionRequest"]["properties"]
        top = chat["max_tokens"]["maximum"]
        assert top == completion["max_tokens"]["maximum"] == 63
        assert chat["max_completion_tokens"]["maximum"] == 63
        # A one-token prompt leaves exactly `top` tokens to generate.
        engine.generate([5], max_tokens=top).cancel()
        with pytest.raises(ContextOverflow):
            engine.generate([5], max_tokens=top + 1)
        ids = completion["prompt"]["anyOf"][1]["items"]
        assert (ids["minimum"], ids["maximum"]) == (0, engine.info["vocab_size"] - 1)
        engine.generate([ids["maximum"]], max_tokens=1).cancel()
        with pytest.raises(InvalidRequest):
            engine.generate([ids["maximum"] + 1], max_tokens=1)
        stop_ids = chat["stop_token_ids"]["anyOf"][0]["items"]
        assert stop_ids == ids
    finally:
        await engine.close()


def test_every_route_is_documented(model_dir: MakeModel) -> None:
    app = create_app(lambda: Engine.load(model_dir("llama")))
    routes = {
        (method.lower(), route.path.replace("{model:path}", "{model}"))  # type: ignore[attr-defined]
        for route in app.routes
        for method in route.methods  # type: ignore[attr-defined]
        if method != "HEAD"
    }
    documented = {(method, path) for path, item in DOC["paths"].items() for method in item}
    documented.discard(("parameters", "/v1/models/{model}"))
    assert routes == documented
    assert len(routes) == 10


def walk(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from walk(v)


def test_every_error_is_the_openai_body_and_every_required_list_is_a_set() -> None:
    for path, item in DOC["paths"].items():
        for op in item.values():
            if "responses" not in op:
                continue
            for status, response in op["responses"].items():
                if status.startswith(("4", "5")) and path != "/health":
                    name = response["$ref"].rsplit("/", 1)[1]
                    content = DOC["components"]["responses"][name]["content"]
                    assert content == {
                        "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}
                    }
    statuses = {
        s
        for item in DOC["paths"].values()
        for op in item.values()
        if "responses" in op
        for s in op["responses"]
    }
    assert statuses == {"200", "400", "404", "413", "503"}
    unavailable = DOC["components"]["responses"]["ServiceUnavailable"]
    assert unavailable["headers"]["Retry-After"]["required"] is False
    # jsonschema-rs misjudges a schema with a repeated `required` entry inside anyOf.
    for node in walk(DOC):
        if isinstance(node.get("required"), list):
            assert len(node["required"]) == len(set(node["required"])), node["required"]


def test_bearer_auth_is_declared_only_with_a_key() -> None:
    assert "security" not in DOC
    assert DOC["components"]["securitySchemes"]["bearerAuth"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "the server's --api-key",
    }
    guarded = openapi_schema("tiny", api_key=True)
    assert guarded["security"] == [{"bearerAuth": []}]
    for path, item in guarded["paths"].items():
        for method, op in item.items():
            if method == "parameters":
                continue
            if path == "/health":
                assert op["security"] == [] and "401" not in op["responses"]
            else:
                assert op["responses"]["401"] == {"$ref": "#/components/responses/Unauthorized"}
                assert "security" not in op, path
    unauthorized = guarded["components"]["responses"]["Unauthorized"]
    assert unauthorized["headers"]["WWW-Authenticate"]["required"] is True


@pytest.mark.anyio
async def test_openapi_json_is_served_and_guarded_like_the_rest(model_dir: MakeModel) -> None:
    engine = await Engine.load(model_dir("llama"), disk_cache_mib=0)
    app = create_app(engine, Settings(served_model_name="tiny", api_key="k"))
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                r = await client.get("/openapi.json")
                assert (r.status_code, r.json()["error"]["code"]) == (401, "invalid_api_key")
                r = await client.get("/openapi.json", headers={"Authorization": "Bearer k"})
                assert r.status_code == 200
                assert r.headers["content-type"] == "application/json"
                assert r.json() == openapi_schema("tiny", api_key=True, info=engine.info)
    finally:
        await engine.close()
