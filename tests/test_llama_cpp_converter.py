"""GGUF files made by llama.cpp's own converter (convert_hf_to_gguf.py) answer as their folders.

Each tiny f32 model folder is converted with `convert_hf_to_gguf.py --outtype f32`; the engine's
logits for the file must equal its logits for the folder (within 1e-5 of the logit range: the
converter permutes the q/k rows of llama, mistral and mixtral, so bit equality is not expected
there).
Our own exporter has the same check in test_gguf.py and test_gguf_export.py.

The module is skipped unless torch, transformers and sentencepiece import (the converter
imports sentencepiece even for byte-level BPE vocabularies) and STRATA_LLAMA_CPP_SOURCE names a
llama.cpp source tree holding convert_hf_to_gguf.py. The test command installs none of these.
To run it:

    pip download --no-deps --no-binary :all: llama-cpp-python -d /tmp/lcp
    tar -xzf /tmp/lcp/llama_cpp_python-*.tar.gz -C /tmp/lcp
    pip install torch transformers sentencepiece
    STRATA_LLAMA_CPP_SOURCE=/tmp/lcp/llama_cpp_python-<version>/vendor/llama.cpp \\
        pytest tests/test_llama_cpp_converter.py

(or point STRATA_LLAMA_CPP_SOURCE at a llama.cpp checkout). The converter runs in a subprocess
of this interpreter with the source tree's own gguf-py first on sys.path.

Two adjustments, both to the converter's input or code path, never to its output:

- The converter names the BPE pre-tokenizer by hashing the tokenizer's ids for a fixed text
  (get_vocab_base_pre) and refuses hashes it does not list, such as the tiny byte-level
  vocabulary's. The driver wraps that method so that an unknown hash gives "gpt-2" (the split
  of the tiny tokenizer's ByteLevel pre-tokenizer, the name our exporter writes too).
- Phi-3's converter reads a SentencePiece tokenizer.model unless tokenizer_config.json names
  the GPT2Tokenizer class (as Phi-4-mini's does), so the phi3 folder is copied with that class.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import strata_rs

pytestmark = pytest.mark.anyio

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")
SOURCE = os.environ.get("STRATA_LLAMA_CPP_SOURCE", "")
if not SOURCE or not (Path(SOURCE) / "convert_hf_to_gguf.py").is_file():
    pytest.skip(
        "set STRATA_LLAMA_CPP_SOURCE to a llama.cpp source tree with convert_hf_to_gguf.py",
        allow_module_level=True,
    )

VOCAB = 512  # the tiny preset's vocab_size
# Ids 0-2 are the special tokens; the rest are ordinary.  Seeded for replay.
SEQ = np.random.default_rng(11).integers(3, VOCAB, 100).tolist()
REL_TOL = 1e-5  # of the folder logits' range

# (family, make_model overrides): what GGUF can express, as in test_gguf_export.py's CASES.
CASES: list[tuple[str, dict[str, Any]]] = [
    ("llama", {}),
    ("mistral", {}),
    ("qwen2", {}),
    ("qwen3", {}),
    # llama.cpp fixes Gemma 3's layer pattern (every sixth layer global) and attention scale.
    (
        "gemma3",
        {
            "num_hidden_layers": 6,
            "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
            "sliding_window_pattern": 6,
            "query_pre_attn_scalar": 32,
        },
    ),
    # llama.cpp's qwen3moe has no dense layers and always renormalizes.
    ("qwen3_moe", {"mlp_only_layers": [], "norm_topk_prob": True}),
    ("mixtral", {}),
    ("phi3", {}),
]

# Runs convert_hf_to_gguf.main() with argv[2:] as its arguments, from the tree in argv[1].
DRIVER = """
import sys

source = sys.argv[1]
sys.path[:0] = [source + "/gguf-py", source]
import convert_hf_to_gguf


def tolerant(original):
    def get_vocab_base_pre(self, tokenizer):
        try:
            return original(self, tokenizer)
        except NotImplementedError:  # "BPE pre-tokenizer was not recognized"
            return "gpt-2"

    return get_vocab_base_pre


# The method sits on TextModel (conversion/base.py, or the script itself in older trees).
patched = 0
for name, module in list(sys.modules.items()):
    if name == "convert_hf_to_gguf" or name.split(".")[0] == "conversion":
        for cls in list(vars(module).values()):
            if isinstance(cls, type) and "get_vocab_base_pre" in vars(cls):
                cls.get_vocab_base_pre = tolerant(vars(cls)["get_vocab_base_pre"])
                patched += 1
assert patched, "get_vocab_base_pre not found"
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
convert_hf_to_gguf.main()
"""


def convert(folder: Path, out: Path) -> Path:
    """llama.cpp's convert_hf_to_gguf.py on `folder`, to an f32 GGUF at `out`."""
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    argv = [sys.executable, "-c", DRIVER, SOURCE, str(folder), "--outtype", "f32"]
    result = subprocess.run(
        [*argv, "--outfile", str(out)],
        cwd=out.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, f"convert_hf_to_gguf.py failed:\n{result.stderr[-4000:]}"
    return out


def as_gpt2_tokenizer(folder: Path, dest: Path) -> Path:
    """A copy of `folder` whose tokenizer_config.json names the GPT2Tokenizer class."""
    shutil.copytree(folder, dest)
    config_path = dest / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "GPT2Tokenizer"
    config_path.write_text(json.dumps(config, indent=2))
    return dest


async def engine_logits(path: Path, ids: list[int]) -> np.ndarray:
    engine = await strata_rs.Engine.load(str(path), device="cpu")
    try:
        return np.asarray(await engine.logits(ids), dtype=np.float64)
    finally:
        await engine.close()


@pytest.mark.parametrize("case", CASES, ids=[family for family, _ in CASES])
async def test_converted_file_answers_as_its_folder(
    model_dir: Callable[..., Path], tmp_path: Path, case: tuple[str, dict[str, Any]]
) -> None:
    family, overrides = case
    folder = model_dir(family, "f32", **overrides)
    source = as_gpt2_tokenizer(folder, tmp_path / family) if family == "phi3" else folder
    path = convert(source, tmp_path / f"{family}.gguf")
    want = await engine_logits(folder, SEQ)
    got = await engine_logits(path, SEQ)
    assert got.shape == want.shape == (len(SEQ), VOCAB)
    diff = float(np.abs(got - want).max())
    span = float(np.ptp(want))
    print(f"{family}: max |diff| {diff:.3g}, logit range {span:.3g}, ratio {diff / span:.3g}")
    assert diff <= REL_TOL * span, f"max |diff| {diff:.3g} vs logit range {span:.3g}"
    assert (got.argmax(-1) == want.argmax(-1)).all()
