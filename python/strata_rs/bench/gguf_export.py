"""Export a Hugging Face Llama-family model folder to GGUF for llama.cpp.

Used to run the same weights through llama.cpp as a benchmark peer.  Written
from the GGUF specification and the `gguf` package's writer API, with the
tensor names and the special tokens (ids, add_bos/add_eos, merges, chat
template) from that package's `TensorNameMap` and `SpecialVocab`, as
llama.cpp's own converter takes them; it handles what
`strata_rs.testing.models.make_model` writes and the equivalent real
checkpoints:

* model_type llama / mistral -> GGUF arch "llama" (q/k rows permuted, see
  `_neox_to_interleaved`), qwen2 -> "qwen2", qwen3 -> "qwen3", gemma3_text ->
  "gemma3" (norm weights stored as 1 + w, as llama.cpp's converter does; only
  what llama.cpp's gemma3 loader can express: every sixth layer global, the
  sliding layers' RoPE base 10000 unscaled, the scale of the head size),
  qwen3_moe -> "qwen3moe" and mixtral -> "llama" with experts (each matrix's
  experts stacked into one `ffn_*_exps` tensor; the router kept f32, as
  llama.cpp's quantizer keeps it), phi3 -> "phi3" as llama.cpp's converter
  writes it (fused attn_qkv and ffn_up = gate_up_proj, unpermuted: llama.cpp
  rotates phi3 in halves as HF does; rope.dimension_count the rotated part;
  LongRoPE as rope_factors_long / rope_factors_short tensors with the original
  context and rope.scaling.attn_factor; sliding_window 0 for none).
* RoPE scaling: none, "linear", "llama3" (as a `rope_freqs` tensor), "yarn",
  and Phi-3's "longrope". Anything else raises ValueError rather than silently
  computing another function.
* Byte-level BPE tokenizers (tokenizer.json) with a pre-tokenizer whose
  regex llama.cpp knows under a name (see `_PRE_TOKENIZERS`).

`gguf` is an optional dependency (the `bench` extra); it is imported lazily.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import gguf

# HF model_type -> GGUF architecture name.
_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "qwen3_moe": "qwen3moe",
    "mixtral": "llama",
    "phi3": "phi3",
}

# Output dtypes of 2-D weight matrices; 1-D tensors (norms, biases) stay f32.
_FLOAT_DTYPES = ("bf16", "f16", "f32")
# ggml block formats: the `gguf` package quantizes the legacy ones (numpy code
# written from ggml's); strata's own quantizer (`strata_rs.quantize`) writes all.
_GGUF_QUANTIZES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
_QUANT_DTYPES = (*_GGUF_QUANTIZES, "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs")
_DTYPES = _FLOAT_DTYPES + _QUANT_DTYPES


def exported_types() -> tuple[str, ...]:
    """Every dtype `export_gguf` writes."""
    return _DTYPES


# Pre-tokenizer regexes of tokenizer.json `Split` steps, keyed to the name
# llama.cpp's loader maps to the same regex.  The plain ByteLevel
# pre-tokenizer (use_regex=true) is GPT-2's regex, which llama.cpp calls
# "gpt-2"; note that its "default" is a *different* regex set.
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZERS = {_LLAMA3_REGEX: "llama-bpe", _QWEN2_REGEX: "qwen2"}
_GPT2_PRE = "gpt-2"

_ST_NUMPY = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "F64": "<f8"}


# --------------------------------------------------------------------------
# safetensors


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"no model.safetensors(.index.json) in {model_dir}")
    return [single]


def _iter_safetensors(path: Path) -> Iterator[tuple[str, str, np.ndarray]]:
    """(name, safetensors dtype, array) per tensor, memory-mapped.

    Read by hand rather than with safetensors.numpy because numpy has no
    bfloat16: BF16 tensors come back as their raw uint16 bit patterns.
    """
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header: dict[str, Any] = json.loads(f.read(n))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    for name, info in header.items():
        if name == "__metadata__":
            continue
        st_dtype = info["dtype"]
        if st_dtype not in _ST_NUMPY:
            raise ValueError(f"{path.name}: tensor {name} has unsupported dtype {st_dtype}")
        begin, end = info["data_offsets"]
        arr = data[begin:end].view(_ST_NUMPY[st_dtype]).reshape(info["shape"])
        yield name, st_dtype, arr


def _to_f32(st_dtype: str, arr: np.ndarray) -> np.ndarray:
    if st_dtype == "BF16":
        # bf16 is the upper half of an f32.
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr.astype(np.float32)


def _f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even f32 -> bf16 bit patterns (NaN stays NaN)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    # Add 0x7FFF plus the lowest kept bit: ties round to even.  No overflow
    # in uint32 for any non-NaN input; NaNs are patched afterwards.
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = 0x7FC0 | ((bits[nan] >> 16).astype(np.uint16) & 0x8000)
    return rounded


# --------------------------------------------------------------------------
# config


def _head_dim(config: Mapping[str, Any]) -> int:
    head_dim = config.get("head_dim")
    if head_dim:
        return int(head_dim)
    return int(config["hidden_size"]) // int(config["num_attention_heads"])


def _rope_scaling(config: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling dict or None), accepting transformers 4 and 5 layouts."""
    params = config.get("rope_parameters")
    if isinstance(params, Mapping) and "full_attention" in params:
        # Gemma 3 under transformers 5: one entry per layer type; the global layers' here.
        params = params["full_attention"]
    if isinstance(params, Mapping):
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


