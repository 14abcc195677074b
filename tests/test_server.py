"""The HTTP server in-process: httpx against the ASGI app, and against a real uvicorn on loopback
(in this process, so that the test can read the engine's stats) for what needs a real socket
(client disconnects, an engine fault mid-stream).

Outputs are compared with the Python API's greedy output for the same request on a separate
engine; error bodies are compared whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.routing import Mount
from strata_rs import Completion, Engine
from strata_rs.server import Settings, create_app
from strata_rs.server.serve import bind

pytestmark = pytest.mark.anyio

MakeModel = Callable[..., Path]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@contextlib.asynccontextmanager
async def asgi_client(
    engine: Any, settings: Settings | None = None
) -> AsyncIterator[httpx.AsyncClient]:
    """httpx on the ASGI app, with the app's lifespan running (loader, watchdog)."""
    app = create_app(engine, settings or Settings(served_model_name="tiny"))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            client.app = app  # type: ignore[attr-defined]
            yield client


@contextlib.asynccontextmanager
async def real_server(engine: Engine, settings: Settings | None = None) -> AsyncIterator[str]:
    """The app under a real uvicorn on 127.0.0.1 (any free port), in this event loop."""
    app = create_app(engine, settings or Settings(served_model_name="tiny"))
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="on")
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    url = f"http://127.0.0.1:{port}"
    _REAL_SERVERS[url] = server
    try:
        yield url
    finally:
        del _REAL_SERVERS[url]
        server.should_exit = True
        await task


_REAL_SERVERS: dict[str, uvicorn.Server] = {}


def real_server_of(url: str) -> uvicorn.Server:
    """The uvicorn server `real_server` runs at `url`."""
    return _REAL_SERVERS[url]


def events(body: str) -> list[Any]:
    """The `data:` payloads of an SSE body, JSON-decoded ([DONE] kept as the string)."""
    out: list[Any] = []
    for block in body.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def wait_for(
    engine: Engine, pred: Callable[[dict[str, Any]], bool], timeout: float = 20.0
) -> dict[str, Any]:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        s = engine.stats()
        if pred(s):
            return dict(s)
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"stats never matched: {s}")
        await asyncio.sleep(0.005)


async def reference(model: Path, prompt: Any, chat: bool = False, **params: Any) -> Completion:
    """The Python API's answer on a fresh engine (so the server's engine starts cold). Its disk
    tier is off: a clean close would otherwise save its blocks for the server's engine to adopt."""
    engine = await Engine.load(model, max_batch=1, disk_cache_mib=0)
    try:
        if chat:
            tok = engine.tokenizer
            prompt = tok.encode(tok.apply_chat_template(prompt), add_special_tokens=False)
        return await engine.complete(prompt, **params)
    finally:
        await engine.close()


def cached_for(prompt_tokens: int) -> int:
    """Tokens a repeated prompt finds cached: its full 16-token blocks, the last token excluded."""
    return (prompt_tokens - 1) // 16 * 16


MESSAGES = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "Tell me about the quick brown fox and the lazy dog."},
]


async def test_chat_equals_the_python_api_greedy_output(model_dir: MakeModel) -> None:
    model = model_dir("llama")
    ref = await reference(model, MESSAGES, chat=True, max_tokens=12, temperature=0, ignore_eos=True)
    engine = await Engine.load(model)
    try:
        async with asgi_client(engine) as client:
            body = {
                "model": "tiny",
                "messages": MESSAGES,
                "max_tokens": 12,
                "temperature": 0,
                "ignore_eos": True,
            }
            r = await client.post(CHAT, json=body)
            assert r.status_code == 200
            got = r.json()
            assert got["id"].startswith("chatcmpl-") and r.headers["x-request-id"] == got["id"]
            assert got["object"] == "chat.completion"
            assert got["model"] == "tiny"
            prompt = ref.usage.prompt_tokens
            assert prompt > 32
            assert got["choices"] == [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": ref.text},
                    "logprobs": None,
                    "finish_reason": "length",
                }
            ]
            assert got["usage"] == {
                "prompt_tokens": prompt,
                "completion_tokens": 12,
                "total_tokens": prompt + 12,
                "prompt_tokens_details": {"cached_tokens": 0},
            }
            # The same conversation again: its prompt's full blocks come from the cache, and
            # max_completion_tokens is the newer name of max_tokens.
            del body["max_tokens"]
            body["max_completion_tokens"] = 12
            again = (await client.post(CHAT, json=body)).json()
            assert again["choices"][0]["message"]["content"] == ref.text
            assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": cached_for(prompt)}

            # Streaming, usage in the last chunk.
            r = await client.post(
                CHAT,
                json={**body, "stream": True, "stream_options": {"include_usage": True}},
            )
            assert r.status_code == 200
            assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
            assert "content-length" not in r.headers
            ev = events(r.text)
            assert ev[-1] == "[DONE]"
            chunks = ev[:-1]
            assert all(c["object"] == "chat.completion.chunk" for c in chunks)
            assert len({c["id"] for c in chunks}) == 1
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
            assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:-1])
            content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
            assert content == ref.text
            assert [c["choices"][0]["finish_reason"] for c in chunks[:-2]] == [None] * (
                len(chunks) - 2
            )
            assert chunks[-2]["choices"][0]["finish_reason"] == "length"
            assert all(c["usage"] is None for c in chunks[:-1])
            assert chunks[-1]["choices"] == []
            assert chunks[-1]["usage"] == {
                "prompt_tokens": prompt,
                "completion_tokens": 12,
                "total_tokens": prompt + 12,
                "prompt_tokens_details": {"cached_tokens": cached_for(prompt)},
            }
            # Without include_usage, no chunk carries a usage field.
            ev = events((await client.post(CHAT, json={**body, "stream": True})).text)
            assert all("usage" not in c for c in ev[:-1])
            # A list of text parts is the same message as their text joined by newlines.
            parts = [
                MESSAGES[0],
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Tell me about the quick brown fox"},
                        {"type": "text", "text": "and the lazy dog."},
                    ],
                },
            ]
            joined = [MESSAGES[0], {"role": "user", "content": MESSAGES[1]["content"]}]
            joined[1]["content"] = "Tell me about the quick brown fox\nand the lazy dog."
            a = (await client.post(CHAT, json={**body, "messages": parts})).json()
            b = (await client.post(CHAT, json={**body, "messages": joined})).json()
            assert a["choices"] == b["choices"]
            assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
    finally:
        await engine.close()


async def test_completions_equal_the_python_api_greedy_output(model_dir: MakeModel) -> None:
    model = model_dir("qwen2")
    ids = [7 + (i * 37) % 500 for i in range(40)]
    text_ref = await reference(model, "hello world", max_tokens=16, temperature=0, ignore_eos=True)
    ids_ref = await reference(model, ids, max_tokens=9, temperature=0, ignore_eos=True)
    engine = await Engine.load(model)
    try:
        async with asgi_client(engine) as client:
            # max_tokens defaults to 16, as OpenAI's.
            body = {"model": "tiny", "prompt": "hello world", "temperature": 0, "ignore_eos": True}
            got = (await client.post(COMPLETIONS, json=body)).json()
            assert got["object"] == "text_completion" and got["id"].startswith("cmpl-")
            assert got["choices"] == [
                {"index": 0, "text": text_ref.text, "logprobs": None, "finish_reason": "length"}
            ]
            assert got["usage"]["completion_tokens"] == 16
            assert got["usage"]["prompt_tokens"] == text_ref.usage.prompt_tokens

            body = {"prompt": ids, "max_tokens": 9, "temperature": 0, "ignore_eos": True}
            got = (await client.post(COMPLETIONS, json=body)).json()
            assert got["choices"][0]["text"] == ids_ref.text
            assert got["usage"] == {
                "prompt_tokens": 40,
                "completion_tokens": 9,
                "total_tokens": 49,
                "prompt_tokens_details": {"cached_tokens": 0},
            }
            ev = events((await client.post(COMPLETIONS, json={**body, "stream": True})).text)
            assert ev[-1] == "[DONE]"
            assert "".join(c["choices"][0]["text"] for c in ev[:-1]) == ids_ref.text
            assert ev[-2]["choices"][0]["finish_reason"] == "length"
            assert all(c["object"] == "text_completion" for c in ev[:-1])
    finally:
        await engine.close()


