"""`strata-rs bench --compare PEER,...`: the peer list, skipped peers, progress lines, --json,
--plot .png, and each installed peer's greedy tokens against strata-rs's on the tiny model.

The peers (torch + transformers, mistralrs, llama-cpp-python) are optional: tests that run one
skip when it is not installed (CI installs none of them). A missing peer is simulated honestly:
the CLI runs in a subprocess whose PYTHONPATH starts with a folder of modules that raise
ModuleNotFoundError when imported, as a missing package does."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from strata_rs import Engine
from strata_rs.bench.compare import CompareSpec, format_table, run_compare, write_plot
from strata_rs.bench.peer_llama_cpp import NO_AMX_CMAKE_ARGS, amx_warning
from strata_rs.bench.peers import (
    INSTALL,
    bench_token_ids,
    first_difference,
    missing,
    parse_peers,
    skip_line,
)
from strata_rs.bench.progress import Progress, format_duration
from strata_rs.cli import main

# A tiny run of every scenario: seconds on the tiny model.
TINY = [
    "--prefill", "32", "--decode-context", "32", "--steps", "3", "--repeats", "1",
    "--streams", "1,4", "--stream-prompt", "16", "--stream-tokens", "6",
    "--history", "64", "--new-tokens", "8", "--rounds", "1",
]  # fmt: skip


def tiny_spec(model: Path, peers: list[str], **kw: Any) -> CompareSpec:
    return CompareSpec(
        model=model,
        peers=peers,
        rounds=1,
        prefill=[32],
        decode_contexts=[32],
        steps=3,
        repeats=1,
        streams=[1, 4],
        stream_prompt=16,
        stream_tokens=6,
        history=64,
        new_tokens=8,
        **kw,
    )


def installed(name: str) -> bool:
    return missing(name) is None


# -- the peer list ------------------------------------------------------------------------------


def test_peer_list_parses_commas_all_and_repeats() -> None:
    assert parse_peers("llama.cpp") == ["llama.cpp"]
    assert parse_peers("transformers, mistralrs") == ["transformers", "mistralrs"]
    assert parse_peers("mistralrs,all") == ["mistralrs", "llama.cpp", "transformers"]
    assert parse_peers("transformers,transformers") == ["transformers"]
    with pytest.raises(ValueError) as e:
        parse_peers("llama.cpp,vllm")
    assert (
        str(e.value)
        == "unknown peer 'vllm'; choose from llama.cpp, transformers, mistralrs (or all)"
    )


def test_unknown_peer_is_a_usage_error_naming_it(
    model_dir: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    model = model_dir("llama")
    with pytest.raises(SystemExit) as e:
        main(["bench", "--model", str(model), "--compare", "llama.cpp,vllm"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (
        "strata-rs bench: error: argument --compare: unknown peer 'vllm'; "
        "choose from llama.cpp, transformers, mistralrs (or all)"
    )
    with pytest.raises(SystemExit):
        main(["bench", "--model", str(model), "--compare", "all", "--scenario", "prefil"])
    assert capsys.readouterr().err.splitlines()[-1] == (
        "strata-rs bench: error: argument --scenario: unknown scenario 'prefil'; "
        "choose from prefill, decode, streams, conversation (or all)"
    )


def test_missing_reports_the_import_error_through_the_given_importer() -> None:
    def importer(name: str) -> Any:
        if name == "torch":
            raise ImportError("No module named 'torch'")
        return object()

    assert missing("transformers", importer) == "No module named 'torch'"
    assert missing("mistralrs", importer) is None
    assert skip_line("transformers", "No module named 'torch'") == (
        "skipping transformers: not installed (No module named 'torch'); "
        "install it with: pip install 'strata-rs[bench-transformers]'"
    )


def test_llama_cpp_with_amx_gets_a_warning_with_the_rebuild_command() -> None:
    # Lines of `llama_print_system_info()` from this project's machines: the default build on
    # an Intel Xeon with AMX, and the same CPU's build without it.
    with_amx = "CPU : AVX2 = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | AMX_INT8 = 1 | OPENMP = 1 | "
    without = "CPU : AVX2 = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | OPENMP = 1 | REPACK = 1 | "
    assert amx_warning(without) is None
    warning = amx_warning(with_amx)
    assert warning is not None
    assert warning.startswith(
        "warning: llama.cpp uses AMX here (AMX_INT8 = 1), whose kernels crash with a "
        "segmentation fault on some machines (llama.cpp issue 20824)."
    )
    assert f'CMAKE_ARGS="{NO_AMX_CMAKE_ARGS}" pip install --force-reinstall' in warning
    assert "-DGGML_NATIVE=OFF" in NO_AMX_CMAKE_ARGS
    assert "AMX" not in NO_AMX_CMAKE_ARGS


# -- the prompts ---------------------------------------------------------------------------------


def test_bench_token_ids_follow_the_rust_xorshift() -> None:
    # rust/bench.rs token_ids(n, vocab, seed): xorshift64 (13, 7, 17), wrapping, then % vocab.
    s = 0x5EED + 4
    want = []
    for _ in range(4):
        s = (s ^ (s << 13)) % 2**64
        s = s ^ (s >> 7)
        s = (s ^ (s << 17)) % 2**64
        want.append(s % 49152)
    assert bench_token_ids(4, 49152, 0x5EED + 4) == want
    assert all(0 <= t < 512 for t in bench_token_ids(1000, 512, 1))
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


# -- progress ------------------------------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_progress_lines_one_per_step_when_not_a_terminal() -> None:
    out = io.StringIO()
    clock = _Clock()
    p = Progress(4, out, tty=False, clock=clock)
    p.step("loading strata-rs")
    clock.t += 2.0
    p.step("loading transformers")
    clock.t += 4.0
    p.note("skipping mistralrs: not installed (x); install it with: pip install mistralrs")
    p.step("round 1/1, strata-rs: prefill and decode")
    clock.t += 90.0
    p.step("round 1/1, transformers: prefill and decode")
    p.done()
    assert out.getvalue().splitlines() == [
        "[1/4] loading strata-rs (3 left)",
        "[2/4] loading transformers (2 left, ~6s to go)",
        "skipping mistralrs: not installed (x); install it with: pip install mistralrs",
        "[3/4] round 1/1, strata-rs: prefill and decode (1 left, ~6s to go)",
        "[4/4] round 1/1, transformers: prefill and decode (0 left, ~32s to go)",
    ]
    assert [format_duration(x) for x in (0.4, 59.6, 61, 3599, 3600, 7322)] == [
        "0s", "1m00s", "1m01s", "59m59s", "1h00m", "2h02m",
    ]  # fmt: skip


def test_progress_rewrites_one_line_on_a_terminal() -> None:
    out = io.StringIO()
    clock = _Clock()
    p = Progress(2, out, tty=True, clock=clock)
    p.step("loading strata-rs")
    clock.t += 1.0
    p.step("round 1/1, strata-rs: streams 1/4")
    p.note("a note")
    p.done()
    first = "[1/2] loading strata-rs (1 left)"
    second = "[2/2] round 1/1, strata-rs: streams 1/4 (0 left, ~1s to go)"
    assert out.getvalue() == (f"\r{first}\r{second}\r{' ' * len(second)}\ra note\n")


# -- the CLI, with every peer hidden ---------------------------------------------------------------


def _hide(tmp_path: Path, modules: list[str]) -> Path:
    shim = tmp_path / "hide-peers"
    shim.mkdir()
    for m in modules:
        (shim / f"{m}.py").write_text(
            f"raise ModuleNotFoundError({m + ' is hidden by the test'!r}, name={m!r})\n"
        )
    return shim


def _run_cli(args: list[str], shim: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(shim), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run(
        [sys.executable, "-m", "strata_rs.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_missing_peers_are_skipped_with_their_install_lines_and_json(
    model_dir: Callable[..., Path], tmp_path: Path
) -> None:
    model = model_dir("llama")
    shim = _hide(tmp_path, ["torch", "mistralrs", "llama_cpp"])
    out = tmp_path / "compare.json"
    r = _run_cli(
        ["bench", "--model", str(model), "--compare", "transformers,mistralrs,llama.cpp",
         *TINY, "--json", str(out)],
        shim,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    err = r.stderr.splitlines()
    for name, module in (("transformers", "torch"), ("mistralrs", "mistralrs"),
                         ("llama.cpp", "llama_cpp")):  # fmt: skip
        line = (
            f"skipping {name}: not installed ({module} is hidden by the test); "
            f"install it with: {INSTALL[name]}"
        )
        assert line in err
    # stderr is a pipe: one line per step, strata-rs only: load + one round of 3 groups.
    steps = [line for line in err if line.startswith("[")]
    pattern = r"\[(\d)/4\] (.*) \((\d) left(, ~\d+s to go)?\)"
    assert [re.fullmatch(pattern, s).group(2) for s in steps] == [  # type: ignore[union-attr]
        "loading strata-rs",
        "round 1/1, strata-rs: prefill and decode",
        "round 1/1, strata-rs: streams 1/4",
        "round 1/1, strata-rs: conversation",
    ]
    assert "prefill 32 tokens (tok/s)" in r.stdout
    assert "conversation TTFT: after restart (ms)" in r.stdout
    data = json.loads(out.read_text())
    for name in ("transformers", "mistralrs", "llama.cpp"):
        assert data["peers"][name] == {
            "status": "skipped",
            "reason": f"{'torch' if name == 'transformers' else name.replace('.', '_')} "
            "is hidden by the test",
            "install": INSTALL[name],
        }
    assert data["engines"] == ["strata-rs"]
    ours = data["medians"]["strata-rs"]
    assert set(ours) == {
        "prefill_32", "decode_32", "streams_1", "streams_4",
        "conversation_cold", "conversation_returning", "conversation_restart",
    }  # fmt: skip
    assert all(v is not None and v > 0 for v in ours.values())
    round1 = data["rounds"]["strata-rs"][0]
    # After the restart, B's history came back from the disk tier.
    assert round1["restart_hit_tokens"]["disk"] > 0 and round1["adopted_files"] > 0
    assert data["read_bandwidth_gb_s"] and data["machine"]["cpus"] >= 1


def test_plot_png_is_written_by_matplotlib(model_dir: Callable[..., Path], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    model = model_dir("llama")
    png = tmp_path / "compare.png"
    rc = main(["bench", "--model", str(model), "--scenario", "all", *TINY, "--plot", str(png)])
    assert rc == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    # matplotlib's Agg backend names itself in a tEXt chunk: "Software\0Matplotlib version...".
    assert b"tEXtSoftware\x00Matplotlib" in data


def test_plot_needs_a_scenario(model_dir: Callable[..., Path], tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    rc = main(["bench", "--model", str(model_dir("llama")), "--plot", str(tmp_path / "x.png")])
    assert rc == 2
    assert capsys.readouterr().err.strip() == (
        "strata-rs: --plot needs --compare, --scenario or --conversations"
    )


# -- installed peers: greedy tokens and the compare run ------------------------------------------


FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


async def _our_greedy(model: Path, ids: list[int], n: int) -> list[int]:
    engine = await Engine.load(model, threads=2)
    try:
        r = await engine.complete(ids, max_tokens=n, temperature=0, ignore_eos=True)
        return list(r.token_ids)
    finally:
        await engine.close()


def _prompt(vocab: int = 512) -> list[int]:
    return [int(x) % (vocab - 3) + 3 for x in bench_token_ids(40, 1 << 30, 7)]


def _assert_same(peer: str, family: str, ours: list[int], theirs: list[int]) -> None:
    at = first_difference(ours, theirs)
    assert at is None, (
        f"{peer} on tiny {family}: greedy tokens differ from strata-rs's at position {at}: "
        f"ours {ours[at : at + 4]}, theirs {theirs[at : at + 4]}"
    )


@pytest.mark.anyio
@pytest.mark.skipif(not installed("transformers"), reason="needs: " + INSTALL["transformers"])
@pytest.mark.parametrize("family", FAMILIES)
async def test_transformers_greedy_equals_ours(model_dir: Callable[..., Path], family: str) -> None:
    from strata_rs.bench.peer_transformers import TransformersPeer

    model = model_dir(family)
    ids = _prompt()
    ours = await _our_greedy(model, ids, 24)
    peer = TransformersPeer(model, 2)
    try:
        _assert_same("transformers", family, ours, peer.greedy(ids, 24))
    finally:
        peer.close()


# mistral.rs 0.9.5 reads no rope_scaling for the Mistral architecture: the tiny mistral's linear
# scaling (factor 2; transformers and the NumPy reference apply it) changes its first token. The
# same folder without rope_scaling agrees token for token.
MISTRALRS_CASES = [
    "llama",
    pytest.param(
        "mistral",
        marks=pytest.mark.xfail(reason="mistral.rs ignores rope_scaling for mistral", strict=False),
    ),
    "mistral-no-rope-scaling",
    "qwen2",
    "qwen3",
]


@pytest.mark.anyio
@pytest.mark.skipif(not installed("mistralrs"), reason="needs: " + INSTALL["mistralrs"])
@pytest.mark.parametrize("family", MISTRALRS_CASES)
async def test_mistralrs_greedy_equals_ours(model_dir: Callable[..., Path], family: str) -> None:
    from strata_rs import Tokenizer
    from strata_rs.bench.peer_mistralrs import MistralrsPeer

    if family == "mistral-no-rope-scaling":
        model = model_dir("mistral", rope_scaling=None)
    else:
        model = model_dir(family)
    # mistral.rs takes text: a prompt whose tokenization both engines agree on.
    text = "The quick brown fox jumps over the lazy dog, then rests by the river bank."
    ids = Tokenizer.from_dir(model).encode(text, add_special_tokens=False)
    peer = MistralrsPeer(model, 2)
    try:
        assert peer.cold.tokenize_text(text, False, None) == ids
        ours = await _our_greedy(model, ids, 24)
        _assert_same("mistralrs", family, ours, peer.greedy_text(text, 24))
    finally:
        peer.close()


@pytest.mark.anyio
@pytest.mark.skipif(not installed("llama.cpp"), reason="needs: " + INSTALL["llama.cpp"])
@pytest.mark.parametrize("family", FAMILIES)
async def test_llama_cpp_greedy_equals_ours(
    model_dir: Callable[..., Path], family: str, tmp_path: Path
) -> None:
    from strata_rs.bench.gguf_export import export_gguf
    from strata_rs.bench.peer_llama_cpp import LlamaCppPeer

    model = model_dir(family)
    ids = _prompt()
    ours = await _our_greedy(model, ids, 24)
    peer = LlamaCppPeer(export_gguf(model, tmp_path / "m.gguf", dtype="f32"), 2, 256)
    try:
        _assert_same("llama.cpp", family, ours, peer.greedy(ids, 24))
    finally:
        peer.close()


@pytest.mark.anyio
@pytest.mark.skipif(
    not any(installed(p) for p in ("transformers", "mistralrs", "llama.cpp")),
    reason="needs at least one peer: pip install 'strata-rs[bench-all]'",
)
async def test_compare_with_installed_peers_has_their_fields(
    model_dir: Callable[..., Path], tmp_path: Path
) -> None:
    names = [p for p in ("llama.cpp", "transformers", "mistralrs") if installed(p)]
    spec = tiny_spec(model_dir("llama"), names)
    err = io.StringIO()
    r = await run_compare(spec, err, tty=False)
    assert r["engines"] == ["strata-rs", *names], err.getvalue()
    keys = [row["key"] for row in r["rows"]]
    for name in names:
        assert r["peers"][name]["status"] == "ran" and r["peers"][name]["version"]
        for key in keys:
            value = r["medians"][name][key]
            if value is None:
                # Only what the peer's API cannot do is missing, and it says why.
                assert key == "conversation_restart", (name, key, r["na"][name].get(key))
                assert "process memory" in r["na"][name][key]
            else:
                assert value > 0 and r["ratios"][name][key] is not None
    table = "\n".join(format_table(r))
    assert "n/a[1]" in table or all(r["medians"][n]["conversation_restart"] for n in names)
    png = write_plot(r, tmp_path / "peers.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
