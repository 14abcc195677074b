"""Engine logits against the independent NumPy reference (tests/reference.py).

Model folders come from the session-scoped `model_dir` fixture in conftest.py
(built once per argument set); reference logits are cached per folder here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import strata_rs
from reference import reference_logits
from strata_rs.testing.models import FAMILIES

pytestmark = pytest.mark.anyio

VOCAB = 512  # the tiny preset's vocab_size
# ~100 tokens: well past the tiny presets' original_max_position_embeddings
# (32), so llama3/linear RoPE scaling matters.  Seeded so failures reproduce.
SEQ = np.random.default_rng(2024).integers(0, VOCAB, 100).tolist()

F32_REL_TOL = 1e-4  # of the reference logits' range
LOW_PRECISION_ARGMAX = 0.99
# bf16/f16 weights with the default f16 K/V, against the reference of the same (rounded)
# weights: the difference is the K/V's rounding to f16. Measured over every family in both
# dtypes (AMD EPYC, AVX-512, 2026-12-04): 1.6e-4 .. 4.0e-4 of the logit range (gemma3 the
# largest). The instruction-set paths differ from one another at f32 rounding (1e-7 of the
# range, the f32 tolerance's scale), so the figure holds on any CPU; 2.5 times it is the bound.
KV16_REL_TOL = 1e-3
# bf16_dot (AVX-512 BF16 CPUs only): the matmul inputs rounded to bf16, against the reference
# rounding them too: measured 5.0e-8 .. 1.7e-3 of the range (gemma3 the largest) on the same
# machine; the bound this test has had since bf16_dot came.
BF16_DOT_REL_TOL = 2e-3
# A GPU's bf16 run has never been measured (no GPU has run this code): only gross errors.
GPU_LOW_PRECISION_REL_TOL = 0.05

MakeModel = Callable[..., Path]

_reference_cache: dict[tuple[Path, tuple[int, ...], str], np.ndarray] = {}


def cpu_flags() -> set[str]:
    """This CPU's flags (Linux's /proc/cpuinfo; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((ln for ln in text.splitlines() if ln.startswith("flags")), "").split())


