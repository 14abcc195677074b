"""`strata-rs bench --conversations` on the tiny model: the scenario's structure, which tier served
each phase, and the plot (SVG; PNG too when matplotlib is installed). History 880 so that the
1 MiB device pool (128 blocks of 16) holds about 2.3 of the 4 conversations and returning turns
must come from below the device."""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import pytest
from strata_rs.bench.conversation_servers import run_server_conversations
from strata_rs.bench.conversations import plot_series, run_conversations, write_png, write_svg

pytestmark = pytest.mark.anyio


async def test_returning_turns_come_from_host_then_disk_and_plot(
    model_dir: Callable[..., Path], tmp_path: Path
) -> None:
    model = model_dir("llama", max_position_embeddings=8192)
    r = await run_conversations(
        model,
        history=880,
        new_tokens=20,
        rounds=1,
        disk_dir=tmp_path / "kv",
        memcpy_mib=16,
        log=lambda _: None,
    )
    setup = r["setup"]
    assert setup["kv_memory_mib"] == 1 and setup["device_holds_histories"] < 4
    assert [t["phase"] for t in r["turns"]] == ["host"] * 4 + ["disk"] * 4 + ["disk_uncached"] * 4
    for t in r["turns"]:
        assert t["ttft_s"]["strata-rs"] > 0 and t["ttft_s"]["cold"] > 0
        assert t["prompt_tokens"] > 880 + 20
        restore = t["restore"]
        assert restore is not None and restore["tokens"] > 0 and restore["gb_s"] > 0
        # Every returning turn reused the history's full blocks: on the device or from below.
        assert t["cached_tokens"] >= (t["prompt_tokens"] - 20 - 8) // 16 * 16
        below = "host" if t["phase"] == "host" else "disk"
        assert t["hit_tokens"][below] > 0 and t["hit_tokens"][below] == restore["tokens"]
        if t["phase"] != "host":
            assert t["hit_tokens"]["host"] == 0 and t["adopted_files"] > 0
        if t["phase"] == "host":
            assert t["ttft_s"]["device"] > 0 and t["device_cached_tokens"] >= t["cached_tokens"]
    # Restored K/V gives exactly the tokens of K/V that never left the device.
    assert r["answers_differ"] == 0
    assert any("restored" in line for line in r["cache_log"])
    med = r["median_ttft_s"]
    assert med["host"] > 0 and med["disk"] > 0 and med["cold"] > 0
    assert med["llama.cpp"] is None and r["ratios"]["host/llama.cpp"] is None
    assert r["memcpy_gb_s"] > 0 and r["restore_gb_s"]["host"] > 0
    assert r["targets"][0]["target"] == "host TTFT <= 5% of cold"

    svg = write_svg(r, tmp_path / "conversations.svg", "tiny")
    root = ET.parse(svg).getroot()
    ns = "{http://www.w3.org/2000/svg}"
    polylines = root.findall(f"{ns}polyline")
    series = plot_series(r)
    assert list(series) == [
        "cold",
        "host tier",
        "device (pool holds all)",
        "disk tier after a restart",
        "disk tier, page cache dropped",
    ]
    assert len(polylines) == len(series)
    assert [len(p.get("points", "").split()) for p in polylines] == [12, 4, 4, 4, 4]

    # The same plot through matplotlib (`--plot turns.png`), when it is installed.
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    png = write_png(r, tmp_path / "conversations.png", "tiny").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and b"tEXtSoftware\x00Matplotlib" in png


# -- through the servers: `--conversations --llama-server PATH` ------------------------------------


def _tiny_gguf(model_dir: Callable[..., Path], tmp_path: Path) -> Path:
    pytest.importorskip("gguf")
    from strata_rs.bench.gguf_export import export_gguf

    model = model_dir("llama", max_position_embeddings=8192)
    # f32: f32 K/V, whose 8 KiB blocks make the 1 MiB pool hold about 2.3 histories of 880.
    return export_gguf(model, tmp_path / "tiny.gguf", "f32")


