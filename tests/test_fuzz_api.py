"""Property tests of the Python API (hypothesis): SamplingParams, Engine.generate / complete and
Engine.chat with arbitrary arguments either succeed with a valid result or raise the documented
exception (InvalidRequest, or its ContextOverflow) whose message starts with the name of a bad
argument. Never a panic, a SystemError, another exception class or a hang, and the engine keeps
serving: each test ends by comparing a greedy request with the reference taken at the start.

Each value the strategies draw is tagged: known good (within the documented range) or maybe bad.
A call whose values are all known good must succeed; a call that fails must name an argument
whose value was maybe bad. So the tests fail on a wrong refusal as well as on a wrong exception.

How examples are driven: the tests are plain functions and each hypothesis example runs its
coroutine with `asyncio.run`, under `asyncio.wait_for` (a hang fails the example instead of
hanging pytest). The one engine per module is loaded by a sync fixture the same way. An Engine is
not bound to the loop it was loaded in (its work runs on its own thread; each awaitable binds to
the loop that awaits it), so short-lived loops share it. This relies on nothing about how an
async pytest plugin re-enters its loop per hypothesis example.
"""

from __future__ import annotations

import math
import string
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fuzzing import no_panic, run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strata_rs import (
    Completion,
    ContextOverflow,
    Engine,
    InvalidRequest,
    SamplingParams,
    StreamChunk,
)

MakeModel = Callable[..., Path]

CONTEXT = 64
REFERENCE_PROMPT = [5, 17, 99, 3]

FUZZ = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# ---------------------------------------------------------------------------------------------
# Tagged values: (value, good). good=True: within the documented range, so the call must accept
# it. good=False: maybe bad (junk, edges, out of range): the call may refuse it, naming it.
# ---------------------------------------------------------------------------------------------

Tagged = tuple[Any, bool]


SURROGATES = st.sampled_from(["\ud800", "a\udfffb", "\udc80x"])
EDGE_INTS = st.sampled_from(
    [0, 1, -1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, 10**400]
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    EDGE_INTS,
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, 1e300, -1e300, 5e-324, 3.5e38, -0.0]),
    st.text(max_size=12),
    SURROGATES,
    st.binary(max_size=6),
    st.sampled_from([np.int64(3), np.float32(0.5), np.bool_(True), object(), SamplingParams()]),
)
# Nested junk: lists, tuples, dicts (any keys), sets of scalars.
JUNK = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.tuples(inner, inner),
        st.dictionaries(st.one_of(st.text(max_size=6), st.integers()), inner, max_size=3),
        st.frozensets(st.integers(), max_size=3),
    ),
    max_leaves=10,
)
TEXT = st.text(max_size=40)  # hypothesis' text() excludes surrogates by default


def numbers(lo: float, hi: float) -> st.SearchStrategy[Any]:
    return st.one_of(st.floats(lo, hi, allow_nan=False), st.integers(math.ceil(lo), math.floor(hi)))


