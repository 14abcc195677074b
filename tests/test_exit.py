"""A process that exits while Rust work is still in flight exits cleanly.

Before the exit gate (rust/python/awaitable.rs), a stream whose engine stopped as the interpreter
finalized attached to the dying interpreter from a runtime thread, and about one exit in seven
aborted ("PyGILState_Release: thread state must be current when releasing") or segfaulted. These
runs exit with streams mid-generation, with and without closing the engine first, many times,
because the failure is a race.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

MakeModel = Callable[..., Path]

EXIT_MID_STREAM = textwrap.dedent(
    """
    import asyncio, sys
    from strata_rs import Engine

    pending: list[asyncio.Future] = []

    async def main(path: str, close: bool) -> None:
        engine = await Engine.load(path, max_context=4096)
        streams = [
            engine.generate([5], max_tokens=3000, temperature=0, ignore_eos=True)
            for _ in range(4)
        ]
        for s in streams:
            await s.__anext__()
        # Left pending: nobody awaits them; the engine keeps generating, or is closed (here, or
        # when `engine` is dropped as main returns), which ends them with EngineStopped.
        pending.extend(asyncio.ensure_future(s.__anext__()) for s in streams)
        await asyncio.sleep(0)
        if close:
            await engine.close()
        print("exiting", len(pending), flush=True)

    asyncio.run(main(sys.argv[1], sys.argv[2] == "close"))
    # The loop is closed, so nothing settles these any more. Retrieve what the engine's stop
    # settled, as an application that abandons futures must, or asyncio logs "Future exception
    # was never retrieved" (a done callback would race the loop's shutdown).
    for f in pending:
        if f.done() and not f.cancelled():
            f.exception()
    """
)

RUNS = 24


def run_once(model: Path, mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", EXIT_MID_STREAM, str(model), mode],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("mode", ["open", "close"])
def test_exit_with_streams_in_flight_is_clean(model_dir: MakeModel, mode: str) -> None:
    model = model_dir("llama", max_position_embeddings=4096)
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: run_once(model, mode), range(RUNS)))
    failed = [(r.returncode, r.stderr[-400:]) for r in results if r.returncode != 0]
    assert failed == []
    # Two processes at a time share one disk tier folder (the test's XDG_CACHE_HOME): neither
    # may disturb the other's writes, so nothing is logged at warning level either.
    unexpected = [
        (r.stdout, r.stderr) for r in results if (r.stdout, r.stderr) != ("exiting 4\n", "")
    ]
    assert unexpected == []
