"""Schemathesis against a real `strata-rs serve` on loopback, with the API key: requests generated
from the server's OpenAPI document (built here at import, since schemathesis makes one test per
operation at collection time, and checked equal to what /openapi.json serves), valid and invalid
(positive and negative modes). For each: no 5xx, every 4xx is OpenAI's error body, and the status,
headers and body are the ones the schema declares; invalid data is refused; a request without the
key is refused. Then the process must still be serving with no traceback in its log, and every
route but /health must answer 401 without the key.

The server runs with a 64-token context, so that generated max_tokens stay small and a generation
takes milliseconds; nothing in the generated data is filtered. (schemathesis.pytest.from_fixture,
which would load the served document lazily, fails on pytest 9: it reads `Function._nodeid`.)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import Case
from schemathesis.checks import (
    content_type_conformance,
    ignored_auth,
    negative_data_rejection,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
    unsupported_method,
)
from schemathesis.config import SchemathesisConfig
from strata_rs.server.openapi import openapi_schema
from test_server_process import MakeModel, Server, serve_argv

API_KEY = "fuzz-s3cret"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_CONTEXT = 64
TINY_VOCAB = 512  # the tiny preset's vocab_size (strata_rs.testing.models)
# Examples per operation: the file takes 25-50 s on 2 shared CPUs.
EXAMPLES = 100

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    negative_data_rejection,
    ignored_auth,
    unsupported_method,
]


@pytest.fixture(scope="module")
def fuzz_server(model_dir: MakeModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    kv = tmp_path_factory.mktemp("fuzz-kv")
    s = Server(
        serve_argv(
            "--model",
            str(model_dir("llama")),
            "--served-model-name",
            "tiny",
            "--max-context",
            str(MAX_CONTEXT),
            "--api-key",
            API_KEY,
            "--disk-cache-dir",
            str(kv),
        )
    )
    s.wait_healthy()
    yield s
    assert s.stop() == 0


# The document the server serves with these flags (test_the_served_schema_is_the_fuzzed_one).
SERVED_SCHEMA = openapi_schema(
    "tiny", api_key=True, info={"max_context": MAX_CONTEXT, "vocab_size": TINY_VOCAB}
)
schema = schemathesis.openapi.from_dict(
    SERVED_SCHEMA,
    config=SchemathesisConfig.from_dict(
        {"headers": AUTH, "generation": {"mode": "all", "max-examples": EXAMPLES}}
    ),
)


def assert_openai_error(response: Any) -> None:
    """A 4xx body is exactly {"error": {"message", "type", "param", "code"}}."""
    body = response.json()
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, body
    assert isinstance(error["message"], str) and error["message"], body
    assert isinstance(error["type"], str) and error["type"], body
    assert error["param"] is None or isinstance(error["param"], str), body
    assert error["code"] is None or isinstance(error["code"], str), body


@schema.parametrize()
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_fuzz_every_operation(case: Case, fuzz_server: Server) -> None:
    response = case.call(base_url=fuzz_server.url, headers=AUTH, timeout=60)
    case.validate_response(response, checks=CHECKS, headers=AUTH)
    assert response.status_code < 500, response.text
    if 400 <= response.status_code < 500:
        assert_openai_error(response)


def test_the_served_schema_is_the_fuzzed_one(fuzz_server: Server) -> None:
    r = httpx.get(fuzz_server.url + "/openapi.json", headers=AUTH)
    assert r.status_code == 200
    assert r.json() == SERVED_SCHEMA


def test_the_server_survives_the_fuzzing(fuzz_server: Server) -> None:
    assert fuzz_server.proc.poll() is None, fuzz_server.lines
    r = httpx.get(fuzz_server.url + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok", r.text
    # A handler that raises after the status line (a stream) answers nothing a check can see:
    # its traceback in the log is the only trace.
    assert not [line for line in fuzz_server.lines if "Traceback" in line], fuzz_server.lines


def test_every_route_but_health_needs_the_key(fuzz_server: Server) -> None:
    missing = "missing API key: send it as `Authorization: Bearer <key>`"
    doc = httpx.get(fuzz_server.url + "/openapi.json", headers=AUTH).json()
    routes = [
        (method.upper(), path.replace("{model}", "tiny"))
        for path, item in doc["paths"].items()
        for method in item
        if method in ("get", "post")
    ]
    assert len(routes) == 10, routes
    with httpx.Client(base_url=fuzz_server.url) as client:
        for method, path in routes:
            for headers, message in [
                ({}, missing),
                ({"Authorization": API_KEY}, missing),  # no scheme
                ({"Authorization": "Bearer wrong"}, "incorrect API key"),
            ]:
                r = client.request(method, path, headers=headers, json={})
                if path == "/health":
                    assert r.status_code == 200, r.text
                    continue
                assert (r.status_code, r.json()) == (
                    401,
                    {
                        "error": {
                            "message": message,
                            "type": "invalid_request_error",
                            "param": None,
                            "code": "invalid_api_key",
                        }
                    },
                ), (method, path, headers)
                assert r.headers["www-authenticate"] == "Bearer"
            # With the key: GETs answer, and an empty POST body is the client's error.
            r = client.request(method, path, headers=AUTH, json={})
            assert r.status_code == (200 if method == "GET" else 400), (method, path, r.text)


def test_health_is_the_only_operation_without_security(fuzz_server: Server) -> None:
    doc = httpx.get(fuzz_server.url + "/openapi.json", headers=AUTH).json()
    assert doc["security"] == [{"bearerAuth": []}]
    open_ops = [
        (path, method)
        for path, item in doc["paths"].items()
        for method, op in item.items()
        if method in ("get", "post") and op.get("security") == []
    ]
    assert open_ops == [("/health", "get")]
