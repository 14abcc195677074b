"""One chat choice's answer as the message it becomes: its text through the reasoning splitter
(`reasoning.py`), then the tool-call parser (`tools.py`), into content, reasoning_content and
tool_calls, as the text streams."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from strata_rs.server.reasoning import ReasoningSplitter
from strata_rs.server.tools import CallDelta, ToolOutput


@dataclass
class MessageDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[CallDelta] = field(default_factory=list)


class MessageParser:
    def __init__(self, tools: ToolOutput | None, reasoning: ReasoningSplitter | None) -> None:
        self.tools = tools
        self.reasoning = reasoning
        # Pieces, joined once by message(): a str grown a token at a time is copied each time.
        self._content: list[str] = []
        self._reasoning: list[str] = []

    def feed(self, text: str, final: bool) -> MessageDelta:
        """The part of `text` that is certain now; `final` with the choice's last text."""
        reasoning, content = "", text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text)
            if final:
                more_reasoning, more_content = self.reasoning.finish()
                reasoning += more_reasoning
                content += more_content
        calls: list[CallDelta] = []
        if self.tools is not None:
            content, calls = self.tools.feed(content, final)
        if content:
            self._content.append(content)
        if reasoning:
            self._reasoning.append(reasoning)
        return MessageDelta(content, reasoning, calls)

    @property
    def called(self) -> bool:
        return self.tools is not None and self.tools.count > 0

    def message(self) -> dict[str, Any]:
        """The whole message, after the final `feed`. A message with tool calls and only
        whitespace around them has null content, as OpenAI's."""
        content = "".join(self._content)
        out: dict[str, Any] = {"role": "assistant", "content": content}
        if self._reasoning:
            out["reasoning_content"] = "".join(self._reasoning)
        if self.called:
            assert self.tools is not None
            out["tool_calls"] = self.tools.message_calls()
            if not content.strip():
                out["content"] = None
        return out

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """`tool_calls` when the answer ended by itself with calls in it."""
        if engine_reason == "stop" and self.called:
            return "tool_calls"
        return engine_reason
