"""The Python API's contract: errors by class and message, the device probe, close, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import strata_rs
from strata_rs import (
    ContextOverflow,
    DeviceUnavailable,
    Engine,
    EngineStopped,
    InvalidRequest,
    ModelLoadError,
    StrataError,
)

pytestmark = pytest.mark.anyio

MakeModel = Callable[..., Path]


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """The API's contract holds on both libraries anyio serves (tests/test_backends.py has the
    streaming side)."""
    return str(request.param)


def test_exception_hierarchy() -> None:
    for cls in (ModelLoadError, InvalidRequest, ContextOverflow, DeviceUnavailable, EngineStopped):
        assert issubclass(cls, StrataError)
        assert cls.__module__ == "strata_rs"
    assert issubclass(InvalidRequest, ValueError)
    assert issubclass(ContextOverflow, InvalidRequest)


async def test_the_device_probe_and_a_cuda_load_agree(model_dir: MakeModel) -> None:
    """What holds with or without a GPU: a GPU the probe does not list cannot be loaded on, and
    (where there is one) the first one it lists can."""
    devices = strata_rs.cuda_devices()
    assert [d["index"] for d in devices] == list(range(len(devices)))
    past = len(devices)
    with pytest.raises(DeviceUnavailable) as e:
        await Engine.load(model_dir("llama"), device=f"cuda:{past}")
    if devices:
        assert str(e.value) == (
            f"device cuda:{past}: GPU {past} does not exist ({past} GPU(s) visible)"
        )
        engine = await Engine.load(model_dir("llama"), device="cuda:0")
        try:
            assert engine.info["device"] == "cuda:0"
        finally:
            await engine.close()
    else:
        # No driver (no GPU here) or a driver that sees no GPU.
        assert str(e.value).startswith(
            ("device cuda:0: no usable CUDA driver: ", "device cuda:0: GPU 0 does not exist")
        ), str(e.value)


async def test_bad_device_string(model_dir: MakeModel) -> None:
    with pytest.raises(InvalidRequest) as e:
        await Engine.load(model_dir("llama"), device="gpu0")
    assert str(e.value) == (
        'device: "gpu0": expected "cpu", "cpu:N,M", "cuda", "cuda:N" or "cuda:N,M"'
    )


def _copy_model(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


async def test_unknown_model_type(model_dir: MakeModel, tmp_path: Path) -> None:
    d = _copy_model(model_dir("llama"), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError) as e:
        await Engine.load(d)
    assert str(e.value) == (
        f'{d / "config.json"}: model_type: unsupported model type "gpt_neox" '
        "(supported: llama, mistral, qwen2, qwen3, gemma3_text, qwen3_moe, mixtral, phi3)"
    )


async def test_bad_json_and_missing_folder(model_dir: MakeModel, tmp_path: Path) -> None:
    d = _copy_model(model_dir("llama"), tmp_path / "m")
    (d / "config.json").write_text("{nope")
    with pytest.raises(ModelLoadError, match=r"config\.json: invalid JSON: "):
        await Engine.load(d)
    with pytest.raises(ModelLoadError) as e:
        await Engine.load(tmp_path / "absent")
    assert str(e.value) == f"{tmp_path / 'absent'}: not found"


async def test_truncated_weights(model_dir: MakeModel, tmp_path: Path) -> None:
    d = _copy_model(model_dir("llama"), tmp_path / "m")
    st = d / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-64])
    with pytest.raises(ModelLoadError) as e:
        await Engine.load(d)
    assert str(e.value).startswith(f"{st}: tensor ")
    assert "truncated file" in str(e.value)


async def test_bad_arguments_name_the_field(model_dir: MakeModel) -> None:
    with pytest.raises(InvalidRequest, match=r"^threads: must be >= 0, got -1$"):
        await Engine.load(model_dir("llama"), threads=-1)
    with pytest.raises(InvalidRequest, match=r"^max_batch_tokens: must be at least 1$"):
        await Engine.load(model_dir("llama"), max_batch_tokens=0)


async def test_token_id_errors_and_context_overflow(model_dir: MakeModel) -> None:
    engine = await Engine.load(model_dir("llama"), max_context=64)
    try:
        vocab = engine.info["vocab_size"]
        with pytest.raises(InvalidRequest) as e:
            await engine.logits([1, vocab])
        assert str(e.value) == (
            f"token_ids: token id {vocab} is outside the vocabulary (size {vocab})"
        )
        with pytest.raises(InvalidRequest, match=r"^token_ids: token id -3 is not a valid id$"):
            await engine.logits([1, -3])
        with pytest.raises(InvalidRequest, match=r"^token_ids: must not be empty$"):
            await engine.logits([])
        with pytest.raises(ContextOverflow) as o:
            await engine.logits([1] * 65)
        assert str(o.value) == "token_ids: 65 tokens exceed the context of 64 tokens"
        # The engine is undisturbed by the bad requests.
        logits = await engine.logits([1, 2, 3])
        assert logits.shape == (3, vocab) and logits.dtype == np.float32
        assert np.isfinite(logits).all()
        logits[0, 0] = 1.0  # the array is the caller's own, writable
    finally:
        await engine.close()


async def test_benchmark_needs_the_prompt_for_prefill_and_the_steps_for_decode(
    model_dir: MakeModel,
) -> None:
    engine = await Engine.load(model_dir("llama"), max_context=64)
    try:
        # A prefill of the whole context fits (it decodes nothing after).
        r = await engine.benchmark(prefill_lens=[64], decode_contexts=[], repeats=1)
        assert list(r["prefill_tok_s"]) == [64] and r["prefill_tok_s"][64] > 0
        # Decode at 40 for 32 steps needs 72.
        with pytest.raises(ContextOverflow) as o:
            await engine.benchmark(prefill_lens=[], decode_contexts=[40], decode_steps=32)
        assert str(o.value) == "bench needs 72 tokens of context but the engine holds 64"
        r = await engine.benchmark(prefill_lens=[], decode_contexts=[32], decode_steps=32)
        assert list(r["decode_tok_s"]) == [32] and r["decode_tok_s"][32] > 0
    finally:
        await engine.close()


async def test_kv_format_follows_the_weights(model_dir: MakeModel) -> None:
    for dtype, kv in (("f32", "f32"), ("bf16", "f16"), ("f16", "f16")):
        engine = await Engine.load(model_dir("llama", dtype))
        try:
            assert (engine.info["dtype"], engine.info["kv_dtype"]) == (dtype, kv)
        finally:
            await engine.close()


async def test_close_is_idempotent_and_final(model_dir: MakeModel) -> None:
    engine = await Engine.load(model_dir("qwen2"))
    assert not engine.closed
    await engine.close()
    await engine.close()
    assert engine.closed
    with pytest.raises(EngineStopped, match=r"^the engine is closed$"):
        await engine.logits([1, 2])


async def test_tokenizer_round_trip(model_dir: MakeModel) -> None:
    engine = await Engine.load(model_dir("qwen3"))
    try:
        tok = engine.tokenizer
        text = "def main():\n    print('héllo wörld ✓')\n"
        ids = tok.encode(text, add_special_tokens=False)
        assert ids and all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
        prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
        assert prompt.endswith("<|im_start|>assistant\n")
        assert "<|im_start|>user\nhi<|im_end|>\n" in prompt
        assert tok.token_to_id("<|im_end|>") in tok.eos_token_ids
    finally:
        await engine.close()


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "strata_rs.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        check=False,
    )


def test_cli_help_and_make_model(tmp_path: Path) -> None:
    r = _cli("--help")
    assert r.returncode == 0, r.stderr
    for sub in ("make-model", "bench", "info"):
        assert sub in r.stdout
    r = _cli("make-model", str(tmp_path / "m"), "--family", "mistral", "--dtype", "bf16")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"wrote mistral tiny (bf16) to {tmp_path / 'm'}"
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["model_type"] == "mistral"


def test_cli_bench_runs_and_reports(model_dir: MakeModel, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    r = _cli(
        "bench",
        "--model",
        str(model_dir("llama", "bf16")),
        "--prefill",
        "32",
        "--decode-context",
        "16",
        "--steps",
        "4",
        "--repeats",
        "1",
        "--json",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    assert "prefill     32 tokens:" in r.stdout
    assert "decode at context     16:" in r.stdout
    result = json.loads(out.read_text())
    assert float(result["prefill_tok_s"]["32"]) > 0
    assert float(result["decode_tok_s"]["16"]) > 0


def test_cli_reports_load_errors_without_a_traceback(tmp_path: Path) -> None:
    r = _cli("info", "--model", str(tmp_path))
    assert r.returncode == 2
    assert r.stderr.startswith("strata-rs: ModelLoadError: ")
    assert "Traceback" not in r.stderr
