"""Tool calling on the chat endpoint: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`.

The tools go to the model's chat template as its `tools` variable (what transformers passes), and
the calls come back out of the generated text in the format the template taught the model:
- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5, Qwen3, Hermes);
- `llama3_json`: the whole answer is `{"name": ..., "parameters": {...}}`, calls separated by `;`,
  after an optional `<|python_tag|>` (Llama 3.1-3.3);
- `mistral`: `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}` (v3), or `name[ARGS]{...}`
  per call (v11 and later);
- `generic`: the template ignores `tools`, so the tools are described in a system message of our
  own (the hermes format), and the history's calls and results are written into message text.

`tool_choice: "required"` and a named function constrain the output with a JSON schema (as vLLM
does), whatever the format: a named call's output is its arguments object, a required call's is
a JSON array of `{"name", "parameters"}`. Their arguments always parse and match the schemas.

Each parser takes the text as it streams (`feed`) and returns what is certain so far: content to
show now, and calls as `CallDelta`s; a possible start of a tag is held back until it is decided.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from strata_rs import StrataError, Tokenizer
from strata_rs.server.protocol import bool_field, invalid, type_name
from strata_rs.server.reasoning import held_prefix

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_CHOICES = ("none", "auto", "required")
# The arguments of a tool without `parameters`: none.
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any]
    # The entry as the client sent it: what the chat template gets.
    definition: dict[str, Any]


@dataclass
class ToolRequest:
    tools: list[Tool]
    # "none", "auto", "required", or the name of the function that must be called.
    choice: str
    parallel: bool

    @property
    def named(self) -> Tool | None:
        if self.choice in _CHOICES:
            return None
        return next(t for t in self.tools if t.name == self.choice)

    @property
    def constrained(self) -> bool:
        return self.choice not in ("none", "auto")


def parse_tool_request(body: Mapping[str, Any]) -> ToolRequest | None:
    """`tools`, `tool_choice` and `parallel_tool_calls`, checked; None when no tool is given and
    none is asked for. Errors name the field (`tools[1].function.name`)."""
    raw_tools = body.get("tools")
    choice_value = body.get("tool_choice")
    parallel = bool_field(body, "parallel_tool_calls", True)
    tools: list[Tool] = []
    if raw_tools is not None:
        if not isinstance(raw_tools, list):
            raise invalid("tools", f"must be an array of tools, got {type_name(raw_tools)}")
        seen: set[str] = set()
        for i, entry in enumerate(raw_tools):
            tool = _parse_tool(i, entry)
            if tool.name in seen:
                raise invalid(f"tools[{i}].function.name", f"{tool.name!r} is defined twice")
            seen.add(tool.name)
            tools.append(tool)
    choice = _parse_choice(choice_value, tools)
    if not tools:
        return None
    return ToolRequest(tools, choice, parallel)


def _parse_tool(i: int, entry: Any) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(entry, dict):
        raise invalid(where, f"must be an object, got {type_name(entry)}")
    if entry.get("type") != "function":
        raise invalid(f"{where}.type", f"must be 'function', got {entry.get('type')!r}")
    function = entry.get("function")
    if not isinstance(function, dict):
        raise invalid(f"{where}.function", f"must be an object, got {type_name(function)}")
    name = function.get("name")
    if not isinstance(name, str):
        raise invalid(f"{where}.function.name", f"must be a string, got {type_name(name)}")
    if not _NAME.fullmatch(name):
        raise invalid(
            f"{where}.function.name",
            f"must be 1 to 64 letters, digits, underscores or dashes, got {name!r}",
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise invalid(
            f"{where}.function.description", f"must be a string, got {type_name(description)}"
        )
    parameters = function.get("parameters")
    if parameters is None:
        parameters = _NO_PARAMETERS
    elif not isinstance(parameters, dict):
        raise invalid(
            f"{where}.function.parameters",
            f"must be a JSON schema object, got {type_name(parameters)}",
        )
    # Checked, not used: `tool_choice` decides whether calls are constrained to the schema.
    bool_field(function, "strict", False, where=f"{where}.function.strict")
    return Tool(name, parameters, entry)


def _parse_choice(value: Any, tools: Sequence[Tool]) -> str:
    if value is None:
        return "auto" if tools else "none"
    if isinstance(value, str):
        if value not in _CHOICES:
            raise invalid(
                "tool_choice", f"must be none, auto, required or a function, got {value!r}"
            )
        if value == "required" and not tools:
            raise invalid("tool_choice", "'required' needs tools")
        return value
    if not isinstance(value, dict):
        raise invalid("tool_choice", f"must be a string or an object, got {type_name(value)}")
    if value.get("type") != "function":
        raise invalid("tool_choice.type", f"must be 'function', got {value.get('type')!r}")
    function = value.get("function")
    if not isinstance(function, dict):
        raise invalid("tool_choice.function", f"must be an object, got {type_name(function)}")
    name = function.get("name")
    if not isinstance(name, str):
        raise invalid("tool_choice.function.name", f"must be a string, got {type_name(name)}")
    if not any(t.name == name for t in tools):
        raise invalid("tool_choice.function.name", f"no tool named {name!r} in tools")
    return name


# llguidance's options for a call's JSON: one space after `:` and `,` and none elsewhere, as
# json.dumps writes it. Its default lets whitespace run anywhere, and a model that keeps writing
# it (a small or unsure one) never finishes the call.
_COMPACT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def constraint(request: ToolRequest) -> tuple[dict[str, Any], str]:
    """The `structured_outputs` of a required or named call, and the field that its compile
    errors name."""
    named = request.named
    if named is not None:
        i = request.tools.index(named)
        schema = {**named.parameters, "x-guidance": _COMPACT}
        return {"json": schema}, f"tools[{i}].function.parameters"
    calls: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": t.name}, "parameters": t.parameters},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for t in request.tools
            ]
        },
    }
    if not request.parallel:
        calls["maxItems"] = 1
    calls["x-guidance"] = _COMPACT
    return {"json": calls}, "tools"


# ---- the template side ---------------------------------------------------------------------------

FORMATS = ("hermes", "llama3_json", "mistral", "generic")
_PROBE_NAME = "strata_rs_probe_function"
_PROBE = {
    "type": "function",
    "function": {
        "name": _PROBE_NAME,
        "description": "probe",
        "parameters": {"type": "object", "properties": {}},
    },
}


def detect_format(tokenizer: Tokenizer) -> str:
    """The tool-call format the model's chat template teaches: rendered with a probe tool, the
    template's instructions name it. `generic` when the template does not show the tools."""
    messages = [{"role": "user", "content": "hi"}]
    try:
        text = tokenizer.apply_chat_template(messages, True, tools=[_PROBE])
    except StrataError:
        return "generic"
    if _PROBE_NAME not in text:
        return "generic"
    if "<tool_call>" in text:
        return "hermes"
    if "[AVAILABLE_TOOLS]" in text or "[TOOL_CALLS]" in text:
        return "mistral"
    if '"parameters"' in text:
        return "llama3_json"
    return "hermes"


