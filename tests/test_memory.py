"""The device memory pool as `stats()["memory"]` and `/metrics` show it: the weights against the
safetensors headers, the K/V pool against the config, the staging buffer after a disk move."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from strata_rs import Engine
from test_server import real_server, samples

pytestmark = pytest.mark.anyio

MakeModel = Callable[..., Path]
BLOCK_SIZE = 16
PURPOSES = ["weights", "kv", "workspace", "graphs", "staging"]


def weight_bytes(model: Path) -> int:
    """The tensors' bytes as the loader keeps them, from the safetensors headers alone: matrices
    at their size in the file (memory-mapped), 1-D tensors as f32 copies, a tied head once."""
    config = json.loads((model / "config.json").read_text())
    tied = config.get("tie_word_embeddings", False)
    total = 0
    for file in sorted(model.glob("*.safetensors")):
        with file.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        for name, info in header.items():
            if name == "__metadata__" or (tied and name == "lm_head.weight"):
                continue
            start, end = info["data_offsets"]
            total += 4 * info["shape"][0] if len(info["shape"]) == 1 else end - start
    return total


def kv_block_bytes(model: Path, kv_dtype_size: int) -> int:
    c = json.loads((model / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads", c["num_attention_heads"])
    return c["num_hidden_layers"] * 2 * BLOCK_SIZE * kv_heads * head_dim * kv_dtype_size


@pytest.mark.parametrize(
    ("family", "dtype", "overrides"),
    [
        ("llama", "f32", {}),
        ("qwen3", "bf16", {"shards": 2}),  # a tied head, norms widened, two files
        ("qwen2", "f16", {}),  # biases
    ],
)
async def test_stats_memory_accounts_weights_kv_and_workspace(
    model_dir: MakeModel, family: str, dtype: str, overrides: dict[str, Any]
) -> None:
    model = model_dir(family, dtype, **overrides)
    engine = await Engine.load(model, kv_memory_mib=1, max_batch_tokens=64, disk_cache_mib=0)
    try:
        s = engine.stats()
        info = engine.info
    finally:
        await engine.close()
    assert list(s["memory"]) == ["cpu"]
    cpu = s["memory"]["cpu"]
    assert cpu["capacity_bytes"] is None
    in_use = cpu["in_use_bytes"]
    assert list(in_use) == PURPOSES
    assert in_use["weights"] == weight_bytes(model)
    if dtype == "f32":
        files = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        assert in_use["weights"] < files  # the tensors, not the headers
    block = kv_block_bytes(model, 4 if dtype == "f32" else 2)
    assert info["kv_block_bytes"] == block
    assert in_use["kv"] == s["kv_blocks_total"] * block
    assert s["kv_blocks_total"] == (1 << 20) // block
    # Activations alone: 64 tokens x (hidden for x, xn, picked + 2 x intermediate) floats.
    c = json.loads((model / "config.json").read_text())
    floor = 64 * (3 * c["hidden_size"] + 2 * c["intermediate_size"]) * 4
    assert in_use["workspace"] > floor
    assert in_use["graphs"] == 0
    assert in_use["staging"] == 0  # no disk tier, nothing staged


async def test_stats_memory_shows_the_staging_buffer_after_a_disk_move(
    model_dir: MakeModel, tmp_path: Path
) -> None:
    model = model_dir("llama", max_position_embeddings=4096)
    # No host tier: blocks evicted from the device go to disk through the staging buffer.
    engine = await Engine.load(
        model, kv_memory_mib=1, host_cache_mib=0, disk_cache_dir=tmp_path / "kv"
    )
    try:
        before = engine.stats()["memory"]["cpu"]["in_use_bytes"]
        assert before["staging"] == 0
        block = engine.info["kv_block_bytes"]
        blocks = engine.stats()["kv_blocks_total"]
        # Two prompts that each fill most of the pool: the second evicts the first's blocks.
        for seed in (1, 2):
            prompt = [(seed * 7919 + i * 31) % 200 + 10 for i in range((blocks - 2) * BLOCK_SIZE)]
            await engine.complete(prompt, max_tokens=1)
        s = engine.stats()
    finally:
        await engine.close()
    moved = sum(
        m["blocks"]
        for m in s["cache"]["moves"]
        if (m["from"], m["to"], m["result"]) == ("device", "disk", "ok")
    )
    assert moved > 0
    after = s["memory"]["cpu"]["in_use_bytes"]
    assert after["staging"] == block
    assert {k: v for k, v in after.items() if k != "staging"} == {
        k: v for k, v in before.items() if k != "staging"
    }


async def test_metrics_expose_memory_in_use_by_device_and_purpose(model_dir: MakeModel) -> None:
    model = model_dir("llama")
    engine = await Engine.load(model, kv_memory_mib=1, disk_cache_mib=0)
    try:
        async with real_server(engine) as url, httpx.AsyncClient(base_url=url) as client:
            response = await client.get("/metrics")
        s = engine.stats()
        block = engine.info["kv_block_bytes"]
    finally:
        await engine.close()
    assert response.status_code == 200
    metrics = samples(response.text)
    assert "# TYPE strata:memory_in_use_bytes gauge" in response.text
    got = {
        purpose: metrics[f'strata:memory_in_use_bytes{{device="cpu",purpose="{purpose}"}}']
        for purpose in PURPOSES
    }
    in_use = s["memory"]["cpu"]["in_use_bytes"]
    assert got == {p: float(in_use[p]) for p in PURPOSES}
    assert got["weights"] == weight_bytes(model)
    assert got["kv"] == block * s["kv_blocks_total"]
    assert got["workspace"] > 0
    assert got["graphs"] == 0
    # The graph cache and the copy streams are listed on the CPU too, at 0 (it captures none and
    # copies in memory).
    assert s["graphs"] == dict.fromkeys(
        [
            "graphs",
            "bytes",
            "captures",
            "hits",
            "evictions",
            "oom_retries",
            "oom_fallbacks",
            "capture_failures",
            "oversize",
        ],
        0,
    )
    assert s["copy_streams"] == 0
    for name in [
        "strata:graph_cache_graphs",
        "strata:graph_cache_bytes",
        "strata:graph_captures_total",
        "strata:graph_oom_fallbacks_total",
        "strata:graph_capture_failures_total",
        "strata:copy_streams",
    ]:
        assert metrics[name] == 0.0, name
