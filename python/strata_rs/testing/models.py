"""Synthetic Hugging Face model folders for tests and benchmarks.

`make_model` writes a folder that looks exactly like one downloaded from the
Hub for the Llama family (llama, mistral, qwen2, qwen3), for Gemma 3's text
model (gemma3), for the mixture-of-experts families Qwen3-MoE (qwen3_moe) and
Mixtral (mixtral) and for Phi-3 / Phi-4-mini (phi3: fused qkv_proj and
gate_up_proj tensors, partial rotary embeddings, LongRoPE): config.json,
safetensors weights (optionally sharded), a trained byte-level BPE tokenizer,
tokenizer_config.json and generation_config.json.  Weights are random but
seeded and deliberately non-trivial (norm weights and biases are not 1/0,
Gemma's norm weights not 0, routers that choose decisively, LongRoPE factors
that are neither 1 nor equal) so that a numerical mistake in an engine shows
up in the logits.

The phi3 family fits the tiny, smollm-135m and llama-1b presets; at llama-1b's
shape it takes Phi-4-mini's RoPE (3/4 of each head rotated, LongRoPE) instead of
Llama 3's scaling, which Phi3Config does not accept.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import struct
import sysconfig
from collections.abc import Mapping
from typing import Any

import numpy as np

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "qwen3_moe", "mixtral", "phi3")
PRESETS = ("tiny", "smollm-135m", "llama-1b", "qwen3-moe-1b", "qwen3-dense-0.3b", "gemma3-1b")
DTYPES = ("f32", "bf16", "f16")
# How config.json spells RoPE: "v4" as transformers 4 writes it and Hub configs carry it
# (rope_theta, rope_scaling, and Gemma 3's rope_local_base_freq at top level); "v5" as
# transformers 5 writes it (one rope_parameters dict with theta inside, per layer type for Gemma 3).
ROPE_FORMS = ("v4", "v5")

# Strings transformers writes in config.json["torch_dtype"].
TORCH_DTYPE = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}
# dtype names used in the safetensors header.
SAFETENSORS_DTYPE = {"f32": "F32", "bf16": "BF16", "f16": "F16"}

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 0, 1, 2

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TRANSFORMERS_VERSION = "4.51.3"

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
# config.json["model_type"] where it is not the family name: "gemma3" is the multimodal
# Gemma3ForConditionalGeneration, the text-only model is "gemma3_text".
MODEL_TYPES = {"gemma3": "gemma3_text"}

# One shape for the Qwen3-MoE preset and its dense counterpart (`_PRESET_FIELDS` tells them
# apart): only the MLP differs.
_QWEN3_1B_SHAPE: dict[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
}
# Model shapes.  The tiny preset ties embeddings for qwen3/mistral and unties
# them for llama/qwen2 so both code paths are covered; its RoPE scaling starts
# at 32 positions so ~100-token tests exercise it.
_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 512,
        "max_position_embeddings": 256,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
    },
    # SmolLM2-135M's shape.
    "smollm-135m": {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5,
    },
    # Llama-3.2-1B's shape (1.24B parameters, tied): the 1B-class model of the GPU checks. Its
    # tokenizer learns 49,152 tokens; the other embedding rows are unused.
    "llama-1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
    },
    # A Qwen3-MoE of 1.0B parameters of which 0.34B are active per token (8 experts of width
    # 1536, two per token, tied), and the dense Qwen3 with those active parameters (one MLP of
    # width 3072 = 2 x 1536): the pair compares MoE and dense decoding at equal work per token.
    "qwen3-moe-1b": _QWEN3_1B_SHAPE,
    "qwen3-dense-0.3b": _QWEN3_1B_SHAPE,
    # Gemma-3-1B's shape (1.0B parameters, 0.3B of them the tied 262K-token embedding; head_dim
    # 256, one K/V head).
    "gemma3-1b": {
        "hidden_size": 1152,
        "intermediate_size": 6912,
        "num_hidden_layers": 26,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "vocab_size": 262144,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
    },
}
# config.json fields a preset sets beyond its shape: Llama-3.2-1B's long-context RoPE (llama3
# scaling from an 8K original context to 131,072 positions) and its tied head.
_PRESET_FIELDS: dict[str, dict[str, Any]] = {
    "llama-1b": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": True,
    },
    # Spelled out although they are qwen3_moe's defaults here: these are the preset's shape.
    "qwen3-moe-1b": {
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 1536,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "tie_word_embeddings": True,
    },
    "qwen3-dense-0.3b": {"tie_word_embeddings": True},
    # Gemma-3-1B's config: a 512-token window on five layers of six, no RoPE scaling.
    "gemma3-1b": {
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "layer_types": None,
        "query_pre_attn_scalar": 256,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": None,
        "final_logit_softcapping": None,
        "tie_word_embeddings": True,
    },
}
# Presets made for one family (their names say which); the others fit every family...
_PRESET_FAMILIES: dict[str, tuple[str, ...]] = {
    "qwen3-moe-1b": ("qwen3_moe",),
    "qwen3-dense-0.3b": ("qwen3",),
    "gemma3-1b": ("gemma3",),
}
# A family's own fields for a preset, replacing the preset's: phi3 at llama-1b's shape takes
# Phi-4-mini's RoPE (three quarters of each head rotated, LongRoPE from a 4K original context to
# 128K, seeded factors of its range) and its tied head, not Llama 3's scaling, which Phi3Config
# refuses.
_FAMILY_PRESET_FIELDS: dict[tuple[str, str], dict[str, Any]] = {
    ("phi3", "llama-1b"): {
        "partial_rotary_factor": 0.75,
        "rope_scaling": {
            "type": "longrope",
            "short_factor": [round(1.0 + 0.08 * i, 4) for i in range(24)],
            "long_factor": [round(1.0 + 2.0 * i, 4) for i in range(24)],
        },
        "original_max_position_embeddings": 4096,
        "sliding_window": None,
        "tie_word_embeddings": True,
    },
}
# ...and the families that fit only some presets.
_FAMILY_PRESETS: dict[str, tuple[str, ...]] = {"phi3": ("tiny", "smollm-135m", "llama-1b")}


# Each preset's family when the caller names none (`strata-rs make-model --preset`).
def preset_family(preset: str) -> str:
    return _PRESET_FAMILIES.get(preset, ("llama",))[0]


# Presets whose tokenizer learns fewer tokens than the vocabulary (training 128K tokens on the
# built-in corpus would take minutes and most of them would be rare byte pairs anyway).
_PRESET_TOKENIZER_VOCAB = {"llama-1b": 49152, "gemma3-1b": 49152}

_TINY_FAMILY: dict[str, dict[str, Any]] = {
    "llama": {
        "tie_word_embeddings": False,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    },
    "mistral": {
        "tie_word_embeddings": True,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
    },
    "qwen2": {"tie_word_embeddings": False, "rope_scaling": None},
    "qwen3": {"tie_word_embeddings": True, "rope_scaling": None},
    # Every Gemma 3 feature shows within ~100 tokens: three sliding layers with a window of 8
    # around one full layer; full layers' RoPE linearly scaled as in Gemma 3 4B and up, sliding
    # layers' on their own unscaled base; head_dim decoupled from hidden/heads, and an attention
    # scale (query_pre_attn_scalar) that is not head_dim, so that a 1/sqrt(head_dim) shows.
    "gemma3": {
        "num_hidden_layers": 4,
        "layer_types": [
            "sliding_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
        ],
        # The same list as a pattern (every third layer full): transformers 5 reads layer_types,
        # but Gemma 3's Hub configs (written by 4.50) carry only sliding_window_pattern.
        "sliding_window_pattern": 3,
        "sliding_window": 8,
        "head_dim": 32,
        "query_pre_attn_scalar": 24,
        "rope_theta": 1000000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "rope_local_base_freq": 10000.0,
        "tie_word_embeddings": True,
    },
    # Three layers with layer 1 a dense MLP (mlp_only_layers) between two sparse ones, so that
    # both kinds of layer and the rule choosing between them show; experts narrower than the
    # dense MLP, as in real Qwen3-MoE models (768 against 6144 in Qwen3-30B-A3B).
    "qwen3_moe": {
        "num_hidden_layers": 3,
        "max_window_layers": 3,  # = num_hidden_layers, as in Qwen3-MoE's configs
        "moe_intermediate_size": 32,
        "mlp_only_layers": [1],
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
    },
    # Mixtral's intermediate_size is each expert's width.
    "mixtral": {
        "intermediate_size": 32,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
    },
    # Every Phi-3 feature shows within ~100 tokens: half of each head rotates (head_dim 16,
    # rotary_dim 8, so 4 LongRoPE factors), a 64-token original context stretched to 256 so that
    # the long factors and the attention factor sqrt(1 + ln 4 / ln 64) apply (the engine picks
    # long because the context it serves, 256, exceeds 64; transformers because the sequence
    # does), short and long factors that differ from 1 and from each other, a window of 48 in
    # every layer, and an untied head.
    "phi3": {
        "max_position_embeddings": 256,
        "original_max_position_embeddings": 64,
        "partial_rotary_factor": 0.5,
        "rope_scaling": {
            "long_factor": [1.5, 2.25, 3.0, 3.75],
            "short_factor": [1.0, 1.25, 1.75, 2.5],
            "type": "longrope",
        },
        "sliding_window": 48,
        "tie_word_embeddings": False,
    },
}

MATRIX_STD = 0.05
# q/k projections get a larger, fan-in scaled std (0.15 at hidden 64, 0.05 at
# hidden 576): with 0.05 everywhere the tiny model's attention is nearly
# uniform, so RoPE or masking mistakes would hardly move the argmax.
QK_STD_TIMES_SQRT_HIDDEN = 1.2
NORM_STD = 0.1
BIAS_STD = 0.05
# Routers get a fan-in scaled std (0.375 at hidden 64, 0.094 at hidden 1024). The router reads
# a normalized hidden state (norm about sqrt(hidden)), so its logits have a std of about 3: with
# the matrices' 0.05 it would be 0.4, a near-uniform routing that a wrong choice of experts would
# hardly change. The std hardly moves which experts win (in the first MoE layer not at all: its
# logits scale with it), but it sets their weights and the margins: at 3 the first of the two
# chosen experts weighs about 0.8 (the second still counts), the six left out keep about a tenth
# of the probability (so norm_topk_prob shows), and the second and third experts' logits differ
# by 0.1 at the 5th percentile, so a float32 engine picks the experts a float64 reference does
# (tests/test_reference_self.py checks the tiny models' routing).
ROUTER_STD_TIMES_SQRT_HIDDEN = 3.0


# --------------------------------------------------------------------------
# config


def _family_config(family: str, shape: Mapping[str, Any], dtype: str) -> dict[str, Any]:
    """config.json fields in the order and with the keys transformers writes."""
    common: dict[str, Any] = {
        "architectures": [ARCHITECTURES[family]],
        "attention_dropout": 0.0,
        "bos_token_id": IM_START_ID,
        "eos_token_id": IM_END_ID,
        "hidden_act": "silu",
        "hidden_size": shape["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": shape["intermediate_size"],
        "max_position_embeddings": shape["max_position_embeddings"],
        "model_type": MODEL_TYPES.get(family, family),
        "num_attention_heads": shape["num_attention_heads"],
        "num_hidden_layers": shape["num_hidden_layers"],
        "num_key_value_heads": shape["num_key_value_heads"],
        "rms_norm_eps": shape["rms_norm_eps"],
        "rope_scaling": None,
        "rope_theta": shape["rope_theta"],
        "tie_word_embeddings": True,
        "torch_dtype": TORCH_DTYPE[dtype],
        "transformers_version": TRANSFORMERS_VERSION,
        "use_cache": True,
        "vocab_size": shape["vocab_size"],
    }
    if family == "llama":
        common.update(
            attention_bias=False,
            head_dim=shape["head_dim"],
            mlp_bias=False,
            pretraining_tp=1,
        )
    elif family == "mistral":
        common.update(head_dim=shape["head_dim"], sliding_window=None)
    elif family == "qwen2":
        # Qwen2 has no attention_bias key: q/k/v biases are unconditional and
        # o_proj never has one.  Real Qwen2 configs carry a sliding_window
        # value with use_sliding_window false, which must then be ignored.
        common.update(
            max_window_layers=shape["num_hidden_layers"],
            sliding_window=shape["max_position_embeddings"],
            use_sliding_window=False,
        )
    elif family == "qwen3":
        common.update(
            attention_bias=False,
            head_dim=shape["head_dim"],
            max_window_layers=shape["num_hidden_layers"],
            sliding_window=None,
            use_sliding_window=False,
        )
    elif family == "qwen3_moe":
        # Qwen3-30B-A3B's config.json keys (transformers 4.51), with 8 experts of which 2 serve
        # each token, each half as wide as the preset's dense MLP (which the dense layers of
        # mlp_only_layers keep): a token's two experts do the dense MLP's work.
        common.update(
            attention_bias=False,
            decoder_sparse_step=1,
            head_dim=shape["head_dim"],
            max_window_layers=shape["num_hidden_layers"],
            mlp_only_layers=[],
            moe_intermediate_size=shape["intermediate_size"] // 2,
            norm_topk_prob=True,
            num_experts=8,
            num_experts_per_tok=2,
            output_router_logits=False,
            router_aux_loss_coef=0.001,
            sliding_window=None,
            use_sliding_window=False,
        )
    elif family == "mixtral":
        # Mixtral-8x7B's config.json keys: 8 experts, 2 per token, each of width
        # intermediate_size (half the preset's dense MLP here, as for qwen3_moe).
        common.update(
            head_dim=shape["head_dim"],
            intermediate_size=shape["intermediate_size"] // 2,
            num_experts_per_tok=2,
            num_local_experts=8,
            output_router_logits=False,
            router_aux_loss_coef=0.02,
            router_jitter_noise=0.0,
            sliding_window=None,
        )
    elif family == "gemma3":
        # Gemma 3 1B's settings (its config.json, transformers 4.50): every sixth layer full,
        # a 512-token window, global RoPE base 1e6 and local 1e4, the attention scale from
        # query_pre_attn_scalar (= head_dim in 1B/4B/12B). Gemma names its activation
        # hidden_activation (GELU, tanh approximation), has no hidden_act, and pads with id 0.
        del common["hidden_act"]
        n_layers = shape["num_hidden_layers"]
        common.update(
            attention_bias=False,
            attn_logit_softcapping=None,
            final_logit_softcapping=None,
            head_dim=shape["head_dim"],
            hidden_activation="gelu_pytorch_tanh",
            layer_types=gemma3_layer_types(n_layers, 6),
            pad_token_id=ENDOFTEXT_ID,
            query_pre_attn_scalar=shape["head_dim"],
            rope_local_base_freq=10000.0,
            rope_theta=1000000.0,
            sliding_window=512,
            sliding_window_pattern=6,
            use_bidirectional_attention=False,
        )
    elif family == "phi3":
        # Phi-3-mini-4k's config.json keys (transformers 4.4x; Phi-4-mini adds
        # partial_rotary_factor), no RoPE scaling and the original context the full one: the
        # tiny preset's own fields (_TINY_FAMILY) add LongRoPE. No head_dim key (Phi3Config has
        # none: hidden_size / num_attention_heads); no biases anywhere.
        common.update(
            embd_pdrop=0.0,
            original_max_position_embeddings=shape["max_position_embeddings"],
            pad_token_id=ENDOFTEXT_ID,
            partial_rotary_factor=1.0,
            resid_pdrop=0.0,
            sliding_window=None,
            tie_word_embeddings=False,
        )
    else:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    return dict(sorted(common.items()))


def gemma3_layer_types(num_hidden_layers: int, sliding_window_pattern: int) -> list[str]:
    """transformers' rule for Gemma 3 configs without layer_types: layer i is full when
    (i + 1) is a multiple of the pattern, sliding otherwise."""
    return [
        "full_attention" if (i + 1) % sliding_window_pattern == 0 else "sliding_attention"
        for i in range(num_hidden_layers)
    ]


def _rope_parameters(config: dict[str, Any]) -> None:
    """Rewrites config's RoPE fields in place into transformers 5's rope_parameters."""
    theta = config.pop("rope_theta")
    scaling = config.pop("rope_scaling", None)
    full = {**(scaling or {"rope_type": "default"}), "rope_theta": theta}
    if config["model_type"] == "gemma3_text":
        # Scaling applies to the full-attention layers only; the sliding ones keep their own base.
        local = {"rope_type": "default", "rope_theta": config.pop("rope_local_base_freq")}
        config["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
    elif config["model_type"] == "phi3":
        # Phi3Config (transformers 5) spells the type rope_type, copies partial_rotary_factor
        # into rope_parameters and, for longrope, original_max_position_embeddings too; both stay
        # at top level as well (and the top-level original context is the one it reads).
        if "type" in full:
            full["rope_type"] = full.pop("type")
        full["partial_rotary_factor"] = config.get("partial_rotary_factor", 1.0)
        if full["rope_type"] == "longrope":
            full["original_max_position_embeddings"] = config["original_max_position_embeddings"]
        config["rope_parameters"] = dict(sorted(full.items()))
    else:
        config["rope_parameters"] = full


def build_config(
    family: str,
    preset: str = "tiny",
    dtype: str = "f32",
    *,
    rope_form: str = "v4",
    **overrides: Any,
) -> dict[str, Any]:
    """The config.json dict make_model would write (without writing anything).

    `rope_form` is one of ROPE_FORMS; "v5" converts the RoPE fields after the overrides, so
    rope_theta/rope_scaling/rope_local_base_freq overrides still apply."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {PRESETS}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {DTYPES}")
    if rope_form not in ROPE_FORMS:
        raise ValueError(f"unknown rope_form {rope_form!r}; expected one of {ROPE_FORMS}")
    if family not in _PRESET_FAMILIES.get(preset, FAMILIES):
        raise ValueError(
            f"preset {preset!r} is for family {' or '.join(_PRESET_FAMILIES[preset])}, "
            f"not {family!r}"
        )
    if preset not in _FAMILY_PRESETS.get(family, PRESETS):
        raise ValueError(
            f"family {family!r} fits preset {' or '.join(_FAMILY_PRESETS[family])} only, "
            f"not {preset!r}"
        )
    config = _family_config(family, _PRESETS[preset], dtype)
    if preset == "tiny":
        config.update(_TINY_FAMILY[family])
    config.update(_FAMILY_PRESET_FIELDS.get((family, preset), _PRESET_FIELDS.get(preset, {})))
    shape_changed = "hidden_size" in overrides or "num_attention_heads" in overrides
    config.update(overrides)
    # Only Qwen3 (dense and MoE) and Gemma 3 decouple head_dim from hidden/heads; elsewhere
    # keep the written head_dim consistent when the caller reshapes the model.
    decoupled = family in ("qwen3", "qwen3_moe", "gemma3")
    if shape_changed and "head_dim" not in overrides and not decoupled and "head_dim" in config:
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    # A Gemma 3 with another layer count gets layer_types of that length, from its pattern.
    if (
        family == "gemma3"
        and "num_hidden_layers" in overrides
        and "layer_types" not in overrides
        and config.get("layer_types") is not None
    ):
        config["layer_types"] = gemma3_layer_types(
            config["num_hidden_layers"], config["sliding_window_pattern"]
        )
    if rope_form == "v5":
        _rope_parameters(config)
        config = dict(sorted(config.items()))
    return config


