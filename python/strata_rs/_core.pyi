"""Type stubs for the Rust extension module ``strata_rs._core``."""

from collections.abc import AsyncIterator, Awaitable, Generator, Mapping, Sequence
from os import PathLike
from types import TracebackType
from typing import Any, Literal, TypedDict, final

import numpy as np
import numpy.typing as npt

__all__ = [
    "Choice",
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
    "stats_metrics",
    "validate_messages",
]

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

class EngineBusy(StrataError):
    """Too many requests are waiting (``max_waiting``); retry later."""

class CudaDevice(TypedDict):
    index: int
    name: str
    total_memory: int

def cuda_devices() -> list[CudaDevice]:
    """The GPUs the CUDA driver reports; ``[]`` when there is no driver."""

def quantize(array: npt.NDArray[np.float32], type: str) -> npt.NDArray[np.uint8]:
    """Quantizes each row of a 2-D float32 array to the ggml block type ``type`` ("Q4_0",
    "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL",
    "IQ4_XS"; case-insensitive): a ``[rows, row_bytes]`` uint8 array. Raises InvalidRequest
    (a ValueError) naming the argument: unknown type, not a 2-D float32 array, columns not a
    whole number of blocks."""

def dequantize(data: npt.NDArray[np.uint8], type: str, cols: int) -> npt.NDArray[np.float32]:
    """Dequantizes a 2-D uint8 array of ggml blocks of ``type``, ``cols`` values per row: a
    ``[rows, cols]`` float32 array (the values ggml computes, to the bit). Raises InvalidRequest
    (a ValueError) naming the argument: unknown type, ``cols`` not a multiple of the block size,
    rows of the wrong byte length."""

def prefix_block_hashes(token_ids: Sequence[int], prefix_salt: int, block_size: int) -> list[int]:
    """The prefix hashes of the full blocks of ``token_ids``, as an engine whose info has this
    ``prefix_salt`` and ``block_size`` computes them: a router's key for where a prompt's prefix
    is cached (``Engine.cached_block_hashes``). InvalidRequest naming ``token_ids`` or
    ``block_size`` (0)."""

def validate_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    """Checks chat messages as ``Engine.chat`` does before rendering them (a non-empty list of
    objects, each with a known role and text content); raises InvalidRequest naming the message."""

class MetricSource(TypedDict):
    path: str
    """Dot-separated keys of the stats dict; ``*``: each key of a dict (the next label's
    value); ``[]`` or ``[field=value]``: each record of a list (giving the labels left)."""
    labels: dict[str, str]
    """Labels every sample from this path has."""

class MetricSpec(TypedDict):
    name: str
    """Without ``_total`` for a counter (prometheus_client appends it)."""
    type: Literal["gauge", "counter", "histogram"]
    help: str
    labels: list[str]
    sources: list[MetricSource]
    zeros: list[list[str]]
    """Label values listed at 0 until counted."""
    zeros_from: str | None
    """A path to a dict whose keys are listed the same way."""

def stats_metrics() -> list[MetricSpec]:
    """The Prometheus families ``/metrics`` reads from ``Engine.stats()``, in exposition order:
    name, type, help text, labels and the key paths of their samples
    (rust/engine/stats/metrics.rs)."""

@final
class Tokenizer:
    @staticmethod
    def load(path: str | PathLike[str]) -> Tokenizer:
        """Loads a tokenizer (no weights): a GGUF file's, built from its tokenizer.ggml.*
        metadata to give llama.cpp's ids (eos_token_ids: its end-of-generation tokens; the chat
        template from tokenizer.chat_template), or a model folder's (as from_dir). Raises
        ModelLoadError naming the file and the metadata key or file at fault."""
    @staticmethod
    def from_dir(path: str | PathLike[str]) -> Tokenizer:
        """Loads the tokenizer files of a model folder (no weights). Raises ModelLoadError naming
        the file: tokenizer.json, tokenizer_config.json, generation_config.json, or the chat
        template's file when the template does not compile."""
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = ...,
        **kwargs: Any,
    ) -> str:
        """Renders the model's chat template as transformers' apply_chat_template(tokenize=False)
        does; keyword arguments become template variables (tools, enable_thinking, ...).
        InvalidRequest naming `messages` when the template fails (raise_exception, an unknown
        filter, more than 20M steps, more than 64 MiB of output)."""
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

