"""Speculative decoding with n-gram drafts (`speculative="ngram"`): outputs are those of decoding
without drafts (greedy: token for token; sampled: same seed, same stream on every run), in the
batch, across preemption and a restore from the host tier, and the K/V blocks after rejected
drafts are those of a run without them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from strata_rs import Engine, InvalidRequest

pytestmark = pytest.mark.anyio

MakeModel = Callable[..., Path]
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma3", "qwen3_moe", "mixtral", "phi3"]
NGRAM: dict[str, Any] = {
    "speculative": "ngram",
    "num_speculative_tokens": 4,
    "ngram_min": 1,
    # Drafts whatever their cost: these tests check the drafted path, which must run.
    "speculative_adaptive": False,
}
GREEDY: dict[str, Any] = {"max_tokens": 96, "temperature": 0, "ignore_eos": True}
# Repeats, so that lookup has something to propose from the first step.
PROMPT = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7]
# The tiny phi3 with LongRoPE continues PROMPT without ever repeating itself (10 drafts, none
# accepted; its output still equals plain decoding's): its acceptance test runs it with the
# partial rotation but without the scaling, whose output repeats.
ACCEPTING: dict[str, dict[str, Any]] = {"phi3": {"rope_scaling": None}}


async def load(model: Path, **options: Any) -> Engine:
    options = {"host_cache_mib": 0, "disk_cache_mib": 0, **options}
    return await Engine.load(model, **options)


async def outputs(
    model: Path, prompts: list[list[int]], params: list[dict[str, Any]], **options: Any
) -> tuple[list[Any], dict[str, Any]]:
    """Each prompt's completion (submitted together), and the engine's stats after them."""
    engine = await load(model, **options)
    try:
        results: list[Any] = [None] * len(prompts)

        async def one(i: int) -> None:
            results[i] = await engine.complete(prompts[i], **params[i])

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
        return results, dict(engine.stats())
    finally:
        await engine.close()


@pytest.mark.parametrize("family", FAMILIES)
async def test_greedy_drafts_give_the_output_of_plain_decoding(
    model_dir: MakeModel, family: str
) -> None:
    model = model_dir(family, **ACCEPTING.get(family, {}))
    plain, plain_stats = await outputs(model, [PROMPT], [GREEDY])
    drafted, stats = await outputs(model, [PROMPT], [GREEDY], **NGRAM)
    assert drafted[0].token_ids == plain[0].token_ids
    assert drafted[0].text == plain[0].text
    assert plain_stats["spec_draft_tokens"] == 0
    # The response counts its own drafts (the engine's only request here).
    assert drafted[0].usage.draft_tokens == stats["spec_draft_tokens"]
    assert drafted[0].usage.accepted_draft_tokens == stats["spec_accepted_tokens"]
    assert plain[0].usage.draft_tokens == 0
    # The path under test ran: drafts were proposed, some accepted, and steps were saved.
    assert stats["spec_draft_tokens"] > 0
    assert 0 < stats["spec_accepted_tokens"] <= stats["spec_draft_tokens"]
    assert stats["generated_tokens"] == plain_stats["generated_tokens"] == 96
    assert stats["steps"] < plain_stats["steps"]
    h = stats["spec_accepted_per_step"]
    assert h["count"] == sum(h["counts"]) and h["sum"] == stats["spec_accepted_tokens"]


async def test_eight_streams_with_drafts_on_some_equal_their_plain_runs(
    model_dir: MakeModel,
) -> None:
    model = model_dir("llama")
    prompts = [[*PROMPT[i:], 20 + i, 21, 22, 20 + i, 21] for i in range(8)]
    params = [{**GREEDY, "speculative": i % 2 == 0} for i in range(8)]
    plain, _ = await outputs(model, prompts, [GREEDY] * 8, max_batch=8)
    drafted, stats = await outputs(model, prompts, params, max_batch=8, **NGRAM)
    assert [r.token_ids for r in drafted] == [r.token_ids for r in plain]
    assert stats["spec_accepted_tokens"] > 0


async def test_drafts_across_preemption(model_dir: MakeModel) -> None:
    """A pool too small for four sequences at once: the newest are preempted and recomputed
    while others draft; every output is the plain one."""
    model = model_dir("llama")
    prompts = [PROMPT + [30 + i] * 5 for i in range(4)]
    params = [{**GREEDY, "max_tokens": 60}] * 4
    # max_context=128 sizes the pool to 8 blocks of 16 tokens: one sequence's worth.
    small = {"max_batch": 4, "max_context": 128}
    plain, plain_stats = await outputs(model, prompts, params, **small)
    drafted, stats = await outputs(model, prompts, params, **small, **NGRAM)
    assert plain_stats["preemptions"] > 0 and stats["preemptions"] > 0
    assert [r.token_ids for r in drafted] == [r.token_ids for r in plain]
    assert stats["spec_accepted_tokens"] > 0


async def test_blocks_after_rejected_drafts_equal_a_run_without_them(
    model_dir: MakeModel,
) -> None:
    model = model_dir("llama")
    params = [{**GREEDY, "max_tokens": 61}]
    _, plain = await outputs(model, [PROMPT], params)
    _, drafted = await outputs(model, [PROMPT], params, **NGRAM)
    assert drafted["spec_accepted_tokens"] < drafted["spec_draft_tokens"], "nothing rejected"
    for key in ("kv_blocks_used", "kv_blocks_cached", "prefix_hit_tokens"):
        assert drafted[key] == plain[key], key


async def test_a_conversation_restored_from_the_host_tier_drafts_exactly(
    model_dir: MakeModel,
) -> None:
    """Turn two of a conversation, its history restored from the host tier (the device pool is
    too small to keep it), decodes with drafts to the output of a cold engine without them."""
    model = model_dir("llama")
    first = await outputs(model, [PROMPT], [GREEDY])
    turn_two = PROMPT + first[0][0].token_ids + [12, 13, 5, 6, 7]
    cold, _ = await outputs(model, [turn_two], [GREEDY])
    # 16 blocks of 16 tokens: other prompts push the conversation's blocks off the device.
    engine = await Engine.load(model, max_context=256, host_cache_mib=64, disk_cache_mib=0, **NGRAM)
    try:
        await engine.complete(PROMPT, **GREEDY)
        for i in range(3):
            await engine.complete([40 + i] * 200, max_tokens=1, temperature=0)
        again = await engine.complete(turn_two, **GREEDY)
        stats = engine.stats()
    finally:
        await engine.close()
    assert stats["cache"]["hit_tokens"]["host"] >= 96
    assert again.token_ids == cold[0].token_ids
    assert stats["spec_accepted_tokens"] > 0


async def test_stop_strings_logprobs_and_n_with_drafts(model_dir: MakeModel) -> None:
    model = model_dir("llama")
    plain_run, _ = await outputs(model, [PROMPT], [GREEDY])
    text = plain_run[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params = {**GREEDY, "logprobs": 2, "stop": [stop], "n": 2}
    plain, _ = await outputs(model, [PROMPT], [params])
    drafted, stats = await outputs(model, [PROMPT], [params], **NGRAM)
    assert stats["spec_accepted_tokens"] > 0
    assert [c.token_ids for c in drafted[0].choices] == [c.token_ids for c in plain[0].choices]
    assert [c.text for c in drafted[0].choices] == [c.text for c in plain[0].choices]
    assert [c.finish_reason for c in drafted[0].choices] == ["stop", "stop"]
    # Each row is computed as in plain decoding (batch invariance): the same log-probabilities.
    assert [c.logprobs for c in drafted[0].choices] == [c.logprobs for c in plain[0].choices]


@pytest.mark.parametrize("family", FAMILIES)
async def test_a_verified_row_has_the_logprobs_of_a_decode_row(
    model_dir: MakeModel, family: str
) -> None:
    """One sequence: plain decoding computes each token alone in its step (a mixture of experts
    takes its single-row path), drafting computes it among the drafts' rows (the gathered
    path); batch invariance makes their log-probabilities equal to the bit."""
    model = model_dir(family)
    params = {**GREEDY, "logprobs": 3}
    plain, _ = await outputs(model, [PROMPT], [params])
    drafted, stats = await outputs(model, [PROMPT], [params], **NGRAM)
    assert stats["spec_draft_tokens"] > 0
    assert drafted[0].token_ids == plain[0].token_ids
    assert drafted[0].logprobs == plain[0].logprobs


async def test_structured_output_with_drafts(model_dir: MakeModel) -> None:
    model = model_dir("llama")
    schema = {"type": "array", "items": {"type": "integer"}, "maxItems": 6}
    params = {
        "max_tokens": 80,
        "temperature": 0,
        "structured_outputs": {"json": schema},
    }
    prompts = [PROMPT]
    plain, _ = await outputs(model, prompts, [params])
    drafted, _ = await outputs(model, prompts, [params], **NGRAM)
    assert drafted[0].token_ids == plain[0].token_ids
    assert drafted[0].text == plain[0].text


async def test_a_seed_gives_one_stream_with_drafts_or_without(model_dir: MakeModel) -> None:
    """Sampled: each step draws once, and a draft is accepted when it is the token drawn, so
    the stream of a seed is plain decoding's whatever was drafted (also with the adaptive
    policy, whose draft lengths follow the machine's measured step times)."""
    model = model_dir("llama")
    params = {"max_tokens": 48, "temperature": 0.7, "seed": 11, "ignore_eos": True}
    plain, _ = await outputs(model, [PROMPT], [params])
    a, stats = await outputs(model, [PROMPT], [params], **NGRAM)
    b, _ = await outputs(model, [PROMPT], [params], **NGRAM)
    adaptive_options = {**NGRAM, "speculative_adaptive": True}
    adaptive, _ = await outputs(model, [PROMPT], [params], **adaptive_options)
    assert a[0].token_ids == b[0].token_ids == plain[0].token_ids == adaptive[0].token_ids
    assert len(a[0].token_ids) == 48
    # The tiny model's flat distributions rarely draw what the lookup proposes; the real
    # model's test below has drafts both accepted and rejected.
    assert stats["spec_draft_tokens"] > 0