def head_dim_of(config: Mapping[str, Any]) -> int:
    head_dim = config.get("head_dim")
    if head_dim is None:
        if config["model_type"] == "gemma3_text":
            return 256  # Gemma3TextConfig's default, not hidden/heads
        return int(config["hidden_size"]) // int(config["num_attention_heads"])
    return int(head_dim)


# model_types whose attention_bias puts biases on q/k/v and o_proj alike.
_ATTENTION_BIAS_TYPES = ("llama", "qwen3", "qwen3_moe", "gemma3_text")


def has_qkv_bias(config: Mapping[str, Any]) -> bool:
    """Qwen2 always has q/k/v biases; Llama/Qwen3/Qwen3-MoE/Gemma 3 follow attention_bias;
    Mistral and Mixtral have none."""
    family = config["model_type"]
    if family == "qwen2":
        return True
    return family in _ATTENTION_BIAS_TYPES and bool(config.get("attention_bias", False))


def has_o_bias(config: Mapping[str, Any]) -> bool:
    """attention_bias covers o_proj too in Llama/Qwen3/Qwen3-MoE/Gemma 3, never in Qwen2."""
    family = config["model_type"]
    return family in _ATTENTION_BIAS_TYPES and bool(config.get("attention_bias", False))


def qwen3_moe_sparse_layer(config: Mapping[str, Any], layer: int) -> bool:
    """transformers' Qwen3MoeDecoderLayer rule: a layer has the experts unless it is in
    mlp_only_layers, provided there are experts and (layer + 1) is a multiple of
    decoder_sparse_step; otherwise it has a dense MLP of intermediate_size."""
    return (
        layer not in (config.get("mlp_only_layers") or [])
        and int(config["num_experts"]) > 0
        and (layer + 1) % int(config.get("decoder_sparse_step", 1)) == 0
    )


