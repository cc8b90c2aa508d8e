"""Match's search over the consecutive masks, and the names of the targets behind mask bits.

Along a request's chain the consecutive masks (``ca``/``cg`` of ``mesh.core.index_nodes``) only
lose bits, so as integers they never increase: each target's depth is found by binary search
over the chain (``depths``, one search per distinct depth, with remembered run ends as hints)
instead of visiting every block, and a C-speed linear pass takes over when a request has many
distinct depths (``depths_linear``). Results may carry retired slots' bits: callers mask them
with the live bits (``live_groups``). ``TargetNames`` turns masks into target tuples, cached per
mask and per 64-bit word (holder sets recur from query to query). Ownership: pure functions, and
a names cache owned by one ``PrefixIndex``, which clears it whenever a slot changes hands.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Callable, Sequence
from itertools import chain, repeat
from operator import neg

import numpy as np

from mesh.core.index_nodes import EMPTY, Nodes
from policies.base import Overlap

Lookup = Callable[[int, int], int]  # key, default -> nid (``dict.get`` of the key -> nid map)


def depths(
    keys: Sequence[int], n: int, get: Lookup, first: int, masks: list[int], hints: dict[int, int]
) -> list[tuple[int, int]]:
    """Change points of a consecutive mask along ``keys``: ``[(depth, bits), ...]`` where the
    targets of ``bits`` hold exactly ``depth`` leading blocks (``bits`` may include retired
    slots: the caller masks them out).

    The positions where the mask still equals its value at ``pos`` form a prefix: each change
    point is one binary search on equality (no big-int arithmetic per probe). ``hints``
    remembers, per key where a run of equal masks starts, where that run ended last time (the
    end of a shared system prompt, of a session's last turn): two probes confirm it, else the
    search runs. With many distinct depths ``depths_linear`` takes over.
    """
    out: list[tuple[int, int]] = []
    cur = first
    pos = 0
    budget = max(8, n >> 5)  # a search costs ~log2(n) Python steps; the scan ~n C steps
    while cur:
        if budget == 0:
            return out + depths_linear(keys, n, get, cur, pos, masks)
        budget -= 1
        start = keys[pos]
        end = hints.get(start, 0)
        if pos < end < n and masks[get(keys[end - 1], EMPTY)] == cur and masks[get(keys[end], EMPTY)] != cur:
            lo = end
        elif end >= n and masks[get(keys[n - 1], EMPTY)] == cur:
            lo = n
        else:
            lo, hi = pos + 1, n
            while lo < hi:
                mid = (lo + hi) >> 1
                if masks[get(keys[mid], EMPTY)] == cur:
                    lo = mid + 1
                else:
                    hi = mid
            if len(hints) >= 65536:
                hints.clear()
            hints[start] = lo
        if lo >= n:
            out.append((n, cur))
            return out
        nxt = masks[get(keys[lo], EMPTY)]
        out.append((lo, cur & ~nxt))
        cur = nxt
        pos = lo
    return out


def depths_linear(
    keys: Sequence[int], n: int, get: Lookup, cur: int, pos: int, masks: list[int]
) -> list[tuple[int, int]]:
    vals = list(map(neg, map(masks.__getitem__, map(get, keys[pos:], repeat(EMPTY)))))
    out = []
    i = 0
    m = len(vals)
    while cur:
        j = bisect_right(vals, -cur, lo=i + 1)
        if j >= m:
            out.append((n, cur))
            break
        nxt = -vals[j]
        out.append((pos + j, cur & ~nxt))
        cur = nxt
        i = j
    return out


def live_groups(groups: list[tuple[int, int]], live: int) -> list[tuple[int, int]]:
    return [(d, m & live) for d, m in groups if m & live]


def split_groups(
    total: list[tuple[int, int]], gpu: list[tuple[int, int]], names: Callable[[int], tuple[str, ...]]
) -> dict[str, Overlap]:
    """Overlaps when some target's prefix has CPU-tier blocks: the any-tier groups ``total``
    cut by the GPU groups ``gpu`` (both ``(depth, bits)``, live bits only)."""
    groups: list[tuple[int, Overlap]] = []  # (targets, their overlap)
    for depth, mask in total:
        rest = mask
        for gdepth, gmask in gpu:
            both = rest & gmask
            if both:
                groups.append((both, Overlap(gdepth, depth - gdepth)))
                rest ^= both
                if not rest:
                    break
        if rest:
            groups.append((rest, Overlap(0, depth)))
    if len(groups) == 1:
        return dict.fromkeys(names(groups[0][0]), groups[0][1])
    groups.sort(key=lambda g: -g[0].bit_count())  # copy the largest group only once
    out = dict.fromkeys(names(groups[0][0]), groups[0][1])
    for mask, ov in groups[1:]:
        out.update(dict.fromkeys(names(mask), ov))
    return out


class Position(dict[int, int]):
    """Stands in for the key -> nid lookup over masks already gathered per position."""

    def __init__(self, keys: Sequence[int]) -> None:
        super().__init__((k, i) for i, k in enumerate(keys))


class TargetNames:
    """The targets of a mask's bits (``tids``: slot -> target, shared with the index). Holder
    sets recur from query to query (the holders of a system prompt), and so do their 64-bit
    words when the sets differ a little: both are cached until ``clear``."""

    __slots__ = ("_tids", "_cache")

    def __init__(self, tids: list[str | None]) -> None:
        self._tids = tids
        self._cache: dict[int, tuple[str, ...]] = {}  # mask, or -(word key) - 1 -> targets

    def clear(self) -> None:
        self._cache.clear()

    def of(self, mask: int) -> tuple[str, ...]:
        """The targets of the bits of ``mask`` (live slots only)."""
        cache = self._cache
        names = cache.get(mask)
        if names is None:
            if len(cache) >= 8192:
                cache.clear()
            if mask >> 64 == 0:
                names = self._word(0, mask)
            else:
                words = array("Q")
                words.frombytes(mask.to_bytes(((mask.bit_length() + 63) >> 6) << 3, "little"))
                word = self._word
                names = tuple(chain.from_iterable([word(i, w) for i, w in enumerate(words) if w]))
            cache[mask] = names
        return names

    def _word(self, word: int, bits: int) -> tuple[str, ...]:
        key = -((bits << 16) | word) - 1  # negative: never a mask
        names = self._cache.get(key)
        if names is None:
            tids = self._tids
            base = word << 6
            # live bits name live slots, whose entries are targets (None marks a free slot only)
            names = self._cache[key] = tuple([tids[base + i] for i in bits_of(bits)])  # type: ignore[misc]
        return names


# the set bits of every byte value, for bits_of
_BYTE_BITS = [tuple(j for j in range(8) if v >> j & 1) for v in range(256)]


def bits_of(mask: int) -> list[int]:
    """Indices of the set bits of a non-negative ``mask``."""
    if mask & (mask - 1) == 0:
        return [mask.bit_length() - 1] if mask else []
    if mask < 1 << 64:
        return [j for j in _BYTE_BITS[mask & 0xFF]] + [
            (i << 3) + j for i in range(1, (mask.bit_length() + 7) >> 3) for j in _BYTE_BITS[mask >> (i << 3) & 0xFF]
        ]
    raw = np.frombuffer(mask.to_bytes((mask.bit_length() + 7) // 8, "little"), np.uint8)
    out: list[int] = np.flatnonzero(np.unpackbits(raw, bitorder="little")).tolist()
    return out


def match_prefix(
    nodes: Nodes, names: Callable[[int], tuple[str, ...]], keys: Sequence[int], hints_ca: dict[int, int],
    hints_cg: dict[int, int],
) -> dict[str, Overlap]:
    """Per target (named by ``names``), its longest consecutive cached prefix of ``keys``:
    ``PrefixIndex.match`` before any hybrid cut. The hints are the index's, kept across calls."""
    n = len(keys)
    if not n:
        return {}
    get = nodes.id.get
    first = get(keys[0], EMPTY)
    live = nodes.live
    if nodes.scrub is None:
        ca, cg = nodes.ca, nodes.cg
    else:  # a scrub pass clears parents before children: compare live bits only
        ca = [v & live for v in map(nodes.ca.__getitem__, map(get, keys, repeat(EMPTY)))]
        cg = [v & live for v in map(nodes.cg.__getitem__, map(get, keys, repeat(EMPTY)))]
        get = Position(keys).get
        first = 0
    if not (ca[first] & live):
        return {}
    total = live_groups(depths(keys, n, get, ca[first], ca, hints_ca), live)
    if not total:
        return {}
    if nodes.budget:
        nodes.touch(nodes.id.get(keys[total[-1][0] - 1], EMPTY))
    # a target whose whole prefix is on the GPU is in CG at its last block; only when some
    # target is not (a CPU-tier block in its prefix) does the GPU depth need its own search
    for depth, mask in total:
        if cg[get(keys[depth - 1], EMPTY)] & mask != mask:
            gpu = live_groups(depths(keys, n, get, cg[first], cg, hints_cg), live) if cg[first] & live else []
            return split_groups(total, gpu, names)
    # the usual case, every target's prefix on the GPU: all holders of the first block (the
    # same set for every prompt that starts alike, so its names are cached) at the shallowest
    # depth, then the deeper groups on top
    out = dict.fromkeys(names(ca[first] & live), Overlap(total[0][0], 0))
    for depth, mask in total[1:]:
        out.update(dict.fromkeys(names(mask), Overlap(depth, 0)))
    return out
