"""Malformed model folders: every corruption of the tiny model's files gives ModelLoadError
naming the file (never a panic, an abort or a hang), and chat templates that fail only when
rendered give InvalidRequest naming `messages`, in bounded time.

Where a template fails: a chat template that does not compile (a syntax error) fails the load
with ModelLoadError naming its file. One that compiles but fails when rendered (an unknown filter
or test, recursion without end, a loop without end, output without end) loads, serves plain
completions, and each chat gets InvalidRequest naming `messages`: minijinja resolves filters and
tests at render time, and its set differs from Jinja2's, so refusing such a model at load would
refuse models whose template only uses the missing filter on some branch (tools, say).

Examples are driven as in test_fuzz_api.py: plain test functions, each load or request run with
`asyncio.run` under `asyncio.wait_for`.
"""

from __future__ import annotations

import json
import shutil
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fuzzing import HANG, no_panic, run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strata_rs import Engine, InvalidRequest, ModelLoadError, Tokenizer

MakeModel = Callable[..., Path]

# Each example is a load of a tiny folder (milliseconds): many are cheap.
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
USER = [{"role": "user", "content": "hi"}]


def copy_model(src: Path, dst: Path) -> Path:
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    return dst


def load(d: Path, **kwargs: Any) -> Engine:
    return run(lambda: Engine.load(d, disk_cache_mib=0, host_cache_mib=0, **kwargs))


def load_error(d: Path, **kwargs: Any) -> str:
    """The message of the ModelLoadError that loading `d` must raise (exactly that class)."""
    with pytest.raises(ModelLoadError) as e:
        load(d, **kwargs)
    assert type(e.value) is ModelLoadError
    return str(e.value)


def serves(engine: Engine) -> None:
    """A loaded engine answers a completion and closes. EOS is ignored: a mutated config may
    make any id the model's EOS, and the answer must still be three tokens long."""
    try:
        c = run(lambda: engine.complete([5, 17, 99], max_tokens=3, temperature=0, ignore_eos=True))
        assert len(c.token_ids) == 3 and c.finish_reason == "length"
    finally:
        run(engine.close)


# ---------------------------------------------------------------------------------------------
# tokenizer.json
# ---------------------------------------------------------------------------------------------