async def test_the_app_mounts_in_an_anyio_based_app(model_dir: MakeModel) -> None:
    """create_app under a prefix of another Starlette app, whose lifespan (an anyio task group)
    runs the mounted app's: the server stays on uvicorn's asyncio, inside apps built on anyio."""
    model = model_dir("qwen2")
    ids = [9 + (i * 31) % 500 for i in range(20)]
    ref = await reference(model, ids, max_tokens=9, temperature=0, ignore_eos=True)
    engine = await Engine.load(model)
    inner = create_app(engine, Settings(served_model_name="tiny"))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.sleep_forever)  # the outer app's own background work
            async with inner.router.lifespan_context(inner):
                yield
            tg.cancel_scope.cancel()

    outer = Starlette(routes=[Mount("/llm", app=inner)], lifespan=lifespan)
    try:
        async with outer.router.lifespan_context(outer):
            transport = httpx.ASGITransport(app=outer)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                assert (await client.get("/llm/health")).status_code == 200
                body = {"prompt": ids, "max_tokens": 9, "temperature": 0, "ignore_eos": True}
                got = (await client.post("/llm" + COMPLETIONS, json=body)).json()
                assert got["choices"][0]["text"] == ref.text
                streamed = await client.post("/llm" + COMPLETIONS, json={**body, "stream": True})
                ev = events(streamed.text)
                assert ev[-1] == "[DONE]"
                assert "".join(c["choices"][0]["text"] for c in ev[:-1]) == ref.text
    finally:
        await engine.close()


async def test_n_choices_prompt_batches_seeds_and_stop(model_dir: MakeModel) -> None:
    model = model_dir("llama")
    p1 = [11 + (i * 13) % 400 for i in range(20)]
    p2 = [17 + (i * 29) % 400 for i in range(25)]
    sampled = {"temperature": 0.9, "top_p": 0.95, "top_k": 40, "seed": 7, "ignore_eos": True}
    ref1 = await reference(model, p1, n=2, max_tokens=8, **sampled)
    ref2 = await reference(model, p2, n=2, max_tokens=8, **sampled)
    greedy = await reference(model, p1, max_tokens=30, temperature=0, ignore_eos=True)
    stop = greedy.text[10:12]
    cut = await reference(model, p1, max_tokens=30, temperature=0, ignore_eos=True, stop=[stop])
    assert cut.finish_reason == "stop" and len(cut.text) < len(greedy.text)
    engine = await Engine.load(model)
    try:
        async with asgi_client(engine) as client:
            body = {"prompt": [p1, p2], "n": 2, "max_tokens": 8, **sampled}
            got = (await client.post(COMPLETIONS, json=body)).json()
            # Choice index = prompt index * n + choice.
            expected = [c.text for c in ref1.choices] + [c.text for c in ref2.choices]
            assert [c["index"] for c in got["choices"]] == [0, 1, 2, 3]
            assert [c["text"] for c in got["choices"]] == expected
            assert got["usage"]["completion_tokens"] == 32
            assert got["usage"]["prompt_tokens"] == 45
            ev = events((await client.post(COMPLETIONS, json={**body, "stream": True})).text)
            texts = ["", "", "", ""]
            finishes: list[str | None] = [None] * 4
            for c in ev[:-1]:
                (choice,) = c["choices"]
                texts[choice["index"]] += choice["text"]
                finishes[choice["index"]] = choice["finish_reason"] or finishes[choice["index"]]
            assert texts == expected
            assert finishes == ["length"] * 4

            r = await client.post(
                CHAT,
                json={
                    "messages": [{"role": "user", "content": "hi"}],
                    "n": 3,
                    "max_tokens": 5,
                    **sampled,
                },
            )
            assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2]

            body = {"prompt": p1, "max_tokens": 30, "temperature": 0, "ignore_eos": True}
            got = (await client.post(COMPLETIONS, json={**body, "stop": stop})).json()
            assert got["choices"][0]["text"] == cut.text
            assert got["choices"][0]["finish_reason"] == "stop"
    finally:
        await engine.close()


async def test_prompt_logprobs_extension(model_dir: MakeModel) -> None:
    """vLLM's `prompt_logprobs`: null, then for each prompt token {id: {logprob, rank,
    decoded_token}} for its top alternatives and the token itself, from `Engine.prompt_logprobs`;
    on each completions choice, on a chat response (and on streams' first events)."""
    model = model_dir("llama")
    ids = [30 + 7 * i for i in range(10)]
    engine = await Engine.load(model)
    try:
        entries = await engine.prompt_logprobs(ids, top_logprobs=2)
        expected: list[Any] = [None]
        for e in entries[1:]:
            assert e is not None
            d = {
                str(t["token_id"]): {
                    "logprob": t["logprob"],
                    "rank": r,
                    "decoded_token": t["token"],
                }
                for r, t in enumerate(e["top_logprobs"], start=1)
            }
            d[str(e["token_id"])] = {
                "logprob": e["logprob"], "rank": e["rank"], "decoded_token": e["token"],
            }  # fmt: skip
            expected.append(d)
        async with asgi_client(engine) as client:
            body = {"prompt": ids, "max_tokens": 2, "n": 2, "prompt_logprobs": 2}
            got = (await client.post(COMPLETIONS, json=body)).json()
            assert [c["prompt_logprobs"] for c in got["choices"]] == [expected, expected]
            r = await client.post(COMPLETIONS, json={**body, "stream": True})
            chunks = [e for e in events(r.text) if e != "[DONE]"]
            firsts = {c["choices"][0]["index"]: c["choices"][0] for c in chunks[:2]}
            assert firsts[0]["prompt_logprobs"] == firsts[1]["prompt_logprobs"] == expected
            assert all("prompt_logprobs" not in c["choices"][0] for c in chunks[2:])

            # Chat: the rendered prompt's, on the response.
            chat = {"messages": MSG, "max_tokens": 2, "prompt_logprobs": 0}
            got = (await client.post(CHAT, json=chat)).json()
            tok = engine.tokenizer
            rendered = tok.encode(tok.apply_chat_template(MSG), add_special_tokens=False)
            plp = got["prompt_logprobs"]
            assert len(plp) == len(rendered) and plp[0] is None
            assert [list(d) for d in plp[1:]] == [[str(t)] for t in rendered[1:]]
            r = await client.post(CHAT, json={**chat, "stream": True})
            first = events(r.text)[0]
            assert first["prompt_logprobs"] == plp

            bad = await client.post(COMPLETIONS, json={**body, "prompt_logprobs": 21})
            assert bad.json()["error"] == {
                "message": "prompt_logprobs: must be in [0, 20], got 21",
                "type": "invalid_request_error", "param": "prompt_logprobs", "code": None,
            }  # fmt: skip
    finally:
        await engine.close()