GENERIC_PROMPT = (
    "You may call functions to answer. The functions you can call, as JSON schemas:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call functions, answer with one JSON object per call, each inside <tool_call></tool_call> "
    "tags:\n<tool_call>\n"
    '{{"name": <function name>, "arguments": <the arguments as a JSON object>}}\n'
    "</tool_call>"
)


def prepare_messages(
    messages: Sequence[dict[str, Any]], request: ToolRequest | None, fmt: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages as the template gets them, and its `tools` variable.

    Assistant `tool_calls` arguments arrive as JSON text (OpenAI's shape) and go to the template
    as objects, which is what the Llama and Mistral templates print with `tojson`. For the generic
    format the tools become a system message and the calls and results become text."""
    out = [_parse_history_calls(i, m) for i, m in enumerate(messages)]
    tools = None
    if request is not None and request.choice != "none":
        tools = [t.definition for t in request.tools]
    if fmt != "generic":
        return out, tools
    out = _history_as_text(out)
    if tools is not None:
        prompt = GENERIC_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
        if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, None


def _parse_history_calls(i: int, message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if calls is None or message.get("role") != "assistant":
        return message
    if not isinstance(calls, list):
        raise invalid(f"messages[{i}].tool_calls", f"must be an array, got {type_name(calls)}")
    parsed = []
    for j, call in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        if not isinstance(call, dict):
            raise invalid(where, f"must be an object, got {type_name(call)}")
        function = call.get("function")
        if not isinstance(function, dict):
            raise invalid(f"{where}.function", f"must be an object, got {type_name(function)}")
        if not isinstance(function.get("name"), str):
            raise invalid(
                f"{where}.function.name", f"must be a string, got {type_name(function.get('name'))}"
            )
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as e:
                raise invalid(f"{where}.function.arguments", f"is not valid JSON ({e})") from None
        if not isinstance(arguments, dict):
            raise invalid(
                f"{where}.function.arguments",
                f"must be a JSON object (or its text), got {type_name(arguments)}",
            )
        parsed.append({**call, "function": {**function, "arguments": arguments}})
    return {**message, "tool_calls": parsed}


def _history_as_text(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For a template without tool support: calls written as the generic prompt asks for them,
    results as user messages (consecutive results in one), so that any template can render them."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            parts = [m["content"]] if isinstance(m.get("content"), str) and m["content"] else []
            for call in m["tool_calls"]:
                f = call["function"]
                call_json = json.dumps({"name": f["name"], "arguments": f["arguments"]})
                parts.append(f"<tool_call>\n{call_json}\n</tool_call>")
            rest = {k: v for k, v in m.items() if k != "tool_calls"}
            out.append({**rest, "content": "\n".join(parts)})
        elif role == "tool":
            result = f"<tool_response>\n{m.get('content')}\n</tool_response>"
            last = out[-1] if out else None
            if last is not None and last.get("_tool_results"):
                last["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result, "_tool_results": True})
        else:
            out.append(m)
    for m in out:
        m.pop("_tool_results", None)
    return out


# ---- parsing the output ------------------------------------------------------------------------


@dataclass
class CallDelta:
    """A piece of a tool call as OpenAI streams it: the first piece of a call has its id and
    name, later ones only add to `arguments`."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def body(self) -> dict[str, Any]:
        function: dict[str, Any] = {"arguments": self.arguments}
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
            function = {"name": self.name, **function}
        out["function"] = function
        return out


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it


def _call_from(obj: Any, keys: tuple[str, ...] = ("arguments", "parameters")) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in keys:
        if key in obj:
            arguments = obj[key]
            if isinstance(arguments, str):
                # Some models write the arguments as JSON text inside the JSON.
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError:
                    return None
            if not isinstance(arguments, dict):
                return None
            return ParsedCall(obj["name"], json.dumps(arguments, ensure_ascii=False))
    return ParsedCall(obj["name"], "{}")


def _json_values(text: str) -> list[Any] | None:
    """The JSON values in `text`, separated by whitespace or `;`; None when any part is not."""
    decoder = json.JSONDecoder()
    values = []
    i, n = 0, len(text)
    while True:
        while i < n and (text[i].isspace() or text[i] == ";"):
            i += 1
        if i == n:
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        values.append(value)


class CallParser:
    """Splits generated text into content and tool calls; `feed` as the text streams, then
    `finish` once. Each returns (content to show now, calls completed now)."""

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ParsedCall]]:
        raise NotImplementedError


