"""llama.cpp (through llama-cpp-python) as a benchmark peer, on a GGUF export of the same folder
(`strata_rs.bench.gguf_export`: same weights, same dtype, same tokenizer).

`Llama(n_ctx, n_batch=n_ubatch=512, n_threads=n_threads_batch=threads, logits_all=False)`, its
defaults otherwise (f16 K/V). What each figure times:

* prefill N: `reset()` + `eval(ids)` of the N prompt ids (llama-cpp-python splits them into
  batches of 512), nothing reused from earlier runs; tok/s = N / median time over `repeats`;
* decode at context C: the C ids are evaluated (untimed), then `steps` one-token `eval`s feeding
  back the argmax of the last logits (the argmax is not timed); tok/s = 1 / median step time;
* aggregate decode with S streams: what llama.cpp's server does with S parallel slots: a second
  context on the same model with `n_seq_max` = S and a unified K/V buffer; the S prompts are
  decoded as sequences 0..S-1, then gen - 1 steps each decode one `llama_batch` holding every
  sequence's next token (its argmax, included in the time); S x (gen - 1) tokens over the
  time of those steps;
* returning conversation: the path of llama-cpp-python's server with `--cache`: each turn is
  `create_completion(ids, max_tokens=gen, temperature=0, stream=True)` on a `Llama` with a
  `LlamaRAMCache`; it reuses the live context's common prefix, or restores the longest cached
  prefix's saved state, and evaluates the rest; TTFT = the call -> its first chunk. Cold: the
  same call after `reset()` with the RAM cache detached. After a restart: what llama.cpp's
  server offers for it (slot save / restore): the conversation's sequence state was written with
  `llama_state_seq_save_file` after its previous turn (untimed, as strata-rs writes its disk tier
  at close); a new `Llama` is created and warmed up; TTFT = `llama_state_seq_load_file` + the
  same `create_completion` -> first chunk.
"""

from __future__ import annotations

import ctypes
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

BATCH = 512


# What llama-cpp-python built with its defaults (native CPU flags) needs to leave out where the
# CPU has AMX: every x86 level but that one.
NO_AMX_CMAKE_ARGS = (
    "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON "
    "-DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON "
    "-DGGML_AVX512_BF16=ON"
)


def amx_warning(system_info: str) -> str | None:
    """A warning where llama.cpp's build uses its AMX kernels (`AMX_INT8 = 1` in
    `llama_print_system_info()`): they crash the process on some machines, which ends the
    whole bench with no message of ours (llama.cpp issue 20824; seen on an Intel Xeon with the
    1B Q4_K_M file, on every batch of 8 tokens or more)."""
    if "AMX_INT8 = 1" not in system_info:
        return None
    return (
        "warning: llama.cpp uses AMX here (AMX_INT8 = 1), whose kernels crash with a "
        "segmentation fault on some machines (llama.cpp issue 20824). If the bench dies that "
        f'way, rebuild llama-cpp-python without AMX: CMAKE_ARGS="{NO_AMX_CMAKE_ARGS}" '
        "pip install --force-reinstall --no-cache-dir --no-deps llama-cpp-python"
    )


def new_llama(lib: Any, gguf: Path, n_ctx: int, threads: int) -> Any:
    """A `Llama` as llama-cpp-python's server makes one with `--cache true`: batches of 512,
    `threads` for decode and batch, and a RAM prompt cache."""
    llm = lib.Llama(
        model_path=str(gguf),
        n_ctx=n_ctx,
        n_batch=BATCH,
        n_ubatch=BATCH,
        n_threads=threads,
        n_threads_batch=threads,
        logits_all=False,
        verbose=False,
    )
    llm.set_cache(lib.LlamaRAMCache(capacity_bytes=2 << 30))
    return llm