def _llama3_freq_factors(theta: float, head_dim: int, scaling: Mapping[str, Any]) -> np.ndarray:
    """Per-frequency divisors that turn plain RoPE into Llama 3 scaled RoPE.

    llama.cpp rotates pair i by pos * theta^(-2i/d) / factors[i], so the
    factor is the ratio of the unscaled to the scaled inverse frequency.
    """
    factor = float(scaling["factor"])
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    base = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2.0 * math.pi / base
    # Wavelengths longer than old_ctx/low are slowed by `factor`, shorter
    # than old_ctx/high kept, and the band in between interpolated.
    smooth = np.clip((old_ctx / wavelen - low) / (high - low), 0.0, 1.0)
    scaled = (1.0 - smooth) * base / factor + smooth * base
    return (base / scaled).astype(np.float32)


# Phi3Config's default original_max_position_embeddings.
_PHI3_ORIGINAL_CONTEXT = 4096


def _phi3_rope(config: Mapping[str, Any], head_dim: int) -> tuple[int, int, dict[str, Any] | None]:
    """(rotary_dim, original context, LongRoPE dict with its attn_factor or None) of a Phi-3
    config, read as transformers 5 reads it: partial_rotary_factor from rope_parameters (or a
    v4 rope_scaling) before the top-level key, the original context from the top-level key
    (Phi3Config's default 4096; transformers copies it over any inside rope_parameters)."""
    params = config.get("rope_parameters")
    if not isinstance(params, Mapping):
        params = config.get("rope_scaling") or {}
    fraction = params.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    rotary_dim = int(head_dim * float(1.0 if fraction is None else fraction))
    original = int(config.get("original_max_position_embeddings") or _PHI3_ORIGINAL_CONTEXT)
    _, scaling = _rope_scaling(config)
    if scaling is None:
        return rotary_dim, original, None
    if scaling["rope_type"] not in ("longrope", "su"):
        # transformers reads "yarn" as longrope here, llama.cpp's converter as YaRN's scale.
        raise ValueError(f"phi3 rope scaling {scaling['rope_type']!r} is not supported")
    long, short = scaling.get("long_factor"), scaling.get("short_factor")
    if not long or not short or len(long) != rotary_dim // 2 or len(short) != rotary_dim // 2:
        raise ValueError(f"phi3 LongRoPE needs {rotary_dim // 2} long and short factors")
    # The converter's sqrt(1 + ln f / ln original), f = max_position_embeddings / original;
    # transformers' explicit attention_factor or factor (for f) first where a config has them.
    factor = scaling.get("factor")
    if factor is None:
        factor = int(config["max_position_embeddings"]) / original
    attn_factor = scaling.get("attention_factor")
    if attn_factor is None:
        factor = float(factor)
        attn_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return rotary_dim, original, {"long": long, "short": short, "attn_factor": float(attn_factor)}


