"""transformers on PyTorch (CPU) as a benchmark peer, on the same Hugging Face folder.

`AutoModelForCausalLM.from_pretrained(folder, dtype=<the folder's torch_dtype>)`, eval mode,
`torch.inference_mode()`, `torch.set_num_threads(threads)` with strata-rs's thread count, greedy
(argmax of the last position's logits). What each figure times:

* prefill N: one forward over the N prompt ids with `use_cache=True` and `logits_to_keep=1`
  (the K/V is written, only the last position's logits are computed, as in strata-rs and
  llama.cpp); no chunking: one forward over the whole prompt is what `generate` does;
* decode at context C: the C ids are prefilled (untimed), then `steps` forwards of one token each
  with the `DynamicCache` (`past_key_values`) feeding back the argmax; only the forward is timed;
  tok/s = 1 / median step time;
* aggregate decode with S streams: S equal-length prompts as one [S, L] batch (no padding
  needed), prefilled together; then gen - 1 batched one-token steps; S x (gen - 1) tokens over
  the time of those steps (argmax included), the window strata-rs's figure uses too (from the
  moment every stream has its first token to the last token);
* returning conversation: each conversation's `DynamicCache` stays in RAM between turns; a
  returning turn feeds only the tokens the cache does not hold; TTFT = that forward + argmax.
  Cold: a forward over the whole prompt with an empty cache. After a restart: not measurable
  (see RESTART_NA).
"""

from __future__ import annotations

import inspect
import json
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from strata_rs.bench.peers import first_difference

RESTART_NA = (
    "transformers keeps past_key_values (DynamicCache) only in process memory and has no API "
    "to save it and load it in a new process"
)

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


class TransformersPeer:
    name = "transformers"
    takes_token_ids = True
    na: dict[str, str] = {"conversation_restart": RESTART_NA}  # noqa: RUF012

    def __init__(self, model_dir: str | Path, threads: int) -> None:
        import torch
        import transformers

        self.torch = torch
        torch.set_num_threads(threads)
        # No progress bars or advice on stderr: the bench's progress lines are there.
        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
        self.threads = threads
        self.version = f"{transformers.__version__} (torch {torch.__version__})"
        config = json.loads((Path(model_dir) / "config.json").read_text())
        dtype = getattr(torch, _DTYPES.get(str(config.get("torch_dtype")), "float32"))
        major = int(transformers.__version__.split(".")[0])
        # transformers 5 renamed from_pretrained's torch_dtype to dtype.
        kwargs: dict[str, Any] = {"dtype": dtype} if major >= 5 else {"torch_dtype": dtype}
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(model_dir), attn_implementation="sdpa", **kwargs
        )
        self.model.eval()
        # transformers 5.2x renamed forward's past_key_values (and the output's field) to cache.
        params = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self.dtype = str(dtype).removeprefix("torch.")
        # conversation id -> (the ids the cache holds, the cache)
        self.conversations: dict[Any, tuple[list[int], Any]] = {}
        self.last_cached_tokens: int | None = None  # prompt tokens the last turn reused

    # -- one forward ------------------------------------------------------------------------

    def _forward(self, ids: Sequence[Sequence[int]], cache: Any = None) -> tuple[Any, Any]:
        """(argmax of each row's last logits as a [rows] tensor, the cache)."""
        torch = self.torch
        with torch.inference_mode():
            out = self.model(
                input_ids=torch.tensor(ids, dtype=torch.long),
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_arg: cache},
            )
            return out.logits[:, -1, :].argmax(dim=-1), getattr(out, self._cache_arg)

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
            times = []
            for _ in range(max(1, repeats)):
                t0 = time.perf_counter()
                self._forward([list(ids)])
                times.append(time.perf_counter() - t0)
            prefill_rate[n] = n / statistics.median(times)
        decode_rate: dict[int, float] = {}
        for ctx, ids in decode.items():
            token, cache = self._forward([list(ids)])
            step_times = []
            for _ in range(steps):
                nxt = [[int(token[0])]]
                t0 = time.perf_counter()
                token, cache = self._forward(nxt, cache)
                step_times.append(time.perf_counter() - t0)
            decode_rate[ctx] = 1.0 / statistics.median(step_times)
        return {"prefill_tok_s": prefill_rate, "decode_tok_s": decode_rate}

    def warmup(self, ids: Sequence[int]) -> None:
        """One untimed forward: oneDNN primitive creation and allocator growth are one-off."""
        self._forward([list(ids)])

    # -- aggregate decode -------------------------------------------------------------------

    def streams(self, prompts: Sequence[Sequence[int]], gen: int) -> float:
        if len({len(p) for p in prompts}) != 1:
            raise ValueError("prompts: the streams' prompts must have equal lengths (no padding)")
        token, cache = self._forward([list(p) for p in prompts])
        t0 = time.perf_counter()
        for _ in range(gen - 1):
            token, cache = self._forward(token.unsqueeze(1).tolist(), cache)
        return len(prompts) * (gen - 1) / (time.perf_counter() - t0)

    # -- greedy tokens ----------------------------------------------------------------------

    def greedy(self, ids: Sequence[int], n: int) -> list[int]:
        token, cache = self._forward([list(ids)])
        out = [int(token[0])]
        while len(out) < n:
            token, cache = self._forward([[out[-1]]], cache)
            out.append(int(token[0]))
        return out

    # -- returning conversation -------------------------------------------------------------

    def cold_ttft(self, prompt: Sequence[int]) -> float:
        t0 = time.perf_counter()
        token, _ = self._forward([list(prompt)])
        int(token[0])
        return time.perf_counter() - t0

    def turn(self, conv: Any, prompt: Sequence[int], gen: int) -> float:
        """Sends a conversation's next prompt and answers it with gen greedy tokens, reusing the
        conversation's cache for the longest prefix it shares with the prompt; returns TTFT."""
        held, cache = self.conversations.get(conv, ([], None))
        # Reuse the longest prefix the cache shares with the prompt (the prompt may leave the
        # cached path: another engine's answer, an edited turn), at least one token left to feed.
        shared = first_difference(held, prompt)
        keep = min(len(held) if shared is None else shared, len(prompt) - 1)
        if keep < len(held):
            if keep == 0:
                cache = None
            else:
                cache.crop(keep - len(held))  # negative: drop that many (4.x and 5.x agree)
            held = held[:keep]
        self.last_cached_tokens = len(held)
        t0 = time.perf_counter()
        token, cache = self._forward([list(prompt[len(held) :])], cache)
        answer = [int(token[0])]
        ttft = time.perf_counter() - t0
        while len(answer) < gen:
            token, cache = self._forward([[answer[-1]]], cache)
            answer.append(int(token[0]))
        # The cache holds the prompt and every answer token but the last (never fed back).
        self.conversations[conv] = ([*prompt, *answer[:-1]], cache)
        return ttft

    def restart(self, warmup: Sequence[int]) -> None:
        raise NotImplementedError(RESTART_NA)

    def close(self) -> None:
        self.conversations.clear()
        del self.model
