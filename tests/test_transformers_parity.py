"""The NumPy reference (tests/reference.py) and the engine against transformers itself, on
every tiny family.

The engine's logit tests trust the reference; this checks the reference's semantics against
the modelling code it was written from, and the engine against it directly: each tiny f32
model (and Gemma 3's variants: its transformers-5 RoPE spelling, a final soft cap, a Hub-style
config with only sliding_window_pattern, attn_logit_softcapping set; the MoE families':
norm_topk_prob off, another decoder_sparse_step, sliding windows; Phi-3's: the short LongRoPE
factors, Phi-4-mini's three-quarter rotary part with tied embeddings, no scaling, an explicit
attention_factor) runs through
AutoModelForCausalLM.from_pretrained in float64 on the same 100 tokens as the reference. The MoE
folders hold one tensor per expert as the Hub's checkpoints do; transformers 5 fuses them into
its 3-D expert tensors on load, and the test asserts that none is left out or made up.

torch and transformers are optional: the module skips when either is missing (CI installs
neither). It needs no GPU.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from reference import reference_logits
from strata_rs import Engine
from strata_rs.testing.models import ARCHITECTURES, FAMILIES, make_model

torch = pytest.importorskip("torch")
# dtype= (rather than torch_dtype=) in from_pretrained is 4.56's.
transformers = pytest.importorskip("transformers", minversion="4.56")

SEQ = np.random.default_rng(1234).integers(0, 512, 100).tolist()

# Largest |reference - transformers| allowed, as a fraction of the reference's logit range.
# transformers in float64 still computes RoPE angles and cos/sin in float32 and every RMSNorm
# in float32 (x.float() / .to(torch.float32) inside the norm), so it is float32-accurate only.
# Measured with transformers 5.25.0 and torch 2.15.0 (CPU, sdpa): llama 2.2e-7, mistral 2.2e-7,
# qwen2 2.2e-7, qwen3 1.0e-7, gemma3 7.4e-7 (every variant), where Gemma 3's RoPE base of 1e6
# makes its float32 angles the coarsest. With Gemma 3's RoPE and norms patched to float64 the
# difference falls to 1.1e-15: the rest is float32 rounding, not a difference in semantics.
# qwen3_moe 9.6e-8 (7.9e-8..1.1e-7 over its variants), mixtral 2.3e-7 (sliding 1.9e-7); their
# routers' softmax is float32 too, and the argmax agrees everywhere. phi3 6.9e-7 (v5 the same),
# phi3-short 1.6e-7, phi3-phi4-mini 8.9e-7, phi3-no-scaling 1.5e-7, phi3-attention-factor
# 8.3e-7: LongRoPE's float32 factors and cos/sin scaled above 1 make these the largest; with
# Phi-3's RoPE (inverse frequencies, angles, cos/sin) and RMSNorm patched to float64 every phi3
# case falls to 1e-15.
TOLERANCE = 1e-6
# The engine computes in float32 throughout: the f32 tolerance of tests/test_logits.py.
ENGINE_TOLERANCE = 1e-4

TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5

MOE_FAMILIES = ("qwen3_moe", "mixtral")

# id -> (family, rope_form, config overrides).
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    **{family: (family, "v4", {}) for family in FAMILIES},
    # transformers 5's rope_parameters (per layer type for Gemma 3) instead of rope_theta,
    # rope_scaling and rope_local_base_freq.
    **{f"{family}-v5": (family, "v5", {}) for family in FAMILIES},
    # cap * tanh(logits / cap) on the logits; 30 moves them by 6e-4 of their range here, 600
    # times TOLERANCE (tests/test_reference_self.py::test_gemma3_final_softcap).
    "gemma3-final-softcap": ("gemma3", "v4", {"final_logit_softcapping": 30.0}),
    # Gemma 3's Hub configs (transformers 4.50) carry no layer_types: which layers slide comes
    # from sliding_window_pattern (3 here: layer 2 is full).
    "gemma3-pattern-only": ("gemma3", "v4", {"layer_types": None}),
    # transformers' Gemma 3 keeps attn_logit_softcapping in its config but never applies it (Gemma
    # 2 did); a cap of 1 would squash the scores (std ~1 here) hard, so a match shows it ignored.
    "gemma3-attn-softcap-ignored": ("gemma3", "v4", {"attn_logit_softcapping": 1.0}),
    # Qwen3-MoE weighs its chosen experts by their share of all experts' probability (the
    # softmax's values, summing to under 1) unless norm_topk_prob renormalizes them; Qwen3-MoE
    # checkpoints set it, transformers' default is off.
    "qwen3_moe-norm-topk-false": ("qwen3_moe", "v4", {"norm_topk_prob": False}),
    # Experts in layer 1 only ((layer + 1) % 2 == 0, mlp_only_layers empty), dense MLPs in 0 and 2.
    "qwen3_moe-sparse-step-2": (
        "qwen3_moe",
        "v4",
        {"decoder_sparse_step": 2, "mlp_only_layers": []},
    ),
    # A window slides in every layer of a Qwen3-MoE with use_sliding_window (transformers 5 reads
    # no max_window_layers for it, which dense Qwen2/Qwen3 do: 3 here would leave every layer full).
    "qwen3_moe-sliding-window": (
        "qwen3_moe",
        "v4",
        {"use_sliding_window": True, "sliding_window": 8},
    ),
    "mixtral-sliding-window": ("mixtral", "v4", {"sliding_window": 8}),
    # Phi-3 with the original context at least the sequence's (here the whole context): both
    # transformers (by the sequence's length) and the engine (by the served context) take the
    # short factors, and the attention factor is 1 (no stretch).
    "phi3-short": ("phi3", "v4", {"original_max_position_embeddings": 256}),
    # Phi-4-mini's shape of RoPE: three quarters of each head rotate (12 of 16, 6 factors per
    # list), tied embeddings, transformers 5's spelling.
    "phi3-phi4-mini": (
        "phi3",
        "v5",
        {
            "partial_rotary_factor": 0.75,
            "rope_scaling": {
                "long_factor": [1.25, 1.5, 2.0, 2.5, 3.25, 4.0],
                "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.75],
                "type": "longrope",
            },
            "tie_word_embeddings": True,
        },
    ),
    # Phi-3-mini-4k's RoPE: no scaling at all (partial rotary and the window still apply).
    "phi3-no-scaling": ("phi3", "v4", {"rope_scaling": None}),
    # An explicit attention_factor replaces sqrt(1 + ln 4 / ln 64) on cos and sin.
    "phi3-attention-factor": (
        "phi3",
        "v4",
        {
            "rope_scaling": {
                "attention_factor": 1.25,
                "long_factor": [1.5, 2.25, 3.0, 3.75],
                "short_factor": [1.0, 1.25, 1.75, 2.5],
                "type": "longrope",
            }
        },
    ),
}


def transformers_logits(folder: Path, family: str) -> np.ndarray:
    """transformers' float64 logits of SEQ, [n, vocab]; every file tensor loaded, none made up."""
    options: dict[str, Any] = {}
    if family in MOE_FAMILIES:
        # transformers 5 runs the experts through torch's grouped_mm by default, which refuses
        # float64; "eager" is the modelling file's own loop over the experts.
        options["experts_implementation"] = "eager"
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder,
        dtype=torch.float64,
        attn_implementation="sdpa",
        output_loading_info=True,
        **options,
    )
    assert type(model).__name__ == ARCHITECTURES[family]
    # A tensor name transformers does not expect would be dropped and the one it expects
    # initialized at random: the logits would differ, but this says why.
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), (
        info
    )
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([SEQ])).logits[0]
    assert logits.dtype == torch.float64
    return logits.numpy()


