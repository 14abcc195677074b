"""Tool calling and reasoning content on the chat endpoint.

- The parsers, on answers written in each family's format (Qwen2.5/Qwen3's hermes tags, Llama
  3.1's JSON, Mistral v0.3's and v11's [TOOL_CALLS]), whole and split at every position as a
  stream splits them: the same content and calls either way.
- On the tiny random model with real templates (tests/fixtures/templates): the format found from
  the template, `auto` calls parsed from an answer forced by a regex (the random model would not
  write one), `required` and named calls constrained by their schemas, a history with calls and
  results rendered as each template renders it, reasoning_content, and the errors.
- On the real SmolLM2 (whose template has no tools: the generic prompt) with the openai client:
  named and required calls, plain and streamed, valid against their schemas, and a conversation
  that goes on after the tool's result.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from strata_rs import Engine
from strata_rs.server import Settings
from strata_rs.server.reasoning import ReasoningSplitter
from strata_rs.server.tools import (
    GENERIC_PROMPT,
    ToolOutput,
    ToolRequest,
    detect_format,
    parse_tool_request,
)
from test_server import asgi_client, events

pytestmark = pytest.mark.anyio

MakeModel = Callable[..., Path]
TEMPLATES = Path(__file__).parent / "fixtures" / "templates"
CHAT = "/v1/chat/completions"

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
# For the random model: every field bounded, so that a constrained answer always ends.
DAYS_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


def tool(name: str, parameters: dict[str, Any], description: str = "") -> dict[str, Any]:
    function = {"name": name, "description": description or name, "parameters": parameters}
    return {"type": "function", "function": function}


WEATHER = tool("get_weather", WEATHER_SCHEMA, "The current weather in a city")
FORECAST = tool("get_forecast", DAYS_SCHEMA, "The forecast for the next days")
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}


# -- the parsers ---------------------------------------------------------------------------------

# (format, answer, content, calls as (name, arguments)).
ANSWERS: list[tuple[str, str, str, list[tuple[str, dict[str, Any]]]]] = [
    # Qwen2.5 / Qwen3 / Hermes.
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
        '"celsius"}}\n</tool_call>',
        "",
        [("get_weather", {"city": "Paris", "unit": "celsius"})],
    ),
    (
        "hermes",
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", '
        '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
        "</tool_call>",
        "Let me look.\n\n",
        [("get_weather", {"city": "Zürich", "unit": "celsius"}), ("get_time", {})],
    ),
    # Not JSON inside the tags: left as text.
    (
        "hermes",
        "a <tool_call>not json</tool_call> b",
        "a <tool_call>not json</tool_call> b",
        [],
    ),
    # A stop string cut the closing tag.
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {}}', "", [("get_time", {})]),
    ("hermes", "x < y, and <tool_ is not a tag", "x < y, and <tool_ is not a tag", []),
    # Llama 3.1-3.3.
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
        "",
        [("get_weather", {"city": "Paris", "unit": "celsius"})],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", '
        '"parameters": {"city": "Rome", "unit": "celsius"}}',
        "",
        [("get_time", {}), ("get_weather", {"city": "Rome", "unit": "celsius"})],
    ),
    ("llama3_json", "It is sunny in Paris.", "It is sunny in Paris.", []),
    ("llama3_json", "{not a call}", "{not a call}", []),
    # Mistral v0.3 and v11+.
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
        '"celsius"}}, {"name": "get_time", "arguments": {}}]',
        "",
        [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {})],
    ),
    (
        "mistral",
        'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
        "[TOOL_CALLS]get_time[ARGS]{}",
        "Checking.",
        [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {})],
    ),
    ("mistral", "[TOOL_CALLS] [oops", "[TOOL_CALLS] [oops", []),
]


def run(fmt: str, pieces: list[str], parallel: bool = True) -> tuple[str, list[Any]]:
    out = ToolOutput(ToolRequest([], "auto", parallel), fmt)
    content = ""
    calls = []
    for i, piece in enumerate(pieces):
        text, deltas = out.feed(piece, i == len(pieces) - 1)
        content += text
        calls += [(d.name, json.loads(d.arguments)) for d in deltas]
    return content, calls


def splits(text: str) -> list[list[str]]:
    """The text whole, in two pieces at every position, and a character at a time."""
    return [[text], *([text[:i], text[i:]] for i in range(1, len(text))), list(text)]


@pytest.mark.parametrize(("fmt", "answer", "content", "calls"), ANSWERS)
def test_parsers_split_anywhere(
    fmt: str, answer: str, content: str, calls: list[tuple[str, dict[str, Any]]]
) -> None:
    for pieces in splits(answer):
        assert run(fmt, pieces) == (content, calls), pieces


def test_content_streams_before_the_call_is_complete() -> None:
    out = ToolOutput(ToolRequest([], "auto", True), "hermes")
    assert out.feed("Let me look. <tool", False) == ("Let me look. ", [])
    assert out.feed('_call>{"name": "get_time", ', False) == ("", [])
    text, deltas = out.feed('"arguments": {}}</tool_call>', False)
    assert (text, [(d.index, d.name, d.arguments) for d in deltas]) == (
        "",
        [(0, "get_time", "{}")],
    )
    assert deltas[0].id is not None and deltas[0].id.startswith("call_")


def test_parallel_false_keeps_the_first_call() -> None:
    answer = ANSWERS[1][1]
    assert run("hermes", [answer], parallel=False) == (
        "Let me look.\n\n",
        [("get_weather", {"city": "Zürich", "unit": "celsius"})],
    )


@pytest.mark.parametrize(
    ("thinking", "answer", "reasoning", "content"),
    [
        (False, "<think>\nStep one.\n</think>\n\nParis.", "\nStep one.\n", "Paris."),
        (False, "  <think>a</think>b", "a", "b"),
        (False, "Paris, no thinking.", "", "Paris, no thinking."),
        (False, "<thinking is not the tag", "", "<thinking is not the tag"),
        # DeepSeek-R1's distills: the prompt opened the thinking.
        (True, "Step one.\n</think>\n\nParis.", "Step one.\n", "Paris."),
        # Cut by max_tokens while thinking.
        (True, "Step one, then", "Step one, then", ""),
    ],
)
def test_reasoning_split_anywhere(
    thinking: bool, answer: str, reasoning: str, content: str
) -> None:
    for pieces in splits(answer):
        splitter = ReasoningSplitter(thinking)
        got_r = got_c = ""
        for piece in pieces:
            r, c = splitter.feed(piece)
            got_r, got_c = got_r + r, got_c + c
        r, c = splitter.finish()
        assert (got_r + r, got_c + c) == (reasoning, content), pieces


# -- the tiny model with real templates ----------------------------------------------------------


def with_template(model_dir: MakeModel, tmp_path: Path, template: str | None) -> Path:
    """The tiny llama with a fixture chat template (None: its own ChatML one, without tools)."""
    path = tmp_path / f"tiny-{template}"
    shutil.copytree(model_dir("llama", max_position_embeddings=2048), path)
    if template is not None:
        shutil.copy(TEMPLATES / f"{template}.jinja", path / "chat_template.jinja")
    return path


@pytest.mark.parametrize(
    ("template", "fmt"),
    [
        ("qwen25", "hermes"),
        ("qwen3", "hermes"),
        ("llama3", "llama3_json"),
        ("llama31_tools", "llama3_json"),
        ("mistral_tools", "mistral"),
        ("mistral", "generic"),
        (None, "generic"),
    ],
)
async def test_format_from_the_template(
    model_dir: MakeModel, tmp_path: Path, template: str | None, fmt: str
) -> None:
    from strata_rs import Tokenizer

    assert detect_format(Tokenizer.from_dir(with_template(model_dir, tmp_path, template))) == fmt


USER = [{"role": "user", "content": "What is the weather in Paris?"}]


async def post(client: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    r = await client.post(CHAT, json={"messages": USER, "max_tokens": 64, **body})
    assert r.status_code == 200, r.text
    return r.json()


async def post_stream(client: httpx.AsyncClient, **body: Any) -> list[dict[str, Any]]:
    r = await client.post(CHAT, json={"messages": USER, "max_tokens": 64, "stream": True, **body})
    assert r.status_code == 200, r.text
    out = events(r.text)
    assert out[-1] == "[DONE]"
    return out[:-1]


def assembled(chunks: list[dict[str, Any]]) -> tuple[dict[str, Any], str | None]:
    """A streamed answer put together as the openai client does: content and reasoning joined,
    each call's pieces joined by its index."""
    content = reasoning = ""
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in chunks:
        (choice,) = chunk["choices"]
        delta = choice["delta"]
        content += delta.get("content") or ""
        reasoning += delta.get("reasoning_content") or ""
        # (The openai client's model_dump() writes absent fields as None.)
        for piece in delta.get("tool_calls") or []:
            call = calls.setdefault(piece["index"], {"function": {"arguments": ""}})
            if piece.get("id") is not None:
                call["id"], call["type"] = piece["id"], piece["type"]
                call["function"]["name"] = piece["function"]["name"]
            call["function"]["arguments"] += piece["function"]["arguments"]
        finish = choice["finish_reason"] or finish
    message: dict[str, Any] = {"content": content, "reasoning": reasoning}
    message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, finish