def _check_supported(config: Mapping[str, Any]) -> str:
    model_type = config.get("model_type")
    if model_type not in _ARCH:
        raise ValueError(
            f"model_type {model_type!r} is not supported by the GGUF export "
            f"(supported: {', '.join(_ARCH)})"
        )
    if model_type == "gemma3_text":
        _check_gemma3(config)
        return _ARCH[model_type]
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported (only silu)")
    window = config.get("sliding_window")
    if model_type == "mistral" and window is not None:
        # GGUF arch "llama" has no sliding-window attention.
        if int(window) < int(config["max_position_embeddings"]):
            raise ValueError(
                f"mistral sliding_window={window} cannot be expressed in GGUF arch 'llama'"
            )
    if model_type in ("qwen2", "qwen3") and config.get("use_sliding_window", False):
        raise ValueError(f"{model_type} with use_sliding_window=true is not supported")
    if config.get("mlp_bias", False):
        raise ValueError("mlp_bias=true is not supported")
    return _ARCH[model_type]


def _check_gemma3(config: Mapping[str, Any]) -> None:
    """What llama.cpp's gemma3 loader fixes rather than reads must be what the config says."""
    act = config.get("hidden_activation", config.get("hidden_act", "gelu_pytorch_tanh"))
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation {act!r} is not supported (only gelu_pytorch_tanh)")
    # attn_logit_softcapping: read by transformers' Gemma 3 but never applied; not exported.
    layers = int(config["num_hidden_layers"])
    pattern = ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(layers)]
    types = config.get("layer_types")
    if types is None:
        every = int(config.get("sliding_window_pattern", 6))
        types = [
            "full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(layers)
        ]
    if list(types) != pattern:
        raise ValueError(
            "gemma3 layer_types other than five sliding layers then one global cannot be "
            "expressed in GGUF (llama.cpp fixes that pattern)"
        )
    head_dim = _head_dim(config)
    scalar = float(config.get("query_pre_attn_scalar", 256))
    fixed = (
        int(config["hidden_size"]) // int(config["num_attention_heads"])
        if layers == 62
        else head_dim
    )
    if scalar != fixed:
        raise ValueError(
            f"gemma3 query_pre_attn_scalar {scalar:g} cannot be expressed in GGUF "
            f"(llama.cpp uses {fixed} for {layers} layers)"
        )
    params = config.get("rope_parameters")
    if isinstance(params, Mapping) and "sliding_attention" in params:
        local = dict(params["sliding_attention"])
    else:
        local = {"rope_theta": config.get("rope_local_base_freq", 10000.0)}
    if (
        float(local.get("rope_theta", 10000.0)) != 10000.0
        or local.get("rope_type", "default") != "default"
    ):
        raise ValueError(
            "gemma3's sliding layers must use RoPE base 10000 unscaled in GGUF "
            f"(llama.cpp fixes it), not {local}"
        )


# --------------------------------------------------------------------------
# tensors


