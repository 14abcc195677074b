"""The event loop of whichever async library is running, as the Rust side sees it.

The extension (rust/python/awaitable.rs, dispatch.rs) needs three things from a loop: a future
it settles (`create_future`), a thread-safe way to run a callback on the loop's thread
(`call_soon_threadsafe`) and a watch on the engine's eventfd doorbell (`add_reader`). An asyncio
loop (uvloop's too) has them already, and the extension finds it without calling in here (its
fast path); trio's are in `strata_rs._async._trio`, which gives the same three methods. The
library is chosen as anyio and httpx choose: by sniffio.
"""

from __future__ import annotations

import asyncio
from typing import Any

import sniffio


def current_loop() -> Any:
    """The running loop, asyncio's or trio's (`_async.trio.TrioLoop`). Raises RuntimeError
    outside async code, or under another library."""
    try:
        library = sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        raise RuntimeError(
            "no running event loop: strata_rs awaitables need asyncio (or uvloop) or trio"
        ) from None
    if library == "asyncio":
        return asyncio.get_running_loop()
    if library == "trio":
        # Imported here: trio is only needed by those who run it.
        from strata_rs._async import _trio

        return _trio.current_loop()
    raise RuntimeError(f"strata_rs runs on asyncio and trio, not on {library}")
