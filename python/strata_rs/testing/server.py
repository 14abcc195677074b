"""`strata-rs serve` as a subprocess on loopback, for tests and the soak benchmark: its log is
read line by line by a thread, so that a caller can wait for a line and inspect the whole log."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import httpx


def serve_argv(*args: str) -> list[str]:
    """The command line of `strata-rs serve` on any free port, in this Python."""
    return [sys.executable, "-m", "strata_rs.cli", "serve", "--port", "0", *args]


class Server:
    """A server subprocess; its log (stderr) is read by a thread, line by line."""

    def __init__(
        self, argv: Sequence[str], env: dict[str, str] | None = None, echo: bool = True
    ) -> None:
        self.proc = subprocess.Popen(
            list(argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.echo = echo
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        line = self.wait_line("listening on http://")
        self.url = line.split("listening on ")[1].split()[0]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if self.echo:
                print("server:", line, end="")  # pytest shows it when a test fails
            self.lines.append(line.rstrip("\n"))
            self._queue.put(line)
        self._queue.put(None)

    def wait_line(self, needle: str, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {needle!r} in the log: {self.lines}") from None
            if line is None:
                raise AssertionError(f"the server exited: {self.lines}")
            if needle in line:
                return line

    def wait_healthy(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"never healthy: {self.lines}")

    def rss_bytes(self) -> int:
        """The server process's resident set size (Linux /proc)."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(f"no VmRSS for pid {self.proc.pid}")

    def kill(self) -> None:
        """SIGKILL: no shutdown path runs (a crash, as far as the server can tell)."""
        self.proc.kill()
        self.proc.wait(timeout=30)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)
