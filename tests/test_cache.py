"""The conversation cache through the public API: K/V restored from the host tier and from disk
gives exactly the tokens a cold engine gives, survives a restart, never crosses models, and no
failed, refused or corrupt move ever fails a request.

Conversations are token-id histories that grow each turn (new "user" ids plus the model's
answer). The device pool is made small (`kv_memory_mib=1`) so that alternating conversations
push each other below the device. References are computed on a fresh engine per turn with every
tier below the device off: a cold prefill.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from strata_rs import Engine, InvalidRequest

pytestmark = pytest.mark.anyio

MakeModel = Callable[..., Path]

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma3", "qwen3_moe", "mixtral", "phi3"]
GEN = 6


def moves(stats: dict[str, Any], src: str, dst: str, result: str) -> int:
    return sum(
        m["blocks"]
        for m in stats["cache"]["moves"]
        if (m["from"], m["to"], m["result"]) == (src, dst, result)
    )


class Conversations:
    """Alternating conversations whose histories grow by `step` ids plus the answer each turn."""

    def __init__(self, count: int, step: int, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.history: list[list[int]] = [[] for _ in range(count)]
        self.step = step

    def next_prompt(self, c: int) -> list[int]:
        self.history[c] += [int(t) for t in self.rng.integers(3, 512, size=self.step)]
        return list(self.history[c])

    def answer(self, c: int, ids: list[int]) -> None:
        self.history[c] += ids


async def cold(model: Path, prompt: list[int]) -> list[int]:
    """Greedy answer from a fresh engine with no cache below the device: a cold prefill."""
    engine = await Engine.load(model, host_cache_mib=0, disk_cache_mib=0)
    try:
        r = await engine.complete(prompt, max_tokens=GEN, temperature=0, ignore_eos=True)
        return r.token_ids
    finally:
        await engine.close()


async def run_turns(
    engine: Engine, model: Path, convs: Conversations, rounds: int
) -> list[tuple[int, int]]:
    """Runs `rounds` turns of every conversation; checks each answer against a cold engine;
    returns (prompt_tokens, cached_tokens) per turn."""
    usage = []
    for _ in range(rounds):
        for c in range(len(convs.history)):
            prompt = convs.next_prompt(c)
            r = await engine.complete(prompt, max_tokens=GEN, temperature=0, ignore_eos=True)
            assert r.token_ids == await cold(model, prompt), f"conversation {c}"
            convs.answer(c, r.token_ids)
            usage.append((r.usage.prompt_tokens, r.usage.cached_tokens))
    return usage


def step_for(info: dict[str, Any]) -> int:
    """History growth per turn (the new ids; the answer adds GEN more) so that two
    conversations outgrow the device within 5 turns and one still fits it after 6."""
    return int(info["kv_blocks"] * info["block_size"] * 0.16) - GEN


@pytest.mark.parametrize("family", FAMILIES)
async def test_host_tier_restores_exactly_for_every_family(
    model_dir: MakeModel, family: str
) -> None:
    model = model_dir(family, max_position_embeddings=8192)
    engine = await Engine.load(model, kv_memory_mib=1, host_cache_mib=64, disk_cache_mib=0)
    try:
        convs = Conversations(2, step_for(engine.info))
        usage = await run_turns(engine, model, convs, rounds=5)
        s = engine.stats()
    finally:
        await engine.close()
    host = s["cache"]["hit_tokens"]["host"]
    assert host > 0 and moves(s, "host", "device", "ok") * 16 == host
    assert moves(s, "device", "host", "ok") > 0
    # Every returning turn reused at least the history's full blocks before the last answer.
    for prompt_tokens, cached in usage[2:]:
        assert cached >= (prompt_tokens - convs.step - GEN) // 16 * 16 > 0
    assert s["cache"]["tiers"]["host"]["bytes"] <= s["cache"]["tiers"]["host"]["budget_bytes"]
    # The device tier's budget is the pool's K/V: a whole block per block, or less where
    # sliding layers keep fewer window slots than there are blocks (phi3's tiny model here;
    # gemma3's budget is too small for them to pay, and its pool keeps every block).
    device, block_bytes = s["cache"]["tiers"]["device"], engine.info["kv_block_bytes"]
    assert device["budget_bytes"] == s["memory"]["cpu"]["in_use_bytes"]["kv"]
    assert s["kv_window_slots_total"] < s["kv_blocks_total"]
    if family == "gemma3":
        assert s["kv_window_slots_total"] == 0
    if s["kv_window_slots_total"] == 0:
        assert device["budget_bytes"] == s["kv_blocks_total"] * block_bytes
        assert device["bytes"] == s["kv_blocks_cached"] * block_bytes > 0
    else:
        assert device["budget_bytes"] < s["kv_blocks_total"] * block_bytes
        assert 0 < device["bytes"] < s["kv_blocks_cached"] * block_bytes


@pytest.mark.parametrize("family", FAMILIES)
async def test_disk_tier_restores_exactly_and_survives_a_restart(
    model_dir: MakeModel, family: str, tmp_path: Path
) -> None:
    model = model_dir(family, max_position_embeddings=8192)
    disk = tmp_path / "kv"
    opts: dict[str, Any] = {"kv_memory_mib": 1, "host_cache_mib": 0, "disk_cache_dir": disk}
    engine = await Engine.load(model, **opts)
    convs = Conversations(2, step_for(engine.info))
    try:
        await run_turns(engine, model, convs, rounds=5)
        s = engine.stats()
    finally:
        await engine.close()
    assert s["cache"]["hit_tokens"]["disk"] > 0 and s["cache"]["hit_tokens"]["host"] == 0
    assert moves(s, "device", "disk", "ok") > 0
    files = list(disk.glob("*.kvb"))
    assert files, "a clean close writes the cached blocks"

    # A new process-like start: the first returning turn comes from disk.
    engine = await Engine.load(model, **opts)
    try:
        s0 = engine.stats()["cache"]
        assert s0["adopted_files"] == len(files) and s0["corrupt_files"] == 0
        prompt = convs.next_prompt(0)
        r = await engine.complete(prompt, max_tokens=GEN, temperature=0, ignore_eos=True)
        assert r.token_ids == await cold(model, prompt)
        history = len(prompt) - convs.step
        assert r.usage.cached_tokens == history // 16 * 16
        assert engine.stats()["cache"]["hit_tokens"]["disk"] == r.usage.cached_tokens
    finally:
        await engine.close()


async def written_conversation(model: Path, disk: Path) -> tuple[Conversations, list[int]]:
    """One conversation turn written to `disk` by a clean close; returns it and its next prompt."""
    engine = await Engine.load(model, host_cache_mib=0, disk_cache_dir=disk)
    convs = Conversations(1, 200)
    try:
        prompt = convs.next_prompt(0)
        r = await engine.complete(prompt, max_tokens=GEN, temperature=0, ignore_eos=True)
        convs.answer(0, r.token_ids)
    finally:
        await engine.close()
    return convs, convs.next_prompt(0)


async def test_other_models_and_dtypes_never_adopt_a_file(
    model_dir: MakeModel, tmp_path: Path
) -> None:
    disk = tmp_path / "kv"
    model = model_dir("llama", max_position_embeddings=8192)
    _, prompt = await written_conversation(model, disk)
    files = sorted(p.name for p in disk.glob("*.kvb"))
    # The first turn fed 200 prompt ids and GEN - 1 answer ids: 12 full blocks.
    assert len(files) == (200 + GEN - 1) // 16 == 12
    # Same config and file sizes, other weights (seed): a different model.
    from strata_rs.testing.models import make_model

    retrained = make_model(
        tmp_path / "retrained", "llama", "tiny", "f32", 1, max_position_embeddings=8192
    )
    f16 = model_dir("llama", "f16", max_position_embeddings=8192)
    for other in (retrained, f16):
        engine = await Engine.load(other, host_cache_mib=0, disk_cache_dir=disk)
        try:
            assert engine.stats()["cache"]["adopted_files"] == 0
            r = await engine.complete(prompt, max_tokens=GEN, temperature=0, ignore_eos=True)
            assert r.usage.cached_tokens == 0
            assert r.token_ids == await cold(other, prompt)
        finally:
            await engine.close()
    # The first model's files were left alone by the others (they added their own).
    assert set(files) <= {p.name for p in disk.glob("*.kvb")}


async def test_truncated_and_bit_flipped_files_are_deleted_and_the_answer_is_right(
    model_dir: MakeModel, tmp_path: Path
) -> None:
    disk = tmp_path / "kv"
    model = model_dir("llama", max_position_embeddings=8192)
    _, prompt = await written_conversation(model, disk)
    files = sorted(disk.glob("*.kvb"), key=lambda p: p.stat().st_mtime_ns)
    assert len(files) >= 4
    # Which file holds which block is not visible by name; corrupt two of them.
    truncated, flipped = files[1], files[2]
    truncated.write_bytes(truncated.read_bytes()[:-100])
    data = bytearray(flipped.read_bytes())
    data[-7] ^= 0x10  # inside the payload: only the read can tell
    flipped.write_bytes(bytes(data))

    engine = await Engine.load(model, host_cache_mib=0, disk_cache_dir=disk)
    try:
        s = engine.stats()["cache"]
        assert s["corrupt_files"] == 1, "the truncated file is caught by the scan"
        assert s["adopted_files"] == len(files) - 1
        assert not truncated.exists()
        r = await engine.complete(prompt, max_tokens=GEN, temperature=0, ignore_eos=True)
        assert r.token_ids == await cold(model, prompt)
        s = engine.stats()["cache"]
        # The restore stops at the first bad block: the flipped one is read only if the
        # truncated one was after it in the chain. Either way the bad files are gone and counted.
        restored = s["hit_tokens"]["disk"]
        assert r.usage.cached_tokens == restored < len(prompt)
        if flipped.exists():
            assert s["corrupt_files"] == 1
        else:
            assert s["corrupt_files"] == 2 and moves({"cache": s}, "disk", "device", "failed") == 1
    finally:
        await engine.close()


FAULTS = [
    # (spec, host tier on, the move that must show the failure)
    ("alloc:1", True, ("device", "host", "failed")),
    ("alloc:*", True, ("device", "host", "failed")),
    ("copy_out:1", True, ("device", "host", "failed")),
    ("copy_out:*", True, ("device", "host", "failed")),
    ("copy_in:1", True, ("host", "device", "failed")),
    ("copy_in:*", True, ("host", "device", "failed")),
    ("write:1", False, ("device", "disk", "failed")),
    ("write:*", False, ("device", "disk", "failed")),
    ("read:1", False, ("disk", "device", "failed")),
    ("read:*", False, ("disk", "device", "failed")),
]


@pytest.mark.parametrize(("spec", "host", "failed_move"), FAULTS)
async def test_injected_faults_never_fail_a_request(
    model_dir: MakeModel,
    tmp_path: Path,
    spec: str,
    host: bool,
    failed_move: tuple[str, str, str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="strata_rs.cache")
    model = model_dir("llama", max_position_embeddings=8192)
    engine = await Engine.load(
        model,
        kv_memory_mib=1,
        host_cache_mib=64 if host else 0,
        disk_cache_dir=tmp_path / "kv",
        cache_faults=spec,
    )
    try:
        convs = Conversations(3, step_for(engine.info))
        await run_turns(engine, model, convs, rounds=4)
        s = engine.stats()
        assert s["stopped"] is None
        assert moves(s, *failed_move) >= 1
        if spec.endswith(":1"):
            # One failure, then the tier works again.
            assert moves(s, failed_move[0], failed_move[1], "ok") > 0
        # Still serving.
        r = await engine.complete([5, 6, 7], max_tokens=2, temperature=0)
        assert len(r.token_ids) == 2
    finally:
        await engine.close()
    await wait_for_log(caplog, "(injected fault)")


async def wait_for_log(caplog: pytest.LogCaptureFixture, text: str) -> str:
    """Cache log lines reach Python logging from a forwarder thread: wait for one."""
    for _ in range(200):
        for r in caplog.records:
            if text in r.getMessage():
                return r.getMessage()
        await asyncio.sleep(0.01)
    raise AssertionError(f"no log line with {text!r}: {[r.getMessage() for r in caplog.records]}")


async def test_a_ram_gate_refusal_skips_the_move_and_the_request_recomputes(
    model_dir: MakeModel, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="strata_rs.cache")
    model = model_dir("llama", max_position_embeddings=8192)
    # A floor no machine has: the gate refuses every host allocation, the disk tier's staging
    # buffer included, so nothing moves below the device and every turn recomputes.
    engine = await Engine.load(
        model,
        kv_memory_mib=1,
        host_cache_mib=64,
        host_min_free_mib=1 << 30,
        disk_cache_dir=tmp_path / "kv",
    )
    try:
        convs = Conversations(2, step_for(engine.info))
        await run_turns(engine, model, convs, rounds=5)
        s = engine.stats()
    finally:
        await engine.close()
    c = s["cache"]
    assert c["refusals"]["ram"] >= 1
    assert c["tiers"]["host"]["blocks"] == 0 and c["tiers"]["disk"]["blocks"] == 0
    assert c["hit_tokens"]["host"] == c["hit_tokens"]["disk"] == 0
    assert moves(s, "device", "host", "refused") > 0
    assert moves(s, "device", "disk", "refused") > 0
    assert moves(s, "device", "host", "ok") == moves(s, "device", "disk", "ok") == 0
    line = await wait_for_log(caplog, "to host: RAM gate, need")
    assert " MiB + 1073741824 MiB floor, " in line and line.endswith(" MiB available")


async def test_restore_logs_tokens_time_and_bandwidth(
    model_dir: MakeModel, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="strata_rs.cache")
    model = model_dir("llama", max_position_embeddings=8192)
    engine = await Engine.load(model, kv_memory_mib=1, host_cache_mib=64, disk_cache_mib=0)
    try:
        convs = Conversations(2, step_for(engine.info))
        await run_turns(engine, model, convs, rounds=5)
        last = engine.stats()["cache"]["last_restore"]
    finally:
        await engine.close()
    assert last["tokens"] == last["from_host"] > 0 and last["from_disk"] == 0
    assert last["bytes"] == last["tokens"] // 16 * engine.info["kv_block_bytes"]
    line = await wait_for_log(caplog, f"restored {last['tokens']} tokens from host in ")
    assert line.endswith(" GB/s)")


async def test_device_refusal_reads_the_prompt(model_dir: MakeModel, tmp_path: Path) -> None:
    """An onload the device cannot take right now is refused; the prompt is read instead."""
    model = model_dir("llama", max_position_embeddings=8192)
    engine = await Engine.load(
        model, kv_memory_mib=1, host_cache_mib=64, disk_cache_mib=0, max_batch_tokens=64
    )
    try:
        tokens = engine.info["kv_blocks"] * 16
        convs = Conversations(1, tokens // 2)
        first = convs.next_prompt(0)
        await engine.complete(first, max_tokens=GEN, temperature=0, ignore_eos=True)
        # A long request holds most of the device while the conversation returns.
        hog = engine.generate(
            [7] * (tokens // 2 + 64), max_tokens=tokens // 4, temperature=0, ignore_eos=True
        )
        await hog.__anext__()
        prompt = list(first) + [9] * 16
        r = await engine.complete(prompt, max_tokens=GEN, temperature=0, ignore_eos=True)
        assert r.token_ids == await cold(model, prompt)
        s = engine.stats()
        hog.cancel()
    finally:
        await engine.close()
    assert s["cache"]["refusals"]["device"] >= 1


async def test_pressure_16_conversations_through_a_device_that_holds_2(
    model_dir: MakeModel,
) -> None:
    model = model_dir("llama", max_position_embeddings=8192)
    # 2 MiB of f32 K/V is 256 blocks: two 2K-token conversations.
    engine = await Engine.load(model, kv_memory_mib=2, host_cache_mib=48, disk_cache_mib=0)
    ref = await Engine.load(model, host_cache_mib=0, disk_cache_mib=0, kv_memory_mib=64)
    try:
        assert engine.info["kv_blocks"] * 16 == 4096
        convs = Conversations(16, 1000)
        host_budget = 48 << 20
        for _ in range(2):
            for c in range(16):
                prompt = convs.next_prompt(c)
                r = await engine.complete(prompt, max_tokens=GEN, temperature=0, ignore_eos=True)
                expect = await ref.complete(prompt, max_tokens=GEN, temperature=0, ignore_eos=True)
                assert r.token_ids == expect.token_ids
                convs.answer(c, r.token_ids)
                s = engine.stats()
                assert s["kv_blocks_used"] <= s["kv_blocks_total"] == 256
                assert s["cache"]["tiers"]["host"]["bytes"] <= host_budget
        s = engine.stats()
        # Second round: every conversation came back from the host (16 x ~62 blocks).
        assert s["cache"]["hit_tokens"]["host"] >= 14 * 992
    finally:
        await engine.close()
        await ref.close()


async def test_disk_cache_days_0_empties_the_tier_at_start(
    model_dir: MakeModel, tmp_path: Path
) -> None:
    disk = tmp_path / "kv"
    model = model_dir("llama", max_position_embeddings=8192)
    _, prompt = await written_conversation(model, disk)
    (disk / "someone-elses.bin").write_bytes(b"keep me")
    assert list(disk.glob("*.kvb"))
    engine = await Engine.load(model, disk_cache_dir=disk, disk_cache_days=0)
    try:
        assert engine.stats()["cache"]["adopted_files"] == 0
        r = await engine.complete(prompt, max_tokens=GEN, temperature=0, ignore_eos=True)
        assert r.usage.cached_tokens == 0
    finally:
        await engine.close()
    assert (disk / "someone-elses.bin").read_bytes() == b"keep me"


async def test_the_environment_variable_injects_faults(
    model_dir: MakeModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STRATA_CACHE_FAULTS", "copy_out:*")
    model = model_dir("llama", max_position_embeddings=8192)
    engine = await Engine.load(model, kv_memory_mib=1, host_cache_mib=64, disk_cache_mib=0)
    try:
        convs = Conversations(2, step_for(engine.info))
        await run_turns(engine, model, convs, rounds=5)
        s = engine.stats()
    finally:
        await engine.close()
    assert moves(s, "device", "host", "failed") > 0 and moves(s, "device", "host", "ok") == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"host_cache_mib": -1}, "host_cache_mib: must be >= 0, got -1"),
        ({"host_min_free_mib": -5}, "host_min_free_mib: must be >= 0, got -5"),
        ({"disk_cache_mib": -1}, "disk_cache_mib: must be >= 0, got -1"),
        ({"disk_cache_days": -1.0}, "disk_cache_days: must be >= 0, got -1"),
        ({"disk_cache_days": float("nan")}, "disk_cache_days: must be >= 0, got NaN"),
        ({"cache_faults": "bogus"}, 'cache_faults: "bogus": expected kind:N or kind:*'),
        (
            {"cache_faults": "disk:1"},
            'cache_faults: "disk:1": the kind must be alloc, copy_out, copy_in, write, read'
            " or ram_gate",
        ),
    ],
)
async def test_bad_cache_options_name_the_field(
    model_dir: MakeModel, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidRequest) as e:
        await Engine.load(model_dir("llama"), **kwargs)
    assert str(e.value) == message


async def test_an_unwritable_disk_folder_turns_the_tier_off_and_serves(
    model_dir: MakeModel, tmp_path: Path
) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    engine = await Engine.load(model_dir("llama"), disk_cache_dir=blocker / "kv")
    try:
        assert engine.stats()["cache"]["tiers"]["disk"]["enabled"] is False
        r = await engine.complete([5, 6, 7], max_tokens=2, temperature=0)
        assert len(r.token_ids) == 2
    finally:
        await engine.close()
    assert os.path.isfile(blocker)