def test_tokenizer_json_corruptions(model_dir: MakeModel, tmp_path: Path) -> None:
    d = copy_model(model_dir("llama"), tmp_path / "m")
    path = d / "tokenizer.json"
    real = path.read_bytes()
    doc = json.loads(real)
    exact: list[tuple[bytes, str]] = [
        (b"", "invalid JSON: EOF while parsing a value at line 1 column 0"),
        (b"hello", "invalid JSON: expected value at line 1 column 1"),
        (real[: len(real) // 2], "invalid JSON: EOF while parsing "),
        # A control character in a string of the decoder section made the tokenizers library
        # panic (an `expect` in its decoder deserializer).
        (real.replace(b'"ByteLevel"', b'"Byte\x01Level"'), "invalid JSON: control character "),
        (bytes(range(256)), "cannot read: stream did not contain valid UTF-8"),
        (
            b"[]",
            "invalid tokenizer: invalid type: sequence, expected struct Tokenizer at line 1"
            " column 2",
        ),
        (
            json.dumps({**doc, "model": {**doc["model"], "vocab": "x"}}).encode(),
            'invalid tokenizer: invalid type: string "x", expected a map at line 1 column ',
        ),
        # Valid JSON that made the library panic (an `expect` in its normalizer deserializer).
        (
            json.dumps(
                {**doc, "normalizer": {"type": "Precompiled", "precompiled_charsmap": 5}}
            ).encode(),
            "invalid tokenizer: the tokenizers library panicked: Precompiled",
        ),
        # Loads, but panicked on every text (a "Prepend" normalizer with an empty string); the
        # fuzzer found it as the normalizer `[""]`.
        (
            json.dumps({**doc, "normalizer": [""]}).encode(),
            "the tokenizer fails on a probe text: the tokenizers library panicked: index out of"
            " bounds",
        ),
    ]
    for data, reason in exact:
        path.write_bytes(data)
        message = load_error(d)
        assert message.startswith(f"{path}: {reason}"), (message, data[:20])
    prefixed: list[bytes] = [
        json.dumps({**doc, "model": "x"}).encode(),
        json.dumps({**doc, "model": {**doc["model"], "merges": 5}}).encode(),
        json.dumps({**doc, "model": {**doc["model"], "vocab": {"a": 2**32 - 1}}}).encode(),
        json.dumps({**doc, "added_tokens": [{"id": -1, "content": 5}]}).encode(),
        json.dumps({**doc, "pre_tokenizer": {"type": "Nope"}}).encode(),
        json.dumps({k: v for k, v in doc.items() if k != "model"}).encode(),
    ]
    for data in prefixed:
        path.write_bytes(data)
        assert load_error(d).startswith(f"{path}: invalid tokenizer: "), data[:60]
    path.unlink()
    assert load_error(d) == f"{path}: file not found"


# JSON-aware mutations of the real file: a value of another type, a deleted key, a number at an
# edge. Many decode to no tokenizer; some still do (a changed string in the vocabulary).
JUNK_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.sampled_from([0, -1, 2**32, 2**40, 10**15, 2**62, 2**64, 1.5, 1e308])
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)


def mutate(doc: Any, path: list[int], junk: Any, delete: bool) -> Any:
    """Replaces (or deletes) the node that `path` picks, choosing children by index modulo."""
    if not path or not isinstance(doc, (dict, list)) or not doc:
        return junk
    if isinstance(doc, dict):
        keys = list(doc)
        key = keys[path[0] % len(keys)]
        out = dict(doc)
        if delete and len(path) == 1:
            del out[key]
        else:
            out[key] = mutate(doc[key], path[1:], junk, delete)
        return out
    i = path[0] % len(doc)
    out_list = list(doc)
    if delete and len(path) == 1:
        del out_list[i]
    else:
        out_list[i] = mutate(doc[i], path[1:], junk, delete)
    return out_list


def check_tokenizer_folder(d: Path) -> None:
    """Loads the tokenizer: ModelLoadError naming one of its files, or a tokenizer that encodes,
    decodes and renders without a panic (its errors are InvalidRequest)."""
    try:
        tok = no_panic(lambda: Tokenizer.from_dir(d))
    except ModelLoadError as e:
        assert type(e) is ModelLoadError
        assert str(e).startswith(
            tuple(str(d / f) for f in ("tokenizer.json", "tokenizer_config.json"))
        ), str(e)
        return
    for call in (
        lambda: tok.decode(tok.encode("hello wörld <|im_end|>")),
        lambda: tok.apply_chat_template(USER),
        lambda: tok.decode(list(range(tok.vocab_size + 2))),
    ):
        try:
            no_panic(call)
        except InvalidRequest:
            pass


def test_tokenizer_json_mutations(
    model_dir: MakeModel, tmp_path_factory: pytest.TempPathFactory
) -> None:
    src = model_dir("llama")
    doc = json.loads((src / "tokenizer.json").read_text())
    raw = (src / "tokenizer.json").read_bytes()
    d = copy_model(src, tmp_path_factory.mktemp("mut") / "m")

    @FUZZ
    @given(
        st.lists(st.integers(0, 10_000), min_size=1, max_size=4),
        JUNK_JSON,
        st.booleans(),
    )
    def json_mutation(path: list[int], junk: Any, delete: bool) -> None:
        (d / "tokenizer.json").write_text(json.dumps(mutate(doc, path, junk, delete)))
        check_tokenizer_folder(d)

    # Replacements: random bytes, and the ones JSON strings and structure care about.
    replacement = st.binary(max_size=4) | st.sampled_from([b"\x01", b"\x1f", b"\x00", b'"', b"\\"])

    @FUZZ
    @given(
        st.lists(
            st.tuples(st.integers(0, len(raw) - 1), st.integers(0, 4), replacement),
            min_size=1,
            max_size=4,
        )
    )
    def byte_mutation(edits: list[tuple[int, int, bytes]]) -> None:
        data = bytearray(raw)
        for at, cut, new in edits:
            data[at : at + cut] = new
        (d / "tokenizer.json").write_bytes(bytes(data))
        check_tokenizer_folder(d)

    # Bytes put right after a quote inside one top-level section, so that each section (the
    # small decoder one too) gets its share of broken strings, not only the big vocabulary.
    pieces = [f"{json.dumps(k)}:{json.dumps(v)}".encode() for k, v in doc.items()]
    sections = {
        key: [i for i, b in enumerate(piece) if b == ord('"')]
        for key, piece in zip(doc, pieces, strict=True)
    }

    @FUZZ
    @given(st.sampled_from(list(doc)), st.integers(0, 10**6), replacement)
    def section_mutation(key: str, at: int, new: bytes) -> None:
        i = list(doc).index(key)
        piece = pieces[i]
        quote = sections[key][at % len(sections[key])] + 1
        mutated = [*pieces[:i], piece[:quote] + new + piece[quote:], *pieces[i + 1 :]]
        (d / "tokenizer.json").write_bytes(b"{" + b",".join(mutated) + b"}")
        check_tokenizer_folder(d)

    json_mutation()
    byte_mutation()
    section_mutation()
    # The engine loads through the same code; one corrupt file through Engine.load as well.
    (d / "tokenizer.json").write_text(json.dumps(mutate(doc, [8], "x", False)))
    assert load_error(d).startswith(f"{d / 'tokenizer.json'}: invalid tokenizer: ")


# ---------------------------------------------------------------------------------------------
# tokenizer_config.json and generation_config.json
# ---------------------------------------------------------------------------------------------


def test_tokenizer_config_wrong_types(model_dir: MakeModel, tmp_path: Path) -> None:
    d = copy_model(model_dir("llama"), tmp_path / "m")
    path = d / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    template_shape = 'chat_template: expected a string or a list of {"name", "template"} objects'
    cases: list[tuple[Any, str]] = [
        ({**cfg, "chat_template": 5}, template_shape),
        ({**cfg, "chat_template": [{"name": 1}]}, template_shape),
        ({**cfg, "chat_template": {"default": "x"}}, template_shape),
        ({**cfg, "bos_token": [1]}, 'bos_token: expected a string or an object with "content"'),
        (
            {**cfg, "eos_token": {"content": 5}},
            'eos_token: expected a string or an object with "content"',
        ),
        ({**cfg, "pad_token": 3.5}, 'pad_token: expected a string or an object with "content"'),
        (
            {**cfg, "tokenizer_class": "LlamaTokenizerFast", "add_bos_token": "yes"},
            "add_bos_token: expected true or false",
        ),
        (
            {**cfg, "tokenizer_class": "LlamaTokenizerFast", "bos_token": "<nope>"},
            'bos_token: "<nope>" is not in the vocabulary',
        ),
        ([], "expected a JSON object"),
    ]
    for value, reason in cases:
        path.write_text(json.dumps(value))
        assert load_error(d) == f"{path}: {reason}", value
    path.write_text('{"chat_template": ')
    assert load_error(d) == f"{path}: invalid JSON: EOF while parsing a value at line 1 column 18"
    path.write_bytes(b"\xff{}")
    assert load_error(d) == f"{path}: cannot read: stream did not contain valid UTF-8"
    # A list of named templates without "default": loads, and chat says why it cannot render.
    path.write_text(json.dumps({**cfg, "chat_template": [{"name": "x", "template": "y"}]}))
    engine = load(d)
    with pytest.raises(InvalidRequest) as e:
        engine.chat(USER)
    assert str(e.value) == (
        'messages: the model has several chat templates and none is named "default"'
    )
    serves(engine)

    gen = d / "generation_config.json"
    path.write_text(json.dumps(cfg))
    for value, reason in [
        ({"eos_token_id": [1, 2**40]}, "eos_token_id: expected an integer or a list of integers"),
        ({"eos_token_id": "2"}, "eos_token_id: expected an integer or a list of integers"),
        ({"bos_token_id": -1}, "bos_token_id: expected an integer"),
    ]:
        gen.write_text(json.dumps(value))
        assert load_error(d) == f"{gen}: {reason}", value


# ---------------------------------------------------------------------------------------------
# Chat templates
# ---------------------------------------------------------------------------------------------

SYNTAX_ERRORS: list[tuple[str, str]] = [
    ("{% for m in messages %}x", "unexpected end of input, expected end of block"),
    ("{% if true %}", "unexpected end of input, expected end of block"),
    ("{{ 1 + }}", "unexpected end of variable block"),
    ("{% endfor %}", "unknown statement endfor"),
    ("{{ messages", "unexpected end of input, expected end of variable block"),
    ("{% macro %}{% endmacro %}", "unexpected end of block, expected identifier"),
    ("{% if true %}" * 5000, "template exceeds maximum recursion limits"),
]


def test_a_template_that_does_not_compile_fails_the_load(
    model_dir: MakeModel, tmp_path: Path
) -> None:
    d = copy_model(model_dir("llama"), tmp_path / "m")
    jinja = d / "chat_template.jinja"
    for source, reason in SYNTAX_ERRORS:
        jinja.write_text(source)
        message = load_error(d)
        assert message.startswith(f"{jinja}: chat_template: syntax error: {reason}"), message
    jinja.write_bytes(b"\xff\xfe{{ x }}")
    assert load_error(d) == f"{jinja}: cannot read: stream did not contain valid UTF-8"
    # The same source in tokenizer_config.json names that file.
    jinja.unlink()
    cfg_path = d / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "chat_template": "{% if x %}"}))
    assert load_error(d) == (
        f"{cfg_path}: chat_template: syntax error: unexpected end of input, expected end of"
        " block (in chat_template:1)"
    )


