"""Structured output (`structured_outputs`, compiled by llguidance): the output follows the
grammar whatever the model, the free requests beside it are unchanged, and a bad grammar is
refused before it queues, naming the field.

A random-weight model is the hard case for a grammar: it never chooses the grammar's tokens by
itself, so every valid output below is the mask's doing. The JSON-schema cases use the real
SmolLM2 (the demo model), which writes short values; a random model would fill an unbounded
string until max_tokens.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import strata_rs
from strata_rs import InvalidRequest

pytestmark = pytest.mark.anyio

jsonschema = pytest.importorskip("jsonschema")


@pytest.fixture(scope="module")
def tiny(model_dir: Callable[..., Path]) -> Path:
    return model_dir("llama")


async def test_choice_and_regex_on_a_random_model(tiny: Path) -> None:
    engine = await strata_rs.Engine.load(tiny)
    try:
        # Multi-byte characters too: a grammar then forces bytes that end inside a character.
        choices = ["yes", "no", "maybe not", 'a "quoted" (one)', "ࠀ", "ab中", "😀", "é"]
        for seed in range(12):
            out = await engine.complete(
                "Is it?", max_tokens=30, temperature=1.0, seed=seed,
                structured_outputs={"choice": choices},
            )  # fmt: skip
            assert out.text in choices, out.text
            assert out.finish_reason == "stop"
        pattern = r"[0-9]{3}-[a-z]{2}(!|\?)"
        out = await engine.complete(
            "Code:", max_tokens=30, temperature=1.0, seed=1, n=4,
            structured_outputs={"regex": pattern},
        )  # fmt: skip
        for choice in out.choices:
            assert re.fullmatch(pattern, choice.text), choice.text
            assert choice.finish_reason == "stop"
        # Unconstrained, the same model does not write any of these.
        free = await engine.complete("Is it?", max_tokens=8, temperature=1.0, seed=0)
        assert free.text not in choices and not re.fullmatch(pattern, free.text)
    finally:
        await engine.close()


async def test_a_lark_grammar_on_a_random_model(tiny: Path) -> None:
    engine = await strata_rs.Engine.load(tiny)
    try:
        grammar = 'start: "(" item ("," item)* ")"\nitem: /[a-c]/ | /[0-9]{1,2}/'
        for seed in range(4):
            out = await engine.complete(
                "List:", max_tokens=40, temperature=1.0, seed=seed,
                structured_outputs={"grammar": grammar},
            )  # fmt: skip
            if out.finish_reason == "stop":
                assert re.fullmatch(r"\((?:[a-c]|[0-9]{1,2})(?:,(?:[a-c]|[0-9]{1,2}))*\)", out.text)
            else:  # cut by max_tokens: still a prefix of the language
                assert out.finish_reason == "length"
                assert re.fullmatch(r"\((?:(?:[a-c]|[0-9]{1,2}),)*(?:[a-c]|[0-9]{1,2})?", out.text)
    finally:
        await engine.close()


async def test_free_requests_beside_constrained_ones_are_unchanged(tiny: Path) -> None:
    """The mask touches only its own row: free requests batched with constrained ones give the
    tokens they give alone."""
    import asyncio

    engine = await strata_rs.Engine.load(tiny, max_batch=8)
    try:
        prompts = [f"Free prompt number {i}" for i in range(4)]
        alone = [
            (await engine.complete(p, max_tokens=16, temperature=0, ignore_eos=True)).token_ids
            for p in prompts
        ]

        async def free(p: str) -> list[int]:
            return (
                await engine.complete(p, max_tokens=16, temperature=0, ignore_eos=True)
            ).token_ids

        async def constrained(i: int) -> str:
            out = await engine.complete(
                f"Pick {i}", max_tokens=16, temperature=0.8, seed=i,
                structured_outputs={"regex": "[a-z]{4,6}"},
            )  # fmt: skip
            return out.text

        results = await asyncio.gather(
            *(x for i, p in enumerate(prompts) for x in (free(p), constrained(i)))
        )
        assert [results[2 * i] for i in range(4)] == alone
        for i in range(4):
            assert re.fullmatch("[a-z]{4,6}", results[2 * i + 1])
    finally:
        await engine.close()


# Any JSON object lets a small model nest without end on some prompts ("Describe Lisbon as
# JSON." does); this one it answers in a line.
CAPITAL = [
    {
        "role": "user",
        "content": 'What is the capital of France? Answer in JSON with the key "answer".',
    }
]
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "country": {"type": "string", "maxLength": 40},
        "population_millions": {"type": "number"},
        "coastal": {"type": "boolean"},
    },
    "required": ["city", "country", "population_millions", "coastal"],
    "additionalProperties": False,
}


async def test_json_schema_on_smollm2(smollm2: Path) -> None:
    engine = await strata_rs.Engine.load(str(smollm2), max_context=1024)
    try:
        messages = [{"role": "user", "content": "Describe Lisbon as JSON."}]
        out = await engine.chat_complete(
            messages, max_tokens=120, temperature=0, structured_outputs={"json": CITY}
        )
        assert out.finish_reason == "stop", out.text
        value = json.loads(out.text)
        jsonschema.validate(value, CITY)
        # The schema as JSON text, and any JSON object.
        text = await engine.chat_complete(
            messages, max_tokens=120, temperature=0, structured_outputs={"json": json.dumps(CITY)}
        )
        assert text.text == out.text
        obj = await engine.chat_complete(
            CAPITAL, max_tokens=120, temperature=0, structured_outputs={"json_object": True}
        )
        assert obj.finish_reason == "stop", obj.text
        assert json.loads(obj.text)["answer"] == "Paris"
    finally:
        await engine.close()


KINDS = "json, json_object, regex, choice or grammar"
SO = "structured_outputs"
BAD: list[tuple[Any, str]] = [
    ("x", f"{SO}: must be an object with one of {KINDS}"),
    ({}, f"{SO}: must set one of {KINDS}"),
    ({"regex": "a", "choice": ["b"]}, f"{SO}: must set only one of {KINDS}, got regex, choice"),
    ({"json": None, "xml": "<a/>"}, f"{SO}.xml: unknown; set one of {KINDS}"),
    (
        {"json": "{not json"},
        f"{SO}.json: is not valid JSON: key must be a string at line 1 column 2",
    ),
    ({"json": 3}, f"{SO}.json: must be a JSON schema: an object, a bool, or its JSON text"),
    ({"json_object": False}, f"{SO}.json_object: must be true"),
    ({"regex": 5}, f"{SO}.regex: must be a string"),
    ({"choice": ["a", 1]}, f"{SO}.choice: must be a list of strings"),
    ({"choice": []}, f"{SO}.choice: must not be empty"),
]


async def test_bad_structured_outputs_are_refused(tiny: Path) -> None:
    for value, message in BAD:
        with pytest.raises(InvalidRequest) as e:
            strata_rs.SamplingParams(structured_outputs=value)
        assert str(e.value) == message
    engine = await strata_rs.Engine.load(tiny)
    try:
        # Grammars llguidance cannot compile: the field and its reason, before anything queues.
        for value, field in [
            ({"regex": "(unclosed"}, "structured_outputs.regex"),
            ({"json": {"type": "no-such-type"}}, "structured_outputs.json"),
            ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar"),
        ]:
            with pytest.raises(InvalidRequest, match=rf"^{re.escape(field)}: cannot compile: .+"):
                engine.generate("x", structured_outputs=value)
        assert engine.stats()["waiting"] == 0 and engine.stats()["running"] == 0
    finally:
        await engine.close()


# -- through the server: response_format with the real openai client -----------------------------


def test_openai_parse_with_a_pydantic_model(smollm2_server: Any) -> None:
    import openai
    import pydantic

    class City(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=40)
        country: str = pydantic.Field(max_length=40)
        coastal: bool

    client = openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="unused")
    messages: Any = [{"role": "user", "content": "Describe Lisbon as JSON."}]
    done = client.chat.completions.parse(
        model="SmolLM2-135M-Instruct.Q4_1",
        messages=messages,
        response_format=City,
        max_tokens=120,
        temperature=0,
    )
    choice = done.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)
    jsonschema.validate(json.loads(choice.message.content or ""), City.model_json_schema())

    # json_object, streamed: the chunks join into one JSON object.
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1",
        messages=CAPITAL,  # type: ignore[arg-type]
        response_format={"type": "json_object"},
        max_tokens=120,
        temperature=0,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert json.loads(text)["answer"] == "Paris"

    # A schema llguidance cannot compile: 400 naming the field the client used.
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="SmolLM2-135M-Instruct.Q4_1",
            messages=messages,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "no-such-type"}},
            },
        )
    body: Any = e.value.body
    assert body["param"] == "response_format.json_schema.schema"
    assert body["message"].startswith("response_format.json_schema.schema: cannot compile: ")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="SmolLM2-135M-Instruct.Q4_1",
            messages=messages,
            response_format={"type": "yaml"},  # type: ignore[arg-type]
        )
    body = e.value.body
    assert body["message"] == (
        "response_format.type: must be text, json_object or json_schema, got 'yaml'"
    )

    # logit_bias, OpenAI's shape (string keys): token 28 forced at every step.
    forced = client.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", prompt="Hi", max_tokens=3, logit_bias={"28": 100}
    )
    import httpx

    expected = httpx.post(smollm2_server.url + "/detokenize", json={"tokens": [28, 28, 28]})
    assert forced.choices[0].text == expected.json()["prompt"]


# -- logit_bias, and logprobs under a grammar ------------------------------------------------------


async def test_logit_bias_bans_and_forces_tokens(tiny: Path) -> None:
    import numpy as np

    engine = await strata_rs.Engine.load(tiny)
    try:
        prompt = [5, 17, 99, 3]
        free = await engine.complete(prompt, max_tokens=6, temperature=0, ignore_eos=True)
        first = free.token_ids[0]
        # Banned, the greedy pick is the runner-up of the raw logits.
        logits = (await engine.logits(prompt))[-1]
        runner_up = int(np.argsort(-logits, kind="stable")[1])
        banned = await engine.complete(
            prompt, max_tokens=1, temperature=0, logit_bias={first: -100}
        )
        assert banned.token_ids == [runner_up]
        # Forced (ids as JSON's string keys too), at any temperature.
        for seed in range(4):
            forced = await engine.complete(
                prompt, max_tokens=3, temperature=1.0, seed=seed, ignore_eos=True,
                logit_bias={"42": 100},
            )  # fmt: skip
            assert forced.token_ids == [42, 42, 42]
        with pytest.raises(
            InvalidRequest, match=r"^logit_bias\[7\]: must be a number in \[-100, 100\], got 101$"
        ):
            await engine.complete(prompt, max_tokens=1, logit_bias={7: 101})
        with pytest.raises(InvalidRequest, match=r"^logit_bias: keys must be token ids, got x$"):
            strata_rs.SamplingParams(logit_bias={"x": 1})
        vocab = engine.info["vocab_size"]
        with pytest.raises(
            InvalidRequest, match=rf"^logit_bias\[{vocab}\]: token id {vocab} is outside"
        ):
            await engine.complete(prompt, max_tokens=1, logit_bias={vocab: 1})
    finally:
        await engine.close()


async def test_logprobs_under_a_grammar_are_the_raw_models(tiny: Path) -> None:
    """A constrained token's logprob is the raw logits' log-softmax, not renormalized over the
    grammar's allowed tokens (as vLLM reports by default)."""
    import numpy as np

    engine = await strata_rs.Engine.load(tiny)
    try:
        prompt = [5, 17, 99, 3]
        out = await engine.complete(
            prompt, max_tokens=1, temperature=0, logprobs=2,
            structured_outputs={"choice": ["zebra"]},
        )  # fmt: skip
        logits = (await engine.logits(prompt))[-1].astype(np.float64)
        log_softmax = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
        (entry,) = out.logprobs or []
        assert entry["token_id"] == out.token_ids[0]
        assert abs(entry["logprob"] - log_softmax[entry["token_id"]]) < 1e-5
        # The top alternatives are the raw model's, whatever the grammar allowed.
        top = np.argsort(-logits, kind="stable")[:2]
        assert [t["token_id"] for t in entry["top_logprobs"]] == [int(t) for t in top]
    finally:
        await engine.close()
