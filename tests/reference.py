"""Independent NumPy reference forward pass for Llama-family, Gemma 3,
mixture-of-experts (Qwen3-MoE, Mixtral) and Phi-3 HF model folders and GGUF
files of those architectures (read and dequantized by the `gguf` package).

Written from the Hugging Face transformers semantics (LlamaForCausalLM,
MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma3ForCausalLM,
Qwen3MoeForCausalLM, MixtralForCausalLM, Phi3ForCausalLM), not from strata-rs
code, and computed in float64 so it is a trustworthy yardstick for the engine's
float32 output (tests/test_transformers_parity.py checks it against
transformers itself).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

_ST_DTYPES: dict[str, str] = {
    "F64": "<f8",
    "F32": "<f4",
    "F16": "<f2",
    "BF16": "<u2",  # raw bits, widened below
    "I64": "<i8",
    "I32": "<i4",
}


def read_safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file and the offset of its data."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n).decode("utf-8"))
    return header, 8 + n


def _read_raw_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Minimal reader for files numpy-backed safetensors can't load (BF16)."""
    header, base = read_safetensors_header(path)
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        raw = np.frombuffer(
            buf[base + begin : base + end].tobytes(), dtype=_ST_DTYPES[info["dtype"]]
        )
        if info["dtype"] == "BF16":
            # bf16 is the top half of an f32: shift the bits back up.
            raw = (raw.astype(np.uint32) << 16).view(np.float32)
        out[name] = raw.reshape(info["shape"])
    return out


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    header, _ = read_safetensors_header(path)
    if any(v["dtype"] == "BF16" for k, v in header.items() if k != "__metadata__"):
        return _read_raw_safetensors(path)
    from safetensors.numpy import load_file

    return load_file(str(path))


def load_weights(model_dir: Path) -> dict[str, np.ndarray]:
    """All tensors of a model folder (single file or sharded with an index)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    weights: dict[str, np.ndarray] = {}
    for fname in files:
        weights.update(read_safetensors(model_dir / fname))
    return weights


# --------------------------------------------------------------------------
# RoPE


def _rope_params(config: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling dict or None), from transformers 4 or 5 style configs."""
    params = config.get("rope_parameters")
    if isinstance(params, Mapping):
        # transformers 5 keeps theta and the scaling fields together.
        theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
        scaling: dict[str, Any] | None = dict(params)
    else:
        theta = float(config.get("rope_theta", 10000.0))
        raw = config.get("rope_scaling")
        scaling = dict(raw) if raw else None
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type == "default":
            return theta, None
        scaling["rope_type"] = rope_type
    return theta, scaling


def inv_freq(config: Mapping[str, Any], head_dim: int) -> np.ndarray:
    theta, scaling = _rope_params(config)
    base = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None:
        return base
    rope_type = scaling["rope_type"]
    factor = float(scaling["factor"])
    if rope_type == "linear":
        # Positions divided by factor == frequencies divided by factor.
        return base / factor
    if rope_type == "llama3":
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_ctx / low
        high_freq_wavelen = old_ctx / high
        wavelen = 2.0 * math.pi / base
        # Long wavelengths are slowed by factor, short ones kept, and the
        # band in between interpolated smoothly.
        scaled = np.where(wavelen > low_freq_wavelen, base / factor, base)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1.0 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return np.where(medium, smoothed, scaled)
    if rope_type == "yarn":
        # YaRN (arXiv 2309.00071, as transformers reads it): dimensions whose frequency turns
        # more than beta_fast times over the original context keep it, those that turn fewer
        # than beta_slow times are divided by factor, a linear ramp between.
        orig = float(
            scaling.get("original_max_position_embeddings") or config["max_position_embeddings"]
        )
        beta_fast = float(scaling.get("beta_fast") or 32.0)
        beta_slow = float(scaling.get("beta_slow") or 1.0)

        def dim_turning(turns: float) -> float:
            # Solves orig * theta ** (-d / head_dim) == turns * 2 pi for d.
            return head_dim * math.log(orig / (turns * 2.0 * math.pi)) / (2.0 * math.log(theta))

        low, high = dim_turning(beta_fast), dim_turning(beta_slow)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0.0), min(high, head_dim - 1.0)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
        return base / factor * ramp + base * (1.0 - ramp)
    raise NotImplementedError(f"rope_type {rope_type!r} is not in the reference")