# Forced answers in each format: the random model writes the calls it is made to.
FORCED = {
    "qwen3": '<tool_call>\\n\\{"name": "get_weather", "arguments": \\{"city": "Paris", "unit": '
    '"celsius"\\}\\}\\n</tool_call>',
    "llama31_tools": '\\{"name": "get_weather", "parameters": \\{"city": "Paris", "unit": '
    '"celsius"\\}\\}',
    "mistral_tools": '\\[TOOL_CALLS\\] \\[\\{"name": "get_weather", "arguments": \\{"city": '
    '"Paris", "unit": "celsius"\\}\\}\\]',
}


@pytest.mark.parametrize("template", sorted(FORCED))
async def test_auto_calls_in_each_format(
    model_dir: MakeModel, tmp_path: Path, template: str
) -> None:
    engine = await Engine.load(with_template(model_dir, tmp_path, template))
    body = {
        "tools": [WEATHER, TIME],
        "structured_outputs": {"regex": FORCED[template]},
        "temperature": 0,
        # The tiny vocabulary spells the call nearly a byte at a time.
        "max_tokens": 200,
    }
    async with asgi_client(engine) as client:
        answer = await post(client, **body)
        (choice,) = answer["choices"]
        assert choice["finish_reason"] == "tool_calls"
        message = choice["message"]
        assert message["content"] is None
        (call,) = message["tool_calls"]
        assert call["type"] == "function"
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
        assert (
            len(call["id"]) == 9 if template == "mistral_tools" else call["id"].startswith("call_")
        )

        streamed, finish = assembled(await post_stream(client, **body))
        assert finish == "tool_calls"
        assert streamed["content"] == ""
        assert [c["function"] for c in streamed["tool_calls"]] == [call["function"]]

        # The call and its result go back through the template, and the conversation goes on.
        history = [
            *USER,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": '{"temperature": 18}'},
        ]
        r = await client.post("/tokenize", json={"messages": history, "tools": [WEATHER, TIME]})
        assert r.status_code == 200, r.text
        rendered = engine.tokenizer.decode(r.json()["tokens"])
        # The result is quoted as it is (Qwen, Llama) or as a JSON string (Mistral).
        result = (
            '"{\\"temperature\\": 18}"' if template == "mistral_tools" else '{"temperature": 18}'
        )
        assert '"city": "Paris"' in rendered and result in rendered, rendered
        # ignore_eos: whether the random model picks EOS early depends on the CPU's float
        # path (it did on an AVX2-only machine), not on what is tested here.
        answer = await post(
            client, messages=history, tools=[WEATHER, TIME], max_tokens=4, ignore_eos=True
        )
        assert answer["choices"][0]["finish_reason"] == "length"
        assert answer["usage"]["completion_tokens"] == 4
    await engine.close()


