"""Router block keys for trace requests: a chained hash of a prompt's trace block ids, at the
simulation block size.

Invariants: equal id prefixes (in one scope) give equal keys, and a key names its whole prefix,
as ``mesh.core.keys`` does; only full simulation blocks get keys; a simulation block size that
differs from the trace's re-blocks the chain (a key then depends on where the simulation block
ends inside the trace block). Each scope (a file's id space, under the load's namespace) seeds
its own chains (``scope_seed``). Pure functions over numpy arrays; the power tables are a
per-process cache, grown to the longest request seen.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

# h_i = sum_{k<=i} x_k * R^(i-k) mod 2^64 over mixed ids x_k: a chained hash of the id prefix,
# computed for a whole request with numpy (cumsum of x_k * R^-k, times R^i). A block key is
# splitmix64(h_b ^ offset-term ^ namespace), where b is the last trace block the sim block
# touches and the offset says how far into it the sim block ends.
_R = 0x9E3779B97F4A7C15 | 1
_R_INV = pow(_R, -1, 2**64)
_pow: list[np.ndarray] = [np.ones(1, dtype=np.uint64), np.ones(1, dtype=np.uint64)]


def _powers(n: int) -> tuple[np.ndarray, np.ndarray]:
    if _pow[0].size < n:
        size = max(n, 2 * _pow[0].size, 1024)
        with np.errstate(over="ignore"):
            for i, base in ((0, _R), (1, _R_INV)):
                out = np.empty(size, dtype=np.uint64)
                out[0] = 1
                b = np.uint64(base)
                for j in range(1, size):  # once per process, up to the longest request
                    out[j] = out[j - 1] * b
                _pow[i] = out
    return _pow[0][:n], _pow[1][:n]


def _splitmix(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def chain_keys(
    ids: Sequence[int] | np.ndarray, prompt_tokens: int, trace_block: int, sim_block: int, scope: int
) -> np.ndarray:
    """Router keys (uint64) of the full ``sim_block`` blocks of a prompt named by trace ids."""
    ids_arr = np.asarray(ids).astype(np.uint64, copy=False)
    covered = min(prompt_tokens, ids_arr.size * trace_block)
    n_keys = covered // sim_block
    if n_keys == 0:
        return np.zeros(0, dtype=np.uint64)
    last_b = (n_keys * sim_block - 1) // trace_block
    x = _splitmix(ids_arr[: last_b + 1] ^ np.uint64(scope))
    pw, pw_inv = _powers(x.size)
    with np.errstate(over="ignore"):
        h = np.cumsum(x * pw_inv) * pw
    if sim_block == trace_block:
        return _splitmix(h ^ np.uint64(scope ^ (trace_block * 0xD6E8FEB86659FD93 & 0xFFFFFFFFFFFFFFFF)))
    ends = np.arange(1, n_keys + 1, dtype=np.int64) * sim_block
    b = (ends - 1) // trace_block
    off = (ends - b * trace_block).astype(np.uint64)
    with np.errstate(over="ignore"):
        mixed = h[b] ^ (off * np.uint64(0xD6E8FEB86659FD93)) ^ np.uint64(scope)
    return _splitmix(mixed)


def scope_seed(namespace: str, scope: str) -> int:
    """The seed of one scope's key chains (a file's ids are local to its scope)."""
    return xxhash.xxh3_64_intdigest(f"{namespace}\0{scope}".encode())