RENDER_ERRORS: list[tuple[str, str]] = [
    (
        "{{ messages | nope }}",
        "chat template failed: unknown filter: filter nope is unknown (in chat_template:1)",
    ),
    (
        "{% if messages is nope %}{% endif %}",
        "chat template failed: unknown test: test nope is unknown (in chat_template:1)",
    ),
    (
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
        "chat template failed: invalid operation: recursion limit exceeded (in chat_template:1)",
    ),
    (
        "{% for m in messages recursive %}{{ loop([m]) }}{% endfor %}",
        "chat template failed: invalid operation: recursion limit exceeded (in chat_template:1)",
    ),
    (
        "{% include 'other' %}",
        "chat template failed: template not found: tried to include non-existing template"
        ' "other" (in chat_template:1)',
    ),
    (
        "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
        "the chat template did not finish within 20000000 steps",
    ),
    (
        "{% for a in range(100) %}{{ 'x' * 10000000 }}{% endfor %}",
        "the chat template's output exceeds 64 MiB",
    ),
    ("{{ raise_exception('no chat for you') }}", "no chat for you"),
]


def test_a_template_that_fails_at_render_is_invalid_request(
    model_dir: MakeModel, tmp_path: Path
) -> None:
    """Loads, then every chat fails with InvalidRequest naming messages, in bounded time; the
    engine keeps serving."""
    d = copy_model(model_dir("llama"), tmp_path / "m")
    for source, reason in RENDER_ERRORS:
        (d / "chat_template.jinja").write_text(source)
        engine = load(d)
        started = time.monotonic()
        with pytest.raises(InvalidRequest) as e:
            engine.chat(USER)
        assert type(e.value) is InvalidRequest
        assert str(e.value) == f"messages: {reason}", source
        assert time.monotonic() - started < HANG
        serves(engine)