def rope_attention_factor(config: Mapping[str, Any]) -> float:
    """What cos and sin are multiplied by: YaRN's attention scaling, else 1."""
    _, scaling = _rope_params(config)
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(m: float) -> float:
        return 1.0 if factor <= 1.0 else 0.1 * m * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(float(scaling["mscale"])) / mscale(float(scaling["mscale_all_dim"]))
    return mscale(1.0)


# Phi3Config's default original_max_position_embeddings.
PHI3_ORIGINAL_CONTEXT = 4096


def phi3_rope(
    config: Mapping[str, Any], head_dim: int, context: int | None = None
) -> tuple[np.ndarray, float, int]:
    """Phi-3's RoPE: (inverse frequencies of the rotary_dim / 2 rotated pairs, the factor on
    cos and sin, rotary_dim).

    rotary_dim = int(head_dim * partial_rotary_factor), the factor read where transformers 5
    reads it: from rope_parameters (or a v4 rope_scaling) when there, else the top-level key.
    LongRoPE divides each frequency by its factor, the long list's when the served `context`
    (default max_position_embeddings) exceeds the original context, the short one's otherwise:
    the engine's rule (llama.cpp's), chosen once per context. transformers chooses per forward
    by the sequence's length instead; the two agree whenever the sequence runs past the
    original context exactly when the served context does. The original context is the
    top-level original_max_position_embeddings (Phi3Config's default 4096 without it), which
    transformers 5 copies over any value inside rope_parameters. The cos/sin factor is
    attention_factor when set, else sqrt(1 + ln f / ln original) for f = the scaling's
    `factor` if set, else max_position_embeddings / original, and 1 when f <= 1."""
    params = config.get("rope_parameters")
    if not isinstance(params, Mapping):
        params = config.get("rope_scaling") or {}
    fraction = params.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    rotary_dim = int(head_dim * float(1.0 if fraction is None else fraction))
    theta, scaling = _rope_params(config)
    base = 1.0 / theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    if scaling is None:
        return base, 1.0, rotary_dim
    # Phi3Config reads the older spellings "su" and "yarn" as longrope.
    if scaling["rope_type"] not in ("longrope", "su", "yarn"):
        raise NotImplementedError(f"phi3 rope_type {scaling['rope_type']!r}")
    original = int(config.get("original_max_position_embeddings") or PHI3_ORIGINAL_CONTEXT)
    max_positions = int(config["max_position_embeddings"])
    factor = scaling.get("factor")
    factor = max_positions / original if factor is None else float(factor)
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1.0 + math.log(factor) / math.log(original))
    served = max_positions if context is None else int(context)
    ext = scaling["long_factor"] if served > original else scaling["short_factor"]
    ext = np.asarray(ext, dtype=np.float64)
    if ext.shape != base.shape:
        raise ValueError(f"phi3 LongRoPE factors: {len(ext)} for rotary_dim {rotary_dim}")
    return base / ext, float(attention), rotary_dim


# Gemma3TextConfig's defaults for the bases of its two layer types.
GEMMA3_FULL_THETA = 1_000_000.0
GEMMA3_SLIDING_THETA = 10_000.0


def gemma3_rope_config(config: Mapping[str, Any], layer_type: str) -> dict[str, Any]:
    """The RoPE of one Gemma 3 layer type ("full_attention" or "sliding_attention") as a
    single-RoPE config that `inv_freq` and `rope_attention_factor` read."""
    params = config.get("rope_parameters")
    if isinstance(params, Mapping):
        # transformers 5: one dict per layer type, theta inside.
        own = dict(params.get(layer_type) or {"rope_type": "default"})
        default = GEMMA3_FULL_THETA if layer_type == "full_attention" else GEMMA3_SLIDING_THETA
        own.setdefault("rope_theta", default)
        return {**config, "rope_parameters": own}
    single = {k: v for k, v in config.items() if k != "rope_parameters"}
    if layer_type == "sliding_attention":
        # transformers 4: sliding layers take rope_local_base_freq and never rope_scaling.
        single["rope_theta"] = config.get("rope_local_base_freq", GEMMA3_SLIDING_THETA)
        single["rope_scaling"] = None
    else:
        single["rope_theta"] = config.get("rope_theta", GEMMA3_FULL_THETA)
    return single


