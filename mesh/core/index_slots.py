"""Targets' bit slots in the prefix index (``Slots``, part of ``PrefixIndex``).

Every target of the index owns one bit of every node's masks: its slot. A removed target's slot
retires in O(1) (its bit leaves the nodes' live mask, which every query applies) and is scrubbed
from the nodes incrementally; only a slot a full scrub pass has cleared is handed out again
(``reuse``). ``gen`` counts each slot's incarnations, so a speculative entry scheduled for a
retired target never ends on its successor. Ownership: the index's thread only; ``tids`` is
shared with ``names`` (mutated in place, never rebound).
"""

from __future__ import annotations

from mesh.core.index_depths import TargetNames, bits_of
from mesh.core.index_nodes import Nodes


class Slots:
    __slots__ = ("of", "tids", "gen", "free", "names")

    def __init__(self) -> None:
        self.of: dict[str, int] = {}  # live target -> slot (bit)
        self.tids: list[str | None] = []  # slot -> target (None: free or dying)
        self.gen: list[int] = []  # slot -> incarnation, bumped on retirement
        self.free: list[int] = []  # scrubbed slots, reusable
        self.names = TargetNames(self.tids)

    def assign(self, target: str, nodes: Nodes) -> int:
        """``target``'s slot, given it (and its bit made live in ``nodes``) on first use."""
        slot = self.of.get(target)
        if slot is None:
            if self.free:
                slot = self.free.pop()
                self.tids[slot] = target
            else:
                slot = len(self.tids)
                self.tids.append(target)
                self.gen.append(0)
            self.of[target] = slot
            nodes.live |= 1 << slot
            self.names.clear()
        return slot

    def release(self, target: str) -> int | None:
        """End ``target``'s slot (the caller retires its bit in the nodes); the slot, or None."""
        slot = self.of.pop(target, None)
        if slot is not None:
            self.tids[slot] = None
            self.gen[slot] += 1
            self.names.clear()
        return slot

    def reuse(self, scrubbed: int) -> None:
        """The slots of mask ``scrubbed`` hold no stale bit anywhere now: hand them out again."""
        self.free.extend(bits_of(scrubbed))