async def test_echo_scores_the_prompt(model_dir: MakeModel) -> None:
    """`echo` (lm-eval's loglikelihood): the prompt's tokens with the log-softmax of the logits
    before each (the first null), equal to `engine.logits` within 1e-5; with max_tokens 0
    nothing is generated; with more, the generated part is the plain request's."""
    import numpy as np

    model = model_dir("llama")
    ids = [30 + 7 * i for i in range(10)]
    engine = await Engine.load(model)
    try:
        logits = (await engine.logits(ids)).astype(np.float64)
        lse = logits.max(axis=1) + np.log(np.exp(logits - logits.max(axis=1, keepdims=True)).sum(1))
        expected = [logits[i - 1, ids[i]] - lse[i - 1] for i in range(1, len(ids))]
        async with asgi_client(engine) as client:
            body = {"prompt": ids, "echo": True, "max_tokens": 0, "logprobs": 2}
            got = (await client.post(COMPLETIONS, json=body)).json()
            (choice,) = got["choices"]
            assert choice["text"] == engine.tokenizer.decode(ids)
            assert choice["finish_reason"] == "length"
            lp = choice["logprobs"]
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            assert np.allclose(lp["token_logprobs"][1:], expected, atol=1e-5, rtol=0)
            assert lp["tokens"] == [engine.tokenizer.decode([t]) for t in ids]
            for i in range(1, len(ids)):
                top = np.argsort(-logits[i - 1], kind="stable")[:2]
                want = [engine.tokenizer.decode([int(t)]) for t in top]
                assert list(lp["top_logprobs"][i]) == list(dict.fromkeys(want))
            assert got["usage"] == {
                "prompt_tokens": 10, "completion_tokens": 0, "total_tokens": 10,
                "prompt_tokens_details": {"cached_tokens": 0},
            }  # fmt: skip

            # With generation: the prompt's text and entries, then the plain request's.
            plain = {"prompt": ids, "max_tokens": 3, "temperature": 0, "logprobs": 1}
            alone = (await client.post(COMPLETIONS, json=plain)).json()["choices"][0]
            both = (await client.post(COMPLETIONS, json={**plain, "echo": True})).json()
            (choice,) = both["choices"]
            assert choice["text"] == engine.tokenizer.decode(ids) + alone["text"]
            assert choice["logprobs"]["token_logprobs"][10:] == alone["logprobs"]["token_logprobs"]
            assert np.allclose(choice["logprobs"]["token_logprobs"][1:10], expected, atol=1e-5)

            # Streamed: each choice's first event is the echo, then the plain stream's events.
            r = await client.post(COMPLETIONS, json={**plain, "echo": True, "stream": True})
            chunks = [e for e in events(r.text) if e != "[DONE]"]
            assert chunks[0]["choices"][0]["text"] == engine.tokenizer.decode(ids)
            assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
            streamed = [x for c in chunks for x in c["choices"][0]["logprobs"]["token_logprobs"]]
            assert streamed == choice["logprobs"]["token_logprobs"]
            offsets = [x for c in chunks for x in c["choices"][0]["logprobs"]["text_offset"]]
            assert offsets == choice["logprobs"]["text_offset"]

            # Text prompts are echoed as sent; a bad field is refused.
            text = (await client.post(COMPLETIONS, json={"prompt": "abc de", "echo": True,
                                                         "max_tokens": 0})).json()  # fmt: skip
            assert text["choices"][0]["text"] == "abc de"
            bad = await client.post(COMPLETIONS, json={**body, "temperature": -1})
            assert bad.json()["error"]["message"] == "temperature: must be >= 0, got -1"
            bad = await client.post(COMPLETIONS, json={**body, "echo": False})
            assert bad.json()["error"]["message"] == "max_tokens: must be >= 1, got 0"
    finally:
        await engine.close()


async def test_logprobs_in_both_shapes(model_dir: MakeModel) -> None:
    model = model_dir("qwen3")
    ids = [30 + i for i in range(12)]
    ref = await reference(model, ids, max_tokens=4, temperature=0, logprobs=3, ignore_eos=True)
    chat_ref = await reference(
        model, MESSAGES, chat=True, max_tokens=3, temperature=0, logprobs=2, ignore_eos=True
    )
    engine = await Engine.load(model)
    try:
        async with asgi_client(engine) as client:
            body = {"prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
            got = (await client.post(COMPLETIONS, json={**body, "logprobs": 3})).json()
            lp = got["choices"][0]["logprobs"]
            assert ref.logprobs is not None
            assert lp["tokens"] == [e["token"] for e in ref.logprobs]
            assert lp["token_logprobs"] == [e["logprob"] for e in ref.logprobs]
            assert lp["top_logprobs"] == [
                {t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in ref.logprobs
            ]
            offsets = [0]
            for e in ref.logprobs[:-1]:
                offsets.append(offsets[-1] + len(e["token"]))
            assert lp["text_offset"] == offsets

            body = {"messages": MESSAGES, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
            got = (
                await client.post(CHAT, json={**body, "logprobs": True, "top_logprobs": 2})
            ).json()
            assert chat_ref.logprobs is not None
            assert got["choices"][0]["logprobs"] == {
                "content": [
                    {
                        "token": e["token"],
                        "logprob": e["logprob"],
                        "bytes": list(e["token"].encode()),
                        "top_logprobs": [
                            {
                                "token": t["token"],
                                "logprob": t["logprob"],
                                "bytes": list(t["token"].encode()),
                            }
                            for t in e["top_logprobs"]
                        ],
                    }
                    for e in chat_ref.logprobs
                ]
            }
            ev = events(
                (
                    await client.post(
                        CHAT, json={**body, "logprobs": True, "top_logprobs": 2, "stream": True}
                    )
                ).text
            )
            streamed = [
                e for c in ev[:-1] for e in (c["choices"][0]["logprobs"] or {}).get("content", [])
            ]
            whole = got["choices"][0]["logprobs"]["content"]
            # The streamed request found the prompt cached: same tokens, logprobs equal to f32
            # rounding (a cached prefix's K/V was computed in a different chunking).
            assert [e["token"] for e in streamed] == [e["token"] for e in whole]
            for a, b in zip(streamed, whole, strict=True):
                assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-5)
                assert [t["token"] for t in a["top_logprobs"]] == [
                    t["token"] for t in b["top_logprobs"]
                ]
            # logprobs=true alone: each token's logprob, no alternatives.
            got = (await client.post(CHAT, json={**body, "logprobs": True})).json()
            assert [e["top_logprobs"] for e in got["choices"][0]["logprobs"]["content"]] == [[]] * 3
    finally:
        await engine.close()


def _err(message: str, param: str | None, code: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": param,
            "code": code,
        }
    }


MSG = [{"role": "user", "content": "hi"}]
# (path, body, expected message, param, code): each answered 400.
INVALID: list[tuple[str, dict[str, Any], str, str | None, str | None]] = [
    (CHAT, {}, "messages: required", "messages", None),
    (CHAT, {"messages": []}, "messages: must not be empty", "messages", None),
    (
        CHAT,
        {"messages": "hi"},
        "messages: must be an array of messages, got string",
        "messages",
        None,
    ),
    (
        CHAT,
        {"messages": [{"role": "wizard", "content": "hi"}]},
        'messages[0].role: unknown role "wizard" (expected one of system, developer, user, '
        "assistant, tool)",
        "messages[0].role",
        None,
    ),
    (
        CHAT,
        {"messages": [{"role": "user", "content": 5}]},
        "messages[0].content: must be a string or a list of content parts",
        "messages[0].content",
        None,
    ),
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content[0].type: only text parts are supported, got 'image_url'",
        "messages[0].content[0].type",
        None,
    ),
    (CHAT, {"messages": MSG, "model": 3}, "model: must be a string, got integer", "model", None),
    (
        CHAT,
        {"messages": MSG, "temperature": "hot"},
        "temperature: must be a number, got str",
        "temperature",
        None,
    ),
    (
        CHAT,
        {"messages": MSG, "temperature": -1},
        "temperature: must be >= 0, got -1",
        "temperature",
        None,
    ),
    (CHAT, {"messages": MSG, "top_p": 1.5}, "top_p: must be in (0, 1], got 1.5", "top_p", None),
    # Checked as sent, not after rounding to the engine's 32-bit float (which gives 1.0).
    (
        CHAT,
        {"messages": MSG, "top_p": 1.0000000000000002},
        "top_p: must be in (0, 1], got 1.0000000000000002",
        "top_p",
        None,
    ),
    (
        CHAT,
        {"messages": MSG, "temperature": 1e39},
        "temperature: must be at most 3.4028235e38 (a 32-bit float), got 1e39",
        "temperature",
        None,
    ),
    (CHAT, {"messages": MSG, "top_k": -3}, "top_k: must be >= 0, got -3", "top_k", None),
    (CHAT, {"messages": MSG, "min_p": 2}, "min_p: must be in [0, 1], got 2", "min_p", None),
    (
        CHAT,
        {"messages": MSG, "presence_penalty": 5},
        "presence_penalty: must be in [-2, 2], got 5",
        "presence_penalty",
        None,
    ),
    (
        CHAT,
        {"messages": MSG, "repetition_penalty": 0},
        "repetition_penalty: must be > 0, got 0",
        "repetition_penalty",
        None,
    ),
    (CHAT, {"messages": MSG, "seed": "x"}, "seed: must be an integer, got str", "seed", None),
    (CHAT, {"messages": MSG, "n": 0}, "n: must be >= 1, got 0", "n", None),
    (
        CHAT,
        {"messages": MSG, "stop": 5},
        "stop: must be a string or a list of strings, got int",
        "stop",
        None,
    ),
    (
        CHAT,
        {"messages": MSG, "max_tokens": 0},
        "max_tokens: must be >= 1, got 0",
        "max_tokens",
        None,
    ),
    (
        CHAT,
        {"messages": MSG, "max_completion_tokens": 1.5},
        "max_completion_tokens: must be an integer, got float",
        "max_completion_tokens",
        None,
    ),
    # Two names of one limit: the one the engine would not see is not silently dropped.
    (
        CHAT,
        {"messages": MSG, "max_tokens": 0, "max_completion_tokens": 5},
        "max_tokens: differs from max_completion_tokens, its newer name",
        "max_tokens",
        None,
    ),
    (
        CHAT,
        {"messages": MSG, "max_tokens": 5, "max_completion_tokens": 6},
        "max_tokens: differs from max_completion_tokens, its newer name",
        "max_tokens",
        None,
    ),
    (
        CHAT,
        {"messages": MSG, "max_tokens": 500},
        "max_tokens: 15 prompt tokens + 500 exceed the context of 256 tokens",
        "max_tokens",
        "context_length_exceeded",
    ),
    (
        CHAT,
        {"messages": [{"role": "user", "content": "word " * 300}]},
        "messages: 914 tokens exceed the context of 256 tokens",
        "messages",
        "context_length_exceeded",
    ),
    (
        CHAT,
        {"messages": MSG, "stream": "yes"},
        "stream: must be a boolean, got string",
        "stream",
        None,
    ),
    (
        CHAT,
        {"messages": MSG, "stream_options": {"include_usage": True}},
        "stream_options: only allowed when stream is true",
        "stream_options",
        None,
    ),
    (
        CHAT,
        {"messages": MSG, "stream": True, "stream_options": {"include_usage": 1}},
        "include_usage: must be a boolean, got integer",
        "include_usage",
        None,
    ),
    (
        CHAT,
        {"messages": MSG, "top_logprobs": 3},
        "top_logprobs: requires logprobs to be true",
        "top_logprobs",
        None,
    ),
    (
        CHAT,
        {"messages": MSG, "logprobs": True, "top_logprobs": 21},
        "top_logprobs: must be in [0, 20], got 21",
        "top_logprobs",
        None,
    ),
    (
        CHAT,
        {"messages": MSG, "logprobs": 2},
        "logprobs: must be a boolean, got integer",
        "logprobs",
        None,
    ),
    (CHAT, {"messages": MSG, "user": 7}, "user: must be a string, got integer", "user", None),
    (
        CHAT,
        {"messages": MSG, "temprature": 0.5},
        "temprature: unrecognized request argument",
        "temprature",
        None,
    ),
    (
        CHAT,
        {"messages": MSG, "tools": [{"type": "function"}]},
        "tools[0].function: must be an object, got null",
        "tools[0].function",
        None,
    ),
    (
        CHAT,
        {"messages": MSG, "functions": [{"name": "f"}]},
        "functions: not supported by this server",
        "functions",
        None,
    ),
    (COMPLETIONS, {}, "prompt: required", "prompt", None),
    (COMPLETIONS, {"prompt": []}, "prompt: must not be empty", "prompt", None),
    (
        COMPLETIONS,
        {"prompt": 3.5},
        "prompt: must be a string, an array of token ids, or an array of either, got number",
        "prompt",
        None,
    ),
    (
        COMPLETIONS,
        {"prompt": ["a", {"x": 1}]},
        "prompt[1]: must be a string, an array of token ids, or an array of either, got object",
        "prompt[1]",
        None,
    ),
    (
        COMPLETIONS,
        {"prompt": [5, 600]},
        "prompt: token id 600 is outside the vocabulary (size 512)",
        "prompt",
        None,
    ),
    (
        COMPLETIONS,
        {"prompt": list(range(3, 259))},
        "prompt: 256 tokens leave no room to generate in the context of 256 tokens",
        "prompt",
        "context_length_exceeded",
    ),
    (
        COMPLETIONS,
        {"prompt": "hi", "logprobs": True},
        "logprobs: must be an integer, got boolean",
        "logprobs",
        None,
    ),
    (
        COMPLETIONS,
        {"prompt": "hi", "logprobs": 21},
        "logprobs: must be in [0, 20], got 21",
        "logprobs",
        None,
    ),
    (
        COMPLETIONS,
        {"prompt": "hi", "echo": "yes"},
        "echo: must be a boolean, got string",
        "echo",
        None,
    ),
    (
        COMPLETIONS,
        {"prompt": "hi", "logit_bias": {"3": "x"}},
        "logit_bias[3]: must be a number, got str",
        "logit_bias[3]",
        None,
    ),
    (
        COMPLETIONS,
        {"prompt": "hi", "messages": MSG},
        "messages: unrecognized request argument",
        "messages",
        None,
    ),
]


