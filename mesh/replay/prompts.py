"""Deterministic prompts from a trace's chained block keys, and the trace's ideal hit rate.

A trace names prompts by block ids, not text. ``PromptBuilder`` spells every trace block (one
chained key of ``simulator.traces``: a key names its whole prefix) as ``block_tokens /
prompt_scale`` *units*, each derived from the key alone, so two requests whose leading blocks
are equal get byte-identical prompt prefixes, and they diverge exactly at the first block whose
key differs. The trailing partial block (prompt tokens past the last full block) becomes units
derived from the request's own trace position: unique to the request, as a partial block is
never shared.

Units:

- ``text``: one lowercase ASCII letter per unit. The bundled worker's presets all use the
  byte-level tokenizer (``workers/config.py``: ``tokenizer="byte"``; ``mesh.request.tokenizer.
  ByteTokenizer``: token ids are the UTF-8 bytes, no BOS), so one unit is exactly one token and a
  shared text prefix is the same shared token prefix, for text-matching routers (sglang-router's
  ``cache_aware``) and token-matching ones (Mesh, the engines' caches) alike. With a subword
  tokenizer (a real vLLM model) the letters merge into tokens: prefix sharing then holds up to
  the token that straddles the divergence.
- ``tokens``: one token id per unit, below ``token_vocab`` (default 256: valid in every model's
  vocabulary and never the byte tokenizer's BOS/EOS), sent as ``prompt: [ids]``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from simulator.traces import Trace, TraceRequest

FORMATS = ("text", "tokens")
_LETTERS = 26
_A = ord("a")
_GOLDEN = 0x9E3779B97F4A7C15
_TAIL_SALT = 0x5851F42D4C957F2D


def _splitmix(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = x + np.uint64(_GOLDEN)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        out: np.ndarray = x ^ (x >> np.uint64(31))
        return out


class PromptBuilder:
    """Prompts of a loaded trace at ``prompt_scale`` trace tokens per prompt unit."""

    def __init__(self, trace: Trace, *, prompt_scale: float = 16.0, fmt: str = "text",
                 token_vocab: int = 256) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"prompt format must be one of {', '.join(FORMATS)}, got {fmt!r}")
        if not prompt_scale > 0:
            raise ValueError(f"prompt scale must be > 0, got {prompt_scale}")
        if fmt == "tokens" and token_vocab < 2:
            raise ValueError(f"token vocabulary must be >= 2, got {token_vocab}")
        self.block = trace.block_size
        self.prompt_scale = float(prompt_scale)
        self.fmt = fmt
        self.alphabet = _LETTERS if fmt == "text" else int(token_vocab)
        exact = self.block / self.prompt_scale
        self.units_per_block = max(1, round(exact))
        self.warnings: list[str] = []
        if abs(exact - self.units_per_block) > 1e-9:
            self.warnings.append(
                f"{self.block}-token trace blocks at prompt scale {prompt_scale:g} are {exact:g} units: "
                f"rounded to {self.units_per_block} per block")
        # one salt per unit position inside a block (the units of a block differ from each other)
        self._salts = _splitmix(np.arange(1, self.units_per_block + 1, dtype=np.uint64))

    def units(self, r: TraceRequest) -> int:
        """The prompt's length in units (tokens at the byte level): its full blocks' units plus
        the scaled partial tail, at least 1."""
        full = int(r.keys.size) * self.units_per_block
        tail_tokens = max(0, r.prompt_tokens - int(r.keys.size) * self.block)
        tail = round(tail_tokens * self.units_per_block / self.block)
        return max(1, full + tail)

    def codes(self, r: TraceRequest) -> np.ndarray:
        """The prompt as unit codes in ``[0, alphabet)`` (int64)."""
        n = self.units(r)
        keys = np.asarray(r.keys, dtype=np.uint64)
        with np.errstate(over="ignore"):
            mixed = _splitmix(keys[:, None] ^ self._salts[None, :]).ravel()
        tail = n - mixed.size
        if tail > 0:
            seed = np.uint64(xxhash.xxh3_64_intdigest(r.source.encode()) ^ _TAIL_SALT)
            with np.errstate(over="ignore"):
                extra = _splitmix(np.arange(tail, dtype=np.uint64) * np.uint64(_GOLDEN) + seed)
            mixed = np.concatenate([mixed, extra])
        return (mixed[:n] % np.uint64(self.alphabet)).astype(np.int64)

    def prompt(self, r: TraceRequest) -> str | list[int]:
        """``text``: lowercase ASCII letters; ``tokens``: a list of token ids."""
        codes = self.codes(r)
        if self.fmt == "text":
            return (codes + _A).astype(np.uint8).tobytes().decode("ascii")
        ids: list[int] = codes.tolist()
        return ids


@dataclass(frozen=True, slots=True)
class IdealHitRate:
    """Prompt units an ideal cache would reuse, over all prompt units (token-weighted), at the
    replay's token scale and the engine's block size: ``session`` reuses every prefix seen before
    in the same session group, ``global`` every prefix seen before at all."""

    session: float
    global_: float
    prompt_units: int


def _match_blocks(keys: np.ndarray, seen: set[int]) -> int:
    """Leading blocks of ``keys`` already in ``seen``. Keys are chained (a key names its whole
    prefix), so the matched blocks are a prefix: binary search for its end."""
    lo, hi = 0, int(keys.size)
    while lo < hi:
        mid = (lo + hi) // 2
        if int(keys[mid]) in seen:
            lo = mid + 1
        else:
            hi = mid
    return lo


def ideal_hit_rate(requests: Sequence[TraceRequest], groups: Iterable[int], builder: PromptBuilder,
                   engine_block: int = 16) -> IdealHitRate:
    """The ideal reuse of ``requests`` (in trace order; ``groups``: each one's session group).

    A request's cacheable units are its leading units equal to an earlier request's, in whole
    engine blocks, and never the whole prompt (an engine computes at least its last token, as
    vLLM caps ``cached_tokens`` at ``prompt - 1``)."""
    if engine_block < 1:
        raise ValueError(f"engine block size must be >= 1, got {engine_block}")
    u = builder.units_per_block
    seen_by_group: dict[int, set[int]] = {}
    seen_all: set[int] = set()
    total = hit_s = hit_g = 0
    for r, g in zip(requests, groups, strict=True):
        n = builder.units(r)
        total += n
        seen = seen_by_group.setdefault(g, set())
        for matched, acc in ((_match_blocks(r.keys, seen), "s"), (_match_blocks(r.keys, seen_all), "g")):
            units = min(matched * u, n - 1)
            cached = units // engine_block * engine_block
            if acc == "s":
                hit_s += cached
            else:
                hit_g += cached
        keys = r.keys.tolist()
        seen.update(keys)
        seen_all.update(keys)
    return IdealHitRate(hit_s / total if total else 0.0, hit_g / total if total else 0.0, total)
