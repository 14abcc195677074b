"""The K/V cache format option (`kv_dtype`): f32, f16, bf16 and 8-bit q8_0 through the public API.

q8_0 stores each head's vector in groups of 32 int8 with one f16 scale (34 bytes per 32 values):
its greedy predictions agree with f16 K/V's (teacher-forced over 256 tokens, every family), the
host and disk tiers restore it as it is (the same tokens as a cold q8_0 engine), a restart with
q8_0 adopts the disk files, and a restart with another format never does.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from strata_rs import Engine, InvalidRequest
from test_cache import GEN, Conversations, moves, step_for

pytestmark = pytest.mark.anyio

MakeModel = Callable[..., Path]

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma3", "qwen3_moe", "mixtral", "phi3"]
KV_DTYPES = ["f32", "f16", "bf16", "q8_0"]

# Teacher-forced positions compared per family.
AGREE_TOKENS = 256
# The least share of those positions whose greedy (argmax) prediction with q8_0 K/V must equal
# f16 K/V's. Derivation: a position flips only where q8_0's noise moves f16's top-2 logit gap
# across 0, so the expected flips are (density of f16's top-2 gaps near 0) x (mean change of the
# gap) x 256. On these random-weight models (measured, docs/benchmarks.md): at most 6.1 gaps per
# logit below 0.05 (llama, qwen2; mistral and qwen3 ~0), a mean gap change of 0.0035, so at most
# ~5 expected flips (2%), with a Poisson spread of ~2.2. 95% allows 12 flips: ~3 spreads above
# the worst family's estimate, so it holds without luck and still fails a q8_0 path that adds
# more than about twice the noise 8 bits should (observed: 4, 0, 3, 0 flips).
AGREE_MIN = 0.95
# A position whose f16 top-2 gap is at least this never flips: the gap's largest change under
# q8_0 measured on these models is 0.017 logit (its largest logit change 0.022), 3x below it.
CONFIDENT_GAP = 0.05


async def load(model: Path, kv_dtype: str | None, **kwargs: Any) -> Engine:
    return await Engine.load(model, kv_dtype=kv_dtype, **kwargs)


async def test_kv_dtype_sets_the_pool_format_and_its_bytes(model_dir: MakeModel) -> None:
    model = model_dir("llama")
    sizes = {}
    for kv in [None, *KV_DTYPES]:
        engine = await load(model, kv, kv_memory_mib=4)
        try:
            info = engine.info
            assert info["kv_dtype"] == (kv or "f32"), "default: the f32 weights' f32 K/V"
            sizes[kv] = (info["kv_block_bytes"], info["kv_blocks"])
            r = await engine.complete([5, 6, 7], max_tokens=4, temperature=0, ignore_eos=True)
            assert len(r.token_ids) == 4
        finally:
            await engine.close()
    # The tiny model: 2 layers x 2 K/V heads x head_dim 16, 16 tokens a block, K and V.
    per_value = {"f32": 4, "f16": 2, "bf16": 2}
    for kv, size in per_value.items():
        assert sizes[kv][0] == 2 * 2 * 2 * 16 * 16 * size
    # q8_0: head_dim 16 is one short group, 16 int8 and one f16 scale: 18 bytes a head.
    assert sizes["q8_0"][0] == 2 * 2 * 2 * 16 * 18
    # The same budget holds more blocks in a smaller format.
    assert sizes["q8_0"][1] > sizes["f16"][1] == sizes["bf16"][1] > sizes["f32"][1]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("int8", 'kv_dtype: "int8": must be f32, f16, bf16 or q8_0'),
        ("Q8_0", 'kv_dtype: "Q8_0": must be f32, f16, bf16 or q8_0'),
        ("", 'kv_dtype: "": must be f32, f16, bf16 or q8_0'),
        (8, "kv_dtype: must be a string, got int"),
    ],
)
async def test_a_bad_kv_dtype_names_the_option_and_the_formats(
    model_dir: MakeModel, value: object, message: str
) -> None:
    with pytest.raises(InvalidRequest) as e:
        await Engine.load(model_dir("llama"), kv_dtype=value)  # type: ignore[arg-type]
    assert str(e.value) == message


async def test_cuda_refuses_the_cpu_only_formats(model_dir: MakeModel) -> None:
    # Refused before any GPU is looked for: the same answer on a machine without one.
    for kv in ("bf16", "q8_0"):
        with pytest.raises(InvalidRequest) as e:
            await Engine.load(model_dir("llama"), device="cuda:0", kv_dtype=kv)
        assert str(e.value) == (
            f'kv_dtype: "{kv}" K/V runs on the CPU only; the CUDA backend reads f32 or f16 K/V'
        )


def top2_gap(logits: np.ndarray) -> np.ndarray:
    top = np.sort(logits, axis=-1)[:, -2:]
    return top[:, 1] - top[:, 0]


async def agreement(model: Path) -> dict[str, Any]:
    """Greedy agreement of q8_0 with f16 K/V, teacher-forced: f16 K/V's greedy answer of
    AGREE_TOKENS tokens after a 16-token prompt, then both formats' logits over prompt + answer
    (prefilled in chunks of 64, so later chunks read the earlier ones' K/V from the pool);
    compared at the AGREE_TOKENS positions that predict the answer."""
    prompt = [int(t) for t in np.random.default_rng(1).integers(3, 512, size=16)]
    opts: dict[str, Any] = {"host_cache_mib": 0, "disk_cache_mib": 0, "max_batch_tokens": 64}
    logits = {}
    for kv in ("f16", "q8_0"):
        engine = await load(model, kv, **opts)
        try:
            if kv == "f16":
                r = await engine.complete(
                    prompt, max_tokens=AGREE_TOKENS, temperature=0, ignore_eos=True
                )
                ids = prompt + r.token_ids
            logits[kv] = (await engine.logits(ids))[len(prompt) - 1 : len(ids) - 1]
        finally:
            await engine.close()
    f16, q8 = logits["f16"], logits["q8_0"]
    same = f16.argmax(-1) == q8.argmax(-1)
    gap = top2_gap(f16)
    return {
        "agree": int(same.sum()),
        "positions": len(same),
        "flip_gaps": sorted(float(g) for g in gap[~same]),
        "median_gap": float(np.median(gap)),
        "max_logit_change": float(np.abs(f16 - q8).max()),
        # The f16 answer is f16 K/V's own greedy choice at every position.
        "f16_self": int((f16.argmax(-1) == np.array(ids[len(prompt) :])).sum()),
    }


@pytest.mark.parametrize("family", FAMILIES)
async def test_q8_0_greedy_agreement_with_f16_kv(model_dir: MakeModel, family: str) -> None:
    a = await agreement(model_dir(family, max_position_embeddings=8192))
    print(f"{family}: q8_0 vs f16 K/V greedy agreement {a}")
    assert a["positions"] == AGREE_TOKENS
    assert a["f16_self"] == AGREE_TOKENS, "teacher forcing replays f16's own answer"
    assert a["agree"] >= AGREE_MIN * AGREE_TOKENS, a
    assert all(g < CONFIDENT_GAP for g in a["flip_gaps"]), a


async def cold(model: Path, kv_dtype: str, prompt: list[int]) -> list[int]:
    """Greedy answer from a fresh engine of `kv_dtype` K/V with no tier below the device."""
    engine = await load(model, kv_dtype, host_cache_mib=0, disk_cache_mib=0)
    try:
        r = await engine.complete(prompt, max_tokens=GEN, temperature=0, ignore_eos=True)
        return r.token_ids
    finally:
        await engine.close()


async def turns(
    engine: Engine, model: Path, kv_dtype: str, convs: Conversations, rounds: int
) -> None:
    """`rounds` turns of every conversation, each answer checked against a cold engine."""
    for _ in range(rounds):
        for c in range(len(convs.history)):
            prompt = convs.next_prompt(c)
            r = await engine.complete(prompt, max_tokens=GEN, temperature=0, ignore_eos=True)
            assert r.token_ids == await cold(model, kv_dtype, prompt), f"conversation {c}"
            convs.answer(c, r.token_ids)


# Models for the tier tests: the tiny llama (head_dim 16: one short q8_0 group a head) and a
# qwen3 with head_dim 64 (two full groups, ggml's case; its bigger K/V per token also fills the
# 1 MiB device pool with fewer tokens, which keeps the turns short).
TIER_MODELS = [("llama", {}), ("qwen3", {"head_dim": 64})]


@pytest.mark.parametrize(("family", "shape"), TIER_MODELS)
async def test_host_tier_restores_q8_0_exactly(
    model_dir: MakeModel, family: str, shape: dict[str, int]
) -> None:
    model = model_dir(family, max_position_embeddings=8192, **shape)
    engine = await load(model, "q8_0", kv_memory_mib=1, host_cache_mib=64, disk_cache_mib=0)
    try:
        convs = Conversations(2, step_for(engine.info))
        await turns(engine, model, "q8_0", convs, rounds=5)
        s = engine.stats()
        block_bytes = engine.info["kv_block_bytes"]
    finally:
        await engine.close()
    host = s["cache"]["hit_tokens"]["host"]
    assert host > 0 and moves(s, "host", "device", "ok") * 16 == host
    assert moves(s, "device", "host", "ok") > 0
    # The host tier holds the blocks as they are: q8_0's bytes.
    tier = s["cache"]["tiers"]["host"]
    assert tier["bytes"] == tier["blocks"] * block_bytes > 0


async def test_disk_tier_restores_q8_0_and_only_a_q8_0_restart_adopts_it(
    model_dir: MakeModel, tmp_path: Path
) -> None:
    family, shape = TIER_MODELS[1]
    model = model_dir(family, max_position_embeddings=8192, **shape)
    disk = tmp_path / "kv"
    opts: dict[str, Any] = {"kv_memory_mib": 1, "host_cache_mib": 0, "disk_cache_dir": disk}
    engine = await load(model, "q8_0", **opts)
    convs = Conversations(2, step_for(engine.info))
    try:
        await turns(engine, model, "q8_0", convs, rounds=5)
        s = engine.stats()
        block_bytes = engine.info["kv_block_bytes"]
    finally:
        await engine.close()
    assert s["cache"]["hit_tokens"]["disk"] > 0 and s["cache"]["hit_tokens"]["host"] == 0
    assert moves(s, "device", "disk", "ok") > 0
    files = sorted(p.name for p in disk.glob("*.kvb"))
    assert files, "a clean close writes the cached blocks"
    # Each file is a header and the block's q8_0 bytes.
    assert all(block_bytes < (disk / f).stat().st_size < block_bytes + 1024 for f in files)

    # Restarts with another format: the files are another format's, never adopted or read; the
    # turn is recomputed and is what a cold engine of that format answers.
    prompt = convs.next_prompt(0)
    history = len(prompt) - convs.step
    for other in ("f16", "f32", "bf16"):
        # A pool that holds the prompt (q8_0's 1 MiB held more tokens than theirs).
        engine = await load(model, other, **{**opts, "kv_memory_mib": 4})
        try:
            assert engine.stats()["cache"]["adopted_files"] == 0
            r = await engine.complete(prompt, max_tokens=GEN, temperature=0, ignore_eos=True)
            assert r.usage.cached_tokens == 0, other
            assert r.token_ids == await cold(model, other, prompt), other
        finally:
            await engine.close()
    # The q8_0 files were left alone by the others (which added their own).
    assert set(files) <= {p.name for p in disk.glob("*.kvb")}

    # A restart with q8_0: the returning turn comes from disk, and is the cold q8_0 answer.
    engine = await load(model, "q8_0", **opts)
    try:
        s0 = engine.stats()["cache"]
        assert s0["adopted_files"] == len(files) and s0["corrupt_files"] == 0
        r = await engine.complete(prompt, max_tokens=GEN, temperature=0, ignore_eos=True)
        assert r.token_ids == await cold(model, "q8_0", prompt)
        assert r.usage.cached_tokens == history // 16 * 16 > 0
        assert engine.stats()["cache"]["hit_tokens"]["disk"] == r.usage.cached_tokens
    finally:
        await engine.close()


def test_serve_and_bench_take_kv_dtype(
    monkeypatch: pytest.MonkeyPatch, model_dir: MakeModel, tmp_path: Path
) -> None:
    import strata_rs.server.serve
    from strata_rs.cli import main

    got: list[dict[str, Any]] = []

    def fake_serve(model: Path | None, engine_options: dict[str, Any], **kwargs: Any) -> int:
        got.append(engine_options)
        return 0

    monkeypatch.setattr(strata_rs.server.serve, "serve", fake_serve)
    assert main(["serve", "--kv-dtype", "q8_0"]) == 0
    assert got.pop()["kv_dtype"] == "q8_0"
    with pytest.raises(SystemExit):
        main(["serve", "--kv-dtype", "int4"])

    out = tmp_path / "bench.json"
    r = subprocess.run(
        [sys.executable, "-m", "strata_rs.cli", "bench", "--model", str(model_dir("llama")),
         "--kv-dtype", "q8_0", "--prefill", "32", "--decode-context", "16", "--steps", "4",
         "--repeats", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "q8_0 K/V" in r.stdout
    result = json.loads(out.read_text())
    assert result["engine"]["kv_dtype"] == "q8_0"
    assert float(result["decode_tok_s"]["16"]) > 0
