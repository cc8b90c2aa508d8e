"""Speculative entries: blocks the router expects a target to hold before its engine says so.

A speculative store counts a chain as held on the GPU (the ``s`` masks of ``mesh.core.index_nodes``)
until its deadline passes (``expire``) or the engine's own store of the same key for that
target confirms it (the store path pops the key from the slot's deadlines). Per slot: key ->
deadline of the newest speculation; a heap of (deadline, seq, slot, incarnation, keys) ends them
in deadline order. Invariants: a heap entry ends only keys whose recorded deadline is its own
(a newer speculation of a key outlives an older one) and only for the slot incarnation that made
it (a retired and reused slot ignores its predecessor's entries). Ownership: one
``Speculation`` per ``PrefixIndex``; the index's store and removal paths read and pop the
per-slot deadlines, nothing else writes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from heapq import heappop, heappush

from mesh.core.index_nodes import Nodes


class Speculation:
    __slots__ = ("_by_slot", "_heap", "_seq")

    def __init__(self) -> None:
        self._by_slot: dict[int, dict[int, float]] = {}  # slot -> key -> speculative deadline
        self._heap: list[tuple[float, int, int, int, Sequence[int]]] = []
        self._seq = 0

    def of(self, slot: int) -> dict[int, float] | None:
        """The slot's deadlines (None: the slot never speculated since it was last forgotten)."""
        return self._by_slot.get(slot)

    def open(self, slot: int) -> dict[int, float]:
        specs = self._by_slot.get(slot)
        if specs is None:
            specs = self._by_slot[slot] = {}
        return specs

    def schedule(self, expires_at: float, slot: int, gen: int, keys: Sequence[int]) -> None:
        """End the speculation of ``keys`` by ``slot`` (incarnation ``gen``) at ``expires_at``."""
        self._seq += 1
        heappush(self._heap, (expires_at, self._seq, slot, gen, keys))

    def forget(self, slot: int) -> None:
        self._by_slot.pop(slot, None)

    def count(self) -> int:
        return sum(map(len, self._by_slot.values()))

    def expire(self, now: float, gens: list[int], nodes: Nodes) -> int:
        """End every speculation whose deadline is <= ``now`` (``gens``: each slot's current
        incarnation); returns the number of entries ended."""
        heap = self._heap
        ended = 0
        while heap and heap[0][0] <= now:
            deadline, _, slot, gen, keys = heappop(heap)
            specs = self._by_slot.get(slot)
            if specs is None or gens[slot] != gen:
                continue
            bit = 1 << slot
            for key in reversed(keys):
                if specs.get(key) == deadline:
                    del specs[key]
                    ended += 1
                    n = nodes.id.get(key)
                    if n is not None:
                        nodes.s[n] &= ~bit
                        nodes.refresh(n, bit)
                        nodes.maybe_delete(n)
        return ended
