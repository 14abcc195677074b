"""Long contexts: logits past 16K positions against the independent reference, and a
conversation with a 32K-token history returning from the host tier, and from disk after a
restart, with exactly the tokens a cold engine gives.

Tiny random-weight llama models (one layer, 2 query heads on one K/V head of 16: attention over
32K positions is the cost, and the test build is not optimized) with Llama 3.x's RoPE scaling
from a 4K original context: at 16K the scaled frequencies are what the model reads. The
reference (tests/reference.py) is the float64 forward of the whole sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from reference import reference_logits
from strata_rs import Engine

pytestmark = pytest.mark.anyio

F32_REL_TOL = 1e-4  # of the reference logits' range: test_logits.py's tolerance
ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 4096,
}
GEN = 4
# One layer, 2 query heads on one K/V head of 16: attention over long contexts is the cost.
TINY: dict[str, int] = {
    "num_hidden_layers": 1,
    "hidden_size": 32,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Path]:
    from strata_rs.testing.models import make_model

    def make(positions: int) -> Path:
        out = tmp_path_factory.mktemp(f"llama-{positions}")
        return make_model(
            out,
            "llama",
            max_position_embeddings=positions,
            rope_scaling=ROPE,
            **TINY,
        )

    return make


async def test_logits_past_16k_match_the_reference(model: Callable[[int], Path]) -> None:
    n = 16_384 + 256
    path = model(n)
    ids = np.random.default_rng(16).integers(0, 512, n).tolist()
    engine = await Engine.load(path)
    try:
        got = await engine.logits(ids)
    finally:
        await engine.close()
    # Every position, and the ones past 16K on their own (their range, their tolerance).
    assert_match_from(got, reference_logits(path, ids), (0, 16_384))


def assert_match_from(got: np.ndarray, want: np.ndarray, starts: tuple[int, ...]) -> None:
    """From each position of `starts` on: within the tolerance of that part's range, and the
    same argmax everywhere."""
    for lo in starts:
        g, w = got[lo:].astype(np.float64), want[lo:]
        span = float(w.max() - w.min())
        worst = float(np.abs(g - w).max())
        assert worst <= F32_REL_TOL * span, f"from {lo}: max diff {worst:.2e} of range {span:.2f}"
        assert (g.argmax(axis=-1) == w.argmax(axis=-1)).all()


@pytest.mark.parametrize(
    "rope_scaling",
    [
        # Qwen2.5's form: the original context named, the default betas and attention factor.
        {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 1024},
        # Every field given (the original context is then the config's 1,024).
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "beta_fast": 16,
            "beta_slow": 2,
            "attention_factor": 1.3,
            "truncate": False,
        },
    ],
)
async def test_yarn_logits_past_the_original_context_match_the_reference(
    tmp_path: Path, rope_scaling: dict[str, Any]
) -> None:
    from strata_rs.testing.models import make_model

    path = make_model(
        tmp_path,
        "qwen2",
        max_position_embeddings=1024,
        rope_scaling=rope_scaling,
        **TINY,
    )
    n = 4096
    ids = np.random.default_rng(17).integers(0, 512, n).tolist()
    engine = await Engine.load(path)
    try:
        # YaRN stretches the original context by its factor: that is the model's context.
        assert engine.info["max_context"] == 1024 * int(rope_scaling["factor"])
        got = await engine.logits(ids)
    finally:
        await engine.close()
    assert_match_from(got, reference_logits(path, ids), (0, 1024))


async def answer(engine: Engine, prompt: list[int]) -> Any:
    return await engine.complete(prompt, max_tokens=GEN, temperature=0, ignore_eos=True)


async def cold_argmax(path: Path, ids: list[int]) -> np.ndarray:
    """A cold engine's greedy prediction after each position of `ids` (no cache below the
    device): one prefill checks every answer that `ids` contains, teacher-forced."""
    engine = await Engine.load(path, host_cache_mib=0, disk_cache_mib=0)
    try:
        return (await engine.logits(ids)).argmax(axis=-1)
    finally:
        await engine.close()


async def test_a_32k_history_returns_from_host_and_from_disk_exactly(
    model: Callable[[int], Path], tmp_path: Path
) -> None:
    path = model(40_000)
    rng = np.random.default_rng(32)
    history = rng.integers(3, 512, 32_768).tolist()
    other = rng.integers(3, 512, 12_000).tolist()
    # The device holds about one long conversation: the other one pushes this one's blocks
    # down to the host tier (and, on close, to disk).
    opts: dict[str, Any] = {
        "max_context": 40_000,
        "kv_memory_mib": 5,
        "host_cache_mib": 64,
        "disk_cache_dir": tmp_path / "kv",
    }
    engine = await Engine.load(path, **opts)
    try:
        first = await answer(engine, history)
        history += first.token_ids
        await answer(engine, other)
        prompt = history + rng.integers(3, 512, 40).tolist()
        back = await answer(engine, prompt)
        s = engine.stats()["cache"]
    finally:
        await engine.close()
    # Every full block of the history (its last token has no K/V yet: it is the next input).
    assert back.usage.cached_tokens == (len(history) - 1) // 16 * 16
    assert s["hit_tokens"]["host"] > 0
    host = s["last_restore"]
    assert host["from_host"] > 0 and host["bytes"] > 0 and host["seconds"] > 0
    print(
        f"host: {host['tokens']} tokens restored, {host['bytes'] / 2**20:.1f} MiB in "
        f"{host['seconds'] * 1e3:.1f} ms ({host['bytes'] / host['seconds'] / 1e9:.2f} GB/s)"
    )

    # A restart: the whole history comes back from disk.
    history = prompt + back.token_ids
    prompt = history + rng.integers(3, 512, 40).tolist()
    engine = await Engine.load(path, **opts)
    try:
        again = await answer(engine, prompt)
        s = engine.stats()["cache"]
    finally:
        await engine.close()
    assert again.usage.cached_tokens == (len(history) - 1) // 16 * 16
    assert s["hit_tokens"]["disk"] == again.usage.cached_tokens
    disk = s["last_restore"]
    assert disk["from_disk"] > 0 and disk["seconds"] > 0
    print(
        f"disk: {disk['tokens']} tokens restored, {disk['bytes'] / 2**20:.1f} MiB in "
        f"{disk['seconds'] * 1e3:.1f} ms ({disk['bytes'] / disk['seconds'] / 1e9:.2f} GB/s)"
    )

    # The answers after the host restore and after the disk restore are a cold engine's: the
    # last prompt holds the first answer, so one cold prefill of it and the second answer
    # gives both, teacher-forced.
    ids = prompt + again.token_ids[:-1]
    predicted = await cold_argmax(path, ids)
    first_at = len(history) - len(back.token_ids) - 1
    assert predicted[first_at : first_at + GEN].tolist() == back.token_ids
    assert predicted[len(prompt) - 1 :].tolist() == again.token_ids
