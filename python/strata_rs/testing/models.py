"""Synthetic Hugging Face model folders for tests and benchmarks.

`make_model` writes a folder that looks exactly like one downloaded from the
Hub for the Llama family (llama, mistral, qwen2, qwen3): config.json,
safetensors weights (optionally sharded), a trained byte-level BPE
tokenizer, tokenizer_config.json and generation_config.json.  Weights are
random but seeded and deliberately non-trivial (norm weights and biases are
not 1/0) so that a numerical mistake in an engine shows up in the logits.
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

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
PRESETS = ("tiny", "smollm-135m", "llama-1b")
DTYPES = ("f32", "bf16", "f16")

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
}
# Presets whose tokenizer learns fewer tokens than the vocabulary (training 128K tokens on the
# built-in corpus would take minutes and most of them would be rare byte pairs anyway).
_PRESET_TOKENIZER_VOCAB = {"llama-1b": 49152}

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
}

MATRIX_STD = 0.05
# q/k projections get a larger, fan-in scaled std (0.15 at hidden 64, 0.05 at
# hidden 576): with 0.05 everywhere the tiny model's attention is nearly
# uniform, so RoPE or masking mistakes would hardly move the argmax.
QK_STD_TIMES_SQRT_HIDDEN = 1.2
NORM_STD = 0.1
BIAS_STD = 0.05


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
        "model_type": family,
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
    else:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    return dict(sorted(common.items()))


def build_config(
    family: str, preset: str = "tiny", dtype: str = "f32", **overrides: Any
) -> dict[str, Any]:
    """The config.json dict make_model would write (without writing anything)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {PRESETS}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {DTYPES}")
    config = _family_config(family, _PRESETS[preset], dtype)
    if preset == "tiny":
        config.update(_TINY_FAMILY[family])
    config.update(_PRESET_FIELDS.get(preset, {}))
    shape_changed = "hidden_size" in overrides or "num_attention_heads" in overrides
    config.update(overrides)
    # Only Qwen3 decouples head_dim from hidden/heads; elsewhere keep the
    # written head_dim consistent when the caller reshapes the model.
    if shape_changed and "head_dim" not in overrides and family != "qwen3" and "head_dim" in config:
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    return config


def head_dim_of(config: Mapping[str, Any]) -> int:
    head_dim = config.get("head_dim")
    if head_dim is None:
        return int(config["hidden_size"]) // int(config["num_attention_heads"])
    return int(head_dim)


def has_qkv_bias(config: Mapping[str, Any]) -> bool:
    """Qwen2 always has q/k/v biases; Llama/Qwen3 follow attention_bias;
    Mistral has none."""
    family = config["model_type"]
    if family == "qwen2":
        return True
    return family in ("llama", "qwen3") and bool(config.get("attention_bias", False))


def has_o_bias(config: Mapping[str, Any]) -> bool:
    """attention_bias covers o_proj too in Llama/Qwen3, never in Qwen2."""
    return config["model_type"] in ("llama", "qwen3") and bool(config.get("attention_bias", False))


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

    def normal(shape: tuple[int, ...], std: float, mean: float = 0.0) -> np.ndarray:
        # In place: the 135M-parameter preset should not pay for temporaries.
        x = rng.standard_normal(shape, dtype=np.float32)
        x *= np.float32(std)
        if mean:
            x += np.float32(mean)
        return x

    def matrix(rows: int, cols: int, std: float = MATRIX_STD) -> np.ndarray:
        return normal((rows, cols), std)

    def norm(n: int) -> np.ndarray:
        return normal((n,), NORM_STD, 1.0)

    def vector(n: int) -> np.ndarray:
        return normal((n,), BIAS_STD)

    w: dict[str, np.ndarray] = {"model.embed_tokens.weight": matrix(vocab, hidden)}
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(hidden)
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
        if family == "qwen3":
            w[p + "self_attn.q_norm.weight"] = norm(head_dim)
            w[p + "self_attn.k_norm.weight"] = norm(head_dim)
        w[p + "post_attention_layernorm.weight"] = norm(hidden)
        w[p + "mlp.gate_proj.weight"] = matrix(inter, hidden)
        w[p + "mlp.up_proj.weight"] = matrix(inter, hidden)
        w[p + "mlp.down_proj.weight"] = matrix(hidden, inter)
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
    **overrides: Any,
) -> pathlib.Path:
    """Write a complete Hugging Face model folder and return its path.

    `overrides` replace config.json fields (e.g. rope_scaling=None,
    sliding_window=8, attention_bias=True, head_dim=32); `shards=N` is not a
    config field and splits the weights over N files plus an index;
    `tokenizer_vocab_size=N` trains the tokenizer to N tokens instead of the
    config's vocab_size (a padded vocabulary, as in Qwen2).
    """
    shards = int(overrides.pop("shards", 1))
    tokenizer_vocab = overrides.pop("tokenizer_vocab_size", _PRESET_TOKENIZER_VOCAB.get(preset))
    config = build_config(family, preset, dtype, **overrides)
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
