"""`strata-rs chat`: a terminal chat with a model, streaming each answer as it is generated.

Multi-turn (the whole conversation is the prompt of each turn, so the conversation cache serves
the part already seen); `/reset` starts a new conversation, `/exit` (or end of input) quits.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, TextIO

HELP = "(/reset: new conversation, /exit: quit)"


async def chat_loop(
    model: Path,
    *,
    max_tokens: int = 512,
    temperature: float = 0.7,
    threads: int | None = None,
    stats: bool = False,
    stdin: TextIO = sys.stdin,
    stdout: TextIO = sys.stdout,
) -> int:
    from strata_rs import Engine

    engine = await Engine.load(str(model), threads=threads)
    try:
        print(f"strata-rs chat: {model.name} {HELP}", file=stdout, flush=True)
        messages: list[dict[str, Any]] = []
        while True:
            print("> ", end="", file=stdout, flush=True)
            line = stdin.readline()
            if not line:
                print(file=stdout)
                return 0
            text = line.strip()
            if text == "/exit":
                return 0
            if text == "/reset":
                messages.clear()
                print("(new conversation)", file=stdout, flush=True)
                continue
            if not text:
                continue
            messages.append({"role": "user", "content": text})
            answer = []
            started = time.perf_counter()
            first: float | None = None
            tokens = 0
            cached = 0
            async for chunk in engine.chat(
                messages, max_tokens=max_tokens, temperature=temperature
            ):
                if chunk.text:
                    first = first or time.perf_counter()
                    answer.append(chunk.text)
                    print(chunk.text, end="", file=stdout, flush=True)
                tokens += len(chunk.token_ids)
                if chunk.usage is not None:
                    cached = chunk.usage.cached_tokens
            print(file=stdout, flush=True)
            messages.append({"role": "assistant", "content": "".join(answer)})
            if stats:
                elapsed = time.perf_counter() - started
                ttft = (first or time.perf_counter()) - started
                print(
                    f"({tokens} tokens in {elapsed:.2f} s, first after {ttft * 1000:.0f} ms, "
                    f"{cached} prompt tokens from the cache)",
                    file=stdout,
                    flush=True,
                )
    finally:
        await engine.close()
