"""strata-rs on Ray Serve, as users run it: `strata-rs serve --replicas 2` in a subprocess (a local
Ray on this machine), driven through the openai client on loopback. Conversations return to the
replica holding their history; a replica killed mid-run loses no request, and its conversations
come back exactly from the shared disk tier. Then two plain servers share one disk folder under
load, checked with the soak's file verifier."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from strata_rs import Engine
from strata_rs.testing.server import Server, serve_argv
from strata_rs.testing.soak import scan_tier

pytest.importorskip("ray.serve", reason="needs the 'ray' extra (scripts/test installs it)")

MakeModel = Callable[..., Path]
Message = dict[str, str]

MAX_TOKENS = 8


def _system_prompt(conversation: int) -> str:
    # Each conversation its own history: nothing cached for one helps another.
    return f"You are assistant number {conversation}. " + "Answer briefly and exactly. " * 6


@pytest.fixture
def ray_server(model_dir: MakeModel, tmp_path: Path) -> Iterator[Callable[..., Server]]:
    servers: list[Server] = []

    def start(*flags: str, env: dict[str, str] | None = None) -> Server:
        argv = serve_argv(
            "--model",
            str(model_dir("llama")),
            "--replicas",
            "2",
            "--max-context",
            "1024",
            "--threads",
            "1",
            "--served-model-name",
            "model",
            *flags,
        )
        server = Server(argv, env=env, echo=False)
        servers.append(server)
        return server

    try:
        yield start
    finally:
        for s in servers:
            assert s.stop() == 0, s.lines[-40:]


def _metrics(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=10).text


def _replica_pids(url: str, count: int, timeout: float = 30.0) -> dict[str, int]:
    """Replica id -> pid, from the ingress's /metrics, once `count` replicas have published."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.findall(r'strata_replica_info\{replica="(\w+)",pid="(\d+)"\} 1', _metrics(url))
        if len(found) >= count:
            return {rid: int(pid) for rid, pid in found}
        time.sleep(0.2)
    raise AssertionError(f"fewer than {count} replicas published: {_metrics(url)}")


def _routed(url: str) -> dict[str, int]:
    found = re.findall(r'strata_router_requests_total\{reason="(\w+)"\} (\d+)', _metrics(url))
    return {reason: int(n) for reason, n in found}


