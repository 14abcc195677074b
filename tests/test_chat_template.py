"""strata-rs renders chat templates exactly as transformers does.

The reference is Jinja2 set up the way transformers' apply_chat_template sets it up
(ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, loop controls, its own
tojson, raise_exception and strftime_now). Each fixture under fixtures/templates/ is
written in the style of a real model's template and rendered for several
conversations by both; the strings must be equal.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import pytest
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from strata_rs._core import InvalidRequest, Tokenizer
from tokenizers import Tokenizer as HfTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"

Message = dict[str, Any]

# tokenizer_config.json special tokens per template family.
SPECIAL_TOKENS: dict[str, dict[str, Any]] = {
    "qwen25": {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "qwen3": {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "llama3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "mistral": {
        "bos_token": {"content": "<s>", "special": True},
        "eos_token": {"content": "</s>", "special": True},
        "unk_token": "<unk>",
    },
    "pyisms": {"bos_token": "<s>", "eos_token": "</s>"},
    "gemma3": {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"},
    # Phi-3-mini-4k-instruct / Phi-3.5-mini-instruct: eos is <|endoftext|> here; generation
    # stops at <|end|> through generation_config's eos_token_id list, not tokenizer_config.
    "phi3": {
        "bos_token": "<s>",
        "eos_token": "<|endoftext|>",
        "unk_token": "<unk>",
        "pad_token": "<|endoftext|>",
    },
    "phi4_mini": {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"},
}

ALL_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<s>",
    "</s>",
    "<unk>",
    "<bos>",
    "<eos>",
    "<pad>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
    "<|tool|>",
    "<|/tool|>",
]

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "search_web",
            "description": 'Search the web. Returns "snippets" <html-free>.',
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "What to look for"},
                    "limit": {"type": "integer", "default": 5},
                },
                "required": ["query"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Température actuelle",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
]

SIMPLE: dict[str, list[Message]] = {
    "single_user": [{"role": "user", "content": "Hello!"}],
    "system_and_user": [
        {"role": "system", "content": "  You are a pirate.  "},
        {"role": "user", "content": "  What is the weather like?  "},
    ],
    "multi_turn": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke?"},
    ],
    "unicode_and_quotes": [
        {"role": "user", "content": 'héllo wörld 日本語 🎉 "quoted" it\'s\nnew line'},
        {"role": "assistant", "content": "Ça va 👍"},
        {"role": "user", "content": "{{ not a template }} {% raw %}"},
    ],
}

TOOL_CALL: list[Message] = [
    {"role": "system", "content": "You can search."},
    {"role": "user", "content": "Find news about Rust"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "search_web", "arguments": {"query": "Rust news", "limit": 3}},
            },
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Zürich"}},
            },
        ],
    },
    {"role": "tool", "name": "search_web", "content": "Rust 1.95 released"},
    {"role": "tool", "name": "get_weather", "content": '{"temp": 21.5}'},
    {"role": "assistant", "content": "Rust 1.95 is out; Zürich is 21.5°C."},
    {"role": "user", "content": "Thanks"},
]

THINKING: list[Message] = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\nSimple sum.\n</think>\n\n4"},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6", "reasoning_content": "\nAdd them.\n"},
    {"role": "user", "content": "<tool_response>x</tool_response>"},
]

MULTIMODAL: list[Message] = [
    {"role": "system", "content": "sys"},
    {
        "role": "user",
        "name": "ana",
        "content": [{"type": "image"}, {"type": "text", "text": "describe this picture"}],
    },
    {
        "role": "assistant",
        "content": "A  cat?",
        "tool_calls": [
            {
                "type": "function",
                "function": {
                    "name": "f",
                    "arguments": {"zeta": [1, 2.5, None, True], "alpha": "é"},
                },
            }
        ],
    },
    {"role": "tool", "content": None},
]

# Phi-3.5-mini's template drops a system turn whose content is empty.
PHI3_EMPTY_SYSTEM: list[Message] = [
    {"role": "system", "content": ""},
    {"role": "user", "content": "Hi there"},
]

# Phi-4-mini's template ignores the tools variable: the tools go in the system message, as a
# JSON string under "tools", and are rendered between <|tool|> and <|/tool|>.
PHI4_TOOLS_IN_SYSTEM: list[Message] = [
    {
        "role": "system",
        "content": "You are a helpful assistant with some tools.",
        "tools": json.dumps([tool["function"] for tool in TOOLS]),
    },
    {"role": "user", "content": "What is the weather like in Zürich today?"},
]

PHI4_TOOLS_NONE_IN_SYSTEM: list[Message] = [
    {"role": "system", "content": "Be brief.", "tools": None},
    {"role": "user", "content": "Hi there"},
]

# (template, conversation name, messages, extra template variables)
Case = tuple[str, str, list[Message], dict[str, Any]]


def cases() -> list[Case]:
    out: list[Case] = []
    for template in [
        "qwen25",
        "qwen3",
        "llama3",
        "mistral",
        "pyisms",
        "gemma3",
        "phi3",
        "phi4_mini",
    ]:
        for name, messages in SIMPLE.items():
            out.append((template, name, messages, {}))
    for template in ["qwen25", "qwen3"]:
        out.append((template, "tool_call", TOOL_CALL, {}))
        out.append((template, "tools_given", SIMPLE["multi_turn"], {"tools": TOOLS}))
        out.append((template, "tools_no_system", SIMPLE["single_user"], {"tools": TOOLS}))
    out.append(("qwen3", "thinking", THINKING, {}))
    out.append(("qwen3", "thinking_off", SIMPLE["single_user"], {"enable_thinking": False}))
    out.append(("llama3", "tools_in_user", SIMPLE["system_and_user"], {"tools": TOOLS}))
    out.append(
        (
            "llama3",
            "tools_in_system",
            SIMPLE["multi_turn"],
            {"tools": TOOLS, "tools_in_user_message": False, "date_string": "01 Mar 2025"},
        )
    )
    out.append(("pyisms", "multimodal", MULTIMODAL, {}))
    out.append(("gemma3", "multimodal", MULTIMODAL[:3], {}))
    out.append(("phi3", "empty_system", PHI3_EMPTY_SYSTEM, {}))
    out.append(("phi4_mini", "tools_given", SIMPLE["multi_turn"], {"tools": TOOLS}))
    out.append(("phi4_mini", "tools_no_system", SIMPLE["single_user"], {"tools": TOOLS}))
    out.append(("phi4_mini", "tools_in_system", PHI4_TOOLS_IN_SYSTEM, {}))
    out.append(("phi4_mini", "tools_none_in_system", PHI4_TOOLS_NONE_IN_SYSTEM, {}))
    return out


# (template, messages, the message raise_exception is called with)
ERROR_CASES: list[tuple[str, list[Message], str]] = [
    (
        "llama3",
        [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
        "Conversation roles must alternate user/assistant/user/assistant/...",
    ),
    (
        "mistral",
        [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}],
        "After the optional system message, conversation roles must alternate "
        "user/assistant/user/assistant/...",
    ),
    ("pyisms", [{"role": "narrator", "content": "x"}], "Unknown role: narrator"),
    (
        "gemma3",
        [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}],
        "Conversation roles must alternate user/assistant/user/assistant/...",
    ),
]


def reference_environment() -> jinja2.Environment:
    """The environment transformers' _compile_jinja_template builds (less its
    {% generation %} extension, which these fixtures do not use)."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | str | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def special_token_strings(family: str) -> dict[str, str]:
    """transformers passes special_tokens_map: only the tokens that are set, as strings."""
    out: dict[str, str] = {}
    for key, value in SPECIAL_TOKENS[family].items():
        if isinstance(value, dict):
            out[key] = value["content"]
        elif isinstance(value, str):
            out[key] = value
    return out