async def test_named_and_required_calls_follow_their_schemas(
    model_dir: MakeModel, tmp_path: Path
) -> None:
    engine = await Engine.load(with_template(model_dir, tmp_path, "qwen3"))
    tools = [FORECAST, TIME]
    named = {"type": "function", "function": {"name": "get_forecast"}}
    async with asgi_client(engine) as client:
        for seed in range(4):
            body = {"tools": tools, "tool_choice": named, "seed": seed, "temperature": 1.0}
            answer = await post(client, **body)
            (choice,) = answer["choices"]
            assert choice["finish_reason"] == "tool_calls"
            (call,) = choice["message"]["tool_calls"]
            assert call["function"]["name"] == "get_forecast"
            jsonschema.validate(json.loads(call["function"]["arguments"]), DAYS_SCHEMA)
            # Streamed: the arguments arrive in pieces, the same call (same seed).
            streamed, finish = assembled(await post_stream(client, **body))
            assert finish == "tool_calls"
            assert [c["function"] for c in streamed["tool_calls"]] == [call["function"]]

            for parallel in (True, False):
                body = {
                    "tools": tools,
                    "tool_choice": "required",
                    "parallel_tool_calls": parallel,
                    "seed": seed,
                    "temperature": 1.0,
                    "max_tokens": 200,
                }
                answer = await post(client, **body)
                (choice,) = answer["choices"]
                assert choice["finish_reason"] == "tool_calls", choice
                calls = choice["message"]["tool_calls"]
                assert calls and (parallel or len(calls) == 1)
                for c in calls:
                    schema = DAYS_SCHEMA if c["function"]["name"] == "get_forecast" else {}
                    jsonschema.validate(json.loads(c["function"]["arguments"]), schema)
                streamed, finish = assembled(await post_stream(client, **body))
                assert finish == "tool_calls"
                assert [c["function"] for c in streamed["tool_calls"]] == [
                    c["function"] for c in calls
                ]
    await engine.close()