def cpu_has_bf16_dot() -> bool:
    """Whether this CPU has AVX-512 with bf16 dot products."""
    return {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= cpu_flags()


def reference(path: Path, ids: Sequence[int], matmul_inputs: str = "f32") -> np.ndarray:
    key = (path, tuple(ids), matmul_inputs)
    if key not in _reference_cache:
        _reference_cache[key] = reference_logits(path, list(ids), matmul_inputs)
    return _reference_cache[key]


async def engine_logits(
    path: Path, batches: Sequence[Sequence[int]], **load_args: Any
) -> list[np.ndarray]:
    """Logits of each id list, in order, from one engine instance."""
    logits, _ = await engine_logits_info(path, batches, **load_args)
    return logits


async def engine_logits_info(
    path: Path, batches: Sequence[Sequence[int]], **load_args: Any
) -> tuple[list[np.ndarray], dict[str, Any]]:
    """As engine_logits, with the engine's info."""
    engine = await strata_rs.Engine.load(str(path), **load_args)
    try:
        return [await engine.logits(list(ids)) for ids in batches], engine.info
    finally:
        await engine.close()


def assert_close(actual: np.ndarray, expected: np.ndarray, rel_tol: float = F32_REL_TOL) -> None:
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == np.float32
    assert np.isfinite(actual).all()
    span = float(expected.max() - expected.min())
    diff = np.abs(actual.astype(np.float64) - expected)
    worst = np.unravel_index(int(diff.argmax()), diff.shape)
    assert diff.max() <= rel_tol * span, (
        f"max |engine - reference| = {diff.max():.3g} at (pos, token) {worst}, "
        f"tolerance {rel_tol * span:.3g} (range {span:.3g})"
    )


def assert_argmax_agrees(actual: np.ndarray, expected: np.ndarray, rel_tol: float) -> None:
    assert actual.shape == expected.shape
    assert np.isfinite(actual).all()
    same = actual.argmax(axis=1) == expected.argmax(axis=1)
    assert same.mean() >= LOW_PRECISION_ARGMAX, (
        f"argmax differs at positions {np.flatnonzero(~same).tolist()}"
    )
    span = float(expected.max() - expected.min())
    worst = float(np.abs(actual - expected).max())
    assert worst <= rel_tol * span, f"max |engine - reference| = {worst / span:.3g} of the range"


async def test_bf16_dot_has_its_own_disk_cache(model_dir: MakeModel, tmp_path: Path) -> None:
    # Its K/V are computed from rounded inputs: a restart that switches bf16_dot on (where the
    # CPU has the instructions) must not adopt the files of f32 inputs, and one that switches
    # it back adopts them again.
    path = model_dir("llama", "bf16")
    opts: dict[str, Any] = {"device": "cpu", "disk_cache_dir": tmp_path / "kv"}
    prompt = SEQ[:40]
    engine = await strata_rs.Engine.load(str(path), **opts)
    try:
        await engine.complete(prompt, max_tokens=2, temperature=0, ignore_eos=True)
    finally:
        await engine.close()
    files = list((tmp_path / "kv").glob("*.kvb"))
    assert files
    for bf16_dot, adopted in ((True, 0 if cpu_has_bf16_dot() else len(files)), (False, len(files))):
        engine = await strata_rs.Engine.load(str(path), **opts, bf16_dot=bf16_dot)
        try:
            assert engine.stats()["cache"]["adopted_files"] == adopted, bf16_dot
        finally:
            await engine.close()


async def test_info_names_the_cpu_levels_the_kernels_use(model_dir: MakeModel) -> None:
    flags = cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags to compare with")
    (_,), info = await engine_logits_info(model_dir("llama"), [SEQ], device="cpu")
    avx2 = {"avx2", "fma", "f16c"} <= flags
    avx512 = {"avx512f", "avx512bw", "avx512vl", "fma", "f16c"} <= flags
    expected = [
        name
        for name, has in [
            ("avx2", avx2),
            ("avx_vnni", avx2 and "avx_vnni" in flags),
            ("avx512", avx512),
            ("avx512_vnni", avx512 and "avx512_vnni" in flags),
            ("avx512_bf16", avx512 and "avx512_bf16" in flags),
        ]
        if has
    ]
    assert info["cpu_levels"] == expected


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("family", FAMILIES)
async def test_logits_match_reference(model_dir: MakeModel, family: str, dtype: str) -> None:
    path = model_dir(family, dtype)
    (logits,), info = await engine_logits_info(path, [SEQ], device="cpu")
    assert info["matmul_inputs"] == "f32"  # bf16_dot is off by default
    expected = reference(path, SEQ)  # reads the same (rounded) weights, upcast
    if dtype == "f32":
        assert_close(logits, expected)
    else:
        assert info["kv_dtype"] == "f16"
        assert_argmax_agrees(logits, expected, KV16_REL_TOL)


@pytest.mark.parametrize("family", FAMILIES)
async def test_bf16_dot_matches_the_reference_of_rounded_inputs(
    model_dir: MakeModel, family: str
) -> None:
    # bf16_dot=True: on a CPU with bf16 dot products every weight matmul rounds its input
    # rows to bf16, and the reference does the same (f32 K/V, so that only the matmuls
    # differ from f64); elsewhere the engine stays on f32 inputs and the plain reference.
    path = model_dir(family, "bf16")
    (logits,), info = await engine_logits_info(
        path, [SEQ], device="cpu", bf16_dot=True, kv_dtype="f32"
    )
    assert info["matmul_inputs"] == ("bf16" if cpu_has_bf16_dot() else "f32")
    expected = reference(path, SEQ, info["matmul_inputs"])
    assert_argmax_agrees(logits, expected, BF16_DOT_REL_TOL)
    # The rounding is what moves the logits: the unrounded reference is further away.
    if info["matmul_inputs"] == "bf16":
        plain = reference(path, SEQ)
        assert np.abs(logits - expected).max() < np.abs(logits - plain).max()


@pytest.mark.parametrize("family", FAMILIES)
async def test_chunking_does_not_change_logits(model_dir: MakeModel, family: str) -> None:
    # 1: token-by-token decode through the KV cache; 7: chunked prefill with a
    # ragged last chunk; 4096: the whole prompt in one step.
    path = model_dir(family)
    runs = {}
    for max_batch_tokens in (1, 7, 4096):
        (runs[max_batch_tokens],) = await engine_logits(
            path, [SEQ], device="cpu", max_batch_tokens=max_batch_tokens
        )
    expected = reference(path, SEQ)
    for logits in runs.values():
        assert_close(logits, expected)
    span = float(expected.max() - expected.min())
    assert np.abs(runs[1] - runs[7]).max() <= F32_REL_TOL * span
    assert np.abs(runs[1] - runs[4096]).max() <= F32_REL_TOL * span


@pytest.mark.parametrize("max_batch_tokens", [1, 7, 4096])
async def test_mistral_sliding_window(model_dir: MakeModel, max_batch_tokens: int) -> None:
    ids = SEQ[:40]
    path = model_dir("mistral", sliding_window=8)
    expected = reference(path, ids)
    # The window must matter for this test to mean anything.
    unwindowed = reference(model_dir("mistral"), ids)
    assert np.abs(expected[8:] - unwindowed[8:]).max() > 100 * F32_REL_TOL * float(np.ptp(expected))
    (logits,) = await engine_logits(path, [ids], device="cpu", max_batch_tokens=max_batch_tokens)
    assert_close(logits, expected)


VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("llama", {"rope_scaling": None}),
    ("llama", {"attention_bias": True}),  # q/k/v and o biases
    ("llama", {"tie_word_embeddings": True}),
    ("llama", {"head_dim": None}),  # derived from hidden_size / heads
    ("llama", {"shards": 3}),
    ("mistral", {"tie_word_embeddings": False, "rope_scaling": None}),
    ("qwen2", {"tie_word_embeddings": True}),
    # A Qwen2 sliding_window is ignored unless use_sliding_window is set.
    ("qwen2", {"sliding_window": 8, "use_sliding_window": False}),
    ("qwen3", {"head_dim": 32}),  # head_dim != hidden_size / heads, as in real Qwen3
    ("qwen3", {"num_key_value_heads": 1}),  # MQA
    ("qwen3", {"rope_theta": 1000000.0}),
    # Phi-3: the short LongRoPE factors (the original context is the whole context), no scaling
    # (Phi-3-mini-4k), no window, a tied head, Phi-4-mini's three-quarter rotary part.
    ("phi3", {"original_max_position_embeddings": 256}),
    ("phi3", {"rope_scaling": None}),
    ("phi3", {"sliding_window": None}),
    ("phi3", {"tie_word_embeddings": True}),
    (
        "phi3",
        {
            "partial_rotary_factor": 0.75,
            "rope_scaling": {
                "long_factor": [1.25, 1.5, 2.0, 2.5, 3.25, 4.0],
                "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.75],
                "type": "longrope",
            },
        },
    ),
]


