"""What the server lets out and in: it listens on loopback unless told otherwise, no request field
reaches the file system, conversation-cache files are the owner's only, and the log holds no text
a user wrote unless --log-prompts asks for it, and a request head is bounded before it is
buffered. (The API key on every route but /health, the body limit and the prompt limit:
tests/test_server.py and tests/test_fuzz_server.py.)"""

from __future__ import annotations

import json
import os
import socket
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from strata_rs import Engine
from strata_rs.server.http_limits import MAX_HEAD_BYTES, MAX_HEADERS
from strata_rs.testing.server import Server, serve_argv

MakeModel = Callable[..., Path]
SECRET = "ZEBRA-7731"  # a word no log line has any other reason to hold


def listening_addresses(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} write them) of the sockets listening on
    `port`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    found.append(address)
    return found


@pytest.fixture
def tiny(model_dir: MakeModel) -> Path:
    return model_dir("llama")


@pytest.fixture
def server(tiny: Path, tmp_path: Path) -> Iterator[Server]:
    s = Server(serve_argv("--model", str(tiny), "--disk-cache-dir", str(tmp_path / "kv")))
    s.wait_healthy()
    yield s
    assert s.stop() == 0


def test_the_server_listens_on_loopback_only_by_default(server: Server) -> None:
    port = int(server.url.rsplit(":", 1)[1])
    assert server.url == f"http://127.0.0.1:{port}"
    # 127.0.0.1 in /proc/net/tcp's little-endian hex; nothing on 0.0.0.0 or on IPv6.
    assert listening_addresses(port) == ["0100007F"]