@final
class SamplingParams:
    """How to pick tokens and when to stop. Keyword arguments only; each is checked at once and
    InvalidRequest names a bad one (wrong type, out of range, unknown keyword)."""

    def __new__(
        cls,
        *,
        max_tokens: int | None = None,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
        logprobs: int | bool | None = None,
        n: int = 1,
        skip_special_tokens: bool = True,
        structured_outputs: Mapping[str, Any] | None = None,
        logit_bias: Mapping[int | str, float] | None = None,
        speculative: bool = True,
    ) -> SamplingParams:
        """`structured_outputs` (vLLM's): exactly one of `json` (a JSON schema, or its text),
        `json_object` (True: any JSON object), `regex`, `choice` (a list of strings) or `grammar`
        (a Lark grammar); the output then follows it (llguidance). The grammar is compiled when
        the request is submitted: InvalidRequest names `structured_outputs.<kind>` if it cannot
        be. `logit_bias` (OpenAI's): token id (an int or its decimal string) -> a bias in
        [-100, 100] added to its logit before sampling; logprobs stay those of the raw logits.
        `speculative=False`: decode this request without drafts on an engine that drafts."""
    @property
    def max_tokens(self) -> int | None:
        """Most tokens to generate; None: until the context is full."""
    @property
    def temperature(self) -> float:
        """0 picks the most likely token (greedy)."""
    @property
    def top_k(self) -> int:
        """Keep the k most likely tokens; 0 keeps all."""
    @property
    def top_p(self) -> float:
        """Keep the smallest set of most likely tokens whose probability reaches p, in (0, 1]."""
    @property
    def min_p(self) -> float:
        """Drop tokens less likely than min_p times the most likely one, in [0, 1]."""
    @property
    def repetition_penalty(self) -> float: ...
    @property
    def presence_penalty(self) -> float: ...
    @property
    def frequency_penalty(self) -> float: ...
    @property
    def seed(self) -> int | None:
        """Same seed and prompt give the same output, whatever else is in the batch."""
    @property
    def stop(self) -> list[str]:
        """Stop strings: matched across token boundaries, never emitted."""
    @property
    def stop_token_ids(self) -> list[int]: ...
    @property
    def ignore_eos(self) -> bool: ...
    @property
    def logprobs(self) -> int | None:
        """Alternatives reported with each token's log-probability; None: no logprobs."""
    @property
    def n(self) -> int:
        """Choices generated from the prompt (they share its K/V blocks)."""
    @property
    def skip_special_tokens(self) -> bool: ...
    @property
    def speculative(self) -> bool:
        """Whether the request may decode with drafts (on an engine with `speculative`)."""

class TopLogprob(TypedDict):
    token_id: int
    token: str
    logprob: float

class TokenLogprob(TypedDict):
    token_id: int
    token: str
    logprob: float
    top_logprobs: list[TopLogprob]

class PromptTokenLogprob(TokenLogprob):
    rank: int
    """1 + how many tokens were more likely at that position."""

FinishReason = Literal["stop", "length", "cancelled"]

@final
class Usage:
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def completion_tokens(self) -> int:
        """Summed over choices."""
    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose K/V came from the cache instead of a prefill."""
    @property
    def draft_tokens(self) -> int:
        """Draft tokens proposed for the request (speculative decoding), summed over choices."""
    @property
    def accepted_draft_tokens(self) -> int:
        """Of `draft_tokens`, those accepted."""

@final
class StreamChunk:
    @property
    def index(self) -> int:
        """Which choice (0..n) the chunk belongs to."""
    @property
    def text(self) -> str: ...
    @property
    def token_ids(self) -> list[int]:
        """One id, or several when the consumer fell behind and deltas were merged."""
    @property
    def logprobs(self) -> list[TokenLogprob] | None: ...
    @property
    def finish_reason(self) -> FinishReason | None:
        """Set on the choice's last chunk."""
    @property
    def usage(self) -> Usage | None:
        """Set on the stream's last chunk."""