# Fragments of Jinja: random sequences of them are mostly not templates.
FRAGMENTS = st.sampled_from(
    [
        "{%",
        "%}",
        "{{",
        "}}",
        "{#",
        "#}",
        "{%-",
        "-%}",
        " for m in messages ",
        " endfor ",
        " if ",
        " else ",
        " endif ",
        " macro f(n) ",
        " endmacro ",
        " f(n) ",
        " set x = ",
        " range(100000) ",
        " loop ",
        " recursive ",
        "|",
        " upper ",
        " nope ",
        " is ",
        " defined ",
        " m.role ",
        " m['content'] ",
        " ~ ",
        " + ",
        " * ",
        "(",
        ")",
        "[",
        "]",
        "'",
        '"',
        "x",
        "1",
        " raise_exception('r') ",
        " tojson ",
        " generation ",
        " endgeneration ",
        "\n",
    ]
)


def test_random_templates_load_or_name_the_file(
    model_dir: MakeModel, tmp_path_factory: pytest.TempPathFactory
) -> None:
    d = copy_model(model_dir("llama"), tmp_path_factory.mktemp("tpl") / "m")
    jinja = d / "chat_template.jinja"

    @FUZZ
    @given(st.lists(FRAGMENTS, max_size=30).map("".join))
    def example(source: str) -> None:
        jinja.write_text(source)
        try:
            tok = no_panic(lambda: Tokenizer.from_dir(d))
        except ModelLoadError as e:
            assert str(e).startswith(f"{jinja}: chat_template: syntax error: "), str(e)
            return
        result: list[Any] = []

        def render() -> None:
            try:
                result.append(tok.apply_chat_template(USER))
            except BaseException as e:  # a panic too: it is reported from the test's thread
                result.append(e)

        # Rendering is synchronous: a thread bounds it, so a hang fails instead of hanging.
        worker = threading.Thread(target=render, daemon=True)
        worker.start()
        worker.join(HANG)
        assert not worker.is_alive(), f"rendering {source!r} did not finish"
        (out,) = result
        if isinstance(out, BaseException):
            assert type(out) is InvalidRequest, f"{type(out).__name__}: {out}"
            assert str(out).startswith("messages: "), str(out)
        else:
            assert isinstance(out, str)

    example()