async def test_invalid_requests_get_400_with_the_field(model_dir: MakeModel) -> None:
    model = model_dir("llama")
    ref = await reference(model, MSG, chat=True, max_tokens=5, temperature=0, ignore_eos=True)
    engine = await Engine.load(model)
    try:
        async with asgi_client(engine) as client:
            for path, body, message, param, code in INVALID:
                r = await client.post(path, json=body)
                assert (r.status_code, r.json()) == (400, _err(message, param, code)), body
            for raw, message in [
                (
                    b"{not json",
                    "the request body is not valid JSON (Expecting property name "
                    "enclosed in double quotes: line 1 column 2 (char 1))",
                ),
                (b"[1, 2]", "the request body must be a JSON object"),
                # json.loads' RecursionError was a 500.
                (
                    b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                    "the request body is nested too deeply",
                ),
                (
                    b'{"a": "\xc3\x28"}',
                    "the request body is not valid JSON ('utf-8' codec can't decode "
                    "byte 0xc3 in position 7: invalid continuation byte)",
                ),
            ]:
                r = await client.post(CHAT, content=raw)
                assert (r.status_code, r.json()) == (400, _err(message, None)), raw
            # Null means "not given", as OpenAI clients send it.
            body = {"messages": MSG, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
            r = await client.post(CHAT, json={**body, "top_p": None, "stop": None, "user": None})
            assert r.json()["choices"][0]["message"]["content"] == ref.text
            assert engine.stats()["requests_finished"] == 1
            # Both names of the limit, equal: accepted.
            r = await client.post(CHAT, json={**body, "max_completion_tokens": 5})
            assert r.json()["choices"][0]["message"]["content"] == ref.text
            assert r.json()["usage"]["completion_tokens"] == 5
    finally:
        await engine.close()


async def test_unpaired_surrogates_get_400_not_500(model_dir: MakeModel) -> None:
    """JSON may escape a lone UTF-16 surrogate; it is no Unicode text, and once reached the engine
    (or an error message echoing it) it was a 500."""
    engine = await Engine.load(model_dir("llama"))
    lone = "must be valid Unicode text, got the unpaired surrogate"
    try:
        async with asgi_client(engine) as client:
            for path, raw, message, param in [
                (
                    CHAT,
                    b'{"messages": [{"role": "user", "content": "a\\ud800"}]}',
                    f"messages[0].content: {lone} \\ud800",
                    "messages[0].content",
                ),
                (COMPLETIONS, b'{"prompt": "\\uDFFF"}', f"prompt: {lone} \\udfff", "prompt"),
                (
                    COMPLETIONS,
                    b'{"prompt": "hi", "stop": ["x", "\\ud83d"]}',
                    f"stop[1]: {lone} \\ud83d",
                    "stop[1]",
                ),
                (
                    COMPLETIONS,
                    b'{"prompt": "hi", "model": "\\udc00"}',
                    f"model: {lone} \\udc00",
                    "model",
                ),
                (
                    COMPLETIONS,
                    b'{"prompt": "hi", "x\\ud800": 1}',
                    "a key holds the unpaired surrogate \\ud800; it must be valid Unicode",
                    None,
                ),
                ("/tokenize", b'{"prompt": "\\ud800"}', f"prompt: {lone} \\ud800", "prompt"),
            ]:
                r = await client.post(path, content=raw)
                assert (r.status_code, r.json()) == (400, _err(message, param)), raw
            # A pair is one character (an emoji), not two halves.
            r = await client.post("/tokenize", content=b'{"prompt": "\\ud83d\\ude00"}')
            assert r.status_code == 200
            assert r.json()["tokens"] == engine.tokenizer.encode("\U0001f600")
            assert engine.stats()["requests_finished"] == 0
    finally:
        await engine.close()


async def test_tokenize_refuses_what_chat_refuses(model_dir: MakeModel) -> None:
    engine = await Engine.load(model_dir("llama"))
    roles = "system, developer, user, assistant, tool"
    reserved = "cannot be set as an extra template variable"
    try:
        async with asgi_client(engine) as client:
            for body, message, param in [
                (
                    {"messages": [{"role": "wizard", "content": "hi"}]},
                    f'messages[0].role: unknown role "wizard" (expected one of {roles})',
                    "messages[0].role",
                ),
                (
                    {"messages": [{"role": "user", "content": None}]},
                    "messages[0].content: must be a string or a list of content parts",
                    "messages[0].content",
                ),
                # A keyword argument of the template call: a TypeError (500) before.
                (
                    {"messages": MSG, "chat_template_kwargs": {"add_generation_prompt": False}},
                    f'chat_template_kwargs: "add_generation_prompt" {reserved}',
                    "chat_template_kwargs",
                ),
                (
                    {"messages": MSG, "chat_template_kwargs": {"messages": []}},
                    f'chat_template_kwargs: "messages" {reserved}',
                    "chat_template_kwargs",
                ),
            ]:
                for path in ("/tokenize", CHAT):
                    r = await client.post(path, json=body)
                    assert (r.status_code, r.json()) == (400, _err(message, param)), (path, body)
            # Checked with a prompt too, not only on the messages path.
            for body, message, param in [
                (
                    {"prompt": "hi", "add_generation_prompt": {}},
                    "add_generation_prompt: must be a boolean, got object",
                    "add_generation_prompt",
                ),
                (
                    {"prompt": "hi", "chat_template_kwargs": 3},
                    "chat_template_kwargs: must be an object, got integer",
                    "chat_template_kwargs",
                ),
            ]:
                r = await client.post("/tokenize", json=body)
                assert (r.status_code, r.json()) == (400, _err(message, param)), body
            assert engine.stats()["requests_finished"] == 0
    finally:
        await engine.close()


async def test_more_prompts_than_the_queue_holds_get_400_not_503(model_dir: MakeModel) -> None:
    """Every prompt of a completions request is queued at once: more than --max-waiting could
    never be admitted, so "retry later" (503) would be a lie."""
    engine = await Engine.load(model_dir("llama"), max_waiting=3)
    try:
        async with asgi_client(engine) as client:
            body = {"prompt": ["a", "b", "c", "d"], "max_tokens": 1}
            r = await client.post(COMPLETIONS, json=body)
            assert (r.status_code, r.json()) == (
                400,
                _err(
                    "prompt: 4 prompts are more than the server queues at once (max_waiting 3)",
                    "prompt",
                ),
            )
            assert engine.stats()["requests_refused"] == 0
            r = await client.post(COMPLETIONS, json={**body, "prompt": ["a", "b", "c"]})
            assert r.status_code == 200
            assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2]
    finally:
        await engine.close()