async def test_info_shows_the_settings(model_dir: MakeModel) -> None:
    engine = await load(model_dir("llama"), **NGRAM)
    try:
        assert engine.info["speculative"] == {
            "method": "ngram",
            "num_speculative_tokens": 4,
            "ngram_min": 1,
            "ngram_max": 4,
            "adaptive": False,
        }
    finally:
        await engine.close()
    engine = await load(model_dir("llama"))
    try:
        assert engine.info["speculative"] is None
    finally:
        await engine.close()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"speculative": ""},
            'speculative: must be "ngram" (drafts by prompt lookup) or a draft model\'s path, '
            'got ""',
        ),
        (
            {"speculative": "ngram", "num_speculative_tokens": 0},
            "num_speculative_tokens: must be between 1 and 16, got 0",
        ),
        ({"speculative": "ngram", "ngram_min": 0}, "ngram_min: must be at least 1"),
        (
            {"speculative": "ngram", "ngram_min": 3, "ngram_max": 2},
            "ngram_max: must be at least ngram_min (3), got 2",
        ),
    ],
)
async def test_bad_settings_are_refused(
    model_dir: MakeModel, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidRequest) as e:
        await load(model_dir("llama"), **options)
    assert str(e.value) == message


COPY_CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
COPY_MESSAGES = [{"role": "user", "content": f"Copy this code exactly:\n\n{COPY_CODE}"}]