class LlamaCppPeer:
    name = "llama.cpp"
    takes_token_ids = True
    na: dict[str, str] = {}  # noqa: RUF012

    def __init__(self, gguf_path: str | Path, threads: int, n_ctx: int) -> None:
        import llama_cpp

        self.lib = llama_cpp
        self.gguf = Path(gguf_path)
        self.threads = threads
        self.n_ctx = -(-max(n_ctx, BATCH) // 256) * 256
        self.version = llama_cpp.__version__
        warning = amx_warning(llama_cpp.llama_print_system_info().decode(errors="replace"))
        if warning is not None:
            print(warning, file=sys.stderr, flush=True)
        self.llm = self._new()
        self.n_vocab = self.llm.n_vocab()
        self._tmp = tempfile.TemporaryDirectory(prefix="strata-llama-cpp-")
        self.saved: dict[Any, Path] = {}  # conversation -> its sequence state file
        self._restored: set[Any] = set()

    def _new(self) -> Any:
        return new_llama(self.lib, self.gguf, self.n_ctx, self.threads)

    def _last_argmax(self, ctx: Any = None, i: int = -1) -> int:
        ptr = self.lib.llama_get_logits_ith(ctx if ctx is not None else self.llm.ctx, i)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))))

    def _cold_eval(self, ids: Sequence[int]) -> float:
        # reset() rewinds n_tokens to 0 and eval() drops every K/V cell from there on, so
        # nothing from an earlier run is reused.
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(list(ids))
        return time.perf_counter() - t0

    def warmup(self, ids: Sequence[int]) -> None:
        """Thread pool start-up and compute-buffer allocation are one-off costs."""
        self._cold_eval(list(ids)[:BATCH])

    # -- prefill and decode -----------------------------------------------------------------

    def prefill_decode(
        self,
        prefill: Mapping[int, Sequence[int]],
        decode: Mapping[int, Sequence[int]],
        steps: int,
        repeats: int,
    ) -> dict[str, Any]:
        prefill_rate: dict[int, float] = {}
        for n, ids in prefill.items():
            times = [self._cold_eval(ids) for _ in range(max(1, repeats))]
            prefill_rate[n] = n / statistics.median(times)
        decode_rate: dict[int, float] = {}
        for ctx, ids in decode.items():
            self._cold_eval(ids)
            token = self._last_argmax()
            step_times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                self.llm.eval([token])
                step_times.append(time.perf_counter() - t0)
                token = self._last_argmax()
            decode_rate[ctx] = 1.0 / statistics.median(step_times)
        return {"prefill_tok_s": prefill_rate, "decode_tok_s": decode_rate}

    # -- aggregate decode -------------------------------------------------------------------

    def streams(self, prompts: Sequence[Sequence[int]], gen: int) -> float:
        lib = self.lib
        s = len(prompts)
        longest = max(len(p) for p in prompts)
        params = type(self.llm.context_params).from_buffer_copy(self.llm.context_params)
        params.n_seq_max = s
        params.kv_unified = True
        params.n_ctx = -(-(s * (longest + gen + 1)) // 256) * 256
        ctx = lib.llama_init_from_model(self.llm.model, params)
        if not ctx:
            raise RuntimeError(f"llama_init_from_model failed for {s} sequences")
        batch = lib.llama_batch_init(max(BATCH, s), 0, 1)
        try:

            def decode(items: list[tuple[int, int, int, bool]]) -> None:
                # items: (token, position, sequence, wants logits)
                for j, (tok, pos, seq, logits) in enumerate(items):
                    batch.token[j] = tok
                    batch.pos[j] = pos
                    batch.n_seq_id[j] = 1
                    batch.seq_id[j][0] = seq
                    batch.logits[j] = 1 if logits else 0
                batch.n_tokens = len(items)
                rc = lib.llama_decode(ctx, batch)
                if rc != 0:
                    raise RuntimeError(f"llama_decode returned {rc}")

            tokens = []
            for seq, p in enumerate(prompts):
                for start in range(0, len(p), BATCH):
                    chunk = p[start : start + BATCH]
                    decode(
                        [
                            (int(t), start + k, seq, start + k == len(p) - 1)
                            for k, t in enumerate(chunk)
                        ]
                    )
                tokens.append(self._last_argmax(ctx, -1))
            pos = [len(p) for p in prompts]
            t0 = time.perf_counter()
            for _ in range(gen - 1):
                decode([(tokens[q], pos[q], q, True) for q in range(s)])
                tokens = [self._last_argmax(ctx, q) for q in range(s)]
                pos = [x + 1 for x in pos]
            return s * (gen - 1) / (time.perf_counter() - t0)
        finally:
            lib.llama_batch_free(batch)
            lib.llama_free(ctx)

    # -- greedy tokens ----------------------------------------------------------------------

    def greedy(self, ids: Sequence[int], n: int) -> list[int]:
        self._cold_eval(ids)
        out = [self._last_argmax()]
        while len(out) < n:
            self.llm.eval([out[-1]])
            out.append(self._last_argmax())
        return out

    # -- returning conversation -------------------------------------------------------------

    def _completion_ttft(self, prompt: Sequence[int], gen: int) -> float:
        t0 = time.perf_counter()
        it = self.llm.create_completion(list(prompt), max_tokens=gen, temperature=0.0, stream=True)
        next(it)
        ttft = time.perf_counter() - t0
        for _ in it:  # the rest of the answer, and the state saved into the RAM cache
            pass
        return ttft

    def cold_ttft(self, prompt: Sequence[int]) -> float:
        cache = self.llm.cache
        self.llm.set_cache(None)
        self.llm.reset()
        try:
            return self._completion_ttft(prompt, 1)
        finally:
            self.llm.set_cache(cache)

    def turn(self, conv: Any, prompt: Sequence[int], gen: int) -> float:
        t0 = time.perf_counter()
        self.last_cached_tokens: int | None = None  # known only when restored from a file
        if conv in self.saved and conv not in self._restored:
            self.last_cached_tokens = self._load(conv)
            self._restored.add(conv)
        load = time.perf_counter() - t0
        return load + self._completion_ttft(prompt, gen)

    def save(self, conv: Any) -> None:
        """Writes the live context's sequence (the conversation just served) to a file."""
        n = self.llm.n_tokens
        tokens = (self.lib.llama_token * n)(*self.llm.input_ids[:n].tolist())
        path = Path(self._tmp.name) / f"conversation-{len(self.saved)}.bin"
        written = self.lib.llama_state_seq_save_file(self.llm.ctx, str(path).encode(), 0, tokens, n)
        if written == 0:
            raise RuntimeError(f"llama_state_seq_save_file wrote nothing to {path}")
        self.saved[conv] = path
        self._restored.discard(conv)

    def _load(self, conv: Any) -> int:
        lib, llm = self.lib, self.llm
        path = self.saved[conv]
        capacity = llm.n_ctx()
        tokens = (lib.llama_token * capacity)()
        count = ctypes.c_size_t(0)
        llm.reset()
        lib.llama_memory_clear(lib.llama_get_memory(llm.ctx), True)
        if (
            lib.llama_state_seq_load_file(
                llm.ctx, str(path).encode(), 0, tokens, capacity, ctypes.byref(count)
            )
            == 0
        ):
            raise RuntimeError(f"llama_state_seq_load_file could not read {path}")
        n = count.value
        llm.input_ids[:n] = np.asarray(tokens[:n], dtype=np.intc)
        llm.n_tokens = n
        return n

    def restart(self, warmup: Sequence[int]) -> None:
        """A new process: the RAM cache and the live context are gone; the state files stay."""
        self.llm.close()
        self.llm = self._new()
        self._restored.clear()
        self._completion_ttft(warmup, 1)

    def close(self) -> None:
        self.llm.close()
        self._tmp.cleanup()