# Per field: values within the documented range (the engine tests keep n and max_tokens small
# so that an example stays fast), and maybe-bad ones (junk, edges, out of range).
SAMPLING_FIELDS: dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]] = {
    "max_tokens": (st.none() | st.integers(1, 8), st.integers(-3, 80) | EDGE_INTS | JUNK),
    "temperature": (numbers(0, 100), SCALARS | JUNK),
    "top_k": (st.none() | st.integers(0, 2**40), EDGE_INTS | JUNK),
    # Above 2**-150, which a 32-bit float rounds to 0.
    "top_p": (st.floats(2**-149, 1) | st.just(1), SCALARS | JUNK),
    "min_p": (numbers(0, 1), SCALARS | JUNK),
    "repetition_penalty": (st.floats(1e-3, 100) | st.integers(1, 100), SCALARS | JUNK),
    "presence_penalty": (numbers(-2, 2), SCALARS | JUNK),
    "frequency_penalty": (numbers(-2, 2), SCALARS | JUNK),
    # Any int up to 128 bits is a seed (folded into 64 bits).
    "seed": (st.none() | st.integers(-(2**100), 2**100), JUNK),
    "stop": (
        st.none()
        | st.text(min_size=1, max_size=8)
        | st.lists(st.text(min_size=1, max_size=8), max_size=3),
        st.lists(SURROGATES | st.just("") | JUNK, min_size=1, max_size=3) | JUNK,
    ),
    "stop_token_ids": (
        st.none() | st.lists(st.integers(0, 511), max_size=3),
        st.lists(st.integers(-5, 2**33) | EDGE_INTS | JUNK, min_size=1, max_size=3) | JUNK,
    ),
    "ignore_eos": (st.booleans(), JUNK),
    "logprobs": (st.none() | st.booleans() | st.integers(0, 20), EDGE_INTS | JUNK),
    "n": (st.integers(1, 3), st.integers(-2, 70) | EDGE_INTS | JUNK),
    "skip_special_tokens": (st.booleans(), JUNK),
    # Grammars that compile and that any output can follow to its end within the context.
    "structured_outputs": (
        st.none()
        | st.fixed_dictionaries(
            {"choice": st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=3)}
        )
        | st.sampled_from([{"regex": "[a-z]{1,4}"}, {"json": {"enum": [1, "a", None]}}]),
        JUNK
        | st.dictionaries(st.text(max_size=12), st.text(max_size=12) | JUNK, max_size=3)
        | st.fixed_dictionaries({"regex": st.text(max_size=12)})
        | st.fixed_dictionaries({"grammar": st.text(max_size=24)})
        | st.fixed_dictionaries({"json": st.text(max_size=24) | JUNK}),
    ),
}
# Keyword names no call takes (a real parameter name as a keyword is a Python TypeError).
RESERVED = {"prompt", "messages", "params", "add_generation_prompt", "chat_template_kwargs"}
UNKNOWN_NAMES = st.text(min_size=1, max_size=12).filter(
    lambda k: k not in SAMPLING_FIELDS and k not in RESERVED
)


@st.composite
def badness(draw: st.DrawFn, slots: list[str]) -> set[str]:
    """Which of the call's arguments get maybe-bad values: none (the call must succeed), one
    (a refusal must name it), or each at random."""
    mode = draw(st.sampled_from(["none", "none", "one", "one", "any"]))
    if mode == "none" or not slots:
        return set()
    if mode == "one":
        return {draw(st.sampled_from(slots))}
    return {slot for slot in slots if draw(st.booleans())}


@st.composite
def tagged_kwargs(
    draw: st.DrawFn,
    fields: dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]],
    bad: set[str],
) -> dict[str, Tagged]:
    kwargs: dict[str, Tagged] = {}
    for name in sorted(fields):
        if name in bad:
            kwargs[name] = (draw(fields[name][1]), False)
        elif draw(st.integers(0, 2)) == 0:
            kwargs[name] = (draw(fields[name][0]), True)
    if "unknown" in bad:
        kwargs[draw(UNKNOWN_NAMES)] = (draw(JUNK), False)
    return kwargs


@st.composite
def sampling_kwargs(draw: st.DrawFn) -> dict[str, Tagged]:
    bad = draw(badness([*SAMPLING_FIELDS, "unknown"]))
    return draw(tagged_kwargs(SAMPLING_FIELDS, bad))


def values(tagged: dict[str, Tagged]) -> dict[str, Any]:
    return {k: v for k, (v, _) in tagged.items()}


def suspects(tagged: dict[str, Tagged]) -> set[str]:
    return {k for k, (_, ok) in tagged.items() if not ok}


def assert_names_a_suspect(e: Exception, allowed: set[str]) -> None:
    """A refusal: exactly InvalidRequest or ContextOverflow, never a panic, SystemError,
    TypeError, ...; its message starts with the name of an argument that was maybe bad (or a
    path inside it: messages[0].role)."""
    assert type(e) in (InvalidRequest, ContextOverflow), f"{type(e).__name__}: {e}"
    message = str(e)
    assert any(message.startswith((f"{a}: ", f"{a}[", f"{a}.")) for a in allowed), (
        f"{message!r} names none of {sorted(allowed)}"
    )


