"""The short versions of the soak (`benches/soak.py` runs them for minutes): a real server under
64 streaming clients with cancels, disconnects, 503s and the cache's faults, and a server killed
with SIGKILL while it writes its disk tier. Every answer is compared with the cold path's."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from strata_rs import Engine
from strata_rs.testing.soak import (
    LoadOptions,
    run_crashes,
    run_load,
    scan_tier,
    verify_block_file,
)

MakeModel = Callable[..., Path]


def test_30_seconds_of_load_with_faults_keep_every_promise() -> None:
    report = run_load(LoadOptions(seconds=30, warmup=8, clients=64, faults=True, seed=3))
    assert report.problems() == [], report.as_dict()
    s = report.server
    # The run did what it claims: many exact answers, every client path taken.
    assert report.completed >= 200 and not report.mismatches
    assert report.cancelled > 0 and report.disconnected > 0
    assert report.rejected > 0 and s["queue_refusals"] == report.rejected
    # Polled every 0.5 s plus the answer's wait on a busy server: how many depends on the
    # machine's speed, which a test does not assert; that it kept polling, and every answer, does.
    assert report.health_checks >= 10 and not report.health_failures
    # Faults of most kinds fired, and each shows in the metrics.
    injected = s["faults_injected"]
    assert len(injected) >= 4, injected
    assert s["refusals"]["ram"] >= injected.get("ram_gate", 0) > 0
    assert s["failed_moves"] >= sum(n for k, n in injected.items() if k != "ram_gate")
    # While the folder was read-only, writes failed beyond the injected ones, each counted.
    failed_writes = sum(n for move, n in s["moves"].items() if "->disk failed" in move)
    if report.read_only is not None:
        assert failed_writes > injected.get("write", 0), s["moves"]
    # The truncated files were found bad when read, deleted and recomputed.
    assert report.truncated_files > 0 and s["corrupt_files"] > 0
    assert s["running"] == s["waiting"] == s["kv_blocks_used"] == 0
    assert report.rss_ratio <= 1.10 and report.exit_status == 0
    if report.read_only is None:
        pytest.skip("every other check passed; this machine cannot make a folder read-only")


def test_sigkill_while_writing_the_disk_tier_loses_nothing_complete() -> None:
    report = run_crashes(cycles=4, seed=5)
    assert report.problems() == [], report.cycles
    kills = report.cycles[:-1]
    assert [c["kill"] for c in kills] == ["random", "mid-write", "random", "mid-write"]
    for before, after in zip(report.cycles, report.cycles[1:], strict=False):
        # The restart adopted every complete file the crash left, and nothing else.
        assert after["adopted"] == before["valid_after"] and not after["invalid_before"]
        assert after["temp_deleted"] == before["temp_after"]
        assert after["disk_hit_tokens"] > 0
    assert report.cycles[-1]["answers_checked"] == 5 * 32
    assert not report.mismatches and not report.errors


@pytest.mark.anyio
async def test_the_file_verifier_and_the_engine_agree_on_bad_files(
    model_dir: MakeModel, tmp_path: Path
) -> None:
    model = model_dir("llama", max_position_embeddings=1024)
    kv = tmp_path / "kv"
    options = {"disk_cache_dir": kv, "host_cache_mib": 0, "kv_memory_mib": 1}
    engine = await Engine.load(model, **options)
    await engine.complete(list(range(3, 3 + 16 * 5)), max_tokens=1)
    await engine.close()  # a clean close writes the cached blocks to disk
    files = sorted(kv.glob("*.kvb"))
    assert len(files) == 5 and all(verify_block_file(f) is None for f in files)

    size = files[0].stat().st_size
    os.truncate(files[0], size - 1)
    assert verify_block_file(files[0]) == f"{size - 1} bytes, the header says {size}"
    data = bytearray(files[1].read_bytes())
    data[-1] ^= 1
    files[1].write_bytes(bytes(data))
    assert verify_block_file(files[1]) == "payload checksum mismatch"
    data = bytearray(files[2].read_bytes())
    data[64] ^= 1  # the first token id
    files[2].write_bytes(bytes(data))
    assert verify_block_file(files[2]) == "header checksum mismatch"
    salt = files[3].name.split("-")[0]
    moved = files[3].rename(kv / f"{salt}-{0:016x}.kvb")
    assert verify_block_file(moved) == "the name does not match the header"
    found = scan_tier(kv)
    assert len(found.valid) == 1 and len(found.invalid) == 4 and found.temp == []

    # The engine's own scan deletes the files whose header is wrong and adopts the rest; it
    # reads no payload at start (the flipped payload byte is caught when the block is read,
    # tested in rust/cache/disk.rs).
    engine = await Engine.load(model, **options)
    try:
        cache = engine.stats()["cache"]
        assert cache["adopted_files"] == 2 and cache["corrupt_files"] == 3
        assert sorted(p.name for p in kv.glob("*.kvb")) == [files[1].name, files[4].name]
    finally:
        await engine.close()