def render_reference(
    family: str,
    messages: list[Message],
    extra: dict[str, Any],
    add_generation_prompt: bool = True,
) -> str:
    template = reference_environment().from_string((TEMPLATES / f"{family}.jinja").read_text())
    variables: dict[str, Any] = {**special_token_strings(family), **extra}
    variables.setdefault("tools", None)
    variables.setdefault("documents", None)
    return template.render(
        messages=messages, add_generation_prompt=add_generation_prompt, **variables
    )


def write_tokenizer_json(path: Path) -> None:
    """A tiny byte-level BPE with every special token the fixtures name."""
    tok = HfTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=ALL_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["hello world", "the weather is nice", "héllo wörld"], trainer=trainer)
    tok.save(str(path))


def build_model_folder(root: Path, family: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    write_tokenizer_json(root / "tokenizer.json")
    config: dict[str, Any] = {
        **SPECIAL_TOKENS[family],
        "chat_template": (TEMPLATES / f"{family}.jinja").read_text(),
        "model_max_length": 32768,
    }
    (root / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2))
    return root


@pytest.mark.parametrize(
    ("family", "name", "messages", "extra"), cases(), ids=[f"{c[0]}-{c[1]}" for c in cases()]
)
def test_template_matches_jinja2(
    tmp_path: Path, family: str, name: str, messages: list[Message], extra: dict[str, Any]
) -> None:
    expected = render_reference(family, messages, extra)
    tokenizer = Tokenizer.from_dir(build_model_folder(tmp_path / family, family))
    got = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **extra)
    assert got == expected, f"{family}/{name}"


