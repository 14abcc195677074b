"""Progress of a long benchmark run, on stderr: which step, what is left, roughly how long.

Each step is announced when it starts:

    [3/24] round 1/3, transformers: prefill and decode (21 left, ~4m10s to go)

The estimate (mean time of the steps finished so far, times the steps not finished) appears from
the second step on. When the stream is a terminal the line is rewritten in place; otherwise
(a log file, a pipe, CI) every step gets a line of its own, so the log reads step by step.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO


def format_duration(seconds: float) -> str:
    """42s, 3m05s, 1h02m: short and fixed in shape."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Progress:
    """Announces `total` steps one by one. `tty=None` asks the stream whether it is a terminal;
    `clock` is injectable so that tests can pin the estimate."""

    def __init__(
        self,
        total: int,
        stream: TextIO | None = None,
        *,
        tty: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if total < 0:
            raise ValueError(f"total: must be >= 0, got {total}")
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        if tty is None:
            isatty = getattr(self.stream, "isatty", None)
            tty = bool(isatty()) if isatty is not None else False
        self.tty = tty
        self.clock = clock
        self.started = 0  # steps announced
        self._t0: float | None = None
        self._width = 0  # length of the line on screen (tty)

    def line(self, label: str) -> str:
        """The text announcing the next step (without writing it)."""
        i = self.started + 1
        left = max(0, self.total - i)
        eta = ""
        if self._t0 is not None and self.started > 0:
            per_step = (self.clock() - self._t0) / self.started
            eta = f", ~{format_duration(per_step * (self.total - self.started))} to go"
        return f"[{i}/{self.total}] {label} ({left} left{eta})"

    def step(self, label: str) -> None:
        """Announces the next step; the previous one is taken as finished."""
        if self._t0 is None:
            self._t0 = self.clock()
        text = self.line(label)
        self.started += 1
        if self.tty:
            pad = " " * max(0, self._width - len(text))
            self.stream.write(f"\r{text}{pad}")
            self._width = len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def note(self, text: str) -> None:
        """A line that is not a step (a skipped peer, a warning): kept on screen in both modes."""
        if self.tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self._width = 0
        self.stream.write(text + "\n")
        self.stream.flush()

    def done(self) -> None:
        """Ends the display: on a terminal, the last step's line stays and the cursor moves on."""
        if self.tty and self._width:
            self.stream.write("\n")
            self._width = 0
        self.stream.flush()