@final
class TokenStream(AsyncIterator[StreamChunk]):
    """The chunks of one request. Dropping it (break, a cancelled task) cancels the request; the
    engine frees its blocks at its next step. Raises EngineStopped if the engine closes first.

    Read it on a running event loop (asyncio, uvloop or trio, in any thread): each loop's chunks
    are polled on that loop's own thread when the engine signals it. Concurrent `__anext__` calls
    get the chunks in call order; a call cancelled while it waits (a timeout, a cancel scope)
    loses nothing."""

    def __aiter__(self) -> TokenStream: ...
    def __anext__(self) -> Awaitable[StreamChunk]: ...
    def cancel(self) -> None:
        """Stops the request; the stream ends with a chunk whose finish_reason is "cancelled"."""
    def aclose(self) -> Awaitable[None]: ...
    @property
    def request_id(self) -> int: ...

@final
class Choice:
    @property
    def index(self) -> int: ...
    @property
    def text(self) -> str: ...
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def logprobs(self) -> list[TokenLogprob] | None: ...
    @property
    def finish_reason(self) -> FinishReason | None: ...

@final
class Completion:
    """A whole answer; text, token_ids, logprobs and finish_reason are those of choice 0."""

    @property
    def text(self) -> str: ...
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def logprobs(self) -> list[TokenLogprob] | None: ...
    @property
    def finish_reason(self) -> FinishReason | None: ...
    @property
    def usage(self) -> Usage: ...
    @property
    def choices(self) -> list[Choice]: ...

class Histogram(TypedDict):
    bounds: list[float]
    counts: list[int]
    """counts[i]: observations in (bounds[i-1], bounds[i]]; the last: above bounds[-1]."""
    sum: float
    count: int

CacheTierName = Literal["device", "host", "disk"]

class CacheTierStats(TypedDict):
    blocks: int
    bytes: int
    budget_bytes: int

class DiskTierStats(CacheTierStats):
    dir: str | None
    """The disk tier's folder; None when the tier is off."""
    enabled: bool

class CacheTiers(TypedDict):
    device: CacheTierStats
    host: CacheTierStats
    disk: DiskTierStats

class CacheHitTokens(TypedDict):
    device: int
    host: int
    disk: int

# Functional form: "from" is a keyword.
CacheMove = TypedDict(
    "CacheMove",
    {
        "from": CacheTierName,
        "to": CacheTierName,
        "result": Literal["ok", "refused", "failed"],
        "blocks": int,
        "bytes": int,
    },
)

class CacheRestore(TypedDict):
    tokens: int
    from_host: int
    from_disk: int
    bytes: int
    seconds: float

class CacheStatsDict(TypedDict):
    tiers: CacheTiers
    hit_tokens: CacheHitTokens
    """Prompt tokens whose K/V came from each tier (device: the same as prefix_hit_tokens)."""
    moves: list[CacheMove]
    """Blocks moved per (from, to, result) since start; bytes = blocks x kv_block_bytes."""
    refusals: dict[Literal["ram", "host_budget", "disk_budget", "device"], int]
    """Moves refused per gate: every gate, at 0 until it refuses."""
    device_refusals: dict[str, int]
    """Moves refused by one device's memory pool (its part of the staging buffer), by device
    ("cpu", "cpu:1"); each is also under refusals["device"]. Only devices that refused appear."""
    corrupt_files: int
    """Disk files found bad (startup scan or a read) and deleted."""
    adopted_files: int
    """Disk files of this model adopted by the startup scan."""
    faults_injected: dict[Literal["alloc", "copy_out", "copy_in", "write", "read", "ram_gate"], int]
    """Faults injected by `cache_faults`, per kind; only kinds that fired appear."""
    last_restore: CacheRestore | None

