"""`strata-rs bench --http` on the tiny model, one short round per client: the figures it prints
come from events it really parsed (a client that saw no `data:` event would give no TTFT)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from strata_rs.bench.http import run_http

MakeModel = Callable[..., Path]


@pytest.mark.anyio
@pytest.mark.parametrize("client", ["raw", "httpx"])
async def test_http_bench_measures_both_paths(model_dir: MakeModel, client: str) -> None:
    model = model_dir("llama", max_position_embeddings=4096)
    r = await run_http(str(model), streams=4, gen=8, rounds=1, alone_repeats=2, client_kind=client)
    assert r["client"] == client and r["streams"] == 4 and len(r["per_round"]["http"]) == 1
    for path in ("api", "http"):
        assert r[f"{path}_decode_tok_s"] > 0
        # Every stream's first event was seen after the round started, within the run.
        assert 0 < r[f"{path}_ttft_s"] < 60 and 0 < r[f"{path}_alone_ttft_s"] < 60
        assert r[f"{path}_cpu_us_per_token"] >= 0
    assert r["http_client_cpu_us_per_token"] >= 0
    assert r["tok_s_ratio"] == r["http_decode_tok_s"] / r["api_decode_tok_s"]


@pytest.mark.anyio
async def test_http_bench_names_a_bad_client(model_dir: MakeModel) -> None:
    with pytest.raises(ValueError, match="client_kind: must be raw or httpx, got 'curl'"):
        await run_http(str(model_dir("llama")), client_kind="curl")