@pytest.mark.parametrize("case", CASES)
def test_reference_matches_transformers(tmp_path: Path, case: str) -> None:
    family, rope_form, overrides = CASES[case]
    if rope_form == "v5" and not TRANSFORMERS_5:
        pytest.skip("rope_parameters configs need transformers 5")
    folder = make_model(tmp_path / case, family, "tiny", "f32", rope_form=rope_form, **overrides)
    want = transformers_logits(folder, family)
    got = reference_logits(folder, SEQ)
    spread = want.max() - want.min()
    error = np.abs(got - want).max() / spread
    assert error <= TOLERANCE, f"{case}: max |reference - transformers| = {error:.3g} of the range"
    assert (got.argmax(1) == want.argmax(1)).all()

    engine = np.asarray(asyncio.run(engine_logits(folder)), dtype=np.float64)
    error = np.abs(engine - want).max() / spread
    assert error <= ENGINE_TOLERANCE, f"{case}: max |engine - transformers| = {error:.3g}"
    assert (engine.argmax(1) == want.argmax(1)).all()


async def engine_logits(folder: Path) -> np.ndarray:
    engine = await Engine.load(str(folder), device="cpu")
    try:
        return await engine.logits(SEQ)
    finally:
        await engine.close()


@pytest.mark.parametrize("naming", ["v4", "v5"])
def test_gemma3_vision_language_folder_matches_transformers(tmp_path: Path, naming: str) -> None:
    """A `gemma3` folder as Gemma3ForConditionalGeneration saves it (text model under
    language_model.model. or model.language_model.): transformers' text-only logits, and the
    engine's. Our vision tower is a stub (transformers initializes the rest of it); none of the
    text model's tensors may be missing or unexpected."""
    from strata_rs.testing.models import vision_language_folder

    text = make_model(tmp_path / "text", "gemma3", "tiny", "f32")
    folder = vision_language_folder(text, tmp_path / naming, naming)
    model, info = transformers.AutoModelForImageTextToText.from_pretrained(
        folder, dtype=torch.float64, output_loading_info=True
    )
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"
    assert not [k for k in info["missing_keys"] if "vision_tower" not in k], info
    assert not info["unexpected_keys"] and not info["mismatched_keys"], info
    model.eval()
    with torch.no_grad():
        want = model(input_ids=torch.tensor([SEQ])).logits[0].numpy()
    engine = np.asarray(asyncio.run(engine_logits(folder)), dtype=np.float64)
    error = np.abs(engine - want).max() / (want.max() - want.min())
    assert error <= ENGINE_TOLERANCE, f"{naming}: max |engine - transformers| = {error:.3g}"
    assert (engine.argmax(1) == want.argmax(1)).all()