def moe_layout(
    config: Mapping[str, Any], layer: int
) -> tuple[str, int, int, tuple[str, ...]] | None:
    """Where one layer's experts are, for the MoE families, as Hub checkpoints name them:
    (the block's prefix under model.layers.N., number of experts, each one's width, its
    gate/up/down projection names); None for a dense layer or a dense family."""
    family = config["model_type"]
    if family == "mixtral":
        return (
            "block_sparse_moe.",
            int(config["num_local_experts"]),
            int(config["intermediate_size"]),
            ("w1", "w3", "w2"),
        )
    if family == "qwen3_moe" and qwen3_moe_sparse_layer(config, layer):
        return (
            "mlp.",
            int(config["num_experts"]),
            int(config["moe_intermediate_size"]),
            ("gate_proj", "up_proj", "down_proj"),
        )
    return None


# --------------------------------------------------------------------------
# weights


def make_weights(config: Mapping[str, Any], seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded float32 weights with HF tensor names, in HF order."""
    rng = np.random.default_rng(seed)
    hidden = int(config["hidden_size"])
    inter = int(config["intermediate_size"])
    vocab = int(config["vocab_size"])
    n_heads = int(config["num_attention_heads"])
    n_kv = int(config["num_key_value_heads"])
    head_dim = head_dim_of(config)
    family = config["model_type"]
    bias = has_qkv_bias(config)
    qk_std = QK_STD_TIMES_SQRT_HIDDEN / float(np.sqrt(hidden))
    router_std = ROUTER_STD_TIMES_SQRT_HIDDEN / float(np.sqrt(hidden))

    def normal(shape: tuple[int, ...], std: float, mean: float = 0.0) -> np.ndarray:
        # In place: the 135M-parameter preset should not pay for temporaries.
        x = rng.standard_normal(shape, dtype=np.float32)
        x *= np.float32(std)
        if mean:
            x += np.float32(mean)
        return x

    def matrix(rows: int, cols: int, std: float = MATRIX_STD) -> np.ndarray:
        return normal((rows, cols), std)

    # Gemma scales by (1 + weight), so its weights sit around 0 to scale by about 1 as well.
    norm_mean = 0.0 if family == "gemma3_text" else 1.0

    def norm(n: int) -> np.ndarray:
        return normal((n,), NORM_STD, norm_mean)

    def vector(n: int) -> np.ndarray:
        return normal((n,), BIAS_STD)

    w: dict[str, np.ndarray] = {"model.embed_tokens.weight": matrix(vocab, hidden)}
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(hidden)
        if family == "phi3":
            # One fused projection, as Phi-3's checkpoints store it: q rows, then k, then v.
            w[p + "self_attn.qkv_proj.weight"] = np.concatenate(
                [
                    matrix(n_heads * head_dim, hidden, qk_std),
                    matrix(n_kv * head_dim, hidden, qk_std),
                    matrix(n_kv * head_dim, hidden),
                ]
            )
            w[p + "self_attn.o_proj.weight"] = matrix(hidden, n_heads * head_dim)
            w[p + "post_attention_layernorm.weight"] = norm(hidden)
            # gate rows first, then up (transformers' chunk(2) of gate_up_proj's output).
            w[p + "mlp.gate_up_proj.weight"] = matrix(2 * inter, hidden)
            w[p + "mlp.down_proj.weight"] = matrix(hidden, inter)
            continue
        w[p + "self_attn.q_proj.weight"] = matrix(n_heads * head_dim, hidden, qk_std)
        w[p + "self_attn.k_proj.weight"] = matrix(n_kv * head_dim, hidden, qk_std)
        w[p + "self_attn.v_proj.weight"] = matrix(n_kv * head_dim, hidden)
        if bias:
            w[p + "self_attn.q_proj.bias"] = vector(n_heads * head_dim)
            w[p + "self_attn.k_proj.bias"] = vector(n_kv * head_dim)
            w[p + "self_attn.v_proj.bias"] = vector(n_kv * head_dim)
        w[p + "self_attn.o_proj.weight"] = matrix(hidden, n_heads * head_dim)
        if has_o_bias(config):
            w[p + "self_attn.o_proj.bias"] = vector(hidden)
        if family in ("qwen3", "qwen3_moe", "gemma3_text"):
            w[p + "self_attn.q_norm.weight"] = norm(head_dim)
            w[p + "self_attn.k_norm.weight"] = norm(head_dim)
        w[p + "post_attention_layernorm.weight"] = norm(hidden)
        if family == "gemma3_text":
            # Gemma 3 also normalizes the MLP's input and output (the attention's output is
            # post_attention_layernorm, its input input_layernorm).
            w[p + "pre_feedforward_layernorm.weight"] = norm(hidden)
            w[p + "post_feedforward_layernorm.weight"] = norm(hidden)
        moe = moe_layout(config, i)
        if moe is None:
            w[p + "mlp.gate_proj.weight"] = matrix(inter, hidden)
            w[p + "mlp.up_proj.weight"] = matrix(inter, hidden)
            w[p + "mlp.down_proj.weight"] = matrix(hidden, inter)
        else:
            # The router ([experts, hidden]) and one tensor per expert and projection, as the
            # Hub's checkpoints store them (transformers 5 fuses them into 3-D tensors on load).
            block, n_experts, width, (gate, up, down) = moe
            w[p + block + "gate.weight"] = matrix(n_experts, hidden, router_std)
            for e in range(n_experts):
                q = f"{p}{block}experts.{e}."
                w[q + gate + ".weight"] = matrix(width, hidden)
                w[q + up + ".weight"] = matrix(width, hidden)
                w[q + down + ".weight"] = matrix(hidden, width)
    w["model.norm.weight"] = norm(hidden)
    if not config.get("tie_word_embeddings", False):
        w["lm_head.weight"] = matrix(vocab, hidden)
    return w


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) of float32 values, round-to-nearest-even."""
    x = np.asarray(x, dtype=np.float32)
    bits = np.ascontiguousarray(x).view(np.uint32)
    # Adding 0x7FFF plus the lowest kept bit rounds ties to even.  In uint32
    # this cannot wrap for any non-NaN input (the largest, -inf's neighbour
    # 0xFF7FFFFF, stays below 2**32); NaNs are fixed up below.
    rounded = bits >> 16
    rounded &= 1
    rounded += 0x7FFF
    rounded += bits
    rounded >>= 16
    out = rounded.astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        # Keep NaNs quiet NaNs (rounding could carry them into infinity).
        out[nan] = ((bits[nan] >> 16).astype(np.uint16) & 0x8000) | 0x7FC0
    return out


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _encode_tensor(x: np.ndarray, dtype: str) -> tuple[str, bytes]:
    if dtype == "bf16":
        data = f32_to_bf16_bits(x)
    elif dtype == "f16":
        data = x.astype("<f2")
    else:
        data = x.astype("<f4")
    return SAFETENSORS_DTYPE[dtype], np.ascontiguousarray(data).tobytes()


def write_safetensors(
    path: str | os.PathLike[str],
    tensors: Mapping[str, np.ndarray],
    dtype: str,
    metadata: Mapping[str, str] | None = None,
) -> int:
    """Write a safetensors file; returns the number of tensor-data bytes.

    f32/f16 go through safetensors.numpy; bf16 (which numpy lacks) through a
    small writer of our own that follows the format spec.
    """
    meta = dict(metadata or {"format": "pt"})
    if dtype != "bf16":
        from safetensors.numpy import save_file

        np_dtype = "<f2" if dtype == "f16" else "<f4"
        arrays = {k: np.ascontiguousarray(v.astype(np_dtype)) for k, v in tensors.items()}
        save_file(arrays, str(path), metadata=meta)
        return sum(a.nbytes for a in arrays.values())

    header: dict[str, Any] = {"__metadata__": meta}
    chunks: list[bytes] = []
    offset = 0
    for name, x in tensors.items():
        st_dtype, data = _encode_tensor(x, dtype)
        header[name] = {
            "dtype": st_dtype,
            "shape": list(x.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        chunks.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    # The spec allows trailing spaces in the header; pad so tensor data starts
    # 8-byte aligned, which lets readers mmap it without copying.
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for data in chunks:
            f.write(data)
    return offset


def _split_shards(names: list[str], sizes: dict[str, int], n: int) -> list[list[str]]:
    """Split tensors, in order, into n contiguous groups of similar byte size."""
    n = max(1, min(n, len(names)))
    total = sum(sizes.values())
    groups: list[list[str]] = [[]]
    acc = 0
    for i, name in enumerate(names):
        remaining_names = len(names) - i
        remaining_groups = n - len(groups)
        target = total * len(groups) / n
        # Close the current group once it reaches its share, but never leave a
        # later group empty.
        if (
            groups[-1]
            and remaining_groups > 0
            and (acc >= target or remaining_names <= remaining_groups)
        ):
            groups.append([])
        groups[-1].append(name)
        acc += sizes[name]
    return groups


def write_weights(
    out: pathlib.Path, weights: Mapping[str, np.ndarray], dtype: str, shards: int = 1
) -> None:
    if shards <= 1:
        write_safetensors(out / "model.safetensors", weights, dtype)
        return
    itemsize = 4 if dtype == "f32" else 2
    sizes = {k: v.size * itemsize for k, v in weights.items()}
    groups = _split_shards(list(weights), sizes, shards)
    weight_map: dict[str, str] = {}
    total = 0
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        total += write_safetensors(out / fname, {k: weights[k] for k in group}, dtype)
        weight_map.update(dict.fromkeys(group, fname))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(out / "model.safetensors.index.json", index)


# --------------------------------------------------------------------------
# tokenizer

# Stdlib modules used as training text: prose (pydoc topics) plus code.
_CORPUS_MODULES = (
    "pydoc_data/topics.py",
    "typing.py",
    "argparse.py",
    "inspect.py",
    "difflib.py",
    "email/message.py",
    "http/client.py",
    "logging/__init__.py",
    "textwrap.py",
    "collections/__init__.py",
    "dataclasses.py",
    "pathlib.py",
    "subprocess.py",
    "functools.py",
    "json/decoder.py",
    "tarfile.py",
    "zipfile.py",
    "unittest/case.py",
    "asyncio/base_events.py",
    "statistics.py",
    "fractions.py",
    "_pydecimal.py",
    "configparser.py",
    "enum.py",
    "doctest.py",
    "pickle.py",
    "ast.py",
    "shutil.py",
    "os.py",
    "string.py",
    "calendar.py",
    "imaplib.py",
    "smtplib.py",
    "mailbox.py",
    "turtle.py",
    "pdb.py",
)


def _corpus(max_chars: int) -> list[str]:
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    used = 0
    for rel in _CORPUS_MODULES:
        path = stdlib / rel
        if not path.is_file():
            continue  # trimmed Python installs may lack some modules
        text = path.read_text(encoding="utf-8", errors="replace")[: max_chars - used]
        texts.append(text)
        used += len(text)
        if used >= max_chars:
            break
    if not texts:
        raise RuntimeError(f"no stdlib sources found under {stdlib} to train a tokenizer")
    return texts


@functools.lru_cache(maxsize=8)
def tokenizer_json(vocab_size: int) -> str:
    """A trained byte-level BPE tokenizer (tokenizer.json text), cached per size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 byte symbols so any text is encodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Small vocabularies need little text; this keeps the tiny preset fast.
    max_chars = 400_000 if vocab_size <= 4096 else 10_000_000
    tokenizer.train_from_iterator(_corpus(max_chars), trainer)
    for i, tok in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(tok) == i, (tok, tokenizer.token_to_id(tok))
    return tokenizer.to_str()


def _tokenizer_config(model_max_length: int) -> dict[str, Any]:
    added = {
        str(i): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, tok in enumerate(SPECIAL_TOKENS)
    }
    return {
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": "<|im_start|>",
        "chat_template": CHATML_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "model_max_length": model_max_length,
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


# --------------------------------------------------------------------------
# folder


def _write_json(path: pathlib.Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def make_model(
    out: str | os.PathLike[str],
    family: str,
    preset: str = "tiny",
    dtype: str = "f32",
    seed: int = 0,
    *,
    rope_form: str = "v4",
    **overrides: Any,
) -> pathlib.Path:
    """Write a complete Hugging Face model folder and return its path.

    `overrides` replace config.json fields (e.g. rope_scaling=None,
    sliding_window=8, attention_bias=True, head_dim=32, and for qwen3_moe
    norm_topk_prob=False or mlp_only_layers=[]); `shards=N` is not a
    config field and splits the weights over N files plus an index;
    `tokenizer_vocab_size=N` trains the tokenizer to N tokens instead of the
    config's vocab_size (a padded vocabulary, as in Qwen2); `rope_form="v5"`
    writes RoPE as transformers 5 does (see ROPE_FORMS).
    """
    shards = int(overrides.pop("shards", 1))
    tokenizer_vocab = overrides.pop("tokenizer_vocab_size", _PRESET_TOKENIZER_VOCAB.get(preset))
    config = build_config(family, preset, dtype, rope_form=rope_form, **overrides)
    out_path = pathlib.Path(out)
    out_path.mkdir(parents=True, exist_ok=True)

    _write_json(out_path / "config.json", config)
    _write_json(
        out_path / "generation_config.json",
        {
            "_from_model_config": True,
            "bos_token_id": IM_START_ID,
            "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
            "transformers_version": TRANSFORMERS_VERSION,
        },
    )
    # The tokenizer may learn fewer tokens than the model's vocab_size; the
    # extra embedding rows are simply unused, as in many real checkpoints.
    (out_path / "tokenizer.json").write_text(
        tokenizer_json(int(tokenizer_vocab or config["vocab_size"])), encoding="utf-8"
    )
    _write_json(
        out_path / "tokenizer_config.json",
        _tokenizer_config(int(config["max_position_embeddings"])),
    )

    weights = make_weights(config, seed)
    write_weights(out_path, weights, dtype, shards)
    return out_path


# Tensor-name prefixes of a Gemma3ForConditionalGeneration checkpoint's text model (for
# `model.`), and of its head, as transformers 4 and 5 save them.
VISION_LANGUAGE_NAMING = {
    "v4": ("language_model.model.", "language_model.lm_head.weight"),
    "v5": ("model.language_model.", "lm_head.weight"),
}


def vision_language_folder(
    text_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    naming: str = "v4",
    seed: int = 0,
) -> pathlib.Path:
    """A Gemma 3 vision-language folder (`model_type` "gemma3") around the text model of the
    gemma3 folder `text_dir`: its config under text_config beside a vision_config, its tensors
    renamed as Gemma3ForConditionalGeneration saves them (`naming` "v4" or "v5"), and a small
    vision tower and projector that a text-only engine must leave unread. f32 folders only."""
    if naming not in VISION_LANGUAGE_NAMING:
        raise ValueError(
            f"unknown naming {naming!r}; expected one of {list(VISION_LANGUAGE_NAMING)}"
        )
    from safetensors.numpy import load_file

    src, out_path = pathlib.Path(text_dir), pathlib.Path(out)
    text_config = json.loads((src / "config.json").read_text(encoding="utf-8"))
    if text_config.get("model_type") != "gemma3_text":
        raise ValueError(f"{src}: not a gemma3_text folder")
    out_path.mkdir(parents=True, exist_ok=True)
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        (out_path / name).write_bytes((src / name).read_bytes())
    vision_hidden = 32
    _write_json(
        out_path / "config.json",
        {
            "architectures": ["Gemma3ForConditionalGeneration"],
            "boi_token_index": 255999,
            "eoi_token_index": 256000,
            "image_token_index": 262144,
            "mm_tokens_per_image": 4,
            "model_type": "gemma3",
            "text_config": {k: v for k, v in text_config.items() if k != "architectures"},
            "torch_dtype": text_config["torch_dtype"],
            "transformers_version": text_config["transformers_version"],
            "vision_config": {
                "hidden_size": vision_hidden,
                "image_size": 32,
                "intermediate_size": 64,
                "model_type": "siglip_vision_model",
                "num_attention_heads": 2,
                "num_hidden_layers": 1,
                "patch_size": 16,
            },
        },
    )
    model_prefix, head = VISION_LANGUAGE_NAMING[naming]
    tower = "model.vision_tower." if naming == "v5" else "vision_tower."
    projector = "model.multi_modal_projector." if naming == "v5" else "multi_modal_projector."
    tensors: dict[str, np.ndarray] = {}
    for file in sorted(src.glob("*.safetensors")):
        for name, x in load_file(str(file)).items():
            if name.startswith("model."):
                tensors[model_prefix + name.removeprefix("model.")] = x
            elif name == "lm_head.weight":
                tensors[head] = x
            else:
                raise ValueError(f"{file}: unexpected tensor {name}")
    rng = np.random.default_rng(seed)
    hidden = int(text_config["hidden_size"])
    tensors[tower + "vision_model.embeddings.patch_embedding.weight"] = rng.standard_normal(
        (vision_hidden, 3, 16, 16), dtype=np.float32
    )
    tensors[projector + "mm_input_projection_weight"] = rng.standard_normal(
        (vision_hidden, hidden), dtype=np.float32
    )
    tensors[projector + "mm_soft_emb_norm.weight"] = rng.standard_normal(
        (vision_hidden,), dtype=np.float32
    )
    write_safetensors(out_path / "model.safetensors", tensors, "f32")
    return out_path
