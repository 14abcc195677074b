"""Independent NumPy reference forward pass for Llama-family HF model folders
and GGUF files (read and dequantized by the `gguf` package).

Written from the Hugging Face transformers semantics (LlamaForCausalLM,
MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM), not from strata-rs
code, and computed in float64 so it is a trustworthy yardstick for the
engine's float32 output.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
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


def _linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """torch.nn.Linear: weight is [out, in]."""
    y = x @ weight.T
    return y if bias is None else y + bias


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _layer_window(config: Mapping[str, Any], layer: int) -> int | None:
    """Sliding window of one layer, or None for full causal attention."""
    family = config["model_type"]
    window = config.get("sliding_window")
    if window is None:
        return None
    if family == "mistral":
        return int(window)
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
    model_dir: Path | str, token_ids: list[int], matmul_inputs: str = "f32"
) -> np.ndarray:
    """HF-semantics forward over the whole sequence; float64 [n, vocab]. A `.gguf`
    path runs the same forward over the file's tensors, dequantized. `matmul_inputs`: see
    `forward`."""
    model_dir = Path(model_dir)
    if model_dir.suffix == ".gguf":
        config, raw, freqs = load_gguf(model_dir)
        return forward(config, raw, token_ids, freqs, matmul_inputs)
    config = json.loads((model_dir / "config.json").read_text())
    raw = load_weights(model_dir)
    return forward(config, raw, token_ids, None, matmul_inputs)


# GGUF architecture -> HF model_type.
_GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
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
        elif name.startswith("blk."):
            _, layer, rest = name.split(".", 2)
            base, suffix = rest.rsplit(".", 1)
            name = f"model.layers.{layer}.{_GGUF_LAYER[base]}.{suffix}"
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            data = _from_adjacent_pairs(data, head_dim)
        raw[name] = data
    config: dict[str, Any] = {
        "model_type": _GGUF_ARCH[arch],
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


def forward(
    config: Mapping[str, Any],
    raw: Mapping[str, np.ndarray],
    token_ids: list[int],
    freqs: np.ndarray | None,
    matmul_inputs: str = "f32",
) -> np.ndarray:
    """The forward pass over HF-named tensors; `freqs` overrides the config's RoPE.
    `matmul_inputs="bf16"` rounds every weight matmul's input rows to bf16 first, the
    arithmetic of an engine whose info["matmul_inputs"] says so (and of a PyTorch bf16 model)."""
    if matmul_inputs not in ("f32", "bf16"):
        raise ValueError(f"matmul_inputs {matmul_inputs!r}")
    rounded = round_bf16 if matmul_inputs == "bf16" else (lambda v: v)

    def mm(x: np.ndarray, name: str, bias: np.ndarray | None = None) -> np.ndarray:
        return _linear(rounded(x), w(name), bias)

    family = config["model_type"]
    if family not in ("llama", "mistral", "qwen2", "qwen3"):
        raise NotImplementedError(f"model_type {family!r}")

    def w(name: str) -> np.ndarray:
        return raw[name].astype(np.float64)

    def maybe(name: str) -> np.ndarray | None:
        return raw[name].astype(np.float64) if name in raw else None

    hidden = int(config["hidden_size"])
    n_heads = int(config["num_attention_heads"])
    n_kv = int(config.get("num_key_value_heads") or n_heads)
    head_dim = int(config.get("head_dim") or hidden // n_heads)
    eps = float(config["rms_norm_eps"])
    group = n_heads // n_kv
    if freqs is None:
        freqs = inv_freq(config, head_dim)
    rope_scale = rope_attention_factor(config)

    ids = np.asarray(token_ids, dtype=np.int64)
    n = len(ids)
    positions = np.arange(n)
    x = w("model.embed_tokens.weight")[ids]

    for layer in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{layer}."
        h = rms_norm(x, w(p + "input_layernorm.weight"), eps)
        q = mm(h, p + "self_attn.q_proj.weight", maybe(p + "self_attn.q_proj.bias"))
        k = mm(h, p + "self_attn.k_proj.weight", maybe(p + "self_attn.k_proj.bias"))
        v = mm(h, p + "self_attn.v_proj.weight", maybe(p + "self_attn.v_proj.bias"))
        q = q.reshape(n, n_heads, head_dim).transpose(1, 0, 2)
        k = k.reshape(n, n_kv, head_dim).transpose(1, 0, 2)
        v = v.reshape(n, n_kv, head_dim).transpose(1, 0, 2)
        if family == "qwen3":
            # Qwen3 normalizes each head's q and k before RoPE.
            q = rms_norm(q, w(p + "self_attn.q_norm.weight"), eps)
            k = rms_norm(k, w(p + "self_attn.k_norm.weight"), eps)
        q = apply_rope(q, positions, freqs, rope_scale)
        k = apply_rope(k, positions, freqs, rope_scale)
        # GQA: query head hq reads kv head hq // group.
        k = np.repeat(k, group, axis=0)
        v = np.repeat(v, group, axis=0)
        window = _layer_window(config, layer)
        attn = np.empty((n_heads, n, head_dim))
        # Queries in blocks: each row's softmax is its own, and the [heads, n, n] scores of a
        # long sequence (16K+ positions) would not fit in memory at once.
        for r0 in range(0, n, QUERY_BLOCK):
            r1 = min(n, r0 + QUERY_BLOCK)
            scores = q[:, r0:r1] @ k[:, :r1].transpose(0, 2, 1) / math.sqrt(head_dim)
            mask = _attention_mask(r1, window, range(r0, r1))
            scores = np.where(mask[None], scores, -np.inf)
            scores -= scores.max(axis=-1, keepdims=True)
            probs = np.exp(scores)
            probs /= probs.sum(axis=-1, keepdims=True)
            attn[:, r0:r1] = probs @ v[:, :r1]
        attn = attn.transpose(1, 0, 2).reshape(n, n_heads * head_dim)
        x = x + mm(attn, p + "self_attn.o_proj.weight", maybe(p + "self_attn.o_proj.bias"))

        h = rms_norm(x, w(p + "post_attention_layernorm.weight"), eps)
        gate = mm(h, p + "mlp.gate_proj.weight")
        up = mm(h, p + "mlp.up_proj.weight")
        x = x + mm(_silu(gate) * up, p + "mlp.down_proj.weight")

    x = rms_norm(x, w("model.norm.weight"), eps)
    # transformers' default for these families is untied; when tied, any
    # lm_head.weight in the file is ignored in favour of the embedding.
    if config.get("tie_word_embeddings", False):
        head = w("model.embed_tokens.weight")
    else:
        head = w("lm_head.weight")
    return rounded(x) @ head.T
