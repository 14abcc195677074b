"""Peer engines measured with the same definitions as strata-rs's own bench.

* prefill: a cold prompt of N random non-special token ids, fed in batches
  of 512; tok/s = N / wall time, median over `repeats`.
* decode: prefill a context of C tokens (untimed), then `decode_steps`
  single-token steps, each feeding back the previous step's argmax (the
  argmax itself is not timed); tok/s = 1 / median per-step time, pooled
  over `repeats` runs.

llama-cpp-python is an optional extra: `pip install llama-cpp-python gguf`.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

INSTALL_HINT = "pip install llama-cpp-python gguf"
BATCH = 512
SEED = 0


def llama_cpp_available() -> str | None:
    """None if llama_cpp imports, else the command that installs it."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return INSTALL_HINT
    return None


def _normal_token_ids(gguf_path: Path, n_vocab: int) -> np.ndarray:
    """Ids of ordinary tokens: special, unused and padding entries excluded.

    Read from the file's token types because llama-cpp-python's high-level
    API does not expose them.
    """
    from gguf import GGUFReader, TokenType

    reader = GGUFReader(gguf_path)
    field = reader.fields.get("tokenizer.ggml.token_type")
    if field is None:
        return np.arange(n_vocab)
    types = np.asarray(field.contents())
    ids = np.flatnonzero(types == int(TokenType.NORMAL))
    return ids[ids < n_vocab]


def llama_cpp_bench(
    gguf_path: str | Path,
    threads: int,
    prefill_lens: list[int],
    decode_contexts: list[int],
    decode_steps: int,
    repeats: int,
) -> dict[str, Any]:
    """Prefill and decode throughput of llama.cpp (via llama-cpp-python)."""
    import llama_cpp

    gguf_path = Path(gguf_path)
    need = max([*prefill_lens, *(c + decode_steps + 1 for c in decode_contexts), BATCH])
    n_ctx = -(-need // 256) * 256
    llm = llama_cpp.Llama(
        model_path=str(gguf_path),
        n_ctx=n_ctx,
        n_batch=BATCH,
        n_ubatch=BATCH,
        n_threads=threads,
        n_threads_batch=threads,
        logits_all=False,
        verbose=False,
    )
    try:
        rng = np.random.default_rng(SEED)
        n_vocab = llm.n_vocab()
        pool = _normal_token_ids(gguf_path, n_vocab)

        def last_argmax() -> int:
            # With logits_all=False llama-cpp-python keeps no scores copy;
            # read the context's logits of the batch's last token directly.
            ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
            return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(n_vocab,))))

        def prompt(n: int) -> list[int]:
            return rng.choice(pool, size=n).tolist()

        def cold_eval(ids: list[int]) -> float:
            # reset() rewinds n_tokens to 0 and eval() drops every KV cell
            # from there on, so nothing from the previous run is reused.
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(ids)  # splits into n_batch chunks itself
            return time.perf_counter() - t0

        # One untimed run: thread pool start-up and compute-buffer
        # allocation are one-off costs, not prefill speed.
        cold_eval(prompt(min(BATCH, n_ctx)))

        prefill: dict[int, float] = {}
        for n in prefill_lens:
            times = [cold_eval(prompt(n)) for _ in range(repeats)]
            prefill[n] = n / statistics.median(times)

        decode: dict[int, float] = {}
        for ctx in decode_contexts:
            steps: list[float] = []
            for _ in range(repeats):
                cold_eval(prompt(ctx))
                token = last_argmax()
                for _ in range(decode_steps):
                    # Like the engine's bench, only the forward step is
                    # timed; the greedy argmax happens outside.
                    t0 = time.perf_counter()
                    llm.eval([token])
                    steps.append(time.perf_counter() - t0)
                    token = last_argmax()
            decode[ctx] = 1.0 / statistics.median(steps)
    finally:
        llm.close()
    return {"prefill_tok_s": prefill, "decode_tok_s": decode, "version": llama_cpp.__version__}