@pytest.mark.parametrize("family", list(SPECIAL_TOKENS))
def test_template_without_generation_prompt_matches_jinja2(tmp_path: Path, family: str) -> None:
    """The branch a template takes without the generation prompt (Phi's closing eos_token,
    for one), on every conversation."""
    tokenizer = Tokenizer.from_dir(build_model_folder(tmp_path / family, family))
    for name, messages in SIMPLE.items():
        expected = render_reference(family, messages, {}, add_generation_prompt=False)
        got = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
        assert got == expected, f"{family}/{name}"


@pytest.mark.parametrize(
    ("family", "messages", "message"), ERROR_CASES, ids=[c[0] for c in ERROR_CASES]
)
def test_raise_exception_is_invalid_request(
    tmp_path: Path, family: str, messages: list[Message], message: str
) -> None:
    with pytest.raises(jinja2.exceptions.TemplateError, match=re.escape(message)):
        render_reference(family, messages, {})
    tokenizer = Tokenizer.from_dir(build_model_folder(tmp_path / family, family))
    with pytest.raises(InvalidRequest, match=re.escape(f"messages: {message}")):
        tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def test_reference_renders_every_fixture() -> None:
    """Guards the fixtures themselves: each renders, and differently per conversation."""
    for family in SPECIAL_TOKENS:
        outputs = {render_reference(family, messages, {}) for messages in SIMPLE.values()}
        assert len(outputs) == len(SIMPLE), family


STRFTIME_TEMPLATE = (
    "{{ strftime_now('%d %b %Y %H:%M|%A %B %j %p %I %w %y|%-d %-m|%z%Z|%%|%e') }}"
    "{% for message in messages %}{{ message['content'] }}{% endfor %}"
)

# Renders STRFTIME_TEMPLATE with the engine and with Python's datetime, in a process whose
# TZ is the test's: prints the two strings.
STRFTIME_CHILD = """
import json, sys
from datetime import datetime
from strata_rs._core import Tokenizer
folder, template = sys.argv[1], sys.argv[2]
for _ in range(3):
    got = Tokenizer.from_dir(folder).apply_chat_template(
        [{"role": "user", "content": "x"}], add_generation_prompt=False
    )
    fmt = template.split("'")[1]
    want = datetime.now().strftime(fmt) + "x"
    if got == want:
        break
print(json.dumps([got, want]))
"""


@pytest.mark.parametrize("tz", ["UTC", "Asia/Kolkata", "America/St_Johns"])
def test_strftime_now_is_pythons_local_time(tmp_path: Path, tz: str) -> None:
    """transformers' strftime_now is datetime.now().strftime: the local time of a naive
    datetime (no %z, no %Z), in whatever zone the process runs; +05:30 and -03:30 (or -02:30)
    show a zone's minutes."""
    import os
    import subprocess
    import sys

    folder = tmp_path / "m"
    folder.mkdir()
    write_tokenizer_json(folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": STRFTIME_TEMPLATE, "eos_token": "</s>"})
    )
    out = subprocess.run(
        [sys.executable, "-c", STRFTIME_CHILD, str(folder), STRFTIME_TEMPLATE],
        env={**os.environ, "TZ": tz},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    got, want = json.loads(out.stdout)
    assert got == want