@pytest.mark.parametrize(
    ("family", "overrides"),
    VARIANTS,
    ids=[f"{f}-" + "-".join(f"{k}={v}" for k, v in o.items()) for f, o in VARIANTS],
)
async def test_config_variants(
    model_dir: MakeModel, family: str, overrides: dict[str, Any]
) -> None:
    path = model_dir(family, **overrides)
    ids = SEQ[:48]
    (logits,) = await engine_logits(path, [ids], device="cpu", max_batch_tokens=16)
    assert_close(logits, reference(path, ids))


@pytest.mark.parametrize("max_context", [64, 65, 256])
async def test_phi3_longrope_follows_the_served_context(
    model_dir: MakeModel, max_context: int
) -> None:
    # The engine picks Phi-3's LongRoPE factors once, by the context it serves: the short ones
    # up to the original context (64 in the tiny model), the long ones past it, whatever the
    # sequence's length (so K/V never change with it); the attention factor is the model's.
    path = model_dir("phi3")
    ids = SEQ[:60]
    expected = reference_logits(path, ids, context=max_context)
    short, long = (reference_logits(path, ids, context=c) for c in (64, 65))
    assert np.abs(short - long).max() > 100 * F32_REL_TOL * float(np.ptp(short))
    (logits,) = await engine_logits(path, [ids], device="cpu", max_context=max_context)
    assert_close(logits, expected)


@pytest.mark.parametrize("naming", ["v4", "v5"])
async def test_gemma3_vision_language_folder_runs_its_text_model(
    model_dir: MakeModel, tmp_path: Path, naming: str
) -> None:
    # A `gemma3` folder (Gemma3ForConditionalGeneration, gemma-3-4b and up) holds the text model
    # under language_model.model. (transformers 4) or model.language_model. (5) beside a vision
    # tower and projector: the engine runs the text model alone, to the bit as its own folder.
    from strata_rs.testing.models import vision_language_folder

    text = model_dir("gemma3")
    folder = vision_language_folder(text, tmp_path / naming, naming)
    (want,), _ = await engine_logits_info(text, [SEQ], device="cpu")
    (got,), info = await engine_logits_info(folder, [SEQ], device="cpu")
    np.testing.assert_array_equal(got, want)
    assert info["model_type"] == "gemma3"
    assert_close(got, reference(text, SEQ))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