async def test_the_generic_prompt_for_a_template_without_tools(
    model_dir: MakeModel, tmp_path: Path
) -> None:
    engine = await Engine.load(with_template(model_dir, tmp_path, None))
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_time", "arguments": "{}"},
    }
    history = [
        {"role": "system", "content": "Be brief."},
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
        {"role": "tool", "tool_call_id": "call_2", "content": "13:00"},
    ]
    async with asgi_client(engine) as client:
        r = await client.post("/tokenize", json={"messages": history, "tools": [TIME]})
        assert r.status_code == 200, r.text
        rendered = engine.tokenizer.decode(r.json()["tokens"])
        prompt = GENERIC_PROMPT.format(tools=json.dumps(TIME))
        expected = (
            f"<|im_start|>system\nBe brief.\n\n{prompt}<|im_end|>\n"
            "<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n"
            '<|im_start|>assistant\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
            "</tool_call><|im_end|>\n"
            "<|im_start|>user\n<tool_response>\n12:00\n</tool_response>\n"
            "<tool_response>\n13:00\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n"
        )
        assert rendered == expected
    await engine.close()


async def test_reasoning_content(model_dir: MakeModel, tmp_path: Path) -> None:
    engine = await Engine.load(with_template(model_dir, tmp_path, "qwen3"))
    body = {"structured_outputs": {"regex": "<think>\\nabc\\n</think>\\n\\nxyz"}, "temperature": 0}
    async with asgi_client(engine) as client:
        message = (await post(client, **body))["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"]) == ("\nabc\n", "xyz")
        streamed, _ = assembled(await post_stream(client, **body))
        assert (streamed["reasoning"], streamed["content"]) == ("\nabc\n", "xyz")
    async with asgi_client(engine, Settings(reasoning_format="inline")) as client:
        message = (await post(client, **body))["choices"][0]["message"]
        assert message == {"role": "assistant", "content": "<think>\nabc\n</think>\n\nxyz"}
    await engine.close()


