"""strata-rs: an LLM inference engine with a tiered conversation cache.

The engine is a Rust core (``strata_rs._core``); this package re-exports its types, and adds
``LLM``, the synchronous facade (``strata_rs.llm``).
"""

from strata_rs._core import (
    Choice,
    Completion,
    ContextOverflow,
    DeviceUnavailable,
    Engine,
    EngineBusy,
    EngineStopped,
    InvalidRequest,
    LoadingEngine,
    ModelLoadError,
    SamplingParams,
    StrataError,
    StreamChunk,
    Tokenizer,
    TokenStream,
    Usage,
    __version__,
    cuda_devices,
    dequantize,
    prefix_block_hashes,
    quantize,
    validate_messages,
)
from strata_rs.llm import LLM, ChunkIterator

__all__ = [
    "LLM",
    "Choice",
    "ChunkIterator",
    "Completion",
    "ContextOverflow",
    "DeviceUnavailable",
    "Engine",
    "EngineBusy",
    "EngineStopped",
    "InvalidRequest",
    "LoadingEngine",
    "ModelLoadError",
    "SamplingParams",
    "StrataError",
    "StreamChunk",
    "TokenStream",
    "Tokenizer",
    "Usage",
    "__version__",
    "cuda_devices",
    "dequantize",
    "prefix_block_hashes",
    "quantize",
    "validate_messages",
]