async def test_shared_prefix_requests(model_dir: MakeModel, family: str) -> None:
    # Requests that share a prefix with earlier ones (where a prefix cache may
    # reuse KV) must give the same logits as a fresh computation.
    path = model_dir(family)
    a = SEQ[:60]
    b = SEQ[:45] + SEQ[70:90]  # diverges after 45 tokens
    c = SEQ[:60] + SEQ[90:100]  # extends a
    outs = await engine_logits(path, [a, b, c, a], device="cpu", max_batch_tokens=16)
    for ids, logits in zip((a, b, c, a), outs, strict=True):
        assert_close(logits, reference(path, ids))


async def test_smollm_shape_matches_reference(model_dir: MakeModel) -> None:
    # Real-size shape (30 layers, 9 heads / 3 KV heads, head_dim 64).
    path = model_dir("llama", "f32", "smollm-135m")
    ids = np.random.default_rng(7).integers(0, 49152, 64).tolist()
    (logits,) = await engine_logits(path, [ids], device="cpu")
    assert_close(logits, reference(path, ids))


@pytest.mark.skipif(not strata_rs.cuda_devices(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
async def test_cuda_matches_reference(model_dir: MakeModel, family: str, dtype: str) -> None:
    path = model_dir(family, dtype)
    runs = [
        (await engine_logits(path, [SEQ], device="cuda", max_batch_tokens=n))[0]
        for n in (1, 7, 4096)
    ]
    expected = reference(path, SEQ)
    for logits in runs:
        if dtype == "f32":
            # GPU reductions reorder sums; still far below any real bug.
            assert_close(logits, expected, rel_tol=1e-3)
        else:
            assert_argmax_agrees(logits, expected, GPU_LOW_PRECISION_REL_TOL)


async def test_prompt_logprobs_are_the_logits_log_softmax(model_dir: MakeModel) -> None:
    """`Engine.prompt_logprobs`: None for the first token, then each token's log-softmax under
    the logits before it (engine.logits, in float64, within 1e-5), its rank (1 + how many tokens
    score higher) and the top alternatives, ties by lower id. With a step of 16 tokens the 100
    tokens are scored in 7 chunks, each reduced before the next: the same entries."""
    model = model_dir("llama")
    for step in (512, 16):
        engine = await strata_rs.Engine.load(model, max_batch_tokens=step)
        try:
            logits = (await engine.logits(SEQ)).astype(np.float64)
            high = logits.max(axis=1, keepdims=True)
            lsm = logits - (high + np.log(np.exp(logits - high).sum(axis=1, keepdims=True)))
            got = await engine.prompt_logprobs(SEQ, top_logprobs=3)
            assert len(got) == len(SEQ) and got[0] is None
            tok = engine.tokenizer
            for i in range(1, len(SEQ)):
                entry = got[i]
                assert entry is not None
                row, token = logits[i - 1], SEQ[i]
                assert entry["token_id"] == token
                assert entry["token"] == tok.decode([token])
                assert abs(entry["logprob"] - lsm[i - 1, token]) < 1e-5
                assert entry["rank"] == 1 + int((row > row[token]).sum())
                best = np.argsort(-row, kind="stable")[:3]
                assert [t["token_id"] for t in entry["top_logprobs"]] == best.tolist()
                for t in entry["top_logprobs"]:
                    assert abs(t["logprob"] - lsm[i - 1, t["token_id"]]) < 1e-5
            assert await engine.prompt_logprobs(SEQ[:1]) == [None]
            for top, message in [
                (21, "top_logprobs: must be at most 20, got 21"),
                (-1, "top_logprobs: must be >= 0, got -1"),
                ("2", "top_logprobs: must be an integer, got str"),
            ]:
                with pytest.raises(strata_rs.InvalidRequest) as e:
                    await engine.prompt_logprobs(SEQ, top_logprobs=top)  # type: ignore[arg-type]
                assert str(e.value) == message
            with pytest.raises(strata_rs.InvalidRequest) as e:
                await engine.prompt_logprobs([VOCAB])
            assert str(e.value).startswith("token_ids: ")
        finally:
            await engine.close()
