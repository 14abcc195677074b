"""GGUF files quantized by llama.cpp's own quantizer (through llama-cpp-python).

The files people download are made this way: `Q4_K_M` mixes Q4_K and Q6_K
matrices by llama.cpp's rules.  Used for the 1B benchmark files and, where
llama-cpp-python is installed, by the tests.
"""

from __future__ import annotations

from pathlib import Path


def quantize_gguf(source: str | Path, out: str | Path, ftype: str, threads: int = 0) -> Path:
    """Writes `source` (an f32/f16/bf16 GGUF file) quantized to `ftype` ("Q4_K_M",
    "Q8_0", ... as llama.cpp's `llama-quantize` names them) into `out`."""
    import llama_cpp

    name = f"LLAMA_FTYPE_MOSTLY_{ftype.upper()}"
    if not hasattr(llama_cpp, name):
        raise ValueError(f"ftype {ftype!r}: llama.cpp has no {name}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, name)
    params.nthread = threads
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rc = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama.cpp's quantizer failed ({rc}) on {source}")
    return out
