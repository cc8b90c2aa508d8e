"""Block keys: the router's own chained 64-bit hash of token ids.

A key names a whole prefix: ``key[i] = xxh3_64(tokens of block i as uint32 LE, seed=key[i-1])``
with ``key[-1] = namespace seed`` (model, LoRA adapter, cache salt). Only *full* blocks get keys;
a trailing partial block is never cached by an engine, so it is never routed on.

The gateway, the simulator and the bundled engine all use this one function, so the engine's own
block hashes equal the router's keys (a convenience: the router never depends on it).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import numpy as np
import xxhash

_xxh3 = xxhash.xxh3_64_intdigest
MAX_TOKEN_ID = 2**32 - 1
_ARRAY_IS_U32 = array("I").itemsize == 4


def namespace_seed(model: str, lora: str | None = None, cache_salt: str | None = None) -> int:
    """The seed of every key chain of one (model, LoRA, salt) namespace."""
    return _xxh3(f"mesh-v1\0{model}\0{lora or ''}\0{cache_salt or ''}".encode())


def block_keys(
    tokens: Sequence[int] | np.ndarray,
    block_size: int,
    seed: int,
    *,
    start_block: int = 0,
    parent: int | None = None,
) -> list[int]:
    """Chained keys of the full blocks of ``tokens`` from block ``start_block`` on.

    ``parent`` is the key of block ``start_block - 1`` (the seed when ``start_block == 0``);
    pass both to extend a chain computed earlier without rehashing its blocks.
    Raises ValueError on a token id outside [0, 2**32).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    data = token_bytes(tokens)
    step = block_size * 4
    key = seed if parent is None else parent
    h = _xxh3
    # a comprehension chaining through ``key``: no per-block append or index store
    return [key := h(data[off : off + step], key) for off in range(start_block * step, len(data) // step * step, step)]


def token_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian uint32 bytes (the hashed form). ValueError outside [0, 2**32)."""
    if isinstance(tokens, np.ndarray) or not _ARRAY_IS_U32:
        arr = np.asarray(tokens)
        # an unsigned dtype of at most 32 bits holds only valid ids (the byte tokenizer's uint8)
        narrow = arr.dtype.kind == "u" and arr.dtype.itemsize <= 4
        if arr.size and not narrow and (arr.min() < 0 or arr.max() > MAX_TOKEN_ID):
            raise ValueError("token ids must lie in [0, 2**32)")
        return arr.astype("<u4", copy=False).tobytes()
    try:
        packed = array("I", tokens)  # from a list, array() is several times faster than numpy
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from exc
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


class KeyChain:
    """Tokens and keys of one growing prompt (a session's turns), extended incrementally.

    ``extend_to(tokens)`` reuses the keys of every full block that the new token list shares
    with the previous one, so turn N of a session hashes only what turn N added.
    """

    __slots__ = ("block_size", "seed", "tokens", "keys")

    def __init__(self, block_size: int, seed: int) -> None:
        self.block_size = block_size
        self.seed = seed
        self.tokens: np.ndarray = np.zeros(0, dtype=np.int64)
        self.keys: list[int] = []

    def extend_to(self, tokens: Sequence[int] | np.ndarray) -> list[int]:
        new = np.asarray(tokens, dtype=np.int64)
        common = _common_prefix_len(self.tokens, new)
        reuse = min(common // self.block_size, len(self.keys))
        parent = self.keys[reuse - 1] if reuse else None
        self.keys = self.keys[:reuse] + block_keys(
            new, self.block_size, self.seed, start_block=reuse, parent=parent
        )
        self.tokens = new
        return self.keys


def _common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n