class MemoryInUse(TypedDict):
    """Bytes a device's memory holds, by purpose (every purpose listed, 0 when unused)."""

    weights: int
    """The model's tensors as loaded: matrices at their file size (memory-mapped views), norm
    weights and biases as f32 copies; a tied head counts once."""
    kv: int
    """The paged K/V pool: kv_blocks_total x this device's part of info()["kv_block_bytes"]
    (its layers' share, with a layer split); with window slots (kv_window_slots_total > 0) the
    sliding layers hold that many blocks instead."""
    workspace: int
    """Buffers sized at load: activations, matmul and attention scratch, the logits rows
    sampled from, the RoPE table."""
    graphs: int
    """Captured decode graphs on a GPU, each as the drop in free memory over its capture
    (always 0 on the CPU)."""
    staging: int
    """The conversation cache's one-block buffer for disk moves, once allocated (with a layer
    split, each device's part of it)."""

class DeviceMemory(TypedDict):
    capacity_bytes: int | None
    """What the device may hold; None when not bounded (a CPU without device_memory_mib)."""
    in_use_bytes: MemoryInUse

class GraphStats(TypedDict):
    """The GPU's captured decode graphs (one per padded batch size); all 0 on the CPU."""

    graphs: int
    bytes: int
    captures: int
    hits: int
    evictions: int
    oom_retries: int
    oom_fallbacks: int
    capture_failures: int
    oversize: int

class EngineStatsDict(TypedDict):
    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_cached: int
    kv_window_slots_total: int
    kv_window_slots_used: int
    kv_window_slots_passed: int
    kv_usage: float
    prefix_query_tokens: int
    prefix_hit_tokens: int
    preemptions: int
    prompt_tokens: int
    generated_tokens: int
    requests_finished: int
    requests_cancelled: int
    requests_refused: int
    steps: int
    step_tokens: int
    last_step_seconds: float
    step_seconds: Histogram
    ttft_seconds: Histogram
    spec_draft_tokens: int
    spec_accepted_tokens: int
    spec_accepted_per_step: Histogram
    """Drafts accepted per verification (one per drafting sequence and step)."""
    spec_draft_detached: int
    """Sequences whose draft model stopped: its drafts stayed rejected, or a prefix hit found
    blocks without its K/V."""
    spec_draft_model_tokens: int
    """Tokens a draft model fed: its proposals and its catch-up over what the target computed."""
    stopped: str | None
    cache: CacheStatsDict
    memory: dict[str, DeviceMemory]
    """Per device ("cpu"; with a layer split "cpu:0", "cpu:1", ...; "cuda:0", ...): its capacity
    and the bytes in use by purpose, read at the call."""
    graphs: GraphStats
    copy_streams: int
    """Copy streams the GPUs' cache moves have made (one per GPU, on its first move)."""

Prompt = str | Sequence[int]

@final
class LoadingEngine:
    """What Engine.load returns: await it for the engine (`await Engine.load(...)`), or use it
    as an async context manager (`async with Engine.load(...) as engine:`), which closes the
    engine when the block ends."""

    def __await__(self) -> Generator[Any, Any, Engine]: ...
    def __aenter__(self) -> Awaitable[Engine]: ...
    def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Awaitable[None]: ...