W = [WEATHER]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
BAD_TOOLS: list[tuple[dict[str, Any], str, str]] = [
    ({"tools": {"a": 1}}, "tools", "must be an array of tools, got object"),
    ({"tools": [3]}, "tools[0]", "must be an object, got integer"),
    ({"tools": [{"function": {}}]}, "tools[0].type", "must be 'function', got None"),
    ({"tools": [{"type": "function"}]}, "tools[0].function", "must be an object, got null"),
    (
        {"tools": [{"type": "function", "function": {"name": "a b"}}]},
        "tools[0].function.name",
        "must be 1 to 64 letters, digits, underscores or dashes, got 'a b'",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f\n"}}]},
        "tools[0].function.name",
        "must be 1 to 64 letters, digits, underscores or dashes, got 'f\\n'",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
        "tools[0].function.parameters",
        "must be a JSON schema object, got array",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "description": 1}}]},
        "tools[0].function.description",
        "must be a string, got integer",
    ),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "'get_weather' is defined twice"),
    (
        {"tools": W, "tool_choice": "any"},
        "tool_choice",
        "must be none, auto, required or a function, got 'any'",
    ),
    ({"tool_choice": "required"}, "tool_choice", "'required' needs tools"),
    (
        {"tools": W, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice.function.name",
        "no tool named 'nope' in tools",
    ),
    ({"tools": W, "tool_choice": {"type": "x"}}, "tool_choice.type", "must be 'function', got 'x'"),
    (
        {"tools": W, "parallel_tool_calls": "yes"},
        "parallel_tool_calls",
        "must be a boolean, got string",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "strict": 1}}]},
        "tools[0].function.strict",
        "must be a boolean, got integer",
    ),
    (
        {"tools": W, "tool_choice": NAMED, "response_format": {"type": "json_object"}},
        "tool_choice",
        "'get_weather' cannot be combined with response_format",
    ),
    (
        {"tools": W, "tool_choice": "required", "structured_outputs": {"regex": "a"}},
        "tool_choice",
        "'required' cannot be combined with structured_outputs",
    ),
    (
        {
            "tools": [tool("f", {"type": "object", "properties": {"a": {"type": "nope"}}})],
            "tool_choice": "required",
        },
        "tools",
        None,  # the compiler's own words follow "cannot compile"
    ),
    (
        {
            "tools": [tool("f", {"type": "object", "properties": {"a": {"type": "nope"}}})],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
        },
        "tools[0].function.parameters",
        None,
    ),
    (
        {
            "messages": [
                *USER,
                {
                    "role": "assistant",
                    "tool_calls": [{"function": {"name": "f", "arguments": "{"}}],
                },
            ]
        },
        "messages[1].tool_calls[0].function.arguments",
        "is not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 "
        "(char 1))",
    ),
    (
        {
            "messages": [
                *USER,
                {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]},
            ]
        },
        "messages[1].tool_calls[0].function.name",
        "must be a string, got null",
    ),
]


async def test_bad_tool_requests_name_the_field(model_dir: MakeModel) -> None:
    engine = await Engine.load(model_dir("llama", max_position_embeddings=2048))
    async with asgi_client(engine) as client:
        for body, param, reason in BAD_TOOLS:
            r = await client.post(CHAT, json={"messages": USER, **body})
            assert r.status_code == 400, (body, r.text)
            error = r.json()["error"]
            assert error["param"] == param, body
            if reason is None:
                assert error["message"].startswith(f"{param}: cannot compile"), error
            else:
                assert error["message"] == f"{param}: {reason}", body
    await engine.close()


def test_no_tools_no_tool_request() -> None:
    assert parse_tool_request({}) is None
    assert parse_tool_request({"tools": [], "tool_choice": "none"}) is None


# -- the real SmolLM2 with the openai client -----------------------------------------------------


def test_smollm2_calls_tools_through_the_openai_client(smollm2_server: Any) -> None:
    import openai

    client = openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="unused")
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    model = client.models.list().data[0].id

    answer = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=[WEATHER, TIME],  # type: ignore[list-item]
        tool_choice=NAMED,  # type: ignore[arg-type]
        max_tokens=64,
        temperature=0,
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls is not None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    arguments = json.loads(call.function.arguments)  # type: ignore[union-attr]
    jsonschema.validate(arguments, WEATHER_SCHEMA)

    # Required, streamed: the openai client's chunks put together.
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=[WEATHER, TIME],  # type: ignore[list-item]
        tool_choice="required",
        max_tokens=96,
        temperature=0,
        stream=True,
    )
    chunks = [c.model_dump() for c in stream]
    streamed, finish = assembled(chunks)
    assert finish == "tool_calls"
    assert streamed["tool_calls"]
    for c in streamed["tool_calls"]:
        schema = WEATHER_SCHEMA if c["function"]["name"] == "get_weather" else {}
        jsonschema.validate(json.loads(c["function"]["arguments"]), schema)

    # The call's result goes back, and the model answers in words.
    messages += [
        choice.message.model_dump(exclude_none=True),
        {
            "role": "tool",
            "tool_call_id": call.id,
            "content": json.dumps({"temperature": 18, "unit": arguments["unit"], "sky": "sunny"}),
        },
    ]
    answer = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=[WEATHER, TIME],
        max_tokens=48,
        temperature=0,  # type: ignore[list-item]
    )
    final = answer.choices[0]
    assert final.finish_reason in ("stop", "length", "tool_calls")
    assert final.message.content or final.message.tool_calls
    assert answer.usage is not None and answer.usage.prompt_tokens > 100