def test_no_request_field_reaches_the_file_system(server: Server, tmp_path: Path) -> None:
    target = tmp_path / "written-by-a-request"
    prompt = {"prompt": "hi", "max_tokens": 1}
    for field in ("disk_cache_dir", "cache_faults", "model_path", "chat_template", "tokenizer"):
        r = httpx.post(server.url + "/v1/completions", json={**prompt, field: str(target)})
        assert r.status_code == 400, r.text
        assert r.json()["error"] == {
            "message": f"{field}: unrecognized request argument",
            "type": "invalid_request_error",
            "param": field,
            "code": None,
        }
    r = httpx.post(server.url + "/v1/completions", json={**prompt, "model": "/etc/passwd"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    for path in ("/v1/models/..%2F..%2F..%2Fetc%2Fpasswd", "/v1/models//etc/passwd"):
        r = httpx.get(server.url + path)
        assert r.status_code == 404 and "root:" not in r.text
    # Template variables are values, never files: an include of a path is not a thing the
    # renderer can do (the environment has no loader).
    body = {
        "messages": [{"role": "user", "content": "{% include '/etc/passwd' %}"}],
        "max_tokens": 1,
        "chat_template_kwargs": {"path": "/etc/passwd"},
    }
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 200 and "root:" not in r.text
    assert not target.exists()


@pytest.mark.anyio
async def test_cache_files_are_the_owners_only_whatever_the_umask(
    model_dir: MakeModel, tmp_path: Path
) -> None:
    kv = tmp_path / "a" / "b" / "kv"
    old = os.umask(0)  # the most permissive: modes must not come from the umask
    try:
        engine = await Engine.load(
            model_dir("llama"), disk_cache_dir=kv, host_cache_mib=0, kv_memory_mib=1
        )
        await engine.complete(list(range(3, 3 + 16 * 3)), max_tokens=1)
        await engine.close()  # writes the cached blocks to disk
    finally:
        os.umask(old)
    files = list(kv.iterdir())
    assert len(files) == 3
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    for folder in (kv, kv.parent, kv.parent.parent):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder


def _requests_quoting_the_secret(url: str) -> None:
    """Successes and errors whose requests carry SECRET in every place a user writes text (the
    errors' messages to the client quote it for the role, the field and the model)."""
    ok = [
        ("/v1/completions", {"prompt": f"tell me {SECRET}", "max_tokens": 2}),
        ("/v1/completions", {"prompt": SECRET, "max_tokens": 2, "stream": True}),
        ("/v1/completions", {"prompt": "a", "max_tokens": 2, "stop": [SECRET]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": SECRET}]}),
        ("/tokenize", {"prompt": SECRET}),
    ]
    errors = [
        ("/v1/chat/completions", {"messages": [{"role": SECRET, "content": "x"}]}),
        ("/v1/completions", {"prompt": SECRET * 400, "max_tokens": 1}),  # over the context
        ("/v1/completions", {"prompt": SECRET, "stop": [SECRET, 7]}),
        ("/v1/completions", {"prompt": SECRET, SECRET: 1}),
        ("/v1/completions", {"prompt": SECRET, "model": SECRET}),
    ]
    for path, body in ok:
        body = {**body, "max_tokens": 2} if "messages" in body else body
        assert httpx.post(url + path, json=body).status_code == 200
    for path, body in errors:
        r = httpx.post(url + path, json=body)
        assert r.status_code in (400, 404), r.text


def test_the_log_holds_no_user_text_unless_log_prompts_asks(tiny: Path, tmp_path: Path) -> None:
    for log_prompts in (False, True):
        flags = ["--model", str(tiny), "--disk-cache-dir", str(tmp_path / "kv")]
        flags += ["--log-level", "debug"]
        s = Server(serve_argv(*flags, *(["--log-prompts"] if log_prompts else [])))
        try:
            s.wait_healthy()
            _requests_quoting_the_secret(s.url)
        finally:
            assert s.stop() == 0
        quoting = [line for line in s.lines if SECRET in line]
        if not log_prompts:
            assert quoting == []
            # The error lines are there, with the field but not the message.
            assert any(
                "chat.completions 400 invalid_request_error param=messages[0].role" in line
                and line.endswith("param=messages[0].role")
                for line in s.lines
            ), s.lines
        else:
            assert any(" prompt: " in line and SECRET in line for line in quoting), quoting
            assert any(f'unknown role "{SECRET}"' in line for line in quoting), quoting


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _answer(url: str, data: bytes) -> tuple[int, dict[str, str], bytes]:
    """Sends `data` on a new connection and reads the answer up to the server's close: (status,
    headers, body)."""
    with socket.create_connection(_address(url), timeout=30) as sock:
        sock.sendall(data)
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def test_request_heads_are_bounded(server: Server) -> None:
    def refused(status: int, headers: dict[str, str], body: bytes, message: str) -> None:
        assert (status, headers["connection"], headers["content-type"]) == (
            431,
            "close",
            "application/json",
        )
        assert json.loads(body) == {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": None,
                "code": "request_header_fields_too_large",
            }
        }

    # One byte over the limit, the head not even finished: refused, before any route or key.
    start = b"GET /health HTTP/1.1\r\nhost: x\r\nx-pad: "
    over = start + b"a" * (MAX_HEAD_BYTES + 1 - len(start))
    message = f"the request head is over the limit of {MAX_HEAD_BYTES} bytes"
    refused(*_answer(server.url, over), message)
    # A URL over the limit likewise.
    refused(*_answer(server.url, b"GET /" + b"a" * MAX_HEAD_BYTES + b" HTTP/1.1\r\n"), message)
    # Too many headers, each small: host, connection and 99 more.
    base = b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
    lines = [b"x-h%d: v\r\n" % i for i in range(MAX_HEADERS - 1)]
    too_many = base + b"".join(lines) + b"\r\n"
    refused(*_answer(server.url, too_many), f"the request has more than {MAX_HEADERS} headers")
    status, _, body = _answer(server.url, base + b"".join(lines[1:]) + b"\r\n")
    assert status == 200, body
    assert any("request head 431" in line for line in server.lines)

    # A head just under the limit, with a body larger than the limit in the same read, on one
    # kept-alive connection twice: the limit is the head's, per request.
    pad = "a" * (MAX_HEAD_BYTES - 512)
    prompt = "hello " * 20_000
    with httpx.Client(base_url=server.url) as client:
        for _ in range(2):
            r = client.post("/tokenize", json={"prompt": prompt}, headers={"x-pad": pad})
            assert r.status_code == 200, r.text
            assert r.json()["count"] > 10_000

    # 256 MiB of one header line: the connection is closed after the limit, and the server's
    # memory does not grow with what the client tried to send.
    rss = server.rss_bytes()
    sent = 0
    line = b"a" * (1 << 20)
    with socket.create_connection(_address(server.url), timeout=30) as sock:
        sock.sendall(start)
        try:
            while sent < 256 << 20:
                sock.sendall(line)
                sent += len(line)
        except OSError:  # the server closed the connection: a reset or a broken pipe
            pass
    assert sent < 64 << 20, f"the server took {sent >> 20} MiB of one header"
    assert server.rss_bytes() - rss < 16 << 20
    assert httpx.get(server.url + "/health").status_code == 200