def check_chunks(chunks: list[StreamChunk], n: int, vocab: int) -> None:
    """A finished stream: every choice's chunks in order, each choice ended once, usage last."""
    ids: dict[int, list[int]] = {i: [] for i in range(n)}
    finished: set[int] = set()
    for chunk in chunks:
        assert chunk.index in ids and chunk.index not in finished
        ids[chunk.index] += chunk.token_ids
        if chunk.finish_reason is not None:
            assert chunk.finish_reason in ("stop", "length")
            finished.add(chunk.index)
    assert finished == set(ids)
    usage = chunks[-1].usage
    assert usage is not None
    assert usage.completion_tokens == sum(len(v) for v in ids.values())
    assert all(usage.prompt_tokens + len(v) <= CONTEXT for v in ids.values())
    assert all(0 <= t < vocab for v in ids.values() for t in v)


# ---------------------------------------------------------------------------------------------
# The engine, the reference, and the check that ends every engine test.
# ---------------------------------------------------------------------------------------------


@dataclass
class Served:
    engine: Engine
    vocab: int
    reference: Completion


@pytest.fixture(scope="module")
def served(model_dir: MakeModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    cache = tmp_path_factory.mktemp("fuzz-cache")
    engine = run(
        lambda: Engine.load(
            model_dir("llama"),
            max_context=CONTEXT,
            host_cache_mib=0,
            disk_cache_mib=0,
            disk_cache_dir=cache,
        )
    )
    reference = run(lambda: engine.complete(REFERENCE_PROMPT, max_tokens=8, temperature=0))
    assert len(reference.token_ids) == 8
    yield Served(engine, engine.info["vocab_size"], reference)
    run(engine.close)


def assert_still_serving(s: Served) -> None:
    assert s.engine.stats()["stopped"] is None
    again = run(lambda: s.engine.complete(REFERENCE_PROMPT, max_tokens=8, temperature=0))
    assert again.token_ids == s.reference.token_ids
    assert again.text == s.reference.text


# ---------------------------------------------------------------------------------------------
# SamplingParams
# ---------------------------------------------------------------------------------------------


def test_sampling_params_accept_or_name_the_field() -> None:
    @FUZZ
    @given(sampling_kwargs())
    def example(tagged: dict[str, Tagged]) -> None:
        kwargs = values(tagged)
        try:
            p = no_panic(lambda: SamplingParams(**kwargs))
        except Exception as e:
            assert_names_a_suspect(e, suspects(tagged))
            return
        check_params(p, kwargs)

    example()


def check_params(p: SamplingParams, kwargs: dict[str, Any]) -> None:
    """An accepted SamplingParams holds what was given, within the documented ranges."""
    assert p.max_tokens is None or p.max_tokens >= 1
    assert math.isfinite(p.temperature) and p.temperature >= 0
    assert 0 < p.top_p <= 1 and 0 <= p.min_p <= 1
    assert p.repetition_penalty > 0
    assert -2 <= p.presence_penalty <= 2 and -2 <= p.frequency_penalty <= 2
    assert 1 <= p.n <= 64
    assert p.logprobs is None or 0 <= p.logprobs <= 20
    assert all(isinstance(s, str) and s for s in p.stop)
    assert all(isinstance(t, int) and 0 <= t < 2**32 for t in p.stop_token_ids)
    assert p.seed is None or 0 <= p.seed < 2**64
    for name in ("max_tokens", "top_k", "n", "ignore_eos", "skip_special_tokens"):
        if kwargs.get(name) is not None:
            assert getattr(p, name) == kwargs[name], name
    if kwargs.get("seed") is not None:
        assert p.seed == kwargs["seed"] % 2**64
    if isinstance(kwargs.get("stop"), str):
        assert p.stop == [kwargs["stop"]]


def test_sampling_params_edges() -> None:
    """The cases the fuzzer found, with their exact messages."""
    cases: list[tuple[dict[str, Any], str]] = [
        ({"temperature": 10**400}, "temperature: is out of range (beyond a 64-bit float)"),
        ({"temperature": -(10**400)}, "temperature: is out of range (beyond a 64-bit float)"),
        ({"top_p": 1e300}, "top_p: must be in (0, 1], got 1e300"),
        ({"stop": "\ud800"}, "stop: must be valid Unicode text (it holds a lone surrogate)"),
        (
            {"stop": ["a", "b\udfff"]},
            "stop: must be valid Unicode text (it holds a lone surrogate)",
        ),
        (
            {"stop_token_ids": [True]},
            "stop_token_ids: must be a list of token ids, got a bool in the list",
        ),
        (
            {"stop_token_ids": [2**64]},
            "stop_token_ids: token id 18446744073709551616 is not a valid id",
        ),
        ({"stop_token_ids": [10**400]}, "stop_token_ids: token id beyond 2**127 is not a valid id"),
        ({"\ud800": 1}, "\ufffd\ufffd\ufffd: unknown sampling parameter"),
    ]
    for kwargs, message in cases:
        with pytest.raises(InvalidRequest) as e:
            SamplingParams(**kwargs)
        assert type(e.value) is InvalidRequest
        assert str(e.value) == message, kwargs
    # A positive value that rounds to 0 as an f32 is refused as sent, not as "got 0"; where 0 is
    # in range it is 0.
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(top_p=1e-300)
    assert (
        str(e.value)
        == "top_p: must be more than 2**-150 (a 32-bit float rounds it to 0), got 1e-300"
    )
    assert SamplingParams(top_p=2**-149).top_p > 0
    assert SamplingParams(temperature=1e-300).temperature == 0
    assert SamplingParams(stop_token_ids=(np.int64(7),)).stop_token_ids == [7]


# ---------------------------------------------------------------------------------------------
# generate / complete
# ---------------------------------------------------------------------------------------------


GOOD_PROMPTS = (
    st.integers(1, CONTEXT - 1)
    .flatmap(
        lambda n: st.lists(st.integers(0, 511) | st.sampled_from([0, 511]), min_size=n, max_size=n)
    )
    .flatmap(lambda ids: st.sampled_from([ids, tuple(ids)]))
)
BAD_PROMPTS = st.one_of(
    # Lengths at and past the context, ids at and past the vocabulary edge, non-ids.
    st.sampled_from([0, CONTEXT - 1, CONTEXT, CONTEXT + 1, 10 * CONTEXT]).flatmap(
        lambda n: st.lists(
            st.integers(0, 511)
            | st.sampled_from([511, 512, -1, 2**32, 2**64, True, False, 1.0, "1", None]),
            min_size=n,
            max_size=n,
        )
    ),
    # Text: short (a few tokens), empty, huge, or with a lone surrogate.
    st.text(max_size=10) | st.just("") | st.just("word " * 20_000) | SURROGATES,
    JUNK,
)


@st.composite
def generate_args(draw: st.DrawFn) -> tuple[Tagged, dict[str, Tagged]]:
    """A prompt and sampling keywords; the prompt is good when it is in the vocabulary and
    leaves room in the context."""
    bad = draw(badness(["prompt", *SAMPLING_FIELDS, "unknown"]))
    prompt_ok = "prompt" not in bad
    prompt = draw(GOOD_PROMPTS if prompt_ok else BAD_PROMPTS)
    return (prompt, prompt_ok), draw(tagged_kwargs(SAMPLING_FIELDS, bad))


def check_completion(c: Completion, prompt: Any, kwargs: dict[str, Any], vocab: int) -> None:
    n = kwargs.get("n", 1)
    assert len(c.choices) == n
    assert [ch.index for ch in c.choices] == list(range(n))
    if isinstance(prompt, (list, tuple)):
        assert c.usage.prompt_tokens == len(prompt)
    assert c.usage.completion_tokens == sum(len(ch.token_ids) for ch in c.choices)
    for ch in c.choices:
        assert ch.finish_reason in ("stop", "length")
        assert all(0 <= t < vocab for t in ch.token_ids)
        assert c.usage.prompt_tokens + len(ch.token_ids) <= CONTEXT
        if kwargs.get("max_tokens") is not None:
            assert len(ch.token_ids) <= kwargs["max_tokens"]
        logprobs = kwargs.get("logprobs")
        if logprobs is None or logprobs is False:
            assert ch.logprobs is None
        else:
            assert ch.logprobs is not None and len(ch.logprobs) == len(ch.token_ids)
            for lp in ch.logprobs:
                # logprobs=True: the chosen token's logprob and no alternatives.
                alternatives = 0 if logprobs is True else logprobs
                assert lp["logprob"] <= 0 and len(lp["top_logprobs"]) == alternatives
    assert (c.text, c.token_ids) == (c.choices[0].text, c.choices[0].token_ids)


def generate_call(
    args: tuple[Tagged, dict[str, Tagged]],
) -> tuple[Any, dict[str, Any], set[str]]:
    """The prompt, the keyword arguments, and the names a refusal may name."""
    (value, prompt_ok), tagged = args
    kwargs = values(tagged)
    allowed = suspects(tagged) | ({"prompt"} if not prompt_ok else set())
    # The prompt's length is only known good with max_tokens that fits after it.
    if prompt_ok and kwargs.get("max_tokens") is not None:
        allowed.add("max_tokens")
    return value, kwargs, allowed


def test_complete_accepts_or_names_the_field(served: Served) -> None:
    @FUZZ
    @given(generate_args())
    def example(args: tuple[Tagged, dict[str, Tagged]]) -> None:
        value, kwargs, allowed = generate_call(args)
        try:
            c = run(lambda: served.engine.complete(value, **kwargs))
        except Exception as e:
            assert_names_a_suspect(e, allowed)
            return
        check_completion(c, value, kwargs, served.vocab)

    example()
    assert_still_serving(served)


def test_generate_streams_or_names_the_field(served: Served) -> None:
    @FUZZ
    @given(generate_args())
    def example(args: tuple[Tagged, dict[str, Tagged]]) -> None:
        value, kwargs, allowed = generate_call(args)

        async def collect() -> list[StreamChunk]:
            return [chunk async for chunk in served.engine.generate(value, **kwargs)]

        try:
            chunks = run(collect)
        except Exception as e:
            assert_names_a_suspect(e, allowed)
            return
        check_chunks(chunks, kwargs.get("n", 1), served.vocab)
        if isinstance(value, (list, tuple)):
            assert chunks[-1].usage is not None
            assert chunks[-1].usage.prompt_tokens == len(value)

    example()
    assert_still_serving(served)


def test_prompt_and_context_edges(served: Served) -> None:
    """The vocabulary and context edges, with their exact messages."""
    engine, vocab = served.engine, served.vocab
    ok = run(lambda: engine.complete([vocab - 1] * (CONTEXT - 1), temperature=0))
    assert len(ok.token_ids) == 1 and ok.finish_reason == "length"
    cases: list[tuple[Any, dict[str, Any], type[Exception], str]] = [
        (
            [vocab],
            {},
            InvalidRequest,
            f"prompt: token id {vocab} is outside the vocabulary (size {vocab})",
        ),
        ([-1], {}, InvalidRequest, "prompt: token id -1 is not a valid id"),
        ([2**32], {}, InvalidRequest, "prompt: token id 4294967296 is not a valid id"),
        ([2**64], {}, InvalidRequest, "prompt: token id 18446744073709551616 is not a valid id"),
        (
            [True, 5],
            {},
            InvalidRequest,
            "prompt: must be a list of token ids, got a bool in the list",
        ),
        ([1.0], {}, InvalidRequest, "prompt: must be a list of token ids, got a float in the list"),
        (
            "\ud800",
            {},
            InvalidRequest,
            "prompt: must be valid Unicode text (it holds a lone surrogate)",
        ),
        (b"ab", {}, InvalidRequest, "prompt: must be a string or a list of token ids"),
        ("", {}, InvalidRequest, "prompt: must not be empty"),
        (
            [1] * CONTEXT,
            {},
            ContextOverflow,
            f"prompt: {CONTEXT} tokens leave no room to generate in the context of {CONTEXT}"
            " tokens",
        ),
        (
            [1] * (CONTEXT + 1),
            {},
            ContextOverflow,
            f"prompt: {CONTEXT + 1} tokens exceed the context of {CONTEXT} tokens",
        ),
        (
            [1] * 60,
            {"max_tokens": 5},
            ContextOverflow,
            f"max_tokens: 60 prompt tokens + 5 exceed the context of {CONTEXT} tokens",
        ),
        (
            [1],
            {"params": {"temperature": 0}},
            InvalidRequest,
            "params: must be a SamplingParams or None, got dict",
        ),
    ]
    for prompt, kwargs, cls, message in cases:
        with pytest.raises(cls) as e:
            engine.generate(prompt, **kwargs)
        assert type(e.value) is cls and str(e.value) == message, (prompt, kwargs)
        with pytest.raises(cls) as e:
            run(lambda p=prompt, kw=kwargs: engine.complete(p, **kw))
        assert type(e.value) is cls and str(e.value) == message, (prompt, kwargs)
    # logits() reads token ids the same way (it used to raise TypeError and OverflowError).
    for ids, message in [
        ("abc", "token_ids: must be a list of token ids, got str"),
        ([True], "token_ids: must be a list of token ids, got a bool in the list"),
        ([2**64], "token_ids: token id 18446744073709551616 is not a valid id"),
    ]:
        with pytest.raises(InvalidRequest) as e:
            run(lambda ids=ids: engine.logits(ids))
        assert type(e.value) is InvalidRequest and str(e.value) == message, ids
    # max_tokens that fills the context exactly is accepted.
    full = run(lambda: engine.complete([1] * 60, max_tokens=4, temperature=0, ignore_eos=True))
    assert len(full.token_ids) == 4
    # Numpy integers are token ids (they have __index__); None params means keyword arguments.
    ids = run(lambda: engine.complete([np.int64(5), 17, 99, 3], None, max_tokens=8, temperature=0))
    assert ids.token_ids == served.reference.token_ids
    assert_still_serving(served)


# ---------------------------------------------------------------------------------------------
# chat
# ---------------------------------------------------------------------------------------------

ROLES = ["system", "developer", "user", "assistant", "tool"]


# Each message has a known role and short ASCII content (the tiny model's ChatML template
# concatenates role and content; ASCII keeps the prompt to at most a token per character, so that
# it fits the context; the byte-level vocabulary can spend 4 tokens on one other character).
GOOD_MESSAGES = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(ROLES),
            "content": st.text(alphabet=string.ascii_letters + " .?", max_size=6),
        }
    ),
    min_size=1,
    max_size=3,
)
BAD_MESSAGES = (
    st.lists(
        st.fixed_dictionaries(
            {},
            optional={
                "role": st.sampled_from(ROLES) | st.text(max_size=8) | SURROGATES | JUNK,
                "content": st.text(max_size=20)
                | st.lists(
                    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=5)})
                )
                | st.just("word " * 2000)
                | SURROGATES
                | JUNK,
                "tool_calls": JUNK,
                "name": JUNK,
            },
        )
        | JUNK,
        max_size=4,
    )
    | JUNK
)
CHAT_OPTIONS: dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]] = {
    "add_generation_prompt": (st.booleans(), JUNK),
    "chat_template_kwargs": (
        st.none() | st.dictionaries(st.sampled_from(["a", "tools", "x"]), TEXT, max_size=2),
        JUNK | st.dictionaries(st.sampled_from(["messages", "k"]), JUNK, max_size=2),
    ),
}