def apply_rope(
    x: np.ndarray, positions: np.ndarray, freqs: np.ndarray, scale: float = 1.0
) -> np.ndarray:
    """rotate_half convention; x is [heads, n, head_dim]; cos and sin times `scale`."""
    angles = positions[:, None].astype(np.float64) * freqs[None, :]
    emb = np.concatenate([angles, angles], axis=-1)
    cos, sin = np.cos(emb) * scale, np.sin(emb) * scale
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


# --------------------------------------------------------------------------
# forward


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def gemma_rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Gemma's RMSNorm scales by (1 + weight): its weights are stored as offsets from 1."""
    return rms_norm(x, 1.0 + weight, eps)


def _linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """torch.nn.Linear: weight is [out, in]."""
    y = x @ weight.T
    return y if bias is None else y + bias


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU's tanh approximation (torch's gelu(approximate="tanh"), HF "gelu_pytorch_tanh")."""
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def gemma3_layer_type(config: Mapping[str, Any], layer: int) -> str:
    """One Gemma 3 layer's type, "sliding_attention" or "full_attention": from layer_types,
    else (the Hub's transformers 4.50 configs) from sliding_window_pattern, default 6: layer i
    is full when i + 1 is a multiple of it."""
    layer_types = config.get("layer_types")
    if layer_types is not None:
        return str(layer_types[layer])
    pattern = int(config.get("sliding_window_pattern") or 6)
    return "full_attention" if (layer + 1) % pattern == 0 else "sliding_attention"


def _layer_window(config: Mapping[str, Any], layer: int) -> int | None:
    """Sliding window of one layer, or None for full causal attention."""
    family = config["model_type"]
    if family == "gemma3_text":
        if gemma3_layer_type(config, layer) != "sliding_attention":
            return None
        window = config.get("sliding_window", 4096)  # Gemma3TextConfig's default
        return None if window is None else int(window)
    window = config.get("sliding_window")
    if window is None:
        return None
    if family in ("mistral", "mixtral", "phi3"):
        # Phi3Model slides config.sliding_window over every layer (Hub configs set it past the
        # context, 262144, or to 2047 for the 4K models).
        return int(window)
    if family == "qwen3_moe":
        # Qwen3MoeConfig (transformers 5) keeps sliding_window only with use_sliding_window and
        # then every layer slides: unlike dense Qwen2/Qwen3, max_window_layers is not read.
        return int(window) if config.get("use_sliding_window", False) else None
    if family in ("qwen2", "qwen3"):
        layer_types = config.get("layer_types")
        if layer_types is not None:
            return int(window) if layer_types[layer] == "sliding_attention" else None
        if not config.get("use_sliding_window", False):
            return None
        # Qwen2's rule: layers from max_window_layers upward slide.
        max_window_layers = config.get("max_window_layers", 0)
        return int(window) if layer >= max_window_layers else None
    return None


def qwen3_moe_sparse_layer(config: Mapping[str, Any], layer: int) -> bool:
    """Qwen3MoeDecoderLayer's choice: the experts unless the layer is in mlp_only_layers,
    provided num_experts > 0 and (layer + 1) % decoder_sparse_step == 0; else a dense MLP."""
    return (
        layer not in (config.get("mlp_only_layers") or [])
        and int(config["num_experts"]) > 0
        and (layer + 1) % int(config.get("decoder_sparse_step", 1)) == 0
    )


def sparse_moe(
    h: np.ndarray,
    router: np.ndarray,
    experts: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
    top_k: int,
    renormalize: bool,
    mm: Callable[[np.ndarray, np.ndarray], np.ndarray],
) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3MoeSparseMoeBlock / MixtralSparseMoeBlock on rows h [n, hidden]: (output, router
    logits [n, experts]). Each row's router probabilities are the softmax over all experts; its
    top_k experts run, weighted by their probabilities (renormalized to sum to 1 when
    `renormalize`). `experts` are (gate, up, down) weights; `mm(x, weight)` is the matmul."""
    logits = mm(h, router)
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    # Highest first; a tie goes to the lower expert (the tiny models have none to break).
    chosen = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(probs, chosen, axis=-1)
    if renormalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    out = np.zeros_like(h)
    for e, (gate, up, down) in enumerate(experts):
        rows, slot = np.nonzero(chosen == e)
        if len(rows) == 0:
            continue
        x = h[rows]
        y = mm(_silu(mm(x, gate)) * mm(x, up), down)
        out[rows] += weights[rows, slot][:, None] * y
    return out, logits


# Query rows per block of the reference's attention.
QUERY_BLOCK = 512


def _attention_mask(n: int, window: int | None, rows: range | None = None) -> np.ndarray:
    """True where query i may attend key j (queries `rows`, default all n; keys 0..n)."""
    i = np.arange(n)[:, None] if rows is None else np.asarray(rows)[:, None]
    j = np.arange(n)[None, :]
    mask = j <= i
    if window is not None:
        mask &= i - j < window
    return mask


def reference_logits(
    model_dir: Path | str,
    token_ids: list[int],
    matmul_inputs: str = "f32",
    *,
    context: int | None = None,
) -> np.ndarray:
    """HF-semantics forward over the whole sequence; float64 [n, vocab]. A `.gguf`
    path runs the same forward over the file's tensors, dequantized. `matmul_inputs` and
    `context`: see `forward`."""
    model_dir = Path(model_dir)
    if model_dir.suffix == ".gguf":
        config, raw, freqs = load_gguf(model_dir)
        return forward(config, raw, token_ids, freqs, matmul_inputs, context=context)
    config = json.loads((model_dir / "config.json").read_text())
    raw = load_weights(model_dir)
    return forward(config, raw, token_ids, None, matmul_inputs, context=context)


# GGUF architecture -> HF model_type.
_GGUF_ARCH = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3": "gemma3_text",
    "qwen3moe": "qwen3_moe",
    "phi3": "phi3",
}
# Stacked experts (GGUF) -> each expert's HF name after `experts.E.`, per family.
_GGUF_EXPERTS = {
    "qwen3_moe": ("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
    "mixtral": ("block_sparse_moe", {"gate": "w1", "up": "w3", "down": "w2"}),
}
# GGUF tensor names -> HF names (after blk.N. / model.layers.N.).
_GGUF_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3's layer norms (llama.cpp's names; its ffn_norm is the pre-MLP norm).
_GGUF_GEMMA3_LAYER = {
    **_GGUF_LAYER,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Phi-3's fused projections keep their fused HF names (llama.cpp's ffn_up is the fused
# gate_up_proj, gate rows first).
_GGUF_PHI3_LAYER = {
    **_GGUF_LAYER,
    "attn_qkv": "self_attn.qkv_proj",
    "ffn_up": "mlp.gate_up_proj",
}
_GGUF_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _from_adjacent_pairs(w: np.ndarray, head_dim: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row permutation: each head's rows (0, d/2, 1, d/2+1, ...)
    back to HF's rotate-half order."""
    rows, cols = w.shape
    heads = w.reshape(rows // head_dim, head_dim // 2, 2, cols)
    return heads.transpose(0, 2, 1, 3).reshape(rows, cols)


def load_gguf(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray], np.ndarray | None]:
    """(HF-style config, HF-named float32 tensors, RoPE frequencies or None) of a GGUF
    file, every tensor dequantized by `gguf.quants.dequantize`."""
    import gguf

    reader = gguf.GGUFReader(str(path))

    def field(key: str, default: Any = None) -> Any:
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch not in _GGUF_ARCH:
        raise NotImplementedError(f"GGUF architecture {arch!r}")
    n_experts = int(field(f"{arch}.expert_count", 0))
    # Mixtral files are llama files with experts.
    family = "mixtral" if arch == "llama" and n_experts else _GGUF_ARCH[arch]
    head_count = int(field(f"{arch}.attention.head_count"))
    hidden = int(field(f"{arch}.embedding_length"))
    head_dim = int(field(f"{arch}.attention.key_length", hidden // head_count))
    raw: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = [int(d) for d in reversed(t.shape)]
        data = np.asarray(data, dtype=np.float32).reshape(shape)
        name = t.name
        if name in _GGUF_TOP:
            name = _GGUF_TOP[name]
        elif "_exps." in name or ".ffn_gate_inp." in name:
            _, layer, rest = name.split(".", 2)
            block, experts = _GGUF_EXPERTS[family]
            if rest == "ffn_gate_inp.weight":
                raw[f"model.layers.{layer}.{block}.gate.weight"] = data
                continue
            which = experts[rest.removeprefix("ffn_").removesuffix("_exps.weight")]
            for e in range(n_experts):
                raw[f"model.layers.{layer}.{block}.experts.{e}.{which}.weight"] = data[e]
            continue
        elif name.startswith("blk."):
            _, layer, rest = name.split(".", 2)
            base, suffix = rest.rsplit(".", 1)
            names = {"gemma3": _GGUF_GEMMA3_LAYER, "phi3": _GGUF_PHI3_LAYER}.get(arch, _GGUF_LAYER)
            name = f"model.layers.{layer}.{names[base]}.{suffix}"
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            data = _from_adjacent_pairs(data, head_dim)
        if arch == "gemma3" and name.endswith("norm.weight"):
            # llama.cpp's converter stores Gemma's 1 + w; the HF forward adds the 1 itself.
            data = data.astype(np.float64) - 1.0
        raw[name] = data
    config: dict[str, Any] = {
        "model_type": family,
        "hidden_size": hidden,
        "num_attention_heads": head_count,
        "num_key_value_heads": int(field(f"{arch}.attention.head_count_kv", head_count)),
        "head_dim": head_dim,
        "rms_norm_eps": float(field(f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(field(f"{arch}.rope.freq_base", 10000.0)),
        "num_hidden_layers": int(field(f"{arch}.block_count")),
        "tie_word_embeddings": "lm_head.weight" not in raw,
    }
    if field(f"{arch}.rope.scaling.type") == "linear":
        config["rope_scaling"] = {
            "rope_type": "linear",
            "factor": float(field(f"{arch}.rope.scaling.factor")),
        }
    if field(f"{arch}.rope.scaling.type") == "yarn":
        config["max_position_embeddings"] = int(field(f"{arch}.context_length"))
        config["rope_scaling"] = {
            "rope_type": "yarn",
            "factor": float(field(f"{arch}.rope.scaling.factor")),
            "original_max_position_embeddings": field(
                f"{arch}.rope.scaling.original_context_length"
            ),
            "beta_fast": field(f"{arch}.rope.scaling.yarn_beta_fast"),
            "beta_slow": field(f"{arch}.rope.scaling.yarn_beta_slow"),
        }
    if n_experts:
        # llama.cpp renormalizes the k weights of both (qwen3_moe's norm_topk_prob); layers
        # without a router are dense.
        layers = config["num_hidden_layers"]
        routed = {n.split(".")[2] for n in raw if n.endswith(".gate.weight")}
        config.update(
            num_experts=n_experts,
            num_local_experts=n_experts,
            num_experts_per_tok=int(field(f"{arch}.expert_used_count")),
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[i for i in range(layers) if str(i) not in routed],
            intermediate_size=int(field(f"{arch}.feed_forward_length")),
        )
        width = field(f"{arch}.expert_feed_forward_length")
        config["moe_intermediate_size"] = int(width) if width else config["intermediate_size"]
    if arch == "gemma3":
        # What llama.cpp's gemma3 loader fixes rather than reads (see its llama-model.cpp):
        # with a window, every sixth layer global and the others on base 10000 unscaled; the
        # scale of the head size but for the 27B (62 layers).
        layers = config["num_hidden_layers"]
        window = field("gemma3.attention.sliding_window")
        config["sliding_window"] = int(window) if window else None
        config["layer_types"] = [
            "full_attention" if not window or i % 6 == 5 else "sliding_attention"
            for i in range(layers)
        ]
        config["rope_local_base_freq"] = 10000.0
        config["query_pre_attn_scalar"] = hidden // head_count if layers == 62 else head_dim
        config["final_logit_softcapping"] = field("gemma3.final_logit_softcapping")
        config["hidden_activation"] = "gelu_pytorch_tanh"
    if arch == "phi3":
        # llama.cpp's phi3: rope.dimension_count rotated dims of each head, LongRoPE as two
        # factor tensors with the original context, the cos/sin factor as a key (absent: 1,
        # llama.cpp's default), a window over every layer unless it is 0.
        rotary_dim = int(field("phi3.rope.dimension_count", head_dim))
        context = int(field("phi3.context_length"))
        original = field("phi3.rope.scaling.original_context_length")
        window = field("phi3.attention.sliding_window")
        config.update(
            max_position_embeddings=context,
            original_max_position_embeddings=int(original) if original else context,
            partial_rotary_factor=rotary_dim / head_dim,
            sliding_window=int(window) if window else None,
            intermediate_size=int(field("phi3.feed_forward_length")),
        )
        long = raw.pop("rope_factors_long.weight", None)
        short = raw.pop("rope_factors_short.weight", None)
        if long is not None and short is not None:
            config["rope_scaling"] = {
                "rope_type": "longrope",
                "long_factor": long.astype(np.float64).tolist(),
                "short_factor": short.astype(np.float64).tolist(),
                "attention_factor": float(field("phi3.rope.scaling.attn_factor", 1.0)),
            }
    freqs = None
    factors = raw.pop("rope_freqs.weight", None)
    if factors is not None:
        base = inv_freq(config, head_dim)
        freqs = base / factors.astype(np.float64)
    return config, raw, freqs


def round_bf16(x: np.ndarray) -> np.ndarray:
    """`x` through f32 rounded to bf16 (nearest even), as float64."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


def _moe_block(
    config: Mapping[str, Any],
    raw: Mapping[str, np.ndarray],
    p: str,
    h: np.ndarray,
    rounded: Callable[[np.ndarray], np.ndarray],
    router_logits: dict[int, np.ndarray] | None,
    layer: int,
) -> np.ndarray:
    """One layer's experts over h, named as the Hub's checkpoints name them (one tensor per
    expert): Mixtral's block_sparse_moe.{gate, experts.E.w1/w3/w2} (w1 the gate projection,
    w3 the up, w2 the down), Qwen3-MoE's mlp.{gate, experts.E.gate_proj/up_proj/down_proj}."""
    if config["model_type"] == "mixtral":
        block, names = p + "block_sparse_moe.", ("w1", "w3", "w2")
        n_experts = int(config["num_local_experts"])
        # MixtralTopKRouter always renormalizes the chosen experts' probabilities.
        renormalize = True
    else:
        block, names = p + "mlp.", ("gate_proj", "up_proj", "down_proj")
        n_experts = int(config["num_experts"])
        # Qwen3MoeConfig's default is False; Qwen3-MoE checkpoints set it true.
        renormalize = bool(config.get("norm_topk_prob", False))

    def w(name: str) -> np.ndarray:
        return raw[name].astype(np.float64)

    gate, up, down = names
    experts = [
        (
            w(f"{block}experts.{e}.{gate}.weight"),
            w(f"{block}experts.{e}.{up}.weight"),
            w(f"{block}experts.{e}.{down}.weight"),
        )
        for e in range(n_experts)
    ]
    out, logits = sparse_moe(
        h,
        w(block + "gate.weight"),
        experts,
        int(config["num_experts_per_tok"]),
        renormalize,
        lambda x, weight: _linear(rounded(x), weight, None),
    )
    if router_logits is not None:
        router_logits[layer] = logits
    return out


def forward(
    config: Mapping[str, Any],
    raw: Mapping[str, np.ndarray],
    token_ids: list[int],
    freqs: np.ndarray | None,
    matmul_inputs: str = "f32",
    router_logits: dict[int, np.ndarray] | None = None,
    *,
    context: int | None = None,
) -> np.ndarray:
    """The forward pass over HF-named tensors; `freqs` overrides the config's RoPE.
    `matmul_inputs="bf16"` rounds every weight matmul's input rows to bf16 first, the
    arithmetic of an engine whose info["matmul_inputs"] says so (and of a PyTorch bf16 model).
    A `router_logits` dict receives each MoE layer's router logits [n, experts] by layer index
    (for tests of how decisively the tiny models route). `context` is the context the engine
    serves, which picks Phi-3's LongRoPE factors (see `phi3_rope`; default
    max_position_embeddings); other families ignore it."""
    if matmul_inputs not in ("f32", "bf16"):
        raise ValueError(f"matmul_inputs {matmul_inputs!r}")
    rounded = round_bf16 if matmul_inputs == "bf16" else (lambda v: v)

    def mm(x: np.ndarray, name: str, bias: np.ndarray | None = None) -> np.ndarray:
        return _linear(rounded(x), w(name), bias)

    family = config["model_type"]
    if family not in (
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "gemma3_text",
        "qwen3_moe",
        "mixtral",
        "phi3",
    ):
        raise NotImplementedError(f"model_type {family!r}")
    phi3 = family == "phi3"
    if phi3 and freqs is not None:
        raise NotImplementedError("RoPE frequencies from a Phi-3 GGUF file")
    gemma = family == "gemma3_text"
    if gemma and freqs is not None:
        raise NotImplementedError("RoPE frequencies from a Gemma 3 GGUF file")
    if gemma and config.get("use_bidirectional_attention"):
        raise NotImplementedError("Gemma 3 with use_bidirectional_attention")
    norm = gemma_rms_norm if gemma else rms_norm

    def w(name: str) -> np.ndarray:
        return raw[name].astype(np.float64)

    def maybe(name: str) -> np.ndarray | None:
        return raw[name].astype(np.float64) if name in raw else None

    hidden = int(config["hidden_size"])
    n_heads = int(config["num_attention_heads"])
    n_kv = int(config.get("num_key_value_heads") or n_heads)
    # Gemma3TextConfig's head_dim defaults to 256, not hidden / heads.
    head_dim = int(config.get("head_dim") or (256 if gemma else hidden // n_heads))
    eps = float(config["rms_norm_eps"])
    group = n_heads // n_kv
    # Per layer: (RoPE frequencies, cos/sin factor). Gemma 3's full and sliding layers each
    # have their own; every other family has one for all layers. Phi-3 rotates only the first
    # rotary_dim dimensions of each head; the others rotate all of them.
    rotary_dim = head_dim
    if phi3:
        phi3_freqs, phi3_scale, rotary_dim = phi3_rope(config, head_dim, context)
        shared = (phi3_freqs, phi3_scale)
    elif gemma:
        ropes: dict[str, tuple[np.ndarray, float]] = {}
        for layer_type in ("full_attention", "sliding_attention"):
            single = gemma3_rope_config(config, layer_type)
            ropes[layer_type] = (inv_freq(single, head_dim), rope_attention_factor(single))
    else:
        shared = (
            inv_freq(config, head_dim) if freqs is None else freqs,
            rope_attention_factor(config),
        )
    # Gemma 3 scales scores by query_pre_attn_scalar ** -0.5 (default 256), whatever head_dim is.
    if gemma:
        score_scale = float(config.get("query_pre_attn_scalar", 256)) ** -0.5
    else:
        score_scale = 1.0 / math.sqrt(head_dim)

    ids = np.asarray(token_ids, dtype=np.int64)
    n = len(ids)
    positions = np.arange(n)
    x = w("model.embed_tokens.weight")[ids]
    if gemma:
        # Gemma scales embeddings by sqrt(hidden_size). transformers casts that factor to the
        # weight dtype it runs in: exact for f32 and f64 runs up to f32 rounding of the square
        # root (8.0 exactly for hidden 64), but a bf16 run rounds it, e.g. sqrt(2560) = 50.596
        # to 50.5 for Gemma 3 4B.
        x = x * math.sqrt(hidden)

    for layer in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{layer}."
        layer_freqs, rope_scale = ropes[gemma3_layer_type(config, layer)] if gemma else shared
        h = norm(x, w(p + "input_layernorm.weight"), eps)
        if phi3:
            # One fused projection: q rows, then k, then v.
            qkv = mm(h, p + "self_attn.qkv_proj.weight")
            q_end, k_end = n_heads * head_dim, (n_heads + n_kv) * head_dim
            q, k, v = qkv[:, :q_end], qkv[:, q_end:k_end], qkv[:, k_end:]
        else:
            q = mm(h, p + "self_attn.q_proj.weight", maybe(p + "self_attn.q_proj.bias"))
            k = mm(h, p + "self_attn.k_proj.weight", maybe(p + "self_attn.k_proj.bias"))
            v = mm(h, p + "self_attn.v_proj.weight", maybe(p + "self_attn.v_proj.bias"))
        q = q.reshape(n, n_heads, head_dim).transpose(1, 0, 2)
        k = k.reshape(n, n_kv, head_dim).transpose(1, 0, 2)
        v = v.reshape(n, n_kv, head_dim).transpose(1, 0, 2)
        if family in ("qwen3", "qwen3_moe", "gemma3_text"):
            # Qwen3 (dense and MoE) and Gemma 3 normalize each head's q and k before RoPE.
            q = norm(q, w(p + "self_attn.q_norm.weight"), eps)
            k = norm(k, w(p + "self_attn.k_norm.weight"), eps)
        if rotary_dim < head_dim:
            # rotate_half within the rotated part; the rest passes through (unscaled).
            r = rotary_dim
            q = np.concatenate(
                [apply_rope(q[..., :r], positions, layer_freqs, rope_scale), q[..., r:]], -1
            )
            k = np.concatenate(
                [apply_rope(k[..., :r], positions, layer_freqs, rope_scale), k[..., r:]], -1
            )
        else:
            q = apply_rope(q, positions, layer_freqs, rope_scale)
            k = apply_rope(k, positions, layer_freqs, rope_scale)
        # GQA: query head hq reads kv head hq // group.
        k = np.repeat(k, group, axis=0)
        v = np.repeat(v, group, axis=0)
        window = _layer_window(config, layer)
        attn = np.empty((n_heads, n, head_dim))
        # Queries in blocks: each row's softmax is its own, and the [heads, n, n] scores of a
        # long sequence (16K+ positions) would not fit in memory at once.
        for r0 in range(0, n, QUERY_BLOCK):
            r1 = min(n, r0 + QUERY_BLOCK)
            # Gemma 3 ignores attn_logit_softcapping (transformers stores it, never applies it).
            scores = q[:, r0:r1] @ k[:, :r1].transpose(0, 2, 1) * score_scale
            mask = _attention_mask(r1, window, range(r0, r1))
            scores = np.where(mask[None], scores, -np.inf)
            scores -= scores.max(axis=-1, keepdims=True)
            probs = np.exp(scores)
            probs /= probs.sum(axis=-1, keepdims=True)
            attn[:, r0:r1] = probs @ v[:, :r1]
        attn = attn.transpose(1, 0, 2).reshape(n, n_heads * head_dim)
        out = mm(attn, p + "self_attn.o_proj.weight", maybe(p + "self_attn.o_proj.bias"))
        if gemma:
            # Gemma normalizes each sublayer's output before the residual add too; there
            # post_attention_layernorm is that output norm, the MLP's input norm is
            # pre_feedforward_layernorm.
            x = x + norm(out, w(p + "post_attention_layernorm.weight"), eps)
            h = norm(x, w(p + "pre_feedforward_layernorm.weight"), eps)
        else:
            x = x + out
            h = norm(x, w(p + "post_attention_layernorm.weight"), eps)
        if family == "mixtral" or (family == "qwen3_moe" and qwen3_moe_sparse_layer(config, layer)):
            out = _moe_block(config, raw, p, h, rounded, router_logits, layer)
        elif phi3:
            # gate_up_proj's output rows: the gate's, then the up projection's.
            gate_up = mm(h, p + "mlp.gate_up_proj.weight")
            gate, up = np.split(gate_up, 2, axis=-1)
            out = mm(_silu(gate) * up, p + "mlp.down_proj.weight")
        else:
            gate = mm(h, p + "mlp.gate_proj.weight")
            up = mm(h, p + "mlp.up_proj.weight")
            act = _gelu_tanh(gate) if gemma else _silu(gate)
            out = mm(act * up, p + "mlp.down_proj.weight")
        if gemma:
            out = norm(out, w(p + "post_feedforward_layernorm.weight"), eps)
        x = x + out

    x = norm(x, w("model.norm.weight"), eps)
    # transformers' default for the Llama family is untied (Gemma 3's is tied); when tied,
    # any lm_head.weight in the file is ignored in favour of the embedding.
    if config.get("tie_word_embeddings", gemma):
        head = w("model.embed_tokens.weight")
    else:
        head = w("lm_head.weight")
    logits = rounded(x) @ head.T
    cap = config.get("final_logit_softcapping") if gemma else None
    if cap is not None:
        # Gemma's final soft cap squashes every logit into (-cap, cap).
        logits = cap * np.tanh(logits / cap)
    return logits