async def copy_answers(
    model: Path, params: dict[str, Any], configs: list[dict[str, Any]]
) -> list[tuple[Any, dict[str, Any]]]:
    """SmolLM2 asked to copy code from its prompt (where drafts are accepted), once per engine
    configuration: each answer with its engine's stats."""
    answers = []
    for options in configs:
        engine = await load(model, **options)
        try:
            answers.append((await engine.chat_complete(COPY_MESSAGES, **params), engine.stats()))
        finally:
            await engine.close()
    return answers


async def test_the_real_model_drafts_to_its_plain_answer(smollm2: Path) -> None:
    """The same greedy answer with drafts forced, with the adaptive default, and without."""
    params = {"max_tokens": 64, "temperature": 0}
    configs = [{}, NGRAM, {"speculative": "ngram"}]
    (plain, _), (forced, stats), (adaptive, _) = await copy_answers(smollm2, params, configs)
    assert stats["spec_accepted_tokens"] > 0
    assert plain.token_ids == forced.token_ids == adaptive.token_ids
    assert "return a + b" in plain.text


async def test_the_real_model_samples_its_plain_stream_with_drafts(smollm2: Path) -> None:
    """Sampling (temperature 0.8, one seed): n-gram drafts and the target as its own draft (its
    greedy picks) are accepted where the draw is the draft and rejected elsewhere, and the
    answer is token for token the one without drafts."""
    params = {"max_tokens": 64, "temperature": 0.8, "seed": 5}
    configs = [{}, NGRAM, {**NGRAM, "speculative": str(smollm2)}]
    (plain, _), *drafted = await copy_answers(smollm2, params, configs)
    for answer, stats in drafted:
        assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
        assert answer.token_ids == plain.token_ids


async def test_the_server_counts_drafts_and_takes_the_per_request_switch(
    model_dir: MakeModel,
) -> None:
    from test_server import asgi_client

    engine = await load(model_dir("llama"), **NGRAM)
    body = {"model": "tiny", "prompt": PROMPT, **GREEDY}
    async with asgi_client(engine) as client:
        off = await client.post("/v1/completions", json={**body, "speculative": False})
        assert off.status_code == 200, off.text
        assert engine.stats()["spec_draft_tokens"] == 0
        on = await client.post("/v1/completions", json=body)
        assert on.status_code == 200, on.text
        assert on.json()["choices"][0]["text"] == off.json()["choices"][0]["text"]
        s = engine.stats()
        assert s["spec_accepted_tokens"] > 0
        # The request's drafts, as OpenAI counts predicted tokens; none for the opted-out one.
        assert on.json()["usage"]["completion_tokens_details"] == {
            "accepted_prediction_tokens": s["spec_accepted_tokens"],
            "rejected_prediction_tokens": s["spec_draft_tokens"] - s["spec_accepted_tokens"],
        }
        assert "completion_tokens_details" not in off.json()["usage"]
        metrics = (await client.get("/metrics")).text
        bad = await client.post("/v1/completions", json={**body, "speculative": "yes"})
    await engine.close()
    assert f"strata:spec_decode_draft_tokens_total {float(s['spec_draft_tokens'])}" in metrics
    assert f"strata:spec_decode_accepted_tokens_total {float(s['spec_accepted_tokens'])}" in metrics
    h = s["spec_accepted_per_step"]
    assert f"strata:spec_decode_accepted_per_step_count {float(h['count'])}" in metrics
    assert bad.status_code == 400
    assert bad.json()["error"]["message"] == "speculative: must be a bool, got str"