async def test_returning_turns_through_strata_rs_serve(
    model_dir: Callable[..., Path], tmp_path: Path
) -> None:
    """The server scenario without a peer: every returning turn reuses its whole history, and
    the pool (about 2.2 histories) has pushed it to the host tier, so part of it is restored."""
    r = await run_server_conversations(
        _tiny_gguf(model_dir, tmp_path), None, history=880, new_tokens=20, rounds=2,
        log=lambda _: None,
    )  # fmt: skip
    assert [(t["round"], t["conversation"]) for t in r["turns"]] == [
        (r, c) for r in (1, 2) for c in range(4)
    ]
    for i, t in enumerate(r["turns"]):
        assert t["prompt_tokens"] == 880 + 20 * t["round"]
        assert list(t["ttft_s"]) == ["strata-rs"] and t["ttft_s"]["strata-rs"] > 0
        # The previous prompt, in whole blocks of 16: all of it came from the cache.
        assert t["cached_tokens"]["strata-rs"] == (t["prompt_tokens"] - 20) // 16 * 16, i
        assert 0 < t["strata-rs host-tier tokens"] <= t["cached_tokens"]["strata-rs"], i
    assert r["ratio"] is None and r["target"]["met"] is None
    assert list(r["median_ttft_s"]) == ["strata-rs"]
    assert r["setup"]["llama-server"] is None and r["setup"]["kv_memory_mib"] == 1


LLAMA_SERVER = os.environ.get("STRATA_LLAMA_SERVER")


@pytest.mark.skipif(
    LLAMA_SERVER is None,
    reason="set STRATA_LLAMA_SERVER to a llama-server binary (scripts/build_llama_server.py)",
)
async def test_returning_turns_through_both_servers(
    model_dir: Callable[..., Path], tmp_path: Path
) -> None:
    assert LLAMA_SERVER is not None
    r = await run_server_conversations(
        _tiny_gguf(model_dir, tmp_path), LLAMA_SERVER, history=880, new_tokens=20, rounds=1,
        log=lambda _: None,
    )  # fmt: skip
    for t in r["turns"]:
        assert set(t["ttft_s"]) == {"strata-rs", "llama-server"}
        # llama-server reused the history too (its prompt cache), then evaluated the new ids.
        assert t["cached_tokens"]["llama-server"] >= 880
        assert (
            t["llama-server timings"]["prompt_n"]
            == t["prompt_tokens"] - t["cached_tokens"]["llama-server"]
        )
    assert [t["first"] for t in r["turns"]] == ["strata-rs", "llama-server"] * 2
    assert r["ratio"] == r["median_ttft_s"]["strata-rs"] / r["median_ttft_s"]["llama-server"]
    assert r["setup"]["llama-server version"] != "unknown"


def test_llama_server_option_errors(
    model_dir: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from strata_rs.cli import main

    folder = model_dir("llama")
    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    gguf = tmp_path / "m.gguf"
    cases = [
        (
            ["--model", str(folder), "--llama-server", str(exe)],
            "--llama-server needs --conversations",
        ),
        (
            ["--model", str(folder), "--conversations", "--llama-server", str(exe)],
            "--llama-server needs a GGUF for both servers: --model FILE.gguf or --gguf FILE",
        ),
        (
            ["--model", str(gguf), "--conversations", "--llama-server", str(exe),
             "--compare", "llama.cpp"],
            "--llama-server runs the turns through the servers only; --compare and --plot "
            "belong to the in-process run (without --llama-server)",
        ),
        (
            ["--model", str(folder), "--gguf", str(gguf), "--conversations",
             "--llama-server", str(tmp_path / "none")],
            f"--llama-server {tmp_path / 'none'}: not an executable file",
        ),
    ]  # fmt: skip
    for args, message in cases:
        assert main(["bench", *args]) == 2
        assert capsys.readouterr().err.strip() == f"strata-rs: {message}"
