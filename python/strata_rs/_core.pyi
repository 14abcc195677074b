"""Type stubs for the Rust extension module ``strata_rs._core``."""

from collections.abc import Awaitable, Mapping, Sequence
from os import PathLike
from typing import Any, TypedDict

import numpy as np
import numpy.typing as npt

__version__: str

class StrataError(Exception):
    """Base class of every strata-rs error."""

class ModelLoadError(StrataError):
    """The model folder cannot be loaded; the message names the file and the field or tensor."""

class InvalidRequest(StrataError, ValueError):
    """A request or argument is invalid; the message names the field and the reason."""

class ContextOverflow(InvalidRequest):
    """The request is longer than the engine's context."""

class DeviceUnavailable(StrataError):
    """The requested device cannot be used."""

class EngineStopped(StrataError):
    """The engine is closed or its loop has stopped."""

class CudaDevice(TypedDict):
    index: int
    name: str
    total_memory: int

def cuda_devices() -> list[CudaDevice]:
    """The GPUs the CUDA driver reports; ``[]`` when there is no driver."""

class Tokenizer:
    @staticmethod
    def from_dir(path: str | PathLike[str]) -> Tokenizer:
        """Loads the tokenizer files of a model folder (no weights)."""
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Renders the model's chat template as transformers' apply_chat_template(tokenize=False)
        does; keyword arguments become template variables (tools, enable_thinking, ...)."""
    @property
    def vocab_size(self) -> int: ...
    @property
    def eos_token_ids(self) -> list[int]: ...
    @property
    def bos_token_id(self) -> int | None: ...
    def token_to_id(self, token: str) -> int | None: ...
    def id_to_token(self, id: int) -> str | None: ...

class BenchResult(TypedDict):
    prefill_tok_s: dict[int, float]
    decode_tok_s: dict[int, float]
    decode_weight_bytes: int
    read_bandwidth_gb_s: dict[int, float]

class Engine:
    @staticmethod
    def load(
        path: str | PathLike[str],
        device: str = "cpu",
        threads: int | None = None,
        max_batch_tokens: int = 512,
        kv_memory_mib: int | None = None,
        max_context: int | None = None,
    ) -> Awaitable[Engine]:
        """Loads a Hugging Face model folder. Raises ModelLoadError, DeviceUnavailable or
        InvalidRequest."""
    def logits(self, token_ids: Sequence[int]) -> Awaitable[npt.NDArray[np.float32]]:
        """Logits of every position, ``[len(token_ids), vocab_size]`` float32."""
    def benchmark(
        self,
        prefill_lens: Sequence[int] = ...,
        decode_contexts: Sequence[int] = ...,
        decode_steps: int = 32,
        repeats: int = 3,
    ) -> Awaitable[BenchResult]:
        """Times cold prefill and single-token decode, and the memory read bandwidth."""
    def close(self) -> Awaitable[None]:
        """Stops the engine thread; idempotent."""
    @property
    def tokenizer(self) -> Tokenizer: ...
    @property
    def closed(self) -> bool: ...
    @property
    def info(self) -> dict[str, Any]: ...