async def test_model_body_limit_routes_and_api_key(model_dir: MakeModel) -> None:
    engine = await Engine.load(model_dir("llama"))
    settings = Settings(served_model_name="tiny", api_key="s3cret", max_body_bytes=1000)
    auth = {"Authorization": "Bearer s3cret"}
    try:
        async with asgi_client(engine, settings) as client:
            body = {"messages": MSG, "max_tokens": 2}
            r = await client.post(CHAT, json=body)
            assert r.status_code == 401
            assert r.headers["www-authenticate"] == "Bearer"
            assert r.json() == _err(
                "missing API key: send it as `Authorization: Bearer <key>`", None, "invalid_api_key"
            )
            for bad in ("Bearer s3cre", "Bearer s3cret2", "Basic s3cret", "s3cret"):
                r = await client.post(CHAT, json=body, headers={"Authorization": bad})
                assert r.status_code == 401, bad
            r = await client.post(CHAT, json=body, headers={"Authorization": "Bearer wrong"})
            assert r.json() == _err("incorrect API key", None, "invalid_api_key")
            for path in ("/v1/models", "/v1/cache"):
                assert (await client.get(path)).status_code == 401
            for path in ("/tokenize", "/detokenize"):
                assert (await client.post(path, json={})).status_code == 401
            # Only health stays open (load balancer probes carry no key); Prometheus sends the
            # key as a bearer token (`authorization` in its scrape config).
            assert (await client.get("/health")).status_code == 200
            assert (await client.get("/metrics")).status_code == 401
            assert (await client.get("/metrics", headers=auth)).status_code == 200
            r = await client.post(CHAT, json=body, headers=auth)
            assert r.status_code == 200

            r = await client.post(CHAT, json={**body, "model": "gpt-4o"}, headers=auth)
            assert (r.status_code, r.json()) == (
                404,
                _err(
                    "The model `gpt-4o` does not exist; this server serves `tiny`",
                    "model",
                    "model_not_found",
                ),
            )
            r = await client.get("/v1/models/gpt-4o", headers=auth)
            assert r.status_code == 404
            big = {"messages": [{"role": "user", "content": "x" * 1000}]}
            r = await client.post(CHAT, json=big, headers=auth)
            assert (r.status_code, r.json()) == (
                413,
                _err("the request body is over the limit of 1000 bytes", None, "request_too_large"),
            )

            # Without Content-Length (chunked): counted while reading.
            async def chunks() -> AsyncIterator[bytes]:
                for _ in range(20):
                    yield b" " * 100

            r = await client.post(CHAT, content=chunks(), headers=auth)
            assert r.status_code == 413
            r = await client.get("/v1/nothing", headers=auth)
            assert (r.status_code, r.json()) == (
                404,
                _err("no such endpoint: GET /v1/nothing", None, "not_found"),
            )
            r = await client.get(CHAT, headers=auth)
            assert (r.status_code, r.json()) == (
                405,
                _err("method GET is not allowed on /v1/chat/completions", None),
            )
    finally:
        await engine.close()


async def test_a_full_queue_answers_503_with_retry_after(model_dir: MakeModel) -> None:
    engine = await Engine.load(model_dir("llama"), max_batch=1, max_waiting=1)
    try:
        async with asgi_client(engine) as client:
            running = engine.generate([5, 6, 7], max_tokens=250, temperature=0, ignore_eos=True)
            await wait_for(engine, lambda s: s["running"] == 1)
            queued = engine.generate([8, 9], max_tokens=2)
            r = await client.post(CHAT, json={"messages": MSG, "stream": True})
            assert r.status_code == 503
            assert r.headers["retry-after"] == "1"
            assert r.json() == {
                "error": {
                    "message": "1 requests are already waiting (max_waiting); retry later",
                    "type": "server_error",
                    "param": None,
                    "code": "engine_busy",
                }
            }
            metrics = (await client.get("/metrics")).text
            assert 'strata:admission_refusals_total{gate="queue"} 1.0' in metrics
            assert 'strata:http_requests_total{endpoint="chat.completions",status="503"} 1.0' in (
                metrics
            )
            running.cancel()
            queued.cancel()
            await wait_for(engine, lambda s: s["running"] == 0 and s["waiting"] == 0)
            r = await client.post(CHAT, json={"messages": MSG, "max_tokens": 2})
            assert r.status_code == 200
    finally:
        await engine.close()


