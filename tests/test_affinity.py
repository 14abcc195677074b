"""The conversation-affinity policy (strata_rs.ray.affinity, no Ray needed), and the engine API it
keys on: `prefix_block_hashes` equals the hashes an engine caches a prompt's blocks under."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from pathlib import Path

import pytest
from strata_rs import Engine, InvalidRequest, prefix_block_hashes
from strata_rs.ray.affinity import AffinityPolicy

MakeModel = Callable[..., Path]


def test_the_longest_cached_prefix_wins_and_ties_go_to_the_less_loaded() -> None:
    p = AffinityPolicy(imbalance=4, rng=random.Random(0))
    p.publish("a", [1, 2])
    p.publish("b", [1, 2, 3])
    p.publish("c", [1, 2, 3])
    d = p.choose([1, 2, 3, 4], {"a": 0, "b": 3, "c": 2})
    assert (d.replica, d.reason, d.matched_blocks) == ("c", "prefix", 3)
    assert d.fallbacks == ("a", "b")
    # A chain is matched from its start: holding a later block alone is no prefix.
    p.publish("a", [2, 3, 4])
    assert p.matched_blocks("a", [1, 2, 3, 4]) == 0
    assert p.counts == {"prefix": 1}


def test_an_overloaded_holder_gives_way_to_the_next_holder_or_the_less_loaded_of_two() -> None:
    p = AffinityPolicy(imbalance=2, rng=random.Random(0))
    p.publish("a", [1, 2, 3])
    # Within the imbalance of the mean load (2.5): the holder.
    assert p.choose([1, 2, 3], {"a": 4, "b": 0, "c": 2, "d": 4}).replica == "a"
    # More than 2 over the mean (2): the less loaded of two that are not overloaded.
    d = p.choose([1, 2, 3], {"a": 5, "b": 0, "c": 1, "d": 2})
    assert d.reason == "overloaded" and d.replica in ("b", "c", "d") and d.matched_blocks == 0
    # Another replica holding enough of the prompt takes it before a blind pick.
    p.publish("c", [1, 2])
    d = p.choose([1, 2, 3], {"a": 5, "b": 0, "c": 1, "d": 2})
    assert (d.replica, d.reason, d.matched_blocks) == ("c", "prefix", 2)
    assert p.counts == {"prefix": 2, "overloaded": 1}


def test_a_new_prompt_goes_to_the_less_loaded_of_two_random_replicas() -> None:
    p = AffinityPolicy(rng=random.Random(1))
    loads = {f"r{i}": i for i in range(8)}
    picks = [p.choose([7, 8], loads) for _ in range(400)]
    assert {d.reason for d in picks} == {"no_prefix"}
    # Never the most loaded (it loses to whichever other was drawn), and spread, not pinned.
    chosen = {d.replica for d in picks}
    assert "r7" not in chosen and len(chosen) == 7
    with pytest.raises(ValueError, match="loads: no replica to route to"):
        p.choose([1], {})


def test_a_shared_system_prompt_alone_does_not_pull_conversations_together() -> None:
    p = AffinityPolicy(min_match=0.5, rng=random.Random(0))
    p.publish("a", [1, 2, 3])  # block 1: the system prompt every conversation starts with
    d = p.choose([1, 20, 21], {"a": 0, "b": 0})
    # One block of three is not enough; of two idle replicas, the one holding less.
    assert (d.replica, d.reason) == ("b", "no_prefix")
    p.record("b", [1, 20, 21])
    assert p.choose([1, 20, 21, 22], {"a": 0, "b": 0}).reason == "prefix"
    with pytest.raises(ValueError, match=r"min_match: must be in \[0, 1\], got 1.5"):
        AffinityPolicy(min_match=1.5)


def test_what_was_routed_is_remembered_until_the_replica_publishes() -> None:
    p = AffinityPolicy(routed_capacity=4, rng=random.Random(0), clock=lambda: 0.0)
    p.set_replicas(["a", "b"])
    first = p.choose([10, 11, 12], {"a": 0, "b": 0})
    p.record(first.replica, [10, 11, 12])
    again = p.choose([10, 11, 12, 13], {"a": 0, "b": 0})
    assert (again.replica, again.reason, again.matched_blocks) == (first.replica, "prefix", 3)
    # Bounded: the oldest routed hashes go first.
    p.record(first.replica, [20, 21])
    assert p.matched_blocks(first.replica, [10, 11, 12]) == 0
    assert p.matched_blocks(first.replica, [11, 12]) == 2
    # A replica that is gone is forgotten.
    p.set_replicas(["b"] if first.replica == "a" else ["a"])
    assert p.matched_blocks(first.replica, [11]) == 0


def test_a_publication_drops_what_it_holds_and_what_the_replica_lost() -> None:
    now = [0.0]
    p = AffinityPolicy(routed_ttl=60.0, rng=random.Random(0), clock=lambda: now[0])
    p.record("a", [1, 2, 3])
    now[0] = 30.0
    p.record("a", [7, 8])
    now[0] = 70.0
    # Holds 1 and 2 (now known from the report); 3 was routed 70 s ago and is not held: gone;
    # 7 and 8 were routed 40 s ago: not computed yet, perhaps, so still counted.
    p.publish("a", [1, 2])
    view = p.views["a"]
    assert view.published == {1, 2} and list(view.routed) == [7, 8]
    assert p.matched_blocks("a", [1, 2, 3]) == 2 and p.matched_blocks("a", [7, 8]) == 2
    now[0] = 91.0
    p.publish("a", [1, 2])
    assert p.matched_blocks("a", [7, 8]) == 0 and not p.views["a"].routed


def test_bad_settings_are_refused_naming_them() -> None:
    with pytest.raises(ValueError, match="imbalance: must be >= 0, got -1"):
        AffinityPolicy(imbalance=-1)
    with pytest.raises(ValueError, match="routed_capacity: must be >= 1, got 0"):
        AffinityPolicy(routed_capacity=0)


@pytest.mark.anyio
async def test_the_routers_key_is_what_the_engine_caches_blocks_under(
    model_dir: MakeModel, tmp_path: Path
) -> None:
    engine = await Engine.load(model_dir("llama"), disk_cache_mib=0)
    try:
        info = engine.info
        prompt = list(range(1, 70))  # four full blocks of 16 and a partial one
        assert await engine.cached_block_hashes() == []
        await engine.complete(prompt, max_tokens=1, temperature=0.0)
        held = set(await engine.cached_block_hashes())
        keys = prefix_block_hashes(prompt, info["prefix_salt"], info["block_size"])
        assert len(keys) == 4 and set(keys) <= held
        # Another salt (another model) keys the same tokens elsewhere.
        assert not set(prefix_block_hashes(prompt, info["prefix_salt"] ^ 1, 16)) & held
    finally:
        await engine.close()
    with pytest.raises(InvalidRequest, match="block_size: must be at least 1"):
        prefix_block_hashes([1, 2], 0, 0)
    with pytest.raises(InvalidRequest, match="token_ids"):
        prefix_block_hashes("abc", 0, 16)  # type: ignore[arg-type]


async def _settled(folder: Path, timeout: float = 10.0) -> int:
    """The number of block files once it stopped changing (the idle write is done)."""
    last, stable = -1, 0
    for _ in range(int(timeout / 0.1)):
        n = len(list(folder.glob("*.kvb")))
        stable = stable + 1 if n == last and n > 0 else 0
        if stable >= 5:
            return n
        last = n
        await asyncio.sleep(0.1)
    raise AssertionError(f"{folder}: the block files never settled (last count {last})")


@pytest.mark.anyio
async def test_an_engine_restores_what_another_engine_sharing_the_folder_wrote_when_idle(
    model_dir: MakeModel, tmp_path: Path
) -> None:
    model = model_dir("llama")
    folder = tmp_path / "kv"
    prompt = list(range(3, 100))  # six full blocks
    cold = await Engine.load(model, host_cache_mib=0, disk_cache_mib=0)
    try:
        expected = await cold.complete(prompt, max_tokens=6, temperature=0.0)
    finally:
        await cold.close()
    writer = await Engine.load(model, disk_cache_dir=folder, disk_write_when_idle=True)
    reader = await Engine.load(model, disk_cache_dir=folder)
    try:
        assert reader.stats()["cache"]["adopted_files"] == 0
        await writer.complete(prompt, max_tokens=6, temperature=0.0)
        # Written while the writer is still open: only the idle write can have done it.
        assert await _settled(folder) >= 6
        got = await reader.complete(prompt, max_tokens=6, temperature=0.0)
        assert got.usage.cached_tokens == 96
        assert got.token_ids == expected.token_ids
        cache = reader.stats()["cache"]
        assert cache["adopted_files"] >= 6 and cache["hit_tokens"]["disk"] == 96
    finally:
        await writer.close()
        await reader.close()