class _Chat:
    """One conversation through the openai client; remembers where and how each turn ran."""

    def __init__(self, client: openai.OpenAI, index: int) -> None:
        self.client = client
        self.messages: list[Message] = [{"role": "system", "content": _system_prompt(index)}]
        self.index = index
        self.turns: list[dict[str, Any]] = []

    def turn(self, n: int, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
        self.messages.append(
            {"role": "user", "content": f"Conversation {self.index}, question {n}: what next?"}
        )
        raw = self.client.chat.completions.with_raw_response.create(
            model="model",
            messages=self.messages,  # type: ignore[arg-type]
            max_tokens=max_tokens,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        r = raw.parse()
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        text = r.choices[0].message.content or ""
        self.messages.append({"role": "assistant", "content": text})
        result = {
            "replica": raw.headers.get("x-strata-replica"),
            "prompt_tokens": r.usage.prompt_tokens,
            "cached_tokens": r.usage.prompt_tokens_details.cached_tokens or 0,
            "text": text,
        }
        self.turns.append(result)
        return result


def test_returning_turns_find_their_history_on_the_replica_that_holds_it(
    ray_server: Callable[..., Server],
) -> None:
    # No disk tier: a returning turn finds its history only in the memory of the replica that
    # served it before, so only the router's choice can make it a hit.
    server = ray_server("--disk-cache-mib", "0")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    chats = [_Chat(client, i) for i in range(6)]
    for n in range(3):
        for chat in chats:  # interleaved, as users come back
            chat.turn(n)
    found = 0
    for chat in chats:
        t = chat.turns
        # The history of turn n is turn n-1's prompt and answer; its prompt is what must be cached.
        if all(t[n]["cached_tokens"] >= 0.9 * t[n - 1]["prompt_tokens"] for n in (1, 2)):
            found += 1
    assert found >= 5, [c.turns for c in chats]
    # Both replicas took conversations, and the router says why each returning turn went where.
    assert len({c.turns[0]["replica"] for c in chats}) == 2, [c.turns for c in chats]
    routed = _routed(server.url)
    assert routed["prefix"] >= 10 and routed["fallback"] == 0, routed
    assert sum(routed.values()) == 18, routed
    # Every replica's own metrics, labelled by replica, once each has published since (every
    # second; Ray hands the publications to the router within a few).
    sent = sum(t["prompt_tokens"] for c in chats for t in c.turns)
    pattern = r'strata:prompt_tokens_total\{replica="(\w+)"\} (\S+)'
    deadline = time.monotonic() + 30
    counted = re.findall(pattern, _metrics(server.url))
    while sum(float(n) for _, n in counted) != sent and time.monotonic() < deadline:
        time.sleep(0.25)
        counted = re.findall(pattern, _metrics(server.url))
    assert {rid for rid, _ in counted} == {t["replica"] for c in chats for t in c.turns}
    assert sum(float(n) for _, n in counted) == sent, counted
    # A streamed answer through the ingress is the same answer, chunk by chunk.
    chat = chats[0]
    stream = client.chat.completions.create(
        model="model",
        messages=chat.messages[:-1],  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        stream=True,
    )
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len(pieces) > 1 and "".join(pieces) == chat.turns[-1]["text"]


async def _cold_answers(model: Path, chats: list[_Chat], max_tokens: int) -> list[str]:
    engine = await Engine.load(model, max_context=4096, host_cache_mib=0, disk_cache_mib=0)
    try:
        out = []
        for chat in chats:
            c = await engine.chat_complete(
                chat.messages[:-1], max_tokens=max_tokens, temperature=0.0, ignore_eos=True
            )
            out.append(c.text)
        return out
    finally:
        await engine.close()


def _settle(folder: Path, timeout: float = 20.0) -> int:
    """The number of block files once it has not changed for a second (idle writes done)."""
    last, since = -1, time.monotonic()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        n = len(list(folder.glob("*.kvb")))
        if n != last:
            last, since = n, time.monotonic()
        elif n > 0 and time.monotonic() - since >= 1.0:
            return n
        time.sleep(0.1)
    raise AssertionError(f"{folder}: the block files never settled")


def test_a_killed_replica_loses_no_request_and_its_conversations_come_back_from_disk(
    ray_server: Callable[..., Server], model_dir: MakeModel, tmp_path: Path
) -> None:
    folder = tmp_path / "shared-kv"
    # The host tier off: what a replica holds is on its device or, once written, on disk.
    # A long context, so that the third turns can be long enough to be killed in flight.
    server = ray_server(
        "--disk-cache-dir", str(folder), "--host-cache-mib", "0", "--max-context", "4096"
    )
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    chats = [_Chat(client, i) for i in range(6)]
    for n in range(2):
        for chat in chats:
            chat.turn(n)
    _settle(folder)
    pids = _replica_pids(server.url, 2)
    victim = chats[0].turns[-1]["replica"]
    orphans = [c for c in chats if c.turns[-1]["replica"] == victim]

    # The third turns, all at once and long (thousands of tokens each, a second or more on any
    # machine); the victim dies while it runs those of its conversations (sent to it: it holds
    # their history), which the ingress sends again to the other replica.
    long = 3000
    with ThreadPoolExecutor(len(chats)) as pool:
        futures = [pool.submit(c.turn, 2, long) for c in chats]
        time.sleep(0.3)
        os.kill(pids[victim], signal.SIGKILL)
        for f in futures:
            f.result(timeout=120)  # every request answered: an exception here fails the test
    retried = re.search(r"strata_ingress_retries_total (\d+)", _metrics(server.url))
    # At least one was in flight on the victim (one sent after its death goes straight on).
    assert retried is not None and int(retried[1]) >= 1
    for chat in orphans:
        t = chat.turns
        assert t[2]["replica"] != victim, t
        assert t[2]["cached_tokens"] >= 0.9 * t[1]["prompt_tokens"], t
    cold = asyncio.run(_cold_answers(model_dir("llama"), orphans, long))
    assert [c.turns[2]["text"] for c in orphans] == cold


def test_two_servers_sharing_a_disk_folder_under_load_lose_and_corrupt_nothing(
    model_dir: MakeModel, tmp_path: Path
) -> None:
    model = model_dir("llama")
    folder = tmp_path / "shared-kv"
    budget_mib = 1
    flags = [
        "--model",
        str(model),
        "--max-context",
        "1024",
        "--threads",
        "1",
        "--disk-cache-dir",
        str(folder),
        "--disk-cache-mib",
        str(budget_mib),
        # Everything a server caches goes to disk: no host tier, a small device pool.
        "--host-cache-mib",
        "0",
        "--kv-memory-mib",
        "1",
        "--disk-write-when-idle",
        "--served-model-name",
        "model",
    ]
    servers = [Server(serve_argv(*flags), echo=False) for _ in range(2)]
    for s in servers:
        s.wait_healthy()  # a plain server listens before its model has loaded
    try:
        clients = [
            openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0) for s in servers
        ]
        chats = [_Chat(clients[0], i) for i in range(8)]

        def run(chat: _Chat, n: int) -> None:
            # Each turn on the other server than the last: it must read what the other wrote.
            chat.client = clients[(chat.index + n) % 2]
            chat.turn(n)

        with ThreadPoolExecutor(8) as pool:
            for n in range(4):
                list(pool.map(lambda c, n=n: run(c, n), chats))
                if n == 1:
                    # A restart's startup scan while the other server writes.
                    servers[0].stop()
                    servers[0] = Server(serve_argv(*flags), echo=False)
                    servers[0].wait_healthy()
                    clients[0] = openai.OpenAI(
                        base_url=servers[0].url + "/v1", api_key="unused", max_retries=0
                    )
        caches = [httpx.get(s.url + "/v1/cache", timeout=10).json() for s in servers]
    finally:
        for s in servers:
            assert s.stop() == 0, s.lines[-40:]
    files = scan_tier(folder)
    assert not files.invalid and not files.temp, (files.invalid, files.temp)
    size = sum((folder / name).stat().st_size for name in files.valid)
    # The folder filled up to the budget, which held for the two servers together.
    file_len = size // len(files.valid)
    assert (budget_mib << 20) - 2 * file_len < size <= budget_mib << 20, size
    # Both read what the other wrote (restored from disk), and the answers are the cold path's.
    disk_hits = [next(t["hit_tokens"] for t in c["tiers"] if t["tier"] == "disk") for c in caches]
    assert all(n > 0 for n in disk_hits) and caches[1]["adopted_files"] > 0, caches
    cold = asyncio.run(_cold_answers_all_turns(model, chats))
    assert [[t["text"] for t in c.turns] for c in chats] == cold


async def _cold_answers_all_turns(model: Path, chats: list[_Chat]) -> list[list[str]]:
    engine = await Engine.load(model, max_context=1024, host_cache_mib=0, disk_cache_mib=0)
    try:
        out = []
        for chat in chats:
            answers = []
            for i, m in enumerate(chat.messages):
                if m["role"] == "assistant":
                    c = await engine.chat_complete(
                        chat.messages[:i], max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
                    )
                    answers.append(c.text)
            out.append(answers)
        return out
    finally:
        await engine.close()


def test_bad_replica_settings_are_refused_naming_them(model_dir: MakeModel) -> None:
    from strata_rs.ray import build_app

    model = model_dir("llama")
    with pytest.raises(ValueError, match="replicas: must be >= 1, got 0"):
        build_app(model, replicas=0)
    with pytest.raises(ValueError, match="min_replicas and max_replicas: give both"):
        build_app(model, min_replicas=1)
    with pytest.raises(ValueError, match=r"need 0 <= min <= max and max >= 1, got 3, 2"):
        build_app(model, min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="request_router: expected one of"):
        build_app(model, request_router="round_robin")
    # Ray flags without --replicas: refused before anything starts.
    out = subprocess.run(
        serve_argv("--model", str(model), "--min-replicas", "1", "--ray-address", "auto"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert out.stderr.strip() == "error: --min-replicas, --ray-address need --replicas"


def test_a_replica_whose_engine_stopped_fails_its_health_check_and_is_replaced(
    ray_server: Callable[..., Server],
) -> None:
    import ray
    from ray import serve

    # Without Ray's token authentication, so that this test's process can join the cluster.
    server = ray_server(
        "--disk-cache-mib", "0", "--health-check-seconds", "1", env={"RAY_AUTH_MODE": "disabled"}
    )
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    _Chat(client, 0).turn(0)  # the router exists from the first request on
    before = set(_replica_pids(server.url, 2))
    # Join the server's local Ray as a second driver, to reach a replica the way Ray does.
    line = next(x for x in server.lines if "Ray cluster at " in x)
    gcs = line.split("Ray cluster at ")[1].strip()
    ray.init(address=gcs, logging_level="WARNING", log_to_driver=False)
    try:
        handle = serve.get_deployment_handle("EngineReplica", app_name="strata")
        handle._inject_fault.remote().result(timeout_s=30)
    finally:
        ray.shutdown()
    # Ray's health check (every second here) fails on the stopped engine and a new replica
    # replaces it; the router learns of it as requests come.
    deadline = time.monotonic() + 120
    replaced: set[str] = set()
    n = 0
    while time.monotonic() < deadline and not replaced:
        n += 1
        with contextlib.suppress(openai.APIStatusError):  # the stopped one answers 503
            _Chat(client, n).turn(0)
        found = re.findall(r'strata_replica_info\{replica="(\w+)"', _metrics(server.url))
        replaced = set(found) - before
        time.sleep(0.5)
    assert replaced, _metrics(server.url)
    # Once replaced, both replicas answer.
    answered = {_Chat(client, i).turn(0)["replica"] for i in range(6)}
    assert len(answered) == 2 and answered <= set(_replica_pids(server.url, 2)), answered


def test_build_app_hands_resources_autoscaling_and_engine_options_to_ray(
    model_dir: MakeModel,
) -> None:
    from strata_rs.ray import build_app

    app = build_app(
        model_dir("llama"),
        replicas=2,
        min_replicas=1,
        max_replicas=3,
        target_ongoing_requests=2,
        num_cpus=1.5,
        num_gpus=0.5,
        health_check_period_s=2.0,
        max_batch=4,
    )
    # The deployment as Ray will run it (its attributes are Ray's; the Application has no
    # public accessor for the deployments it binds).
    engines = app._bound_deployment.init_args[0]._bound_deployment
    config = engines._deployment_config
    scaling = config.autoscaling_config
    assert (scaling.min_replicas, scaling.initial_replicas, scaling.max_replicas) == (1, 2, 3)
    assert scaling.target_ongoing_requests == 2
    assert engines.ray_actor_options == {"num_cpus": 1.5, "num_gpus": 0.5}
    assert config.health_check_period_s == 2.0
    assert engines.init_args[1] == {"disk_write_when_idle": True, "max_batch": 4}
    router = config.request_router_config
    assert router.request_router_kwargs == {"imbalance": 8, "min_match": 0.5}
    assert router.request_routing_stats_period_s == 1.0
