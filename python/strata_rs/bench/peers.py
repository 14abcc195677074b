"""The peers of `strata-rs bench --compare`: which exist, whether each is installed, and the
prompts every engine gets.

A peer is optional: when its Python package does not import, it is skipped with a line that
says how to install it (`pip install 'strata-rs[bench-all]'` installs all of them). Each peer lives
in its own module (`peer_llama_cpp`, `peer_transformers`, `peer_mistralrs`) whose docstring
says what each figure times through that engine's API.

Same prompts for all: the prefill and decode prompts are the token ids strata-rs's own
benchmark (`Engine.benchmark`, rust/bench.rs) generates, computed here by the same xorshift, so
every engine that takes token ids reads the same ids; the streams' and the conversations'
prompts are drawn here (`canonical_ids`: ids that survive a text round trip) and given to every
engine, as ids or, to an engine that takes text only (mistral.rs), as their text. That engine
gets prefill and decode prompts of the same lengths drawn the same way (rust/bench.rs's ids do
not survive a round trip).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Protocol

import numpy as np

PEERS = ("llama.cpp", "transformers", "mistralrs")
INSTALL = {
    "llama.cpp": "pip install 'strata-rs[bench-llama-cpp]'",
    "transformers": "pip install 'strata-rs[bench-transformers]'",
    "mistralrs": "pip install 'strata-rs[bench-mistralrs]'",
}
# What each peer imports (all must import for the peer to run).
MODULES = {
    "llama.cpp": ("llama_cpp", "gguf"),
    "transformers": ("torch", "transformers"),
    "mistralrs": ("mistralrs",),
}

Importer = Callable[[str], ModuleType]


def parse_peers(text: str) -> list[str]:
    """`llama.cpp,transformers` -> ["llama.cpp", "transformers"]; `all` -> every peer.
    Raises ValueError naming the unknown peer and the known ones."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise ValueError(f"expected a comma-separated list of peers ({', '.join(PEERS)}), got ''")
    out: list[str] = []
    for name in names:
        if name == "all":
            out += [p for p in PEERS if p not in out]
            continue
        if name not in PEERS:
            raise ValueError(f"unknown peer {name!r}; choose from {', '.join(PEERS)} (or all)")
        if name not in out:
            out.append(name)
    return out


def missing(name: str, importer: Importer = importlib.import_module) -> str | None:
    """None when the peer's packages import; else why not (the import error's message)."""
    for module in MODULES[name]:
        try:
            importer(module)
        except ImportError as e:
            return str(e) or f"cannot import {module}"
        except OSError as e:  # a wheel whose shared library does not load
            return f"importing {module} failed: {e}"
    return None


def skip_line(name: str, reason: str) -> str:
    """The line printed for a peer that is not installed."""
    return f"skipping {name}: not installed ({reason}); install it with: {INSTALL[name]}"


# -- prompts -----------------------------------------------------------------------------------

_MASK = (1 << 64) - 1
PREFILL_SEED = 0x5EED
DECODE_SEED = 0xDEC0DE


def bench_token_ids(n: int, vocab: int, seed: int) -> list[int]:
    """The ids rust/bench.rs's `token_ids(n, vocab, seed)` generates (xorshift64, wrapping)."""
    s = seed & _MASK
    out = []
    for _ in range(n):
        s ^= (s << 13) & _MASK
        s ^= s >> 7
        s ^= (s << 17) & _MASK
        out.append(s % vocab)
    return out


def prefill_ids(n: int, vocab: int) -> list[int]:
    """The prompt of strata-rs's prefill benchmark for n tokens."""
    return bench_token_ids(n, vocab, PREFILL_SEED + n)


def decode_ids(ctx: int, vocab: int) -> list[int]:
    """The context strata-rs's decode benchmark prefills before timing steps at `ctx`."""
    return bench_token_ids(ctx, vocab, DECODE_SEED + ctx)


def ordinary_ids(n: int, vocab: int, rng: np.random.Generator) -> list[int]:
    """n random ids above the lowest 300 (where vocabularies keep their special tokens)."""
    return [int(t) for t in rng.integers(min(300, vocab // 2), vocab, size=n)]


class TextTokenizer(Protocol):
    """What canonical_ids needs of a tokenizer (strata_rs.Tokenizer has it)."""

    @property
    def vocab_size(self) -> int: ...
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


def canonical_ids(tokenizer: TextTokenizer, n: int, rng: np.random.Generator) -> list[int]:
    """n random ordinary ids that survive a text round trip: encode(decode(ids)) == ids.

    For engines whose API takes text (mistral.rs): random ids do not survive it (ids above the
    tokenizer's vocabulary, which models pad their embedding to, decode to nothing; adjacent
    pieces merge), so such an engine would read a shorter, different prompt. These ids are the
    tokenizer's own encoding of a random text, cut to n where the cut is stable."""

    def round_trip(ids: Sequence[int]) -> list[int]:
        return tokenizer.encode(tokenizer.decode(ids, skip_special_tokens=False), False)

    for _ in range(64):
        ids = round_trip(ordinary_ids(n + n // 2 + 8, tokenizer.vocab_size, rng))
        while len(ids) < n:
            ids = round_trip(ids + ordinary_ids(n, tokenizer.vocab_size, rng))
        if round_trip(ids[:n]) == ids[:n]:
            return ids[:n]
    raise RuntimeError(f"no {n}-token prompt survives this tokenizer's decode -> encode")


def stream_prompts(
    streams: int, length: int, tokenizer: TextTokenizer, seed: int
) -> list[list[int]]:
    """One prompt per stream (ids that survive a text round trip, so that every engine reads the
    same ones)."""
    return [
        canonical_ids(tokenizer, length, np.random.default_rng(seed * 100 + i))
        for i in range(streams)
    ]


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two token lists differ (a length difference counts); None if
    they are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