# ---------------------------------------------------------------------------------------------
# config.json, weights, and load arguments that would abort
# ---------------------------------------------------------------------------------------------


def test_config_json_variations(model_dir: MakeModel, tmp_path: Path) -> None:
    d = copy_model(model_dir("llama"), tmp_path / "m")
    path = d / "config.json"
    cfg = json.loads(path.read_text())
    cases: list[tuple[dict[str, Any], str]] = [
        ({"num_hidden_layers": 10**15}, "num_hidden_layers: 1000000000000000 is more than 4096"),
        (
            {"num_hidden_layers": 2**64},
            "num_hidden_layers: expected a non-negative integer, found 1.8446744073709552e+19",
        ),
        ({"num_hidden_layers": 0}, "num_hidden_layers: must be > 0"),
        (
            {"num_attention_heads": 2**62, "num_key_value_heads": 2**62},
            "num_attention_heads: 4611686018427387904 is more than 65536",
        ),
        (
            {"num_key_value_heads": 0},
            "num_key_value_heads: 0 does not divide num_attention_heads 4",
        ),
        ({"vocab_size": 2**32 + 1}, "vocab_size: 4294967297 is more than 4294967296"),
        ({"max_position_embeddings": 0}, "max_position_embeddings: must be > 0"),
        ({"hidden_size": "64"}, 'hidden_size: expected a non-negative integer, found "64"'),
        ({"hidden_size": -3}, "hidden_size: expected a non-negative integer, found -3"),
        ({"head_dim": 2**62}, "head_dim: 4611686018427387904 is not an even size in 2..=256"),
        ({"rms_norm_eps": "x"}, 'rms_norm_eps: expected a finite number, found "x"'),
        ({"rope_scaling": 5}, "rope_scaling: expected an object or null"),
        (
            {"rope_scaling": {"rope_type": "dynamic"}},
            'rope_scaling.rope_type: unsupported rope scaling "dynamic" (supported: default,'
            " linear, llama3, yarn, longrope)",
        ),
        (
            {"rope_scaling": {"rope_type": "yarn"}},
            "rope_scaling.factor: missing or not a positive number",
        ),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4, "attention_factor": "x"}},
            "rope_scaling.attention_factor: not a positive number",
        ),
        ({"layer_types": ["x"]}, "layer_types: has 1 entries for 2 layers"),
        ({"tie_word_embeddings": "no"}, 'tie_word_embeddings: expected true or false, found "no"'),
        ({"model_type": None}, "model_type: missing"),
        ({"model_type": 5}, "model_type: expected a string"),
    ]
    for change, reason in cases:
        path.write_text(json.dumps({**cfg, **change}))
        assert load_error(d) == f"{path}: {reason}", change
    weights = d / "model.safetensors"
    for change in ({"vocab_size": 2**31}, {"hidden_size": 2**62}, {"intermediate_size": 2**62}):
        path.write_text(json.dumps({**cfg, **change}))
        assert load_error(d).startswith(f"{weights}: tensor "), change
    for text, reason in [
        ("", "invalid JSON: EOF while parsing a value at line 1 column 0"),
        ("[]", "expected a JSON object"),
        ("5", "expected a JSON object"),
    ]:
        path.write_text(text)
        assert load_error(d) == f"{path}: {reason}", text