def _neox_to_interleaved(w: np.ndarray, n_head: int) -> np.ndarray:
    """Reorder q/k projection rows from HF's rotate_half RoPE layout to GGUF's.

    HF Llama rotates dimension j of each head with j + head_dim/2; llama.cpp's
    "llama" arch rotates adjacent pairs (2j, 2j+1).  Moving row j to 2j and
    row j + head_dim/2 to 2j+1 makes llama.cpp compute the same attention.
    Works on weights [rows, in] and biases [rows].
    """
    rows = w.shape[0]
    head_dim = rows // n_head
    rest = w.shape[1:]
    return w.reshape(n_head, 2, head_dim // 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def _tensor_name_map(arch: str, n_blocks: int) -> gguf.TensorNameMap:
    """The `gguf` package's HF -> GGUF tensor names for a GGUF architecture name (the map
    llama.cpp's converter uses; it knows each arch's own names, such as Gemma 3's four norms)."""
    import gguf

    model_arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    return gguf.get_tensor_name_map(model_arch, n_blocks)


# One expert's matrix, Qwen3-MoE's `mlp.experts.E.gate_proj` or Mixtral's
# `block_sparse_moe.experts.E.w1`: gguf's map names only the stacked tensor (the HF name without
# the expert index, as llama.cpp's converter looks it up after stacking), so the index is taken
# out here.
_EXPERT = re.compile(r"(.+\.experts)\.(\d+)\.(.+)")


def _num_experts(config: Mapping[str, Any]) -> int:
    return int(config.get("num_experts") or config.get("num_local_experts") or 0)


def _quantized(arr: np.ndarray, dtype: str, quantizer: str) -> tuple[np.ndarray, Any]:
    """(bytes, ggml type) of an f32 matrix (or stack of them) in `dtype`. A row that is not
    whole blocks falls back as llama.cpp's quantizer does: to q8_0 (rows of 32s), else f16."""
    from gguf import GGMLQuantizationType, quants
    from gguf.constants import GGML_QUANT_SIZES

    qtype = GGMLQuantizationType[dtype.upper()]
    block = GGML_QUANT_SIZES[qtype][0]
    if arr.shape[-1] % block != 0:
        if arr.shape[-1] % 32 == 0 and dtype != "q8_0":
            return _quantized(arr, "q8_0", quantizer)
        return np.ascontiguousarray(arr, "<f2"), GGMLQuantizationType.F16
    if quantizer == "gguf":
        return quants.quantize(arr, qtype), qtype
    import strata_rs

    rows = np.ascontiguousarray(arr, np.float32).reshape(-1, arr.shape[-1])
    data = np.asarray(strata_rs.quantize(rows, dtype))
    return data.reshape(*arr.shape[:-1], data.shape[-1]), qtype


def _write(
    writer: gguf.GGUFWriter,
    name: str,
    st_dtype: str,
    arr: np.ndarray,
    dtype: str,
    quantizer: str,
) -> None:
    """One tensor in `dtype` (vectors and routers in f32)."""
    from gguf import GGMLQuantizationType

    if arr.ndim == 1 or dtype == "f32" or name.endswith("ffn_gate_inp.weight"):
        writer.add_tensor(name, np.ascontiguousarray(_to_f32(st_dtype, arr)))
    elif dtype == "f16":
        writer.add_tensor(name, np.ascontiguousarray(_to_f32(st_dtype, arr), "<f2"))
    elif dtype in _QUANT_DTYPES:
        data, qtype = _quantized(_to_f32(st_dtype, arr), dtype, quantizer)
        writer.add_tensor(name, data, raw_dtype=qtype)
    else:
        # bf16 sources are copied bit for bit; others rounded.
        bits = (
            np.ascontiguousarray(arr)
            if st_dtype == "BF16"
            else _f32_to_bf16_bits(_to_f32(st_dtype, arr))
        )
        writer.add_tensor(name, bits, raw_dtype=GGMLQuantizationType.BF16)


def _add_tensors(
    writer: gguf.GGUFWriter,
    model_dir: Path,
    config: Mapping[str, Any],
    arch: str,
    dtype: str,
    quantizer: str,
) -> None:
    tied = bool(config.get("tie_word_embeddings", False))
    n_head = int(config["num_attention_heads"])
    n_kv = int(config.get("num_key_value_heads") or n_head)
    n_experts = _num_experts(config)
    n_blocks = int(config["num_hidden_layers"])
    tensor_maps = [_tensor_name_map(arch, n_blocks)]
    if arch == "qwen3moe":
        # llama.cpp's qwen3moe has no dense layers, so gguf's map has no names for the MLP of a
        # Qwen3-MoE dense layer (mlp_only_layers); strata-rs reads it under qwen3's names.
        tensor_maps.append(_tensor_name_map("qwen3", n_blocks))

    def gguf_name(hf_name: str) -> str | None:
        for tensor_map in tensor_maps:
            name = tensor_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            if name is not None:
                return name
        return None

    # A layer's experts of one matrix by stacked name, gathered until all have been read.
    experts: dict[str, dict[int, tuple[str, np.ndarray]]] = {}
    seen: set[str] = set()
    for path in _safetensors_files(model_dir):
        for hf_name, st_dtype, arr in _iter_safetensors(path):
            if "rotary_emb" in hf_name:
                # Old checkpoints store derived inv_freq buffers (gguf's llama map names them).
                continue
            expert = _EXPERT.fullmatch(hf_name)
            name = gguf_name(hf_name if expert is None else f"{expert[1]}.{expert[3]}")
            if name is None:
                raise ValueError(f"unexpected tensor {hf_name!r} in {path.name}")
            if expert is not None:
                parts = experts.setdefault(name, {})
                parts[int(expert[2])] = (st_dtype, arr)
                if len(parts) == n_experts:
                    stacked = np.stack([_to_f32(*parts[e]) for e in range(n_experts)])
                    seen.add(name)
                    _write(writer, name, "F32", stacked, dtype, quantizer)
                    del experts[name]
                continue
            if name == "output.weight" and tied:
                # A tied checkpoint may still carry lm_head; llama.cpp reuses
                # token_embd when `output` is absent, matching transformers.
                continue
            if arch == "llama" and ".attn_q." in name:
                arr = _neox_to_interleaved(arr, n_head)
            elif arch == "llama" and ".attn_k." in name:
                arr = _neox_to_interleaved(arr, n_kv)
            elif arch == "gemma3" and name.endswith("norm.weight"):
                # Gemma's RMSNorm scales by 1 + w; llama.cpp's gemma3 reads 1 + w stored.
                arr = _to_f32(st_dtype, arr) + np.float32(1.0)
                st_dtype = "F32"
            seen.add(name)
            _write(writer, name, st_dtype, arr, dtype, quantizer)
    if experts:
        raise ValueError(f"missing experts in {model_dir}: {sorted(experts)}")
    required = {"token_embd.weight", "output_norm.weight"} | (set() if tied else {"output.weight"})
    missing = required - seen
    if missing:
        raise ValueError(f"missing tensors in {model_dir}: {sorted(missing)}")


# --------------------------------------------------------------------------
# tokenizer


def _pre_tokenizer_name(tok: Mapping[str, Any]) -> str:
    pre = tok.get("pre_tokenizer")
    if pre is None:
        raise ValueError("tokenizer.json has no pre_tokenizer; not a byte-level BPE")
    steps = pre["pretokenizers"] if pre.get("type") == "Sequence" else [pre]
    kinds = [step.get("type") for step in steps]
    if kinds == ["ByteLevel"]:
        if steps[0].get("add_prefix_space", False):
            raise ValueError("ByteLevel add_prefix_space=true is not supported")
        if not steps[0].get("use_regex", True):
            raise ValueError("ByteLevel without a splitting regex is not supported")
        return _GPT2_PRE
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        pattern = steps[0].get("pattern", {})
        regex = pattern.get("Regex") if isinstance(pattern, Mapping) else None
        if regex in _PRE_TOKENIZERS:
            return _PRE_TOKENIZERS[regex]
    raise ValueError(
        f"unrecognised pre-tokenizer {json.dumps(pre)[:200]}; pass pre_tokenizer= "
        "with the llama.cpp name of an equivalent one"
    )


def _check_merges(model: Mapping[str, Any]) -> None:
    for merge in model.get("merges", []):
        # tokenizers >= 0.20 writes [left, right] pairs, older ones "left right". GGUF stores
        # "left right"; gguf's SpecialVocab would turn a space inside a side into U+0120, which
        # in a byte-level vocabulary is the space byte's own symbol: another merge.
        text = merge if isinstance(merge, str) else " ".join(merge)
        if text.count(" ") != 1:
            raise ValueError(f"merge {merge!r} contains a space; cannot store it in GGUF")


def _add_tokenizer(
    writer: gguf.GGUFWriter,
    model_dir: Path,
    vocab_size: int,
    pre_tokenizer: str | None,
) -> None:
    import gguf
    from gguf import TokenType

    tok = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    model = tok["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"tokenizer model {model.get('type')!r} is not supported (BPE only)")
    # llama.cpp's "gpt2" tokenizer model merges plain byte-level symbols.
    for key in ("continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            raise ValueError(f"BPE {key}={model[key]!r} is not supported")
    _check_merges(model)
    normalizer = tok.get("normalizer")
    # Qwen2 ships an NFC normalizer that llama.cpp does not run; it only
    # matters for text that is not already NFC.  Anything else changes text.
    if normalizer is not None and normalizer.get("type") != "NFC":
        raise ValueError(f"tokenizer normalizer {normalizer.get('type')!r} is not supported")

    tokens: dict[int, str] = {int(i): t for t, i in model["vocab"].items()}
    types: dict[int, int] = dict.fromkeys(tokens, TokenType.NORMAL)
    for added in tok.get("added_tokens", []):
        tid = int(added["id"])
        tokens[tid] = added["content"]
        types[tid] = TokenType.CONTROL if added.get("special") else TokenType.USER_DEFINED

    n = max(vocab_size, max(tokens) + 1)
    if n > vocab_size:
        raise ValueError(f"tokenizer has ids up to {n - 1} but vocab_size is {vocab_size}")
    # Checkpoints often have more embedding rows than tokens; llama.cpp needs
    # one token per row, so fill the gap with unique never-produced entries.
    taken = set(tokens.values())
    token_list: list[str] = []
    type_list: list[int] = []
    for i in range(n):
        if i in tokens:
            token_list.append(tokens[i])
            type_list.append(int(types[i]))
        else:
            pad = f"[PAD{i}]"
            while pad in taken:
                pad = f"[{pad}]"
            token_list.append(pad)
            type_list.append(int(TokenType.UNUSED))

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer or _pre_tokenizer_name(tok))
    writer.add_token_list(token_list)
    writer.add_token_types(type_list)
    # The merges, the special token ids (tokenizer_config.json's tokens, else config.json's ids),
    # add_bos/add_eos where tokenizer_config.json or the post-processor says, and the chat
    # template: as llama.cpp's converter writes them (its _set_vocab_gpt2 does just this).
    special = gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=vocab_size)
    special.add_to_gguf(writer, quiet=True)


# --------------------------------------------------------------------------
# entry point


def export_gguf(
    model_dir: str | Path,
    out_path: str | Path,
    dtype: str = "bf16",
    *,
    pre_tokenizer: str | None = None,
    quantizer: str | None = None,
    name: str | None = None,
) -> Path:
    """Convert an HF Llama-family folder to a GGUF file; returns out_path.

    dtype (see `exported_types()`: "bf16", "f16", "f32", or a ggml block
    format such as "q4_0" or "q4_k") applies to 2-D weights; norms and biases
    are always f32.  quantizer: "gguf" (the gguf package's quantizer; the
    default for the legacy formats it has) or "strata" (strata-rs's own,
    the only one here for K-quants and IQ4).  pre_tokenizer overrides the
    llama.cpp pre-tokenizer name otherwise derived from tokenizer.json; name
    (general.name) defaults to the folder's name.
    """
    try:
        import gguf
    except ImportError as exc:
        raise ImportError("GGUF export needs the gguf package: pip install gguf") from exc

    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {_DTYPES}")
    if quantizer is None:
        quantizer = "gguf" if dtype in _GGUF_QUANTIZES else "strata"
    if quantizer not in ("gguf", "strata"):
        raise ValueError(f"quantizer {quantizer!r}: expected 'gguf' or 'strata'")
    if quantizer == "gguf" and dtype in _QUANT_DTYPES and dtype not in _GGUF_QUANTIZES:
        raise ValueError(f"quantizer 'gguf': the gguf package does not quantize {dtype}")
    model_dir = Path(model_dir)
    out_path = Path(out_path)
    config: dict[str, Any] = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    arch = _check_supported(config)

    hidden = int(config["hidden_size"])
    n_head = int(config["num_attention_heads"])
    n_kv = int(config.get("num_key_value_heads") or n_head)
    head_dim = _head_dim(config)
    vocab_size = int(config["vocab_size"])
    theta, scaling = _rope_scaling(config)
    freq_factors: np.ndarray | None = None
    phi3_rope = _phi3_rope(config, head_dim) if arch == "phi3" else None
    if phi3_rope is not None:
        scaling = None  # LongRoPE: the factor tensors and keys below
    if scaling is not None:
        rope_type = scaling["rope_type"]
        if rope_type == "llama3" and arch == "llama":
            freq_factors = _llama3_freq_factors(theta, head_dim, scaling)
        elif rope_type == "yarn":
            # llama.cpp's YaRN takes the factor, the original context and the betas; an
            # explicit attention factor or an untruncated ramp has no key of its own there.
            for unsupported in ("attention_factor", "mscale", "mscale_all_dim"):
                if scaling.get(unsupported) is not None:
                    raise ValueError(f"YaRN's {unsupported} is not supported by the GGUF export")
            if scaling.get("truncate", True) is not True:
                raise ValueError("YaRN's truncate=false is not supported by the GGUF export")
        elif rope_type != "linear":
            raise ValueError(f"rope scaling {rope_type!r} is not supported by the GGUF export")

    writer = gguf.GGUFWriter(out_path, arch)
    writer.add_name(model_dir.name if name is None else name)
    writer.add_context_length(int(config["max_position_embeddings"]))
    if phi3_rope is not None:
        writer.add_rope_scaling_orig_ctx_len(phi3_rope[1])
    writer.add_embedding_length(hidden)
    writer.add_block_count(int(config["num_hidden_layers"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    if phi3_rope is not None:
        # As llama.cpp's converter: no key/value length (hidden_size / n_head, as Phi3Config
        # has it), the rotated part of each head.
        writer.add_rope_dimension_count(phi3_rope[0])
    else:
        # Explicit because Qwen3 (and head_dim overrides) decouple it from
        # hidden_size / n_head, which llama.cpp would otherwise assume.
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_vocab_size(vocab_size)
    file_type = {
        "bf16": gguf.LlamaFileType.MOSTLY_BF16,
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "f32": gguf.LlamaFileType.ALL_F32,
        "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
        "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
        "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
        "q5_0": gguf.LlamaFileType.MOSTLY_Q5_0,
        "q5_1": gguf.LlamaFileType.MOSTLY_Q5_1,
        "q2_k": gguf.LlamaFileType.MOSTLY_Q2_K,
        "q3_k": gguf.LlamaFileType.MOSTLY_Q3_K_M,
        "q4_k": gguf.LlamaFileType.MOSTLY_Q4_K_M,
        "q5_k": gguf.LlamaFileType.MOSTLY_Q5_K_M,
        "q6_k": gguf.LlamaFileType.MOSTLY_Q6_K,
        "iq4_nl": gguf.LlamaFileType.MOSTLY_IQ4_NL,
        "iq4_xs": gguf.LlamaFileType.MOSTLY_IQ4_XS,
    }[dtype]
    writer.add_file_type(int(file_type))
    if scaling is not None and scaling["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(scaling["factor"]))
    elif scaling is not None and scaling["rope_type"] == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(scaling["factor"]))
        original = scaling.get("original_max_position_embeddings")
        writer.add_rope_scaling_orig_ctx_len(int(original or config["max_position_embeddings"]))
        if scaling.get("beta_fast") is not None:
            writer.add_rope_scaling_yarn_beta_fast(float(scaling["beta_fast"]))
        if scaling.get("beta_slow") is not None:
            writer.add_rope_scaling_yarn_beta_slow(float(scaling["beta_slow"]))
    elif freq_factors is not None:
        # Llama 3 scaling is carried entirely by rope_freqs; a linear factor
        # on top would scale twice.
        writer.add_rope_scaling_type(gguf.RopeScalingType.NONE)
        writer.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))

    if n_experts := _num_experts(config):
        writer.add_expert_count(n_experts)
        writer.add_expert_used_count(int(config["num_experts_per_tok"]))
        if arch == "qwen3moe":
            writer.add_expert_feed_forward_length(int(config["moe_intermediate_size"]))
            # llama.cpp's qwen3moe always renormalizes the k weights (norm_topk_prob, as every
            # Qwen3-MoE ships); a model without it cannot be expressed there.
            if not config.get("norm_topk_prob", False):
                raise ValueError("qwen3_moe with norm_topk_prob=false is not supported in GGUF")
    if phi3_rope is not None:
        # 0 for none, as the converter writes it; every layer slides otherwise.
        writer.add_sliding_window(int(config.get("sliding_window") or 0))
        if phi3_rope[2] is not None:
            writer.add_rope_scaling_attn_factors(phi3_rope[2]["attn_factor"])
    if arch == "gemma3":
        if config.get("sliding_window") is not None:
            writer.add_sliding_window(int(config["sliding_window"]))
        if config.get("final_logit_softcapping") is not None:
            writer.add_final_logit_softcapping(float(config["final_logit_softcapping"]))

    _add_tokenizer(writer, model_dir, vocab_size, pre_tokenizer)
    if freq_factors is not None:
        writer.add_tensor("rope_freqs.weight", freq_factors)
    if phi3_rope is not None and phi3_rope[2] is not None:
        writer.add_tensor("rope_factors_long.weight", np.asarray(phi3_rope[2]["long"], np.float32))
        writer.add_tensor(
            "rope_factors_short.weight", np.asarray(phi3_rope[2]["short"], np.float32)
        )
    _add_tensors(writer, model_dir, config, arch, dtype, quantizer)

    out_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return out_path
