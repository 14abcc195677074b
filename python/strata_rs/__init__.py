"""strata-rs: an LLM inference engine with a tiered conversation cache.

The engine is a Rust core (``strata_rs._core``); this package re-exports its types.
"""

from strata_rs._core import (
    ContextOverflow,
    DeviceUnavailable,
    Engine,
    EngineStopped,
    InvalidRequest,
    ModelLoadError,
    StrataError,
    Tokenizer,
    __version__,
    cuda_devices,
)

__all__ = [
    "ContextOverflow",
    "DeviceUnavailable",
    "Engine",
    "EngineStopped",
    "InvalidRequest",
    "ModelLoadError",
    "StrataError",
    "Tokenizer",
    "__version__",
    "cuda_devices",
]