@final
class Engine:
    """The engine. Its awaitables and streams work under asyncio (and uvloop) and trio, the
    library running the caller, chosen as anyio does (sniffio); on either, cancelling the
    awaiting task (a cancel scope, `task.cancel()`) cancels the request."""

    @staticmethod
    def load(
        path: str | PathLike[str],
        device: str = "cpu",
        max_batch: int = 8,
        max_context: int | None = None,
        kv_memory_mib: int | None = None,
        max_batch_tokens: int = 512,
        max_waiting: int = 256,
        threads: int | None = None,
        *,
        host_cache_mib: int = 4096,
        host_min_free_mib: int = 1024,
        disk_cache_dir: str | PathLike[str] | None = None,
        disk_cache_mib: int = 16384,
        disk_cache_days: float = 7.0,
        disk_write_when_idle: bool = False,
        cache_faults: str | None = None,
        device_memory_mib: str | int | Sequence[int] | None = None,
        layer_split: str | int | Sequence[int] | None = None,
        vram_reserve_mib: int = 1024,
        kv_dtype: str | None = None,
        quantize: str | None = None,
        bf16_dot: bool = False,
        speculative: str | PathLike[str] | None = None,
        num_speculative_tokens: int = 4,
        ngram_min: int = 2,
        ngram_max: int = 4,
        speculative_adaptive: bool = True,
    ) -> LoadingEngine:
        """Loads a Hugging Face model folder (awaitable: `await Engine.load(...)`, or
        `async with Engine.load(...) as engine:`). Raises ModelLoadError (naming the file),
        DeviceUnavailable or InvalidRequest (naming the argument; also for sizes that cannot be
        allocated: threads over 1024, a kv_memory_mib or max_context past memory).

        max_batch: sequences decoding at once. max_context: longest sequence (default: the
        model's). kv_memory_mib: K/V pool budget (default: one max_context sequence, at most
        2 GiB). max_batch_tokens: tokens per forward step (prefill chunk size). max_waiting:
        requests that may wait for admission before EngineBusy. kv_dtype (keyword-only): the K/V
        cache's format, "f32", "f16", "bf16" or "q8_0" (8-bit: groups of 32 int8 with one f16
        scale, 34 bytes per 32 values, about half of f16's: twice the context and conversations
        in every cache tier, at a small cost in agreement, docs/operations.md); default: f32 K/V
        for f32 weights, else f16. bf16 and q8_0 run on the CPU only (a GPU refuses them).
        info["kv_dtype"] shows it. A disk tier's files are one format's: a restart with another
        kv_dtype neither adopts nor reads them.
        quantize (keyword-only): quantize a Hugging Face folder's weight matrices at load to
        "q8_0", "q4_k" or "q6_k" (ggml's block types, the blocks strata_rs.quantize makes), so
        a bf16 checkpoint runs at quantized speed without a conversion step: every layer
        matrix to that type, the head to q6_k (q8_0 with "q8_0"); a matrix whose rows are not
        whole blocks of it gets q8_0, or stays as stored if they are not whole blocks of 32.
        The embedding stays as stored. info["quantize"] shows it and info["dtype"] the type
        holding the most bytes. A GGUF file is refused (already quantized): InvalidRequest
        naming quantize. Runs on the CPU only.
        bf16_dot (keyword-only): bf16 weight matrices take the CPU's bf16 dot products
        (AVX512_BF16), their input rows rounded to bf16 as llama.cpp computes on bf16 weights:
        about twice the prefill speed, each product off by the rounding (at most 2^-9 of it).
        Off by default (f32 inputs). Ignored where the CPU lacks the instructions and on a
        GPU; info["matmul_inputs"] says what runs.
        speculative (keyword-only): "ngram" decodes with drafts proposed by prompt lookup (the
        longest suffix of the sequence, ngram_max down to ngram_min tokens, that occurred
        earlier in it proposes the up to num_speculative_tokens (1-16) tokens that followed),
        checked in one forward: outputs are those of decoding without drafts, greedy and
        sampled alike (each step draws once; a draft is accepted when it is the token drawn,
        speculative sampling's rule for a draft proposed with certainty). A sequence drafts as
        many tokens as its acceptance rate and the measured time of steps with that many more
        rows say pay (none where each row costs as much as a step: plain decoding is then
        faster), and where none pays checks one now and then so that the estimate can recover;
        speculative_adaptive=False drafts what lookup proposes, fewer after rejections, none
        for a while after a run of them (for tests and measurements). A path instead of
        "ngram" names a draft model (a GGUF file or a model folder, with the target's
        tokenizer token for token; `quantize` and `bf16_dot` apply to
        it as to the target): it proposes its greedy picks, its K/V kept in the target's blocks
        (prefix cache, tiers and restarts serve both), and it runs over every token of the
        sequences that draft; with the adaptive policy one whose drafts stay rejected
        detaches (the draft runs no more for it, nor for its conversation's later turns)
        (CPU, one device). A request's
        `speculative=False` opts out of drafting and feeds a draft model nothing.
        info["speculative"] shows the settings; stats() counts drafts, acceptances, detached
        sequences and the draft model's tokens.

        device: "cpu", "cuda:N", or a list that splits the layers across devices ("cpu:0,1",
        "cuda:0,1"): each device holds a consecutive layer range, its weights and the K/V of its
        layers, and hands the activations to the next. Outputs equal one device's exactly.
        device_memory_mib: each device's memory capacity in MiB, one per device of `device`
        ("300,120" or [300, 120]); reservations past it are refused (at load: InvalidRequest;
        a cache move: skipped and recomputed). Default: a CPU's pool is not bounded.
        layer_split: layers per device ("20,10"), each >= 1, summing to the model's layers.
        Default: in proportion to each device's capacity, evenly when none is configured.
        vram_reserve_mib: on a GPU, memory left free beside what the engine accounts (the
        driver's own allocations, other processes); a GPU's capacity is its free memory at load
        less this, capped by device_memory_mib. Without kv_memory_mib the K/V pool takes what
        is left after the weights, the step buffers and 256 MiB for captured decode graphs.

        The conversation cache's tiers below the device (keyword-only):
        host_cache_mib: host RAM tier budget; 0 turns the tier off.
        host_min_free_mib: the RAM gate's floor: the host tier takes a copy only when
        need + floor <= available memory (MemAvailable, or a memory cgroup's room if smaller).
        disk_cache_dir: disk tier folder (default: $XDG_CACHE_HOME/strata-rs/kv, else
        ~/.cache/strata-rs/kv).
        disk_cache_mib: disk tier budget; 0 turns the tier off.
        disk_cache_days: files older than this are deleted at start; 0 empties the tier at start.
        disk_write_when_idle: whenever the engine falls idle after work, the cached blocks not
        on disk yet are written there (as at a clean close), so conversations survive the
        process being killed; for replicas that share disk_cache_dir. Engines sharing a folder
        find each other's files and keep the folder's total within their budget.
        cache_faults: fault injection for tests, e.g. "copy_in:2,read:5%,ram_gate:100-200"
        (kinds alloc, copy_out, copy_in, write, read, ram_gate; N: the Nth operation of that
        kind fails, A-B: operations A to B, P%: each with probability P percent (fixed seed),
        *: every one); default: $STRATA_CACHE_FAULTS.

        A clean close() writes the cached K/V to the disk tier; the next load of the same model
        adopts those files."""
    def generate(
        self, prompt: Prompt, params: SamplingParams | None = None, **kwargs: Any
    ) -> TokenStream:
        """Streams the continuation of a prompt (text, encoded with special tokens, or token
        ids: ints in 0..vocab_size, not bools). Sampling options as `params` (a SamplingParams or
        None) or as SamplingParams keywords. Raises InvalidRequest (a wrong type or value, naming
        the argument), ContextOverflow, EngineBusy or EngineStopped at once."""
    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        params: SamplingParams | None = None,
        *,
        add_generation_prompt: bool = ...,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> TokenStream:
        """Streams the assistant's answer to `messages`, rendered with the chat template. Raises
        as generate() does; errors about the messages or the prompt they render to (its
        length: ContextOverflow) name `messages`, and a template that fails to render is an
        InvalidRequest naming `messages`."""
    def complete(
        self, prompt: Prompt, params: SamplingParams | None = None, **kwargs: Any
    ) -> Awaitable[Completion]:
        """The whole answer at once."""
    def chat_complete(
        self,
        messages: Sequence[Mapping[str, Any]],
        params: SamplingParams | None = None,
        *,
        add_generation_prompt: bool = ...,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> Awaitable[Completion]:
        """The assistant's whole answer to `messages` at once; arguments and errors as chat()."""
    def stats(self) -> EngineStatsDict:
        """Counters as of the engine's last step (no round trip to the engine thread).
        ``stopped`` is None while the engine loop serves, else why it stopped. ``cache`` is the
        conversation cache: bytes, blocks and budget per tier (device, host, disk), hit tokens
        per tier, moves per (from, to, result), refusals per gate, corrupt and adopted disk
        files, and the last restore (None before the first). ``memory`` is each device's memory
        accounting, read at the call: ``{"cpu": {"capacity_bytes": None, "in_use_bytes":
        {"weights": ..., "kv": ..., "workspace": ..., "graphs": 0, "staging": ...}}}``.
        ``graphs`` is the GPU's captured decode graphs (graphs, bytes, captures, hits,
        evictions, oom_retries, oom_fallbacks, capture_failures, oversize; all 0 on the CPU),
        ``copy_streams`` the copy streams the GPUs' cache moves have made."""
    def _inject_fault(self) -> None:
        """Makes the engine thread's next step panic as a bug would (tests of fault handling)."""
    def logits(self, token_ids: Sequence[int]) -> Awaitable[npt.NDArray[np.float32]]:
        """Logits of every position, ``[len(token_ids), vocab_size]`` float32. InvalidRequest
        naming token_ids for anything but a list of ids in the vocabulary."""
    def prompt_logprobs(
        self, token_ids: Sequence[int], top_logprobs: int | None = None
    ) -> Awaitable[list[PromptTokenLogprob | None]]:
        """Each prompt token's logprob under the tokens before it: None for the first, then the
        entry a generated token gets, with its rank, and `top_logprobs` (0-20) alternatives. One
        forward from a cold K/V state, its logits reduced a chunk at a time (a long prompt never
        holds all of them). InvalidRequest naming token_ids or top_logprobs."""
    def benchmark(
        self,
        prefill_lens: Sequence[int] = ...,
        decode_contexts: Sequence[int] = ...,
        decode_steps: int = 32,
        repeats: int = 3,
    ) -> Awaitable[BenchResult]:
        """Times cold prefill and single-token decode, and the memory read bandwidth."""
    def cached_block_hashes(self) -> Awaitable[list[int]]:
        """The prefix hashes of the K/V blocks the engine holds on the device and in the host
        tier (not the disk tier, which other processes may share): where a router finds which
        engine holds a prompt's prefix (``prefix_block_hashes``)."""
    def close(self) -> Awaitable[None]:
        """Stops the engine thread, from the call on; awaiting it waits until the thread has
        written the disk tier and exited. Idempotent."""
    def __aenter__(self) -> Awaitable[Engine]:
        """`async with await Engine.load(...) as engine:` gives the engine."""
    def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Awaitable[None]:
        """Closes the engine (as close()), also when the block raised; the exception goes on."""
    @property
    def tokenizer(self) -> Tokenizer: ...
    @property
    def closed(self) -> bool: ...
    @property
    def info(self) -> dict[str, Any]:
        """What was loaded and how: model shape, dtype, device, threads, context, K/V pool.
        info["matmul_inputs"] says what the weight matmuls round their input rows to: "f32"
        (not rounded), "bf16" (bf16 weights on a CPU with bf16 dot products, as llama.cpp
        and a PyTorch bf16 model compute) or "int8" (quantized weights). info["cpu_levels"]
        lists the instruction-set levels the CPU kernels dispatch to here ("avx2", "avx_vnni",
        "avx512", "avx512_vnni", "avx512_bf16"; none: the portable paths)."""