class _GrowingText:
    """Text that grows a piece at a time, as a stream gives it: an append costs the piece, and a
    search for a tag looks at the new piece and the few characters before it. (A str attribute
    grown by `+=` is copied whole each time: quadratic over a long answer.)"""

    def __init__(self) -> None:
        self._pieces: list[str] = []
        self._len = 0
        self._tail = ""

    def add(self, piece: str, tag: str = "") -> int:
        """Appends `piece`; where `tag` now starts, if it ends in this piece, else -1."""
        window = self._tail + piece
        at = window.find(tag) if tag else -1
        start = self._len - len(self._tail)
        self._pieces.append(piece)
        self._len += len(piece)
        self._tail = window[max(0, len(window) - len(tag) + 1) :] if tag else ""
        return start + at if at >= 0 else -1

    def take(self) -> str:
        """The whole text; the buffer is empty after."""
        text = "".join(self._pieces)
        self._pieces, self._len, self._tail = [], 0, ""
        return text


class HermesParser(CallParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._held = ""  # outside a call: the end that may start a tag
        self._body = _GrowingText()  # inside a call
        self._in_call = False

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        content: list[str] = []
        calls: list[ParsedCall] = []
        while text:
            if not self._in_call:
                buf, text = self._held + text, ""
                at = buf.find(self.OPEN)
                if at < 0:
                    keep = held_prefix(buf, self.OPEN)
                    content.append(buf[: len(buf) - keep])
                    self._held = buf[len(buf) - keep :]
                    break
                content.append(buf[:at])
                self._held, text = "", buf[at + len(self.OPEN) :]
                self._in_call = True
            else:
                at = self._body.add(text, self.CLOSE)
                if at < 0:
                    break
                full = self._body.take()
                body, text = full[:at], full[at + len(self.CLOSE) :]
                self._in_call = False
                call = _call_from(_single_json(body))
                if call is None:
                    content.append(self.OPEN + body + self.CLOSE)
                else:
                    calls.append(call)
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ParsedCall]]:
        if not self._in_call:
            rest, self._held = self._held, ""
            return rest, []
        # The output ended inside a call (a stop string, or the tag's end left out before EOS).
        rest = self._body.take()
        call = _call_from(_single_json(rest))
        return ("", [call]) if call is not None else (self.OPEN + rest, [])


