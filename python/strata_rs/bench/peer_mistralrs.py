"""mistral.rs (the `mistralrs` PyPI wheel, CPU) as a benchmark peer, on the same folder.

`Runner(Which.Plain(model_id=<folder>, dtype=<the folder's dtype>), token_source="none")` loads
the Hugging Face folder in-process. Its compute threads come from rayon's global pool, which
reads `RAYON_NUM_THREADS` when it starts: it is set to strata-rs's thread count before the first
Runner. Its K/V on CPU is f16 unless `MISTRALRS_CPU_KV_F32=1`; that is set for f32 folders, so
that each engine keeps K/V in the format strata-rs uses for the same weights (f32 weights: f32
K/V; bf16/f16 weights: f16 K/V).

What its API lets us measure, and how:

* Prompts are text: its requests take no token ids. The streams' and the conversations' prompts
  are ids chosen to survive a text round trip (`peers.canonical_ids`), so it reads the same ids
  as the other engines from their text (decoded with the folder's tokenizer.json, the file
  mistral.rs reads). The prefill and decode prompts of the others (rust/bench.rs's ids) do not
  survive one (ids above the tokenizer's vocabulary decode to nothing; pieces merge), so it
  gets prompts of the same lengths drawn like the canonical ones. Its own count
  (`usage.prompt_tokens`) is kept in the JSON (`prompt_tokens`).
* Completion requests cannot stream, so every timed request is a streamed chat request whose
  chat template is replaced by one that outputs the message text unchanged (`jinja_explicit`):
  the model sees exactly the prompt text, and the first chunk marks the first token.
* prefill N: submit -> first streamed chunk (max_tokens 1), on a Runner whose prefix cache is
  off (`prefix_cache_n=0`), so every repeat is cold; tok/s = its prompt tokens / that time. It
  includes tokenizing the text and sampling one token (both small next to a prefill).
* decode at context C: one streamed request of C tokens and steps + 1 answer tokens; tok/s =
  the answer's tokens after the first (`usage.completion_tokens` - 1) over the time from the
  first chunk to the last. That is the engine's steps plus its sampler and its stream to
  Python, where strata-rs's and the other peers' figure is the forward step alone; and when
  the first answer token is an incomplete UTF-8 piece, mistral.rs sends it with the second,
  which shortens the window by a step (then 1/(steps - 1) high: 3% at 32 steps).
* aggregate decode with S streams: S such requests submitted at once (a Runner serves one call
  at a time, but a streamed request returns its iterator at once), their chunks read in turn
  from one thread; the Runner batches them (`max_seqs` 8). S x (gen - 1) tokens over the
  window from the moment every stream has its first chunk to the last chunk.
* returning conversation: a second Runner with its prefix cache on (the default, 16 sequences);
  a turn's TTFT = submit -> first chunk; its prefix cache decides what is reused
  (`usage.prompt_tokens_details.cached_tokens`, kept in the JSON). Cold: the same prompt on the
  Runner whose prefix cache is off. After a restart: not measurable (RESTART_NA).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

RESTART_NA = (
    "mistral.rs keeps its prefix cache in process memory only (Runner(prefix_cache_n): evicted "
    "sequences are dropped and re-prefilled); its API cannot save K/V for a new process"
)
# Renders the messages' text as it is: no roles, no special tokens.
RAW_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
MAX_SEQS = 8


class MistralrsPeer:
    name = "mistralrs"
    takes_token_ids = False
    na: dict[str, str] = {"conversation_restart": RESTART_NA}  # noqa: RUF012

    def __init__(self, model_dir: str | Path, threads: int) -> None:
        # Read once, when mistral.rs's rayon pool starts (its first Runner in this process).
        os.environ["RAYON_NUM_THREADS"] = str(threads)
        config = json.loads((Path(model_dir) / "config.json").read_text())
        torch_dtype = str(config.get("torch_dtype", "float32"))
        if torch_dtype == "float32":
            os.environ["MISTRALRS_CPU_KV_F32"] = "1"
        import mistralrs
        from tokenizers import Tokenizer

        self.m = mistralrs
        self.version = _version()
        self.threads = threads
        self.tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        dtype = {
            "float32": mistralrs.ModelDType.F32,
            "bfloat16": mistralrs.ModelDType.BF16,
            "float16": mistralrs.ModelDType.F16,
        }.get(torch_dtype, mistralrs.ModelDType.Auto)
        self._tmp = tempfile.TemporaryDirectory(prefix="strata-mistralrs-")
        template = Path(self._tmp.name) / "raw.jinja"
        template.write_text(RAW_TEMPLATE)

        def runner(prefix_cache_n: int) -> Any:
            return mistralrs.Runner(
                which=mistralrs.Which.Plain(model_id=str(model_dir), dtype=dtype),
                token_source="none",
                max_seqs=MAX_SEQS,
                prefix_cache_n=prefix_cache_n,
                jinja_explicit=str(template),
            )

        # Its loader logs ~20 lines at info on stdout (where the table goes; no setting turns
        # them off): they are kept aside, and shown on stderr only if loading fails.
        with _output_aside() as log:
            try:
                self.cold = runner(0)  # prefill, decode, streams, cold TTFT
                self.cached = runner(16)  # the returning conversation
            except Exception:
                log.show()
                raise
        self.last_cached_tokens: int | None = None  # prompt tokens the last turn reused

    # -- prompts ----------------------------------------------------------------------------

    def text(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def count(self, text: str) -> int:
        return len(self.cold.tokenize_text(text, False, None))

    def _request(
        self, text: str, max_tokens: int, *, stream: bool = True, logprobs: bool = False
    ) -> Any:
        return self.m.ChatCompletionRequest(
            messages=[{"role": "user", "content": text}],
            model="default",
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=True,
            stream=stream,
            logprobs=logprobs,
            top_logprobs=1 if logprobs else None,
        )

    def _stream(self, runner: Any, text: str, max_tokens: int) -> tuple[list[float], Any]:
        """(seconds from submit to each chunk with text, the usage of the last chunk)."""
        t0 = time.perf_counter()
        times: list[float] = []
        usage = None
        for chunk in runner.send_chat_completion_request(self._request(text, max_tokens)):
            if chunk.choices:
                times.append(time.perf_counter() - t0)
            if chunk.usage is not None:
                usage = chunk.usage
        if not times:
            raise RuntimeError("mistral.rs streamed no chunk")
        return times, usage

    # -- prefill and decode -----------------------------------------------------------------

    def prefill_decode(
        self,
        prefill: Mapping[int, Sequence[int]],
        decode: Mapping[int, Sequence[int]],
        steps: int,
        repeats: int,
    ) -> dict[str, Any]:
        prefill_rate: dict[int, float] = {}
        prompt_tokens: dict[str, dict[int, int]] = {"prefill": {}, "decode": {}}
        for n, ids in prefill.items():
            text = self.text(ids)
            ttfts = []
            for _ in range(max(1, repeats)):
                times, usage = self._stream(self.cold, text, 1)
                ttfts.append(times[0])
            got = int(usage.prompt_tokens) if usage is not None else self.count(text)
            prompt_tokens["prefill"][n] = got
            prefill_rate[n] = got / statistics.median(ttfts)
        decode_rate: dict[int, float] = {}
        for ctx, ids in decode.items():
            text = self.text(ids)
            times, usage = self._stream(self.cold, text, steps + 1)
            prompt_tokens["decode"][ctx] = int(usage.prompt_tokens) if usage else self.count(text)
            # Chunks are not always one token each (an incomplete UTF-8 piece waits for the
            # next token), so: the tokens after the first over the time from the first chunk
            # to the last.
            answer = int(usage.completion_tokens) if usage is not None else steps + 1
            decode_rate[ctx] = (answer - 1) / (times[-1] - times[0])
        return {
            "prefill_tok_s": prefill_rate,
            "decode_tok_s": decode_rate,
            "prompt_tokens": prompt_tokens,
        }

    def warmup(self, ids: Sequence[int]) -> None:
        self._stream(self.cold, self.text(ids), 2)
        self._stream(self.cached, self.text(ids[: len(ids) // 2]), 2)

    # -- aggregate decode -------------------------------------------------------------------

    def streams(self, prompts: Sequence[Sequence[int]], gen: int) -> float:
        if len(prompts) > MAX_SEQS:
            raise ValueError(f"prompts: at most {MAX_SEQS} streams (Runner max_seqs)")
        # A Runner takes one call at a time (a second thread gets "Already borrowed"), but a
        # streamed request returns its iterator at once: submit all, then read them in turn.
        streams = [
            self.cold.send_chat_completion_request(self._request(self.text(p), gen))
            for p in prompts
        ]
        first: list[float | None] = [None] * len(streams)
        last: list[float] = [0.0] * len(streams)
        live = list(range(len(streams)))
        while live:
            for i in list(live):
                chunk = next(streams[i], None)
                now = time.perf_counter()
                if chunk is None:
                    last[i] = now
                    live.remove(i)
                elif chunk.choices and first[i] is None:
                    first[i] = now
        if any(t is None for t in first):
            raise RuntimeError("a stream ended without a token")
        return len(streams) * (gen - 1) / (max(last) - max(t for t in first if t is not None))

    # -- greedy tokens ----------------------------------------------------------------------

    def greedy_text(self, text: str, n: int) -> list[int]:
        """Greedy ids for a text prompt, read from the logprobs' top token of each position."""
        res = self.cold.send_chat_completion_request(
            self._request(text, n, stream=False, logprobs=True)
        )
        content = res.choices[0].logprobs.content if res.choices[0].logprobs else []
        return [int(lp.top_logprobs[0].token) for lp in content]

    def greedy(self, ids: Sequence[int], n: int) -> list[int]:
        return self.greedy_text(self.text(ids), n)

    # -- returning conversation -------------------------------------------------------------

    def cold_ttft(self, prompt: Sequence[int]) -> float:
        times, _ = self._stream(self.cold, self.text(prompt), 1)
        return times[0]

    def turn(self, conv: Any, prompt: Sequence[int], gen: int) -> float:
        times, usage = self._stream(self.cached, self.text(prompt), gen)
        details = getattr(usage, "prompt_tokens_details", None) if usage is not None else None
        self.last_cached_tokens = getattr(details, "cached_tokens", None)
        return times[0]

    def restart(self, warmup: Sequence[int]) -> None:
        raise NotImplementedError(RESTART_NA)

    def close(self) -> None:
        del self.cold, self.cached
        self._tmp.cleanup()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mistralrs")
    except PackageNotFoundError:
        return "unknown"


class _Aside:
    def __init__(self, file: Any) -> None:
        self.file = file
        self.shown = False

    def show(self) -> None:
        self.shown = True


@contextlib.contextmanager
def _output_aside() -> Iterator[_Aside]:
    """Points file descriptors 1 and 2 at a temporary file for the block; what was written there
    is copied to stderr afterwards if the block called show()."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile() as f:
        aside = _Aside(f)
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            yield aside
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, copy in zip((1, 2), saved, strict=True):
                os.dup2(copy, fd)
                os.close(copy)
            if aside.shown:
                f.seek(0)
                sys.stderr.write(f.read().decode(errors="replace"))
                sys.stderr.flush()
