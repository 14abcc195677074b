"""The layer split on two CPU devices (`device="cpu:0,1"`), each with its own memory pool: outputs
bitwise equal to one device's for every family (cold, and through the host and disk tiers),
explicit and default splits, every bad option refused with its exact message, memory accounted
per device, and an onload refused by the device that cannot take its part of the move (counted
and logged naming it) while the answer stays a cold engine's."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from strata_rs import Engine, InvalidRequest
from test_cache import GEN, Conversations, cold, moves, run_turns, step_for, wait_for_log
from test_server import real_server, samples

pytestmark = pytest.mark.anyio

MakeModel = Callable[..., Path]

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]
NO_TIERS: dict[str, Any] = {"host_cache_mib": 0, "disk_cache_mib": 0}
MIB = 1 << 20


def bits(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("family", FAMILIES)
async def test_split_logits_and_greedy_outputs_equal_one_devices_bitwise(
    model_dir: MakeModel, family: str
) -> None:
    model = model_dir(family, num_hidden_layers=3)
    ids = [int(t) for t in np.random.default_rng(5).integers(3, 512, size=90)]
    messages = [{"role": "user", "content": "Tell me about the layer split, twice over."}]
    one = await Engine.load(model, **NO_TIERS)
    two = await Engine.load(model, device="cpu:0,1", **NO_TIERS)
    three = await Engine.load(model, device="cpu:0,1,2", **NO_TIERS)
    try:
        assert one.info["layer_split"] == {"cpu": 3}
        assert two.info["layer_split"] == {"cpu:0": 2, "cpu:1": 1}
        assert three.info["layer_split"] == {"cpu:0": 1, "cpu:1": 1, "cpu:2": 1}
        assert two.info["device"] == "cpu:0,1"
        want = await one.logits(ids)
        want_ids = await one.complete(ids, max_tokens=24, temperature=0, ignore_eos=True)
        for split in (two, three):
            np.testing.assert_array_equal(bits(await split.logits(ids)), bits(want))
            got = await split.complete(ids, max_tokens=24, temperature=0, ignore_eos=True)
            assert got.token_ids == want_ids.token_ids
            assert got.text == want_ids.text
        # A streamed chat, token by token, is the same too.
        texts = []
        for engine in (one, two):
            chunks = [c.text async for c in engine.chat(messages, max_tokens=16, temperature=0)]
            texts.append("".join(chunks))
        assert texts[0] == texts[1] and texts[0]
    finally:
        for engine in (one, two, three):
            await engine.close()


@pytest.mark.parametrize(
    ("family", "split"), [(f, s) for f, s in zip(FAMILIES, ["1,2", None] * 2, strict=True)]
)
async def test_a_conversation_through_the_host_tier_equals_a_cold_one_device_engine(
    model_dir: MakeModel, family: str, split: str | None
) -> None:
    model = model_dir(family, max_position_embeddings=8192, num_hidden_layers=3)
    engine = await Engine.load(
        model,
        device="cpu:0,1",
        layer_split=split,
        kv_memory_mib=1,
        host_cache_mib=64,
        disk_cache_mib=0,
    )
    try:
        want_split = {"cpu:0": 1, "cpu:1": 2} if split else {"cpu:0": 2, "cpu:1": 1}
        assert engine.info["layer_split"] == want_split
        convs = Conversations(2, step_for(engine.info))
        # run_turns checks every answer against a cold engine on plain "cpu".
        await run_turns(engine, model, convs, rounds=5)
        s = engine.stats()
    finally:
        await engine.close()
    host = s["cache"]["hit_tokens"]["host"]
    assert host > 0 and moves(s, "host", "device", "ok") * 16 == host
    assert moves(s, "device", "host", "ok") > 0
    assert s["cache"]["device_refusals"] == {}


async def test_default_split_follows_device_memory_and_explicit_split_wins(
    model_dir: MakeModel,
) -> None:
    model = model_dir("qwen2", num_hidden_layers=3)
    cases: list[tuple[dict[str, Any], dict[str, int]]] = [
        ({"device_memory_mib": "200,100"}, {"cpu:0": 2, "cpu:1": 1}),
        ({"device_memory_mib": [100, 200]}, {"cpu:0": 1, "cpu:1": 2}),
        ({"device_memory_mib": "100,200", "layer_split": "2,1"}, {"cpu:0": 2, "cpu:1": 1}),
        ({"layer_split": [1, 2]}, {"cpu:0": 1, "cpu:1": 2}),
        ({}, {"cpu:0": 2, "cpu:1": 1}),
    ]
    for kwargs, want in cases:
        engine = await Engine.load(model, device="cpu:0,1", **NO_TIERS, **kwargs)
        try:
            assert engine.info["layer_split"] == want, kwargs
            memory = engine.stats()["memory"]
            assert list(memory) == ["cpu:0", "cpu:1"]
            caps = kwargs.get("device_memory_mib")
            if caps is None:
                assert [m["capacity_bytes"] for m in memory.values()] == [None, None]
            else:
                caps = [int(c) for c in str(caps).strip("[]").split(",")]
                assert [m["capacity_bytes"] for m in memory.values()] == [c * MIB for c in caps]
        finally:
            await engine.close()
    # A plain "cpu" with a capacity: one pool, named "cpu", bounded.
    engine = await Engine.load(model, device_memory_mib=64, **NO_TIERS)
    try:
        assert engine.stats()["memory"]["cpu"]["capacity_bytes"] == 64 * MIB
        assert engine.info["layer_split"] == {"cpu": 3}
    finally:
        await engine.close()


def bad_options() -> list[tuple[str, dict[str, Any], str]]:
    two = "cpu:0, cpu:1"
    return [
        (
            "count",
            {"device_memory_mib": "300"},
            f'device_memory_mib: "300": gives 1 value for 2 device(s) ({two}); give one per device',
        ),
        (
            "count-plain-cpu",
            {"device": "cpu", "device_memory_mib": "300,120"},
            'device_memory_mib: "300,120": gives 2 values for 1 device(s) (cpu); give one per '
            "device",
        ),
        (
            "zero",
            {"device_memory_mib": "300,0"},
            'device_memory_mib: "300,0": values must be numbers of MiB greater than 0',
        ),
        (
            "negative-list",
            {"device_memory_mib": [300, -1]},
            'device_memory_mib: "300,-1": values must be numbers of MiB greater than 0',
        ),
        (
            "type",
            {"device_memory_mib": {"cpu:0": 1}},
            'device_memory_mib: must be a string such as "300,120", a number or a list of '
            "numbers, got dict",
        ),
        (
            "bool",
            {"layer_split": [True, 2]},
            'layer_split: must be a string such as "300,120", a number or a list of numbers, '
            "got list",
        ),
        (
            "split-count",
            {"layer_split": "3"},
            f'layer_split: "3": gives 1 count for 2 device(s) ({two}); give one per device',
        ),
        (
            "split-zero",
            {"layer_split": "3,0"},
            'layer_split: "3,0": each device needs at least 1 layer',
        ),
        (
            "split-sum",
            {"layer_split": "2,2"},
            'layer_split: "2,2" sums to 4 layers; the model has 3',
        ),
        (
            "split-text",
            {"layer_split": "a,1"},
            'layer_split: "a,1": counts must be non-negative integers',
        ),
        (
            "split-float",
            {"layer_split": [2, 1.5]},
            'layer_split: "2,1.5": counts must be non-negative integers',
        ),
        (
            "more-devices-than-layers",
            {"device": "cpu:0,1,2,3"},
            "device: 4 devices (cpu:0, cpu:1, cpu:2, cpu:3) but the model has 3 layer(s); each "
            "device needs at least 1",
        ),
        (
            "device-twice",
            {"device": "cpu:1,1"},
            'device: "cpu:1,1": a device index appears twice',
        ),
    ]


@pytest.mark.parametrize(("case", "kwargs", "message"), bad_options(), ids=lambda v: str(v)[:20])
async def test_bad_split_options_are_refused_naming_the_field(
    model_dir: MakeModel, case: str, kwargs: dict[str, Any], message: str
) -> None:
    model = model_dir("qwen2", num_hidden_layers=3)
    kwargs = {"device": "cpu:0,1"} | kwargs
    with pytest.raises(InvalidRequest) as e:
        await Engine.load(model, **NO_TIERS, **kwargs)
    assert str(e.value) == message, case


async def test_a_device_too_small_for_its_share_refuses_the_load_naming_it(
    model_dir: MakeModel,
) -> None:
    model = model_dir("llama", num_hidden_layers=3)
    # No room for even one block next to the weights: the default sizing says so.
    with pytest.raises(InvalidRequest) as e:
        await Engine.load(model, device="cpu:0,1", device_memory_mib="64,0.01", **NO_TIERS)
    assert str(e.value).startswith(
        "device_memory_mib: device cpu:1 holds 10485 bytes; its weights and workspace with one "
        "K/V block need "
    ), str(e.value)
    # An explicit K/V budget the second device cannot hold: refused by its pool, naming it.
    with pytest.raises(InvalidRequest) as e:
        await Engine.load(
            model, device="cpu:0,1", device_memory_mib="64,1", kv_memory_mib=4, **NO_TIERS
        )
    assert str(e.value).startswith("kv_memory_mib: device cpu:1: cannot reserve "), str(e.value)


async def test_kv_blocks_are_what_the_tightest_device_holds(model_dir: MakeModel) -> None:
    model = model_dir("qwen2", max_position_embeddings=8192, num_hidden_layers=3)
    opts: dict[str, Any] = {"device": "cpu:0,1", "max_batch_tokens": 64, **NO_TIERS}
    free = await Engine.load(model, **opts)
    try:
        unbounded = free.info["kv_blocks"]
        full = free.stats()["memory"]["cpu:1"]["in_use_bytes"]
    finally:
        await free.close()
    # cpu:1 gets room for about half the blocks it would hold unbounded.
    capacity = sum(full.values()) - full["kv"] // 2
    engine = await Engine.load(model, device_memory_mib=f"256,{capacity / MIB!r}", **opts)
    try:
        blocks = engine.info["kv_blocks"]
        assert unbounded // 3 < blocks < unbounded
        tight = engine.stats()["memory"]["cpu:1"]
        used = sum(tight["in_use_bytes"].values())
        part = full["kv"] // unbounded
        assert tight["in_use_bytes"]["kv"] == blocks * part
        assert used <= tight["capacity_bytes"] == capacity
        # The most blocks that fit: one more, with the 16 positions of RoPE table (head_dim 16,
        # f32) and block-table hint it adds, would not.
        assert capacity - used < part + 16 * 16 * 4 + 16
        prompt = list(range(3, 200))
        r = await engine.complete(prompt, max_tokens=GEN, temperature=0, ignore_eos=True)
        assert r.token_ids == await cold(model, prompt)
    finally:
        await engine.close()


async def test_memory_stats_per_device_sum_to_one_devices(model_dir: MakeModel) -> None:
    for family in ("llama", "qwen3"):  # untied and tied heads
        model = model_dir(family, num_hidden_layers=3)
        one = await Engine.load(model, **NO_TIERS)
        two = await Engine.load(model, device="cpu:0,1", layer_split="1,2", **NO_TIERS)
        try:
            m1 = one.stats()["memory"]["cpu"]["in_use_bytes"]
            m2 = two.stats()["memory"]
            assert list(m2) == ["cpu:0", "cpu:1"]
            a, b = m2["cpu:0"]["in_use_bytes"], m2["cpu:1"]["in_use_bytes"]
            c = one.info
            head = c["vocab_size"] * c["hidden_size"] * 4
            tied = family == "qwen3"
            # The last device holds its own copy of a tied head.
            assert a["weights"] + b["weights"] == m1["weights"] + (head if tied else 0)
            assert a["kv"] + b["kv"] == m1["kv"] == c["kv_blocks"] * c["kv_block_bytes"]
            # Layers 1 of 3 on cpu:0, 2 of 3 on cpu:1: the K/V in that proportion.
            assert (a["kv"] * 3, b["kv"] * 3) == (m1["kv"], 2 * m1["kv"])
            assert a["workspace"] > 0 and b["workspace"] > 0
            assert a["staging"] == b["staging"] == a["graphs"] == b["graphs"] == 0
        finally:
            await one.close()
            await two.close()


async def test_an_onload_the_tight_device_cannot_take_is_refused_there_and_recomputed(
    model_dir: MakeModel, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="strata_rs.cache")
    model = model_dir("llama", num_hidden_layers=3)
    disk = tmp_path / "kv"
    opts: dict[str, Any] = {
        "device": "cpu:0,1",
        "kv_memory_mib": 1,
        "host_cache_mib": 0,
        "disk_cache_dir": disk,
    }
    prompt = [int(t) for t in np.random.default_rng(9).integers(3, 512, size=100)]
    want = await cold(model, prompt)

    # A first engine answers and, closing, saves the conversation's blocks to disk.
    first = await Engine.load(model, **opts)
    try:
        loaded = {d: dict(m["in_use_bytes"]) for d, m in first.stats()["memory"].items()}
        r = await first.complete(prompt, max_tokens=GEN, temperature=0, ignore_eos=True)
        assert r.token_ids == want
    finally:
        await first.close()
    assert any(disk.glob("*.kvb"))

    # cpu:1 sized to the byte for what the load reserves: no room for its part of the staging
    # buffer that a disk onload needs. cpu:0 has plenty.
    exact = sum(loaded["cpu:1"].values()) / MIB
    tight = await Engine.load(model, device_memory_mib=f"256,{exact!r}", **opts)
    try:
        r = await tight.complete(prompt, max_tokens=GEN, temperature=0, ignore_eos=True)
        s = tight.stats()
    finally:
        await tight.close()
    assert r.token_ids == want
    assert r.usage.cached_tokens == 0
    cache = s["cache"]
    assert cache["hit_tokens"]["disk"] == 0
    assert cache["device_refusals"].get("cpu:1", 0) >= 1
    assert "cpu:0" not in cache["device_refusals"]
    assert cache["refusals"]["device"] >= cache["device_refusals"]["cpu:1"]
    # All or nothing: cpu:0's part was given back when cpu:1 refused.
    assert s["memory"]["cpu:0"]["in_use_bytes"]["staging"] == 0
    assert s["memory"]["cpu:1"]["in_use_bytes"] == loaded["cpu:1"]
    line = await wait_for_log(caplog, "skip onload of ")
    assert "device cpu:1 cannot take its part of the staging buffer: device cpu:1: cannot " in line

    # With room on both devices the same restart restores from disk, each device staging its
    # own part of a block.
    roomy = await Engine.load(model, device_memory_mib="256,256", **opts)
    try:
        r = await roomy.complete(prompt, max_tokens=GEN, temperature=0, ignore_eos=True)
        s = roomy.stats()
        info = roomy.info
    finally:
        await roomy.close()
    assert r.token_ids == want
    assert s["cache"]["hit_tokens"]["disk"] > 0 and s["cache"]["device_refusals"] == {}
    staged = [s["memory"][d]["in_use_bytes"]["staging"] for d in ("cpu:0", "cpu:1")]
    kv = [s["memory"][d]["in_use_bytes"]["kv"] // info["kv_blocks"] for d in ("cpu:0", "cpu:1")]
    assert staged == kv and sum(staged) == info["kv_block_bytes"]


async def test_metrics_show_memory_and_refusals_per_device(model_dir: MakeModel) -> None:
    model = model_dir("qwen2", num_hidden_layers=3)
    engine = await Engine.load(model, device="cpu:0,1", **NO_TIERS)
    try:
        async with real_server(engine) as url, httpx.AsyncClient(base_url=url) as client:
            response = await client.get("/metrics")
        memory = engine.stats()["memory"]
    finally:
        await engine.close()
    assert response.status_code == 200
    metrics = samples(response.text)
    for device in ("cpu:0", "cpu:1"):
        for purpose, n in memory[device]["in_use_bytes"].items():
            key = f'strata:memory_in_use_bytes{{device="{device}",purpose="{purpose}"}}'
            assert metrics[key] == float(n)
        assert metrics[f'strata:device_refusals_total{{device="{device}"}}'] == 0.0
    assert not any('device="cpu"' in k for k in metrics)


def test_serve_flags_split_the_layers_and_bound_each_device(model_dir: MakeModel) -> None:
    from strata_rs.testing.server import Server, serve_argv

    model = model_dir("qwen2", num_hidden_layers=3)
    messages = [{"role": "user", "content": "split me"}]

    async def reference() -> str:
        engine = await Engine.load(model, **NO_TIERS)
        try:
            tok = engine.tokenizer
            ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
            return (await engine.complete(ids, max_tokens=8, temperature=0)).text
        finally:
            await engine.close()

    want = asyncio.run(reference())
    s = Server(
        serve_argv(
            "--model",
            str(model),
            "--device",
            "cpu:0,1",
            "--layer-split",
            "1,2",
            "--device-memory-mib",
            "200,100",
            "--host-cache-mib",
            "0",
            "--disk-cache-mib",
            "0",
        )
    )
    try:
        s.wait_healthy()
        body = {"model": model.name, "messages": messages, "max_tokens": 8, "temperature": 0}
        r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == want
        metrics = samples(httpx.get(s.url + "/metrics").text)
    finally:
        assert s.stop() == 0
    for device in ("cpu:0", "cpu:1"):
        assert metrics[f'strata:memory_in_use_bytes{{device="{device}",purpose="kv"}}'] > 0
    # cpu:1 holds 2 of the 3 layers: twice cpu:0's K/V.
    kv = [metrics[f'strata:memory_in_use_bytes{{device="cpu:{i}",purpose="kv"}}'] for i in (0, 1)]
    assert kv[1] == 2 * kv[0]
