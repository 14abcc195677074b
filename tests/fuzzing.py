"""What the hypothesis tests share: running one example's coroutine so that a hang or a Rust panic
fails that example (reported and shrunk) instead of stopping the run."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

# Seconds one example may take before it counts as a hang (a normal one takes milliseconds).
HANG = 30.0


def no_panic(call: Callable[[], T]) -> T:
    """Runs `call`; a Rust panic (pyo3's PanicException, a BaseException, which hypothesis would
    re-raise at once without shrinking or reporting the example) becomes an AssertionError."""
    try:
        return call()
    except Exception:
        raise
    except BaseException as e:
        if type(e).__name__ == "PanicException":
            raise AssertionError(f"Rust panic: {e}") from e
        raise


def run(make: Callable[[], Awaitable[T]]) -> T:
    """Runs one example's coroutine on a fresh loop; a hang fails it."""

    async def bounded() -> T:
        return await asyncio.wait_for(make(), HANG)

    return no_panic(lambda: asyncio.run(bounded()))
