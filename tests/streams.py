"""Helpers of the stream tests: a request's greedy ids from an engine of its own, and a stream
read to its end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from strata_rs import Engine

PARAMS: dict[str, Any] = {"max_tokens": 40, "temperature": 0, "ignore_eos": True}


async def solo_ids(model: Path, prompt: list[int]) -> list[int]:
    """The ids `prompt` gets alone, from an engine with one sequence and no cache tiers."""
    engine = await Engine.load(model, max_batch=1, host_cache_mib=0, disk_cache_mib=0)
    try:
        return (await engine.complete(prompt, **PARAMS)).token_ids
    finally:
        await engine.close()


async def read_all(stream: Any) -> list[int]:
    """Every id of `stream`, in order."""
    ids: list[int] = []
    async for chunk in stream:
        ids += chunk.token_ids
    return ids