@st.composite
def chat_args(draw: st.DrawFn) -> tuple[Tagged, dict[str, Tagged], dict[str, Tagged]]:
    bad = draw(badness(["messages", *SAMPLING_FIELDS, *CHAT_OPTIONS, "unknown"]))
    messages_ok = "messages" not in bad
    msgs = draw(GOOD_MESSAGES if messages_ok else BAD_MESSAGES)
    return (
        (msgs, messages_ok),
        draw(tagged_kwargs(SAMPLING_FIELDS, bad)),
        draw(tagged_kwargs(CHAT_OPTIONS, bad - {"unknown"})),
    )


def test_chat_accepts_or_names_the_field(served: Served) -> None:
    @FUZZ
    @given(chat_args())
    def example(args: tuple[Tagged, dict[str, Tagged], dict[str, Tagged]]) -> None:
        msgs, tagged, options = args
        value, messages_ok = msgs
        allowed = suspects(tagged) | suspects(options)
        if not messages_ok:
            allowed.add("messages")
        # The template renders a good conversation to a prompt whose length is only known
        # once encoded: max_tokens may not fit after it.
        if tagged.get("max_tokens", (None, True))[0] is not None:
            allowed.add("max_tokens")

        async def collect() -> list[StreamChunk]:
            stream = served.engine.chat(value, **values(tagged), **values(options))
            return [chunk async for chunk in stream]

        try:
            chunks = run(collect)
        except Exception as e:
            assert_names_a_suspect(e, allowed)
            return
        check_chunks(chunks, values(tagged).get("n", 1), served.vocab)

    example()
    assert_still_serving(served)


