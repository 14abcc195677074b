"""Speculative decoding with a draft model (`speculative=<path>`): outputs are those of decoding
without drafts, in the batch, across preemption and a restore from the host and disk tiers; the
draft model's K/V lives in the target's blocks.

A draft model that is the target itself proposes the target's own greedy picks, so every draft
must be accepted: that holds only if the draft's K/V is exactly the target's at every position it
reads (after prefill chunks, rejected drafts, preemption, prefix hits and tier restores). Any
hole or misplaced row there changes a pick and shows as a rejected draft."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from strata_rs import Engine, InvalidRequest, ModelLoadError
from strata_rs.testing.models import make_model
from test_speculative import FAMILIES, GREEDY, PROMPT, load, outputs

pytestmark = pytest.mark.anyio

MakeModel = Callable[..., Path]


def drafting(draft: Path, **options: Any) -> dict[str, Any]:
    """Engine options that draft with `draft`, 4 tokens a step whatever their cost (these tests
    check the drafted path, which must run)."""
    return {
        "speculative": str(draft),
        "num_speculative_tokens": 4,
        "speculative_adaptive": False,
        **options,
    }


@pytest.mark.parametrize("family", FAMILIES)
async def test_a_draft_model_gives_the_output_of_plain_decoding(
    model_dir: MakeModel, family: str
) -> None:
    model = model_dir(family)
    plain, plain_stats = await outputs(model, [PROMPT], [GREEDY])
    # The target as its own draft: every draft accepted, 4 a step.
    same, same_stats = await outputs(model, [PROMPT], [GREEDY], **drafting(model))
    assert same[0].token_ids == plain[0].token_ids
    assert same_stats["spec_draft_tokens"] == same_stats["spec_accepted_tokens"] == 76
    assert (same[0].usage.draft_tokens, same[0].usage.accepted_draft_tokens) == (76, 76)
    # One prefill step, then 19 steps of 5 tokens (the last token and 4 drafts).
    assert (plain_stats["steps"], same_stats["steps"]) == (96, 20)
    # A one-layer draft of the same family: another model, whose drafts are often rejected.
    small = model_dir(family, num_hidden_layers=1)
    drafted, stats = await outputs(model, [PROMPT], [GREEDY], **drafting(small))
    assert drafted[0].token_ids == plain[0].token_ids
    assert drafted[0].text == plain[0].text
    assert stats["spec_draft_tokens"] > 0
    assert stats["generated_tokens"] == 96


async def test_eight_streams_with_drafts_on_some_equal_their_plain_runs(
    model_dir: MakeModel,
) -> None:
    model = model_dir("qwen3")
    prompts = [[*PROMPT[i:], 20 + i, 21, 22, 20 + i, 21] for i in range(8)]
    params = [{**GREEDY, "speculative": i % 2 == 0} for i in range(8)]
    plain, _ = await outputs(model, prompts, [GREEDY] * 8, max_batch=8)
    small = model_dir("qwen3", num_hidden_layers=1)
    drafted, stats = await outputs(model, prompts, params, max_batch=8, **drafting(small))
    assert [r.token_ids for r in drafted] == [r.token_ids for r in plain]
    assert 0 < stats["spec_accepted_tokens"] <= stats["spec_draft_tokens"]
    same, same_stats = await outputs(model, prompts, params, max_batch=8, **drafting(model))
    assert [r.token_ids for r in same] == [r.token_ids for r in plain]
    assert same_stats["spec_accepted_tokens"] == same_stats["spec_draft_tokens"] > 0


async def test_a_draft_model_across_preemption(model_dir: MakeModel) -> None:
    """A pool too small for four sequences at once: the newest are preempted and recomputed
    (the draft's K/V with them) while others draft; every output is the plain one."""
    model = model_dir("llama")
    prompts = [PROMPT + [30 + i] * 5 for i in range(4)]
    params = [{**GREEDY, "max_tokens": 60}] * 4
    # max_context=128 sizes the pool to 8 blocks of 16 tokens: one sequence's worth.
    small = {"max_batch": 4, "max_context": 128}
    plain, plain_stats = await outputs(model, prompts, params, **small)
    drafted, stats = await outputs(model, prompts, params, **small, **drafting(model))
    assert plain_stats["preemptions"] > 0 and stats["preemptions"] > 0
    assert [r.token_ids for r in drafted] == [r.token_ids for r in plain]
    assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"] > 0


async def test_blocks_after_rejected_drafts_equal_a_run_without_them(
    model_dir: MakeModel,
) -> None:
    model = model_dir("qwen3")
    params = [{**GREEDY, "max_tokens": 61}]
    _, plain = await outputs(model, [PROMPT], params)
    draft = model_dir("qwen3", num_hidden_layers=1)
    _, drafted = await outputs(model, [PROMPT], params, **drafting(draft))
    assert 0 < drafted["spec_accepted_tokens"] < drafted["spec_draft_tokens"]
    for key in ("kv_blocks_used", "kv_blocks_cached", "prefix_hit_tokens"):
        assert drafted[key] == plain[key], key


async def turn_two(engine: Engine, first: Any, prompt: list[int]) -> Any:
    return await engine.complete(prompt + first.token_ids + [12, 13, 5, 6, 7], **GREEDY)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
async def test_the_draft_k_v_travels_with_the_host_tier(model_dir: MakeModel, family: str) -> None:
    """Turn two of a conversation, its history restored from the host tier (the device pool is
    too small to keep it): the output of a cold engine, and every draft of the target as its
    own draft accepted, so the restored blocks carried the draft's K/V too (on Gemma 3 beside
    the window slots' presence byte)."""
    model = model_dir(family)
    first, _ = await outputs(model, [PROMPT], [GREEDY])
    history = PROMPT + first[0].token_ids + [12, 13, 5, 6, 7]
    cold, _ = await outputs(model, [history], [GREEDY])
    options = drafting(model, max_context=256, host_cache_mib=64)
    engine = await load(model, **options)
    try:
        await engine.complete(PROMPT, **GREEDY)
        for i in range(3):
            await engine.complete([40 + i] * 200, max_tokens=1, temperature=0)
        before = engine.stats()
        again = await engine.complete(history, **GREEDY)
        stats = engine.stats()
    finally:
        await engine.close()
    assert stats["cache"]["hit_tokens"]["host"] >= 96
    assert again.token_ids == cold[0].token_ids
    drafts = stats["spec_draft_tokens"] - before["spec_draft_tokens"]
    # Drafts wait where their blocks would evict cached ones (this pool is full of them).
    assert stats["spec_accepted_tokens"] - before["spec_accepted_tokens"] == drafts >= 60


async def test_a_draft_that_stays_rejected_detaches_and_its_conversation_stays_detached(
    model_dir: MakeModel, tmp_path: Path
) -> None:
    """Another random model of the same tokenizer proposes what the target almost never picks:
    the adaptive policy detaches it (its draft model feeds no more tokens, so it costs nothing
    more), and the blocks indexed after that say they hold no draft K/V, also once moved to the
    host tier and back: the returning turn starts detached, feeds the draft nothing, and still
    gives the cold output."""
    model = model_dir("llama")
    stranger = make_model(tmp_path / "stranger", "llama", "tiny", "f32", seed=1)
    plain, _ = await outputs(model, [PROMPT], [GREEDY])
    history = PROMPT + plain[0].token_ids + [12, 13, 5, 6, 7]
    cold, _ = await outputs(model, [history], [GREEDY])
    options = {"max_context": 256, "host_cache_mib": 64}
    engine = await load(model, speculative=str(stranger), num_speculative_tokens=4, **options)
    try:
        first = await engine.complete(PROMPT, **GREEDY)
        one = engine.stats()
        # Other conversations (not drafting) push this one's blocks to the host tier.
        for i in range(3):
            filler = [40 + i] * 200
            await engine.complete(filler, max_tokens=1, temperature=0, speculative=False)
        before = engine.stats()
        again = await engine.complete(history, **GREEDY)
        two = engine.stats()
    finally:
        await engine.close()
    assert first.token_ids == plain[0].token_ids
    assert one["spec_draft_detached"] == 1
    assert one["spec_accepted_tokens"] < one["spec_draft_tokens"] <= 12
    # Kept attached, its catch-up alone would feed every full block: 112 of the 113 tokens.
    assert one["spec_draft_model_tokens"] < 112 - 16
    assert before["spec_draft_model_tokens"] == one["spec_draft_model_tokens"], "opted out"
    assert two["cache"]["hit_tokens"]["host"] >= 96
    assert again.token_ids == cold[0].token_ids
    assert two["spec_draft_detached"] == 2
    assert two["spec_draft_tokens"] == before["spec_draft_tokens"]
    assert two["spec_draft_model_tokens"] == before["spec_draft_model_tokens"]


async def test_a_request_that_opts_out_costs_the_draft_nothing(model_dir: MakeModel) -> None:
    """A request with `speculative=False` feeds the draft model nothing, so its blocks hold no
    draft K/V: its conversation returning with drafts on starts detached (the target as its own
    draft would have had every draft accepted)."""
    from test_server import asgi_client

    model = model_dir("qwen3")
    engine = await load(model, **drafting(model, speculative_adaptive=True))
    try:
        first = await engine.complete(PROMPT, **GREEDY, speculative=False)
        one = engine.stats()
        history = PROMPT + first.token_ids + [12, 13, 5, 6, 7]
        again = await engine.complete(history, **GREEDY)
        two = engine.stats()
        async with asgi_client(engine) as client:
            metrics = (await client.get("/metrics")).text
    finally:
        await engine.close()
    assert "strata:spec_decode_draft_detached_total 1.0" in metrics
    assert "strata:spec_decode_draft_model_tokens_total 0.0" in metrics
    cold, _ = await outputs(model, [history], [GREEDY])
    assert one["spec_draft_model_tokens"] == one["spec_draft_tokens"] == 0
    assert one["spec_draft_detached"] == 0
    assert again.token_ids == cold[0].token_ids
    assert two["prefix_hit_tokens"] >= 96
    assert (two["spec_draft_detached"], two["spec_draft_tokens"]) == (1, 0)
    assert two["spec_draft_model_tokens"] == 0


async def test_the_draft_k_v_survives_a_restart_on_disk(
    model_dir: MakeModel, tmp_path: Path
) -> None:
    """The disk tier written by one engine serves the next one's returning conversation, both
    models' K/V: every draft accepted, and an engine with another draft reads none of it."""
    model = model_dir("llama")
    disk = {"disk_cache_dir": str(tmp_path / "disk"), "disk_cache_mib": 64}
    engine = await Engine.load(model, host_cache_mib=0, **drafting(model), **disk)
    try:
        first = await engine.complete(PROMPT, **GREEDY)
    finally:
        await engine.close()
    history = PROMPT + first.token_ids + [12, 13, 5, 6, 7]
    cold, _ = await outputs(model, [history], [GREEDY])
    engine = await Engine.load(model, host_cache_mib=0, **drafting(model), **disk)
    try:
        again = await engine.complete(history, **GREEDY)
        stats = engine.stats()
    finally:
        await engine.close()
    assert stats["cache"]["hit_tokens"]["disk"] >= 96
    assert again.token_ids == cold[0].token_ids
    assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"] == 76
    other = drafting(model_dir("llama", num_hidden_layers=1))
    engine = await Engine.load(model, host_cache_mib=0, **other, **disk)
    try:
        await engine.complete(history, **GREEDY)
        assert engine.stats()["cache"]["hit_tokens"]["disk"] == 0
    finally:
        await engine.close()


async def test_a_seed_gives_one_stream_with_a_draft_model(model_dir: MakeModel) -> None:
    model = model_dir("qwen3")
    draft = model_dir("qwen3", num_hidden_layers=1)
    params = {"max_tokens": 48, "temperature": 0.8, "seed": 7, "ignore_eos": True}
    plain, _ = await outputs(model, [PROMPT], [params])
    runs = []
    for _ in range(2):
        out, stats = await outputs(model, [PROMPT], [params], **drafting(draft))
        runs.append(out[0].token_ids)
        assert stats["spec_draft_tokens"] > 0
    # The stream of plain decoding (`test_a_seed_gives_one_stream_with_drafts_or_without`).
    assert runs[0] == runs[1] == plain[0].token_ids


async def test_info_shows_the_draft_model(model_dir: MakeModel) -> None:
    model = model_dir("llama")
    engine = await load(model)
    plain_block = engine.info["kv_block_bytes"]
    await engine.close()
    engine = await load(model, speculative=model, num_speculative_tokens=3)
    try:
        assert engine.info["speculative"] == {
            "method": "draft_model",
            "draft_model": str(model),
            "draft_dtype": "f32",
            "draft_num_layers": 2,
            "num_speculative_tokens": 3,
            "adaptive": True,
        }
        # A block holds both models' K/V.
        assert engine.info["kv_block_bytes"] == 2 * plain_block
    finally:
        await engine.close()


async def test_quantize_on_load_applies_to_a_draft_folder(model_dir: MakeModel) -> None:
    model = model_dir("llama", "bf16")
    draft = model_dir("llama", "bf16", num_hidden_layers=1)
    q8 = {"quantize": "q8_0"}
    plain, _ = await outputs(model, [PROMPT], [GREEDY], **q8)
    engine = await load(model, **q8, **drafting(draft))
    try:
        assert engine.info["speculative"]["draft_dtype"] == "q8_0"
        assert engine.info["speculative"]["draft_num_layers"] == 1
        drafted = await engine.complete(PROMPT, **GREEDY)
        assert engine.stats()["spec_draft_tokens"] > 0
    finally:
        await engine.close()
    assert drafted.token_ids == plain[0].token_ids


async def test_a_gguf_cut_to_its_first_layer_drafts_for_it(
    model_dir: MakeModel, tmp_path: Path
) -> None:
    """scripts/truncate_gguf.py keeps the first layers of a GGUF file and everything else: the
    cut file loads with one layer and drafts for the whole one, whose output it leaves as is."""
    gguf = pytest.importorskip("gguf")
    from strata_rs.bench.gguf_export import export_gguf

    sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
    try:
        from truncate_gguf import truncate
    finally:
        sys.path.pop(0)
    target = export_gguf(model_dir("qwen3"), tmp_path / "target.gguf", "f32")
    assert truncate(target, tmp_path / "draft.gguf", 1) == 2
    reader = gguf.GGUFReader(tmp_path / "draft.gguf")
    assert {t.name.split(".")[1] for t in reader.tensors if t.name.startswith("blk.")} == {"0"}
    engine = await load(tmp_path / "draft.gguf")
    assert engine.info["num_layers"] == 1
    await engine.close()
    plain, _ = await outputs(target, [PROMPT], [GREEDY])
    drafted, stats = await outputs(target, [PROMPT], [GREEDY], **drafting(tmp_path / "draft.gguf"))
    assert drafted[0].token_ids == plain[0].token_ids
    assert stats["spec_draft_tokens"] > 0


async def test_a_draft_with_another_tokenizer_is_refused(
    model_dir: MakeModel, tmp_path: Path
) -> None:
    model = model_dir("llama")
    # The same vocabulary with two tokens' ids swapped.
    draft = tmp_path / "swapped"
    shutil.copytree(model, draft)
    tok = json.loads((draft / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = (t for t, i in vocab.items() if i in (300, 301))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (draft / "tokenizer.json").write_text(json.dumps(tok))
    first, second = sorted((a, b), key=lambda t: vocab[t])
    with pytest.raises(InvalidRequest) as e:
        await load(model, speculative=draft)
    assert str(e.value) == (
        f"speculative: the draft model {draft} does not share the target's tokenizer: "
        f"token 300 is {json.dumps(first, ensure_ascii=False)}, "
        f"the target's {json.dumps(second, ensure_ascii=False)}"
    )
    with pytest.raises(ModelLoadError) as missing:
        await load(model, speculative=tmp_path / "absent.gguf")
    assert str(missing.value) == f"{tmp_path / 'absent.gguf'}: not found"
    with pytest.raises(InvalidRequest) as typed:
        await load(model, speculative=5)
    assert str(typed.value) == "speculative: must be a string or a path, got int"
    with pytest.raises(InvalidRequest) as split:
        await load(model, speculative=model, device="cpu:0,1")
    assert str(split.value) == (
        "speculative: a draft model runs on one CPU device (no CUDA, no layer_split)"
    )


async def test_a_windowed_target_keeps_its_window_slots_beside_a_draft(
    model_dir: MakeModel,
) -> None:
    """Gemma 3 (window 8 on its sliding layers) with itself as the draft: the target's sliding
    layers run through window slots while the draft keeps every block, far past the window, in
    prefill chunks of 7; every draft accepted and the plain output."""
    model = model_dir("gemma3", max_position_embeddings=4096)
    params = {**GREEDY, "max_tokens": 120}
    small = {"max_batch_tokens": 7}
    plain, plain_stats = await outputs(model, [PROMPT * 3], [params], **small)
    same, stats = await outputs(model, [PROMPT * 3], [params], **small, **drafting(model))
    assert same[0].token_ids == plain[0].token_ids
    assert stats["kv_window_slots_total"] > 0 and plain_stats["kv_window_slots_total"] > 0
    assert stats["kv_window_slots_passed"] > 0
    assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"] > 0