def test_config_json_mutations(
    model_dir: MakeModel, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Any field of config.json set to junk: ModelLoadError naming config.json or the weights
    (a shape that no longer matches), or an engine that serves."""
    src = model_dir("llama")
    cfg = json.loads((src / "config.json").read_text())
    d = copy_model(src, tmp_path_factory.mktemp("cfg") / "m")

    # Half the values are sizes past any model (the per-layer lists and the RoPE table were
    # allocated from them before the weights were checked).
    value = JUNK_JSON | st.sampled_from([2**31, 2**40, 10**15, 2**62, 2**64 - 1])

    @FUZZ
    @given(st.lists(st.tuples(st.sampled_from(sorted(cfg)), value), min_size=1, max_size=3))
    def example(changes: list[tuple[str, Any]]) -> None:
        (d / "config.json").write_text(json.dumps({**cfg, **dict(changes)}))
        try:
            engine = load(d)
        except ModelLoadError as e:
            assert type(e) is ModelLoadError
            assert str(e).startswith((f"{d / 'config.json'}: ", f"{d / 'model.safetensors'}: ")), (
                str(e)
            )
            return
        serves(engine)

    example()


def test_safetensors_header_overflow(model_dir: MakeModel, tmp_path: Path) -> None:
    d = copy_model(model_dir("llama"), tmp_path / "m")
    st_path = d / "model.safetensors"
    data = st_path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    name = "model.embed_tokens.weight"
    header[name] = {"dtype": "F32", "shape": [2**62, 4], "data_offsets": [0, 0]}
    raw = json.dumps(header).encode()
    st_path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
    assert load_error(d) == f"{st_path}: tensor {name}: shape [4611686018427387904, 4] is too large"
    st_path.write_bytes(struct.pack("<Q", 2**64 - 1) + data[8:])
    assert load_error(d) == (
        f"{st_path}: truncated file: header of 18446744073709551615 bytes but the file has"
        f" {len(data)} bytes"
    )


def test_load_arguments_that_would_abort(model_dir: MakeModel) -> None:
    """Sizes past memory are refused with InvalidRequest naming the argument, not an abort. The
    sizes exceed any address space, so that no overcommit setting lets an allocation through."""
    d = model_dir("llama")
    cases: list[tuple[dict[str, Any], str]] = [
        ({"threads": 2**40}, "threads: must be at most 1024, got 1099511627776"),
        ({"kv_memory_mib": 2**50}, "kv_memory_mib: 1125899906842624 MiB is too large"),
        ({"kv_memory_mib": 2**30}, "kv_memory_mib: cannot allocate the K/V pool (1073741824 MiB)"),
        (
            {"max_context": 2**50, "kv_memory_mib": 2**33},
            "max_context: cannot allocate the rotary position table for 17592186044416 positions",
        ),
    ]
    for kwargs, message in cases:
        with pytest.raises(InvalidRequest) as e:
            load(d, **kwargs)
        assert type(e.value) is InvalidRequest and str(e.value) == message, kwargs
