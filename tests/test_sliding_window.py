"""Sliding-window K/V: the sliding layers keep only what a window still reads.

A tiny random Gemma 3 (window 8, four layers of which layer 2 is full) generates far past its
window; its sliding layers give their blocks' slots back as the window passes them (the stats
count it), every generated token's log-probability matches the independent reference of the whole
sequence, a budget of K/V holds more blocks than it would if every layer kept every position,
and more running windows than slots (waiting, preempted) still give each request's tokens alone.
The conversation cache's round trips of such sequences (host and disk tiers, blocks with and
without their sliding part) are test_cache.py's, for every family.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import anyio
import numpy as np
import pytest
from reference import reference_logits
from strata_rs import Engine

pytestmark = pytest.mark.anyio

MakeModel = Callable[..., Path]

F32_REL_TOL = 1e-4  # of the reference logits' range: test_logits.py's tolerance
PROMPT = [int(t) for t in np.random.default_rng(3).integers(3, 500, size=40)]
GEN = 100
BLOCK = 16


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from strata_rs.testing.models import make_model

    # A 4,096-position context: 256 blocks, more than the slots.
    return make_model(
        tmp_path_factory.mktemp("gemma3-window"),
        "gemma3",
        "tiny",
        "f32",
        0,
        max_position_embeddings=4096,
    )


async def test_generation_past_the_window_is_exact_and_frees_its_slots(gemma3: Path) -> None:
    # Prefill chunks of 7 tokens: the window passes blocks inside the prompt, not only while
    # decoding.
    engine = await Engine.load(gemma3, max_batch_tokens=7, host_cache_mib=0, disk_cache_mib=0)
    try:
        assert json.loads((gemma3 / "config.json").read_text())["sliding_window"] == 8
        r = await engine.complete(
            PROMPT, max_tokens=GEN, temperature=0, ignore_eos=True, logprobs=True
        )
        s = engine.stats()
    finally:
        await engine.close()
    assert len(r.token_ids) == GEN
    ids = PROMPT + r.token_ids
    # 139 positions fed: 8 full blocks and a partial one. The sequence kept the blocks its last
    # full block's end reads (position 128 reads 121..=128: the last full block and the partial
    # one); when it finished, the partial block was freed and the full one stayed cached with
    # its slot. Every block before it gave its slot back as the window passed.
    fed = len(ids) - 1
    assert s["kv_blocks_cached"] == fed // BLOCK
    assert s["kv_window_slots_used"] == 1
    assert s["kv_window_slots_passed"] == fed // BLOCK - 1
    assert s["kv_window_slots_total"] > 0
    # Each generated token against the reference of the whole sequence, teacher-forced.
    want = reference_logits(gemma3, ids[:-1])[len(PROMPT) - 1 :]
    lp = log_softmax(want.astype(np.float64))
    assert r.logprobs is not None
    for i, (tok, entry) in enumerate(zip(r.token_ids, r.logprobs, strict=True)):
        span = float(np.ptp(want[i]))
        assert entry["token_id"] == tok
        assert abs(entry["logprob"] - lp[i, tok]) <= 2 * F32_REL_TOL * span, f"token {i}"
        best = int(want[i].argmax())
        assert tok == best or want[i, best] - want[i, tok] <= 2 * F32_REL_TOL * span, f"token {i}"


async def test_a_budget_holds_more_blocks_when_sliding_layers_keep_windows(gemma3: Path) -> None:
    budget = 8 << 20
    engine = await Engine.load(
        gemma3, kv_memory_mib=8, max_batch=2, max_batch_tokens=64, host_cache_mib=0
    )
    try:
        info, s = engine.info, engine.stats()
        kv_bytes = s["memory"]["cpu"]["in_use_bytes"]["kv"]
    finally:
        await engine.close()
    # The device tier's budget is what the pool holds, not a whole block per block.
    device = s["cache"]["tiers"]["device"]
    assert device["budget_bytes"] == kv_bytes < info["kv_blocks"] * info["kv_block_bytes"]
    every_layer = budget // info["kv_block_bytes"]
    # Slots for two windows of 8 (each its block, the partial one and one more) and as many
    # cached tails, plus a step's 64 tokens.
    slots = 2 * 2 * (1 + 2) + 64 // BLOCK
    assert s["kv_window_slots_total"] == slots
    # One layer of four is full: the three sliding ones hold their slots, and the rest of the
    # budget becomes blocks of the full one.
    per_layer = info["kv_block_bytes"] // 4
    assert info["kv_blocks"] == (every_layer * info["kv_block_bytes"] - slots * 3 * per_layer) // (
        per_layer
    )
    assert info["kv_blocks"] > 3 * every_layer
    assert kv_bytes == (info["kv_blocks"] + slots * 3) * per_layer <= budget


async def test_a_prefix_passed_by_the_window_is_recomputed_exactly(gemma3: Path) -> None:
    # The first request's window passes its first blocks: a second one sharing only them
    # cannot continue from those (their sliding part is gone) and computes them again.
    engine = await Engine.load(gemma3, host_cache_mib=0, disk_cache_mib=0)
    cold = await Engine.load(gemma3, host_cache_mib=0, disk_cache_mib=0)
    try:
        first = await engine.complete(PROMPT, max_tokens=30, temperature=0, ignore_eos=True)
        other = [*PROMPT[:32], 7, 8, 9, 10, 11]
        r = await engine.complete(other, max_tokens=20, temperature=0, ignore_eos=True)
        assert r.usage.cached_tokens == 0
        assert (
            r.token_ids
            == (await cold.complete(other, max_tokens=20, temperature=0, ignore_eos=True)).token_ids
        )
        # The whole first conversation returning continues from its cached blocks.
        again = [*PROMPT, *first.token_ids, 12, 13]
        r = await engine.complete(again, max_tokens=20, temperature=0, ignore_eos=True)
        assert r.usage.cached_tokens == (len(again) - 1) // BLOCK * BLOCK
    finally:
        await engine.close()
        await cold.close()


async def test_more_windows_than_slots_wait_or_are_preempted_and_stay_exact(gemma3: Path) -> None:
    # 32 sequences running at once, past their windows; the slots hold 16 windows (2 x 8) and
    # a step's blocks, so some wait for slots or are preempted and recomputed.
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(3, 500, size=60 + 2 * i)] for i in range(32)]
    engine = await Engine.load(
        gemma3, max_batch=32, max_batch_tokens=64, host_cache_mib=0, disk_cache_mib=0
    )
    got: dict[int, list[int]] = {}

    async def one(i: int) -> None:
        r = await engine.complete(prompts[i], max_tokens=60, temperature=0, ignore_eos=True)
        got[i] = r.token_ids

    try:
        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        s = engine.stats()
    finally:
        await engine.close()
    # Fewer slots than the 32 windows' 64 to 96 blocks (a window of 8 reads one or two blocks,
    # the partial one and a step's); how many wait or are preempted depends on arrival timing.
    assert s["kv_window_slots_total"] == 2 * 8 * (1 + 2) + 64 // BLOCK < 32 * 2
    alone = await Engine.load(gemma3, host_cache_mib=0, disk_cache_mib=0)
    try:
        for i, p in enumerate(prompts):
            r = await alone.complete(p, max_tokens=60, temperature=0, ignore_eos=True)
            assert got[i] == r.token_ids, f"request {i}"
    finally:
        await alone.close()