async def test_models_tokenize_detokenize_cache_and_metrics(
    model_dir: MakeModel, private_cache_dir: Path
) -> None:
    model = model_dir("llama")
    engine = await Engine.load(model)
    tok = engine.tokenizer
    try:
        async with asgi_client(engine) as client:
            models = (await client.get("/v1/models")).json()
            assert models["object"] == "list"
            (card,) = models["data"]
            assert card["id"] == "tiny" and card["object"] == "model"
            assert card["owned_by"] == "strata-rs"
            assert card["root"] == str(model) and card["max_model_len"] == 256
            assert "demo" not in card
            assert (await client.get("/v1/models/tiny")).json() == card

            r = (await client.post("/tokenize", json={"prompt": "hello world"})).json()
            assert r == {
                "count": len(tok.encode("hello world")),
                "max_model_len": 256,
                "tokens": tok.encode("hello world"),
            }
            r = (await client.post("/tokenize", json={"messages": MESSAGES})).json()
            rendered = tok.apply_chat_template(MESSAGES)
            assert r["tokens"] == tok.encode(rendered, add_special_tokens=False)
            r = (await client.post("/detokenize", json={"tokens": r["tokens"]})).json()
            assert r == {"prompt": rendered}
            r = await client.post("/detokenize", json={"tokens": [5, 512]})
            assert (r.status_code, r.json()) == (
                400,
                _err("tokens: token id 512 is outside the vocabulary (size 512)", "tokens"),
            )
            r = await client.post("/tokenize", json={"prompt": "a", "messages": MSG})
            assert (r.status_code, r.json()) == (
                400,
                _err("send exactly one of prompt and messages", None),
            )
            # The same words as the completions' booleans (one validator).
            r = await client.post("/tokenize", json={"prompt": "a", "add_special_tokens": "no"})
            assert (r.status_code, r.json()) == (
                400,
                _err("add_special_tokens: must be a boolean, got string", "add_special_tokens"),
            )
            r = await client.post("/detokenize", json={"tokens": [5], "skip_special_tokens": 1})
            assert (r.status_code, r.json()) == (
                400,
                _err("skip_special_tokens: must be a boolean, got integer", "skip_special_tokens"),
            )

            empty = (await client.get("/v1/cache")).json()
            block_bytes = engine.info["kv_block_bytes"]
            assert [t["tier"] for t in empty.pop("tiers")] == ["device", "host", "disk"]
            assert empty == {
                "object": "cache",
                "block_size": 16,
                "entry_bytes": block_bytes,
                "hit_tokens": 0,
                "query_tokens": 0,
                "hit_rate": 0.0,
                "moves": [],
                "refusals": {"ram": 0, "host_budget": 0, "disk_budget": 0, "device": 0},
                "corrupt_files": 0,
                "adopted_files": 0,
                "faults_injected": {},
                "last_restore": None,
            }
            ids = list(range(3, 53))  # 50 tokens: 3 full blocks
            body = {"prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
            for _ in range(2):
                assert (await client.post(COMPLETIONS, json=body)).status_code == 200
            cache = (await client.get("/v1/cache")).json()
            s = engine.stats()
            assert s["kv_blocks_cached"] >= 3
            # Nothing was evicted from the 16-block pool: the tiers below hold nothing yet.
            assert cache["tiers"] == [
                {
                    "tier": "device",
                    "enabled": True,
                    "bytes": s["kv_blocks_cached"] * block_bytes,
                    "capacity_bytes": 16 * block_bytes,
                    "entries": s["kv_blocks_cached"],
                    "hit_tokens": 48,
                },
                {
                    "tier": "host",
                    "enabled": True,
                    "bytes": 0,
                    "capacity_bytes": 4096 << 20,
                    "entries": 0,
                    "hit_tokens": 0,
                },
                {
                    "tier": "disk",
                    "enabled": True,
                    "bytes": 0,
                    "capacity_bytes": 16384 << 20,
                    "entries": 0,
                    "hit_tokens": 0,
                    "dir": str(private_cache_dir / "strata-rs" / "kv"),
                },
            ]
            assert cache["hit_tokens"] == 48 and cache["query_tokens"] == 100
            assert cache["hit_rate"] == 0.48
            assert cache["moves"] == [] and cache["last_restore"] is None

            text = (await client.get("/metrics")).text
            lines = set(text.splitlines())
            for line in [
                "strata:engine_up 1.0",
                "strata:num_requests_running 0.0",
                "strata:num_requests_waiting 0.0",
                "strata:kv_cache_usage_perc 0.0",
                "strata:kv_blocks_total 16.0",
                f"strata:kv_blocks_cached {float(s['kv_blocks_cached'])}",
                f'strata:cache_bytes{{tier="device"}} {float(cache["tiers"][0]["bytes"])}',
                'strata:cache_bytes{tier="host"} 0.0',
                'strata:cache_bytes{tier="disk"} 0.0',
                f'strata:cache_blocks{{tier="device"}} {float(s["kv_blocks_cached"])}',
                'strata:cache_blocks{tier="host"} 0.0',
                "strata:prefix_cache_queries_total 100.0",
                'strata:prefix_cache_hits_total{tier="device"} 48.0',
                'strata:prefix_cache_hits_total{tier="host"} 0.0',
                'strata:prefix_cache_hits_total{tier="disk"} 0.0',
                'strata:cache_moves_total{from="device",result="ok",to="host"} 0.0',
                'strata:cache_moves_total{from="disk",result="failed",to="device"} 0.0',
                'strata:cache_move_bytes_total{from="host",to="device"} 0.0',
                "strata:cache_corrupt_files_total 0.0",
                'strata:admission_refusals_total{gate="ram"} 0.0',
                'strata:admission_refusals_total{gate="device"} 0.0',
                "strata:prompt_tokens_total 100.0",
                "strata:generation_tokens_total 8.0",
                "strata:requests_finished_total 2.0",
                "strata:requests_cancelled_total 0.0",
                'strata:admission_refusals_total{gate="queue"} 0.0',
                "strata:num_preemptions_total 0.0",
                "strata:time_to_first_token_seconds_count 2.0",
                "strata:e2e_request_latency_seconds_count 2.0",
                "strata:engine_time_to_first_token_seconds_count 2.0",
                'strata:http_requests_total{endpoint="completions",status="200"} 2.0',
                'strata:http_requests_total{endpoint="detokenize",status="400"} 2.0',
                'strata:http_requests_total{endpoint="tokenize",status="400"} 2.0',
            ]:
                assert line in lines, line
            assert "strata:inter_token_latency_seconds_count 0.0" in lines  # not streamed
            assert 'strata:engine_step_seconds_bucket{le="+Inf"} ' in text
    finally:
        await engine.close()


# ---- the conversation cache's tiers -------------------------------------------------------------


def conversation(seed: int, length: int = 1200) -> list[int]:
    """`length` token ids of one conversation (the tiny model's vocabulary has 512)."""
    return [3 + (i * seed + seed) % 500 for i in range(length)]


async def alternate(
    client: httpx.AsyncClient, histories: list[list[int]], rounds: int
) -> list[int]:
    """Sends each history in turn, `rounds` times, each growing by 16 new ids a turn, so that
    with `kv_memory_mib=1` (128 blocks) two 1200-token conversations push each other below the
    device. Returns the cached_tokens of every request."""
    cached = []
    for _ in range(rounds):
        for h in histories:
            body = {"prompt": h, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
            r = await client.post(COMPLETIONS, json=body)
            assert r.status_code == 200, r.text
            cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            h += [100 + len(h) % 300 + k for k in range(16)]
    return cached


def samples(text: str) -> dict[str, float]:
    """The Prometheus text's samples: 'name{labels}' -> value."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def moves_by_route(cache: dict[str, Any]) -> dict[tuple[str, str, str], dict[str, Any]]:
    return {(m["from"], m["to"], m["result"]): m for m in cache["moves"]}


async def wait_for_log(caplog: pytest.LogCaptureFixture, text: str) -> str:
    """Cache log lines reach Python logging from a forwarder thread: wait for one."""
    for _ in range(200):
        for r in caplog.records:
            if text in r.getMessage():
                return r.getMessage()
        await asyncio.sleep(0.01)
    raise AssertionError(f"no log line with {text!r}: {[r.getMessage() for r in caplog.records]}")


async def test_cache_and_metrics_show_restores_from_the_host_tier(
    model_dir: MakeModel, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="strata_rs.cache")
    model = model_dir("llama", max_position_embeddings=4096)
    # Floor 0: the RAM gate admits on any machine (its refusals have their own test).
    engine = await Engine.load(
        model,
        kv_memory_mib=1,
        host_cache_mib=64,
        host_min_free_mib=0,
        disk_cache_dir=tmp_path / "kv",
    )
    block_bytes = engine.info["kv_block_bytes"]
    try:
        async with asgi_client(engine) as client:
            cached = await alternate(client, [conversation(1), conversation(7)], rounds=3)
            # Every turn finds its whole previous prompt (full blocks) cached, though the device
            # holds one conversation at a time: the rest came back from the host tier.
            assert cached == [0, 0, 1200, 1200, 1216, 1216]
            cache = (await client.get("/v1/cache")).json()
            metrics = samples((await client.get("/metrics")).text)
        s = engine.stats()
    finally:
        await engine.close()
    c = s["cache"]
    device, host, disk = cache["tiers"]
    assert device == {
        "tier": "device",
        "enabled": True,
        "bytes": c["tiers"]["device"]["bytes"],
        "capacity_bytes": 128 * block_bytes,
        "entries": c["tiers"]["device"]["blocks"],
        "hit_tokens": s["prefix_hit_tokens"],
    }
    assert device["entries"] > 0 and device["bytes"] == device["entries"] * block_bytes
    assert host["enabled"] and host["capacity_bytes"] == 64 << 20
    assert host["entries"] == c["tiers"]["host"]["blocks"] > 0
    assert host["bytes"] == host["entries"] * block_bytes
    assert host["hit_tokens"] == c["hit_tokens"]["host"] > 0
    assert host["hit_tokens"] % 16 == 0
    assert disk["enabled"] and disk["dir"] == str(tmp_path / "kv")
    assert disk["capacity_bytes"] == 16384 << 20
    # The hits of all tiers are the cached tokens the requests reported.
    assert device["hit_tokens"] + host["hit_tokens"] + disk["hit_tokens"] == sum(cached)
    assert cache["hit_tokens"] == sum(cached)
    assert cache["query_tokens"] == 2 * (1200 + 1216 + 1232)
    assert cache["hit_rate"] == sum(cached) / cache["query_tokens"]

    moves = moves_by_route(cache)
    down = moves[("device", "host", "ok")]
    up = moves[("host", "device", "ok")]
    assert down["blocks"] > 0 and down["bytes"] == down["blocks"] * block_bytes
    assert up["blocks"] * 16 == host["hit_tokens"] and up["bytes"] == up["blocks"] * block_bytes
    last = cache["last_restore"]
    assert last["tokens"] == last["from_host"] > 0 and last["from_disk"] == 0
    assert last["bytes"] == last["tokens"] // 16 * block_bytes and last["seconds"] > 0
    assert cache["corrupt_files"] == 0 and cache["adopted_files"] == 0

    # prometheus-client writes labels sorted by name: from, result, to.
    n_down, n_up = down["blocks"], up["blocks"]
    assert metrics['strata:cache_moves_total{from="device",result="ok",to="host"}'] == n_down
    assert metrics['strata:cache_moves_total{from="host",result="ok",to="device"}'] == n_up
    assert metrics['strata:cache_moves_total{from="device",result="failed",to="host"}'] == 0
    assert metrics['strata:cache_move_bytes_total{from="device",to="host"}'] == down["bytes"]
    assert metrics['strata:cache_move_bytes_total{from="host",to="device"}'] == up["bytes"]
    for tier in ("device", "host", "disk"):
        t = cache["tiers"][("device", "host", "disk").index(tier)]
        assert metrics[f'strata:cache_bytes{{tier="{tier}"}}'] == t["bytes"]
        assert metrics[f'strata:cache_blocks{{tier="{tier}"}}'] == t["entries"]
        assert metrics[f'strata:prefix_cache_hits_total{{tier="{tier}"}}'] == t["hit_tokens"]
    line = await wait_for_log(caplog, f"restored {last['tokens']} tokens from host in ")
    assert line.endswith(" GB/s)")


async def test_cache_shows_the_disk_tier_across_a_restart(
    model_dir: MakeModel, tmp_path: Path
) -> None:
    model = model_dir("llama", max_position_embeddings=4096)
    kv = tmp_path / "kv"
    histories = [conversation(1), conversation(7)]
    # Host tier off: what leaves the device goes to disk. Floor 0: the disk tier's staging
    # buffer passes the RAM gate on any machine.
    options: dict[str, Any] = {"host_cache_mib": 0, "host_min_free_mib": 0, "disk_cache_dir": kv}
    engine = await Engine.load(model, kv_memory_mib=1, **options)
    block_bytes = engine.info["kv_block_bytes"]
    try:
        async with asgi_client(engine) as client:
            assert await alternate(client, histories, rounds=2) == [0, 0, 1200, 1200]
            cache = (await client.get("/v1/cache")).json()
    finally:
        await engine.close()  # a clean close writes every cached block to disk
    _, host, disk = cache["tiers"]
    assert host["enabled"] is False and host["capacity_bytes"] == 0 and host["entries"] == 0
    assert disk["enabled"] and disk["dir"] == str(kv) and disk["entries"] > 0
    # Disk bytes are file bytes: each block's payload and its header.
    assert disk["bytes"] > disk["entries"] * block_bytes
    assert disk["hit_tokens"] > 0
    moves = moves_by_route(cache)
    assert moves[("device", "disk", "ok")]["blocks"] > 0
    assert moves[("disk", "device", "ok")]["blocks"] * 16 == disk["hit_tokens"]

    # The last prompts (1216 tokens, 76 blocks each) are all on disk now. Cut one file short.
    files = sorted(kv.glob("*.kvb"))
    assert len(files) == 2 * 76
    with open(files[0], "r+b") as f:
        f.truncate(100)
    engine = await Engine.load(model, kv_memory_mib=1, **options)
    try:
        async with asgi_client(engine) as client:
            cache = (await client.get("/v1/cache")).json()
            assert cache["adopted_files"] == 151 and cache["corrupt_files"] == 1
            assert cache["tiers"][2]["entries"] == 151
            cached = await alternate(client, histories, rounds=1)
            cache = (await client.get("/v1/cache")).json()
            metrics = samples((await client.get("/metrics")).text)
    finally:
        await engine.close()
    # One conversation comes back whole from disk; the other up to the deleted block.
    assert max(cached) == 1216 and min(cached) < 1216 and min(cached) % 16 == 0
    device, _, disk = cache["tiers"]
    assert device["hit_tokens"] == 0 and disk["hit_tokens"] == sum(cached)
    up = moves_by_route(cache)[("disk", "device", "ok")]
    assert up["blocks"] * 16 == sum(cached)
    assert cache["last_restore"]["from_disk"] == cache["last_restore"]["tokens"]
    assert metrics["strata:cache_corrupt_files_total"] == 1
    assert metrics['strata:cache_moves_total{from="disk",result="ok",to="device"}'] == up["blocks"]
    assert metrics['strata:prefix_cache_hits_total{tier="disk"}'] == sum(cached)


async def test_ram_gate_refusals_show_in_cache_and_metrics(
    model_dir: MakeModel, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="strata_rs.cache")
    model = model_dir("llama", max_position_embeddings=4096)
    # A floor no machine has: the RAM gate refuses every host copy; the requests still succeed.
    engine = await Engine.load(
        model, kv_memory_mib=1, host_cache_mib=64, host_min_free_mib=1 << 30, disk_cache_mib=0
    )
    try:
        async with asgi_client(engine) as client:
            cached = await alternate(client, [conversation(1), conversation(7)], rounds=2)
            cache = (await client.get("/v1/cache")).json()
            metrics = samples((await client.get("/metrics")).text)
    finally:
        await engine.close()
    assert cached[:2] == [0, 0] and all(n < 1200 for n in cached)  # the device's leftovers
    refused = cache["refusals"]["ram"]
    assert refused > 0
    assert cache["refusals"] == {"ram": refused, "host_budget": 0, "disk_budget": 0, "device": 0}
    _, host, disk = cache["tiers"]
    assert host["entries"] == 0 and host["hit_tokens"] == 0
    assert disk["enabled"] is False and disk["dir"] is None
    blocks = moves_by_route(cache)[("device", "host", "refused")]["blocks"]
    assert blocks > 0
    assert metrics['strata:admission_refusals_total{gate="ram"}'] == refused
    assert metrics['strata:admission_refusals_total{gate="queue"}'] == 0
    assert metrics['strata:cache_moves_total{from="device",result="refused",to="host"}'] == blocks
    assert metrics['strata:cache_moves_total{from="device",result="ok",to="host"}'] == 0
    line = await wait_for_log(caplog, "tokens to host: RAM gate, need ")
    assert line.startswith("skip offload of ") and "MiB + 1073741824 MiB floor, " in line


def test_serve_flags_reach_engine_load(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import inspect

    import strata_rs.server.serve
    from strata_rs.cli import main

    got: list[dict[str, Any]] = []

    def fake_serve(model: Path | None, engine_options: dict[str, Any], **kwargs: Any) -> int:
        got.append(engine_options)
        return 0

    monkeypatch.setattr(strata_rs.server.serve, "serve", fake_serve)
    # Without flags: exactly Engine.load's defaults, so the flags never drift from the engine.
    assert main(["serve"]) == 0
    defaults = {
        name: p.default
        for name, p in inspect.signature(Engine.load).parameters.items()
        if name != "path"
    }
    assert got.pop() == defaults
    flags = [
        "serve",
        "--host-cache-mib", "64",
        "--host-min-free-mib", "0",
        "--disk-cache-dir", str(tmp_path / "kv"),
        "--disk-cache-mib", "0",
        "--disk-cache-days", "0.5",
        "--cache-faults", "copy_in:2,read:*",
        "--disk-write-when-idle",
        "--speculative", "ngram",
        "--num-speculative-tokens", "3",
        "--ngram-min", "1",
        "--ngram-max", "5",
        "--no-speculative-adaptive",
    ]  # fmt: skip
    assert main(flags) == 0
    assert got.pop() == {
        **defaults,
        "host_cache_mib": 64,
        "host_min_free_mib": 0,
        "disk_cache_dir": tmp_path / "kv",
        "disk_cache_mib": 0,
        "disk_cache_days": 0.5,
        "cache_faults": "copy_in:2,read:*",
        "disk_write_when_idle": True,
        "speculative": "ngram",
        "num_speculative_tokens": 3,
        "ngram_min": 1,
        "ngram_max": 5,
        "speculative_adaptive": False,
    }


async def test_health_tells_the_truth(model_dir: MakeModel) -> None:
    model = model_dir("llama")
    release = asyncio.Event()

    async def load() -> Engine:
        await release.wait()
        return await Engine.load(model)

    async with asgi_client(load) as client:
        state = client.app.state.strata  # type: ignore[attr-defined]
        r = await client.get("/health")
        assert (r.status_code, r.json()) == (
            503,
            {"status": "loading", "reason": "the model is loading"},
        )
        r = await client.post(CHAT, json={"messages": MSG})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "model_loading"
        assert "strata:engine_up 0.0" in (await client.get("/metrics")).text
        release.set()
        while state.engine is None:
            await asyncio.sleep(0.01)
        r = await client.get("/health")
        assert (r.status_code, r.json()) == (
            200,
            {
                "status": "ok",
                "model": "tiny",
                "demo": False,
                "running": 0,
                "waiting": 0,
                "kv_usage": 0.0,
            },
        )
        state.engine._inject_fault()
        # The fault happens in the engine's next step: give it one.
        r = await client.post(CHAT, json={"messages": MSG, "max_tokens": 3})
        assert r.status_code == 503
        error = r.json()["error"]
        # The request rode the faulting step, or arrived as the loop went down, or after.
        assert error.pop("message") in (
            "engine fault: panic: injected fault",
            "the engine stopped before the request finished",
            "the engine stopped: engine fault: panic: injected fault",
        )
        assert error == {"type": "server_error", "param": None, "code": "engine_stopped"}
        r = await client.get("/health")
        assert (r.status_code, r.json()) == (
            503,
            {"status": "stopped", "reason": "engine fault: panic: injected fault"},
        )
        await asyncio.wait_for(state.fatal_event.wait(), 5)
        assert state.fatal == "the engine loop stopped: engine fault: panic: injected fault"
        assert "strata:engine_up 0.0" in (await client.get("/metrics")).text
        r = await client.post(CHAT, json={"messages": MSG})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stopped"

    # A model that cannot load: 503 with the reason, and fatal.
    async def broken() -> Engine:
        return await Engine.load(model.parent / "missing")

    async with asgi_client(broken) as client:
        state = client.app.state.strata  # type: ignore[attr-defined]
        await asyncio.wait_for(state.fatal_event.wait(), 5)
        r = await client.get("/health")
        assert r.status_code == 503
        assert r.json()["status"] == "failed"
        assert r.json()["reason"].startswith("the model failed to load: ModelLoadError: ")

    # An engine closed under the app (the loop stopped): 503 with the engine's reason.
    engine = await Engine.load(model)
    async with asgi_client(engine) as client:
        await engine.close()
        r = await client.get("/health")
        assert (r.status_code, r.json()) == (
            503,
            {"status": "stopped", "reason": "the engine was closed"},
        )


async def test_client_disconnect_frees_its_sequence(model_dir: MakeModel) -> None:
    model = model_dir("llama", max_position_embeddings=4096)
    engine = await Engine.load(model)
    try:
        async with real_server(engine) as url, httpx.AsyncClient(base_url=url) as client:
            body = {"prompt": [5, 6, 7], "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
            async with client.stream("POST", COMPLETIONS, json={**body, "stream": True}) as r:
                seen = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        seen += 1
                        if seen == 3:
                            break
            # Leaving the block closed the connection mid-stream.
            s = await wait_for(engine, lambda s: s["requests_cancelled"] == 1)
            s = await wait_for(engine, lambda s: s["running"] == 0)
            assert s["kv_blocks_used"] == 0
            assert s["generated_tokens"] < 4000
            metrics = (await client.get("/metrics")).text
            assert "strata:requests_cancelled_total 1.0" in metrics
            assert "strata:num_requests_running 0.0" in metrics

            # A non-streaming client that gives up is cancelled too.
            task = asyncio.ensure_future(client.post(COMPLETIONS, json=body))
            await wait_for(engine, lambda s: s["running"] == 1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            s = await wait_for(engine, lambda s: s["requests_cancelled"] == 2)
            s = await wait_for(engine, lambda s: s["running"] == 0)
            assert s["kv_blocks_used"] == 0
            assert (await client.get("/health")).status_code == 200
    finally:
        await engine.close()


async def test_an_engine_fault_mid_stream_ends_it_with_an_error_event(
    model_dir: MakeModel,
) -> None:
    model = model_dir("llama", max_position_embeddings=4096)
    engine = await Engine.load(model)
    try:
        async with real_server(engine) as url, httpx.AsyncClient(base_url=url) as client:
            body = {
                "prompt": [5, 6, 7],
                "max_tokens": 4000,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            lines: list[str] = []
            async with client.stream("POST", COMPLETIONS, json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        lines.append(line)
                        if len(lines) == 2:
                            engine._inject_fault()
            assert lines[-1] == "data: " + json.dumps(
                {
                    "error": {
                        "message": "engine fault: panic: injected fault",
                        "type": "server_error",
                        "param": None,
                        "code": "engine_stopped",
                    }
                },
                separators=(",", ":"),
            )
            assert "data: [DONE]" not in lines
            assert (await client.get("/health")).status_code == 503
    finally:
        await engine.close()


async def test_kept_alive_connections_answer_without_a_nagle_delay(model_dir: MakeModel) -> None:
    """Accepted sockets need TCP_NODELAY (asyncio sets it only for a listening socket created
    with proto IPPROTO_TCP); without it, every answer on a kept-alive connection waits for the
    client's delayed ACK, ~40 ms. Checked on the server's side of the live connection."""
    engine = await Engine.load(model_dir("llama"))
    try:
        async with real_server(engine) as url, httpx.AsyncClient(base_url=url) as client:
            for _ in range(3):
                assert (await client.get("/health")).status_code == 200
            server = real_server_of(url)
            socks = [c.transport.get_extra_info("socket") for c in server.server_state.connections]
            assert len(socks) == 1  # the client's one kept-alive connection
            assert socks[0].getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        await engine.close()
