"""`strata-rs chat` as a user runs it: a real process, its stdin and stdout, the demo model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from strata_rs.demo import DemoNotInstalled, demo_model_path


def test_a_multi_turn_chat_with_reset(tmp_path: Path) -> None:
    try:
        demo_model_path()
    except DemoNotInstalled as e:
        pytest.skip(str(e))
    turns = [
        "What is the capital of France? Answer in one sentence.",
        "What is the capital of Germany?",
        "/reset",
        "What is 2+2?",
        "/exit",
    ]
    out = subprocess.run(
        [sys.executable, "-m", "strata_rs.cli", "chat", "--temperature", "0", "--stats"],
        input="\n".join(turns) + "\n",
        capture_output=True,
        text=True,
        timeout=180,
        # The disk tier in a folder of the test's own.
        env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)},
    )
    assert out.returncode == 0, out.stderr
    lines = [x.removeprefix("> ") for x in out.stdout.splitlines()]
    assert lines[0].startswith("strata-rs chat: SmolLM2-135M-Instruct.Q4_1.gguf (/reset")
    answers = [x for x in lines[1:] if x and not x.startswith("(")]
    assert answers == [
        "The capital of France is Paris.",
        "The capital of Germany is Berlin.",
        "The answer to this classic math problem is 4.",
    ]
    assert "(new conversation)" in lines
    stats = [x for x in lines if x.startswith("(") and "tokens in" in x]
    assert len(stats) == 3
    # The second turn's prompt starts with the whole first turn: the cache serves more of it
    # than of the first turn's (whose shared part is at most the system prompt).
    cached = [int(x.rsplit(", ", 1)[1].split()[0]) for x in stats]
    assert cached[1] > cached[0]