def _single_json(text: str) -> Any:
    values = _json_values(text)
    return values[0] if values is not None and len(values) == 1 else None


class Llama3JsonParser(CallParser):
    """A call is the whole answer: decided at its first visible character."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self._buf = _GrowingText()
        self._head = ""  # the answer's start, until it is decided
        self._mode: str | None = None  # "content" or "call" once decided

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        if self._mode == "content":
            return text, []
        if self._mode == "call":
            self._buf.add(text)
            return "", []
        self._head += text
        head = self._head.lstrip()
        if not head or (self.TAG.startswith(head) and head != self.TAG):
            return "", []
        if head.startswith(self.TAG):
            head = head[len(self.TAG) :].lstrip()
            if not head:
                return "", []
        self._mode = "call" if head.startswith("{") else "content"
        out, self._head = self._head, ""
        if self._mode == "content":
            return out, []
        self._buf.add(out)
        return "", []

    def finish(self) -> tuple[str, list[ParsedCall]]:
        rest = self._head + self._buf.take()
        self._head = ""
        if self._mode == "content" or not rest.strip():
            return rest, []
        body = rest.strip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG) :]
        values = _json_values(body)
        calls = [_call_from(v) for v in values or ()]
        if not values or any(c is None for c in calls):
            return rest, []
        return "", [c for c in calls if c is not None]


class MistralParser(CallParser):
    TAG = "[TOOL_CALLS]"
    ARGS = "[ARGS]"

    def __init__(self) -> None:
        self._held = ""  # before the calls: the end that may start the tag
        self._calls = _GrowingText()  # after it
        self._in_calls = False

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        if self._in_calls:
            self._calls.add(text)
            return "", []
        buf = self._held + text
        at = buf.find(self.TAG)
        if at < 0:
            keep = held_prefix(buf, self.TAG)
            self._held = buf[len(buf) - keep :]
            return buf[: len(buf) - keep], []
        self._held = ""
        self._calls.add(buf[at + len(self.TAG) :])
        self._in_calls = True
        return buf[:at], []

    def finish(self) -> tuple[str, list[ParsedCall]]:
        if not self._in_calls:
            rest, self._held = self._held, ""
            return rest, []
        rest = self._calls.take()
        calls = self._parse(rest)
        return ("", calls) if calls else (self.TAG + rest, [])

    def _parse(self, text: str) -> list[ParsedCall] | None:
        body = text.strip()
        if body.startswith("["):
            values = _json_values(body)
            if values is None or len(values) != 1 or not isinstance(values[0], list):
                return None
            calls = [_call_from(v) for v in values[0]]
        else:
            # v11: name[ARGS]{...}, the next call after another [TOOL_CALLS].
            calls = []
            for part in body.split(self.TAG):
                name, sep, arguments = part.partition(self.ARGS)
                value = _single_json(arguments) if sep else None
                calls.append(_call_from({"name": name.strip(), "arguments": value}))
        if not calls or any(c is None for c in calls):
            return None
        return [c for c in calls if c is not None]


class RequiredParser(CallParser):
    """The constrained output of `tool_choice: required`: a JSON array of {name, parameters}."""

    def __init__(self) -> None:
        self._buf = _GrowingText()

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        self._buf.add(text)
        return "", []

    def finish(self) -> tuple[str, list[ParsedCall]]:
        rest = self._buf.take()
        value = _single_json(rest)
        calls = [_call_from(v, ("parameters",)) for v in value] if isinstance(value, list) else []
        if not calls or any(c is None for c in calls):
            # Cut short (max_tokens): what there is, as text.
            return rest, []
        return "", [c for c in calls if c is not None]


PARSERS: dict[str, type[CallParser]] = {
    "hermes": HermesParser,
    "generic": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}


def call_id(fmt: str) -> str:
    """A new call's id: Mistral's templates accept 9 letters and digits only."""
    if fmt == "mistral":
        alphabet = string.ascii_letters + string.digits
        return "".join(secrets.choice(alphabet) for _ in range(9))
    return f"call_{secrets.token_hex(12)}"


@dataclass
class ToolOutput:
    """One choice's tool calls as they stream: which parser, how many calls so far."""

    request: ToolRequest
    fmt: str
    parser: CallParser | None = None
    count: int = 0
    calls: list[dict[str, Any]] = field(default_factory=list)
    # A named call's arguments as they stream, joined by message_calls.
    _arguments: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.request.named is None:
            self.parser = RequiredParser() if self.request.choice == "required" else None
            if self.parser is None:
                self.parser = PARSERS[self.fmt]()

    def feed(self, text: str, final: bool) -> tuple[str, list[CallDelta]]:
        named = self.request.named
        if named is not None:
            # The output is the call's arguments, streamed as they come.
            if not text and not (final and self.count == 0):
                return "", []
            first = self.count == 0
            self.count = 1
            if first:
                self.calls.append({"id": call_id(self.fmt), "name": named.name, "arguments": ""})
            self._arguments.append(text)
            if first:
                return "", [CallDelta(0, text, self.calls[0]["id"], named.name)]
            return "", [CallDelta(0, text)]
        assert self.parser is not None
        content, calls = self.parser.feed(text)
        if final:
            more, last = self.parser.finish()
            content += more
            calls += last
        deltas = []
        for call in calls:
            if self.count and not self.request.parallel:
                continue  # parallel_tool_calls false: the first call only
            entry = {"id": call_id(self.fmt), "name": call.name, "arguments": call.arguments}
            self.calls.append(entry)
            deltas.append(CallDelta(self.count, call.arguments, entry["id"], call.name))
            self.count += 1
        return content, deltas

    def message_calls(self) -> list[dict[str, Any]]:
        """The calls as `message.tool_calls`."""
        if self._arguments:
            self.calls[0]["arguments"] = "".join(self._arguments)
        return [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": c["arguments"]},
            }
            for c in self.calls
        ]