def test_chat_edges(served: Served) -> None:
    engine = served.engine
    user = [{"role": "user", "content": "hi"}]
    cases: list[tuple[Any, dict[str, Any], type[Exception], str]] = [
        ([], {}, InvalidRequest, "messages: must not be empty"),
        ({"role": "user"}, {}, InvalidRequest, "messages: must be a list of messages"),
        ([1], {}, InvalidRequest, "messages[0]: must be an object with role and content"),
        ([[user[0]]], {}, InvalidRequest, "messages[0]: must be an object with role and content"),
        ([{"content": "x"}], {}, InvalidRequest, "messages[0].role: must be a string"),
        (
            [{"role": "user"}],
            {},
            InvalidRequest,
            "messages[0].content: must be a string or a list of content parts",
        ),
        (
            [{"role": "user", "content": "\ud800"}],
            {},
            InvalidRequest,
            "messages[0].content: must be valid Unicode text (it holds a lone surrogate)",
        ),
        (
            [{"role": "user", "content": "x", 1: 2}],
            {},
            InvalidRequest,
            "messages[0]: dictionary keys must be strings",
        ),
        (
            [{"role": "user", "content": math.nan}],
            {},
            InvalidRequest,
            "messages[0].content: must be a finite number",
        ),
        (
            [{"role": "user", "content": ["x"]}],
            {},
            InvalidRequest,
            "messages: chat template failed: invalid operation: tried to use + operator on"
            " unsupported types string and sequence (in chat_template:1)",
        ),
        (
            user,
            {"add_generation_prompt": 1},
            InvalidRequest,
            "add_generation_prompt: must be a bool, got int",
        ),
        (
            user,
            {"chat_template_kwargs": [1]},
            InvalidRequest,
            "chat_template_kwargs: must be a dict or None, got list",
        ),
        (
            user,
            {"chat_template_kwargs": {"messages": []}},
            InvalidRequest,
            'chat_template_kwargs: "messages" cannot be set as an extra template variable',
        ),
        (user, {"params": 3}, InvalidRequest, "params: must be a SamplingParams or None, got int"),
        (
            [{"role": "user", "content": "word " * 100}],
            {},
            ContextOverflow,
            f"messages: 314 tokens exceed the context of {CONTEXT} tokens",
        ),
    ]
    for msgs, kwargs, cls, message in cases:
        with pytest.raises(cls) as e:
            engine.chat(msgs, **kwargs)
        assert type(e.value) is cls and str(e.value) == message, (msgs, kwargs)
    # The tokenizer's own rendering checks its flag the same way.
    with pytest.raises(InvalidRequest) as e:
        engine.tokenizer.apply_chat_template(user, add_generation_prompt="yes")
    assert str(e.value) == "add_generation_prompt: must be a bool, got str"
    assert engine.tokenizer.apply_chat_template(user, add_generation_prompt=False) == (
        "<|im_start|>user\nhi<|im_end|>\n"
    )
    assert_still_serving(served)
