"""Router keys of a worker that hashes each block with the tokens after it (speculative decoding).

With EAGLE, vLLM's lookahead hashes (``num_hash_lookahead_tokens`` L) cover each block and the L
tokens that follow it, and SGLang's bigram pages cover each page and the one token after it: a
block is reused only when the next L tokens agree too. Such a worker's blocks are keyed in their
own namespace, ``lookahead_seed(seed, L)``, with
``key[i] = xxh3_64(tokens of block i + the L tokens after it, seed=key[i-1])``, so two prompts that
part right after a block hold two keys for it (two engine blocks), and a prompt's block counts only
when the tokens after it match. A prompt's block is keyed only when L tokens follow it (the engine
hashes it only then). Workers without lookahead never see these keys, and the common path keys
nothing extra (``overlaps`` merges only while some target hashes with lookahead).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeVar

import numpy as np
import xxhash

from mesh.core.keys import token_bytes

_xxh3 = xxhash.xxh3_64_intdigest
T = TypeVar("T")


def lookahead_seed(seed: int, lookahead: int) -> int:
    """The namespace seed of keys that cover ``lookahead`` tokens past each block."""
    return _xxh3(f"mesh-lookahead\0{lookahead}".encode(), seed)


def prompt_keys(tokens: Sequence[int] | np.ndarray, block_size: int, seed: int, lookahead: int) -> list[int]:
    """Lookahead keys of a prompt's blocks that have ``lookahead`` tokens after them (``seed``: the
    plain namespace seed). Raises ValueError on a bad token id."""
    if block_size <= 0 or lookahead <= 0:
        raise ValueError(f"block_size and lookahead must be positive, got {block_size}, {lookahead}")
    data = token_bytes(tokens)
    step, ahead = block_size * 4, lookahead * 4
    key = lookahead_seed(seed, lookahead)
    h = _xxh3
    return [key := h(data[off : off + step + ahead], key) for off in range(0, len(data) - step - ahead + 1, step)]


def event_keys(token_ids: Sequence[int], ahead: Sequence[Sequence[int]], block_size: int, parent: int) -> list[int]:
    """Lookahead keys of an event's blocks: block i's tokens and ``ahead[i]`` (the tokens the engine
    hashed after it), chained from ``parent`` (the parent block's lookahead key, or
    ``lookahead_seed`` at a prompt's start). Raises ValueError on a bad token id or a count that
    does not match."""
    n = len(ahead)
    if len(token_ids) != n * block_size:
        raise ValueError(f"{len(token_ids)} tokens for {n} blocks of {block_size}")
    key, out, h = parent, [], _xxh3
    for i, after in enumerate(ahead):
        start = i * block_size
        key = h(token_bytes([*token_ids[start : start + block_size], *after]), key)
        out.append(key)
    return out


def merge_overlaps(plain: Mapping[str, T], ahead: Mapping[int, Mapping[str, T]],
                   lookaheads: Mapping[str, int]) -> dict[str, T]:
    """One overlap per target: a lookahead target's from the match of its L's keys (``ahead[L]``),
    every other target's from the plain match."""
    out = {t: o for t, o in plain.items() if t not in lookaheads}
    for target, la in lookaheads.items():
        got = ahead.get(la, {}).get(target)
        if got is not None:
            out[target] = got
    return out
