"""Reasoning models' thinking, apart from the answer: `<think>...</think>` goes to the message's
`reasoning_content` (and the stream's `delta.reasoning_content`), as vLLM's and llama.cpp's
servers return it.

Qwen3 writes `<think>` itself; DeepSeek-R1's distills get it at the end of the prompt from their
chat template and write only `</think>`: the splitter starts inside the thinking when the
rendered prompt ends with `<think>`. An answer that never closes its thinking (cut by max_tokens)
is all reasoning.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def prompt_opens_thinking(prompt: str) -> bool:
    return prompt.rstrip().endswith(OPEN)


def held_prefix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could be the start of `tag`. Runs on every
    streamed chunk: one `find` of the tag's first character in the last few characters."""
    at = text.find(tag[0], max(0, len(text) - len(tag) + 1))
    while at >= 0:
        if tag.startswith(text[at:]):
            return len(text) - at
        at = text.find(tag[0], at + 1)
    return 0


class ReasoningSplitter:
    """Feed the answer's text as it streams; each call returns (reasoning, content) that is
    certain so far. A possible start of a tag is held back until it is decided."""

    def __init__(self, thinking: bool) -> None:
        # "start": the answer may still open with <think>; "think"; "answer".
        self._state = "think" if thinking else "start"
        self._buf = ""
        # After </think> the answer's leading newlines are the template's, not the answer's.
        self._strip_newlines = False

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning = content = ""
        if self._state == "start":
            head = self._buf.lstrip()
            if OPEN.startswith(head) and head != OPEN:
                return "", ""  # too little to tell
            if head.startswith(OPEN):
                self._buf = head[len(OPEN) :]
                self._state = "think"
            else:
                self._state = "answer"
        if self._state == "think":
            at = self._buf.find(CLOSE)
            if at < 0:
                keep = held_prefix(self._buf, CLOSE)
                reasoning = self._buf[: len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep :]
                return reasoning, ""
            reasoning, self._buf = self._buf[:at], self._buf[at + len(CLOSE) :]
            self._state = "answer"
            self._strip_newlines = True
        content, self._buf = self._buf, ""
        if self._strip_newlines:
            stripped = content.lstrip("\n")
            if stripped:
                self._strip_newlines = False
            content = stripped
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self._buf = self._buf, ""
        if self._state == "think":
            return rest, ""
        return "", rest
