"""The prefix index's node store: a radix tree over blocks, in parallel arrays, with its masks.

A node is addressed by its chained key (``id``: key -> node id, "nid"); its fields live in arrays
indexed by nid, so the garbage collector never walks the index (no Python object per node). Targets
are bit slots; per node ``g``/``c``/``s`` hold the GPU, CPU and speculative holders, and

    ca(node) = (g | c | s)(node) & ca(parent)      holders of the whole path, any tier
    cg(node) = (g | s)(node)     & cg(parent)      holders of the whole path on the GPU

with ``ca = cg = -1`` at ROOT (the parent of a prompt's first block) and 0 at EMPTY (the parent
of a placeholder for an unknown parent). Invariants, after every public call of the index: ``ca``
and ``cg`` are exact for live slots; ``pend[n]`` over-approximates the targets that may hold a
child of ``n`` without ``n``'s whole path; a node with no live holder and no child is gone.
Ownership: one ``PrefixIndex`` owns a ``Nodes``, written only by the ``mesh.core.index*`` modules.
Here too: the LRU budget (leaves first, a parent inherits its children's recency), the scrub.
"""

from __future__ import annotations

from array import array
from heapq import heapify, heappop, heappush
from itertools import repeat

import numpy as np

from policies.base import Tier

EMPTY = 0  # masks all 0: the parent of a node whose parent is unknown, and a missing key in scans
ROOT = 1  # masks all 1 (-1): the parent of a prompt's first block
MANY = -1  # kid[n] when n has several children (they are in ``kids[n]``); 0 = no child


class Nodes:
    """The node arrays (one entry per nid; nids 0 and 1 are EMPTY and ROOT) and the operations
    that keep their links and masks consistent. Per node: a dict entry and key object (shared
    with the engine maps), 4+4-byte links, six mask pointers, a 4-byte ``iota`` entry, up to a
    quarter of preallocated slack; an 8-byte recency stamp only with a budget."""

    __slots__ = ("budget", "id", "key", "par", "kid", "kids", "stamp", "g", "c", "s", "ca", "cg", "pend",
                 "top", "iota", "free", "orphans", "live", "dying", "scrub", "clock", "lru", "evicted")

    def __init__(self, budget: int) -> None:
        self.budget = budget  # max nodes, 0 = unbounded (then ``stamp`` is never indexed)
        self.id: dict[int, int] = {}
        self.key: list[int] = [0, 0]  # the key objects of ``id`` itself (engine maps share them)
        self.par = array("i", [EMPTY, EMPTY])  # EMPTY: parent unknown; ROOT: first block
        self.kid = array("i", [0, 0])  # 0: none; > ROOT: the only child; MANY: see ``kids``
        self.kids: dict[int, set[int]] = {}
        self.stamp = array("q", [0, 0])  # LRU recency (indexed with a budget only)
        self.g = [0, -1]  # holders on the GPU
        self.c = [0, -1]  # holders on the CPU
        self.s = [0, -1]  # speculative holders (count as GPU)
        self.ca = [0, -1]  # holders of the whole path, any tier
        self.cg = [0, -1]  # holders of the whole path on the GPU
        self.pend = [0, 0]  # targets that may hold a child without this node's whole path
        # nids below ``top`` are in use or in ``free``; the arrays are preallocated beyond it
        # (``grow``) with every field 0; ``iota[n] == n`` (for slice-assigned links)
        self.top = 2
        self.iota = array("i", [0, 1])
        self.free: list[int] = []
        self.orphans: set[int] = set()  # placeholders: nodes whose parent is unknown
        self.live = 0  # bits of live slots: every query masks with it
        self.dying = 0  # bits of retired slots not yet scrubbed from every node
        self.scrub: tuple[int, int] | None = None  # (next nid, bits being scrubbed)
        self.clock = 0
        self.lru: list[tuple[int, int]] = []  # (stamp, nid) of leaves, lazily invalidated
        self.evicted = 0  # nodes evicted by the budget

    # ------------------------------------------------------------------ links
    def alloc(self, key: int, parent: int, stamp: int) -> int:
        """A fresh node (masks 0, no child) under ``parent``; links it as a child."""
        if self.free:
            n = self.free.pop()
            self.key[n] = key
            self.par[n] = parent
            self.kid[n] = 0
            if self.budget:
                self.stamp[n] = stamp
            self.g[n] = self.c[n] = self.s[n] = self.ca[n] = self.cg[n] = self.pend[n] = 0
        else:  # a fresh slot: its fields are still all 0
            n = self.top
            self.top += 1
            if n >= len(self.key):
                self.grow(n + 1)
            self.key[n] = key
            self.par[n] = parent
            if self.budget:
                self.stamp[n] = stamp
        self.id[key] = n
        if parent > ROOT:
            self.add_kid(parent, n)
        return n

    def add_kid(self, parent: int, kid: int) -> None:
        kids = self.kid[parent]
        if kids == 0:
            self.kid[parent] = kid
        elif kids == MANY:
            self.kids[parent].add(kid)
        else:
            self.kids[parent] = {kids, kid}
            self.kid[parent] = MANY

    def del_kid(self, parent: int, kid: int) -> None:
        kids = self.kid[parent]
        if kids == kid:
            self.kid[parent] = 0
        elif kids == MANY:
            many = self.kids[parent]
            many.discard(kid)
            if len(many) == 1:
                self.kid[parent] = many.pop()
                del self.kids[parent]

    def children(self, n: int) -> list[int]:
        kids = self.kid[n]
        if kids == 0:
            return []
        return list(self.kids[n]) if kids == MANY else [kids]

    def free_node(self, n: int) -> None:
        """Forget node ``n`` (a leaf): unlink it from its parent, recycle its nid."""
        del self.id[self.key[n]]
        parent = self.par[n]
        if parent > ROOT:
            self.del_kid(parent, n)
        elif parent == EMPTY:
            self.orphans.discard(n)
        self.free.append(n)  # its fields are all rewritten when the nid is reused

    def unlink_leaf(self, n: int, p: int) -> None:
        """The parent side of removing leaf ``n`` (already out of ``id``; the caller recycles
        its nid after this): ``p`` loses its child, is deleted if that leaves it a holder-less
        placeholder, and with a budget keeps ``n``'s recency (a new leaf is queued for it)."""
        if p > ROOT:
            kid = self.kid
            if kid[p] == n:
                kid[p] = 0
                if not ((self.g[p] | self.c[p] | self.s[p]) & self.live):
                    self.maybe_delete(p)  # a placeholder left without children
                elif self.budget:  # the parent became a leaf: it inherits the recency
                    stamp = self.stamp
                    stamp[p] = max(stamp[p], stamp[n])
                    heappush(self.lru, (stamp[p], p))
            else:
                self.del_kid(p, n)
                if self.budget:  # a parent keeps its subtree's recency for when it is a leaf
                    stamp = self.stamp
                    stamp[p] = max(stamp[p], stamp[n])
        elif p == EMPTY:
            self.orphans.discard(n)

    def parent_nid(self, parent: int | None) -> int:
        """The node of key ``parent`` (ROOT for None), a holder-less placeholder if unknown."""
        if parent is None:
            return ROOT
        n = self.id.get(parent)
        if n is None:
            n = self.alloc(parent, EMPTY, self.clock)
            self.orphans.add(n)
        return n

    def relink(self, n: int, parent: int) -> None:
        """Give a placeholder (parent unknown) its parent, then fix every holder's masks."""
        self.par[n] = parent
        self.orphans.discard(n)
        if parent > ROOT:
            self.add_kid(parent, n)
        held = self.g[n] | self.c[n] | self.s[n]
        if held:
            self.refresh(n, held)

    def grow(self, need: int) -> None:
        """Make the arrays hold at least ``need`` nids, by a quarter of their size at least: nodes
        are written into preallocated slots (a list grown by ``extend`` a little at a time is
        copied to new memory over and over; this costs ~100 ns per block over 6 lists)."""
        old = len(self.key)
        add = max(need, old + (old >> 2), 1024) - old
        for arr in (self.key, self.g, self.c, self.s, self.ca, self.cg, self.pend):
            arr += [0] * add
        zeros = bytes(4 * add)
        self.par.frombytes(zeros)
        self.kid.frombytes(zeros)
        self.iota.frombytes(np.arange(old, old + add, dtype=np.int32).tobytes())
        if self.budget:
            self.stamp.frombytes(bytes(8 * add))

    # ------------------------------------------------------------------ masks
    def refresh(self, x: int, m: int) -> None:
        """Recompute the consecutive masks for the bits of ``m`` at node ``x`` and below it.

        Descends into children only for bits that changed: lost bits always (children may hold
        them), gained bits only where ``pend`` says a child may be waiting for them. Allocates
        nothing unless it must descend (the common case: a leaf, or an unchanged node).
        """
        par, g, c, s, ca, cg, pend = self.par, self.g, self.c, self.s, self.ca, self.cg, self.pend
        stack: list[tuple[int, int]] | None = None
        while True:
            p = par[x]
            gs = g[x] | s[x]
            held = gs | c[x]
            new_a = held & ca[p] & m
            new_g = gs & cg[p] & m
            waiting = ((held & ~new_a) | (gs & ~new_g)) & m
            if waiting and p > ROOT:
                pend[p] |= waiting
            old_a = ca[x] & m
            old_g = cg[x] & m
            if new_a != old_a or new_g != old_g:
                ca[x] ^= old_a ^ new_a
                cg[x] ^= old_g ^ new_g
                if self.kid[x]:
                    down = self.down(x, (old_a & ~new_a) | (old_g & ~new_g), (new_a & ~old_a) | (new_g & ~old_g))
                    if down:
                        if stack is None:
                            stack = []
                        stack.extend(zip(self.children(x), repeat(down)))
            if not stack:
                return
            x, m = stack.pop()

    def down(self, x: int, lost: int, gained: int) -> int:
        """Bits to recompute in ``x``'s children after its consecutive masks lost ``lost`` and
        gained ``gained``: every lost bit, and the gained bits a child may be waiting for."""
        pend = self.pend
        gained &= pend[x]
        down = lost | gained
        if down:
            pend[x] = (pend[x] & ~gained) | lost
        return down

    def descend(self, x: int, lost: int, gained: int) -> None:
        down = self.down(x, lost, gained)
        if down:
            g, c, s, ca, cg = self.g, self.c, self.s, self.ca, self.cg
            for child in self.children(x):
                # a child that neither holds nor has consecutive any bit of ``down`` is unchanged
                if (g[child] | c[child] | s[child] | ca[child] | cg[child]) & down:
                    self.refresh(child, down)

    def remove_key(self, slot: int, key: int, tier: Tier | None, specs: dict[int, float] | None) -> int | None:
        """Take ``slot`` off ``key``'s node on ``tier`` (None: every tier, speculation included;
        ``specs``: the slot's speculative deadlines). Returns the nid (None: unknown key)."""
        n = self.id.get(key)
        if n is None:
            return None
        bit = 1 << slot
        if tier is not Tier.CPU:  # GPU or every tier
            if self.s[n] & bit:
                if specs is not None:
                    specs.pop(key, None)
                self.s[n] &= ~bit
            self.g[n] &= ~bit
        if tier is not Tier.GPU:  # CPU or every tier
            self.c[n] &= ~bit
        if self.kid[n]:
            self._refresh_bit(n, bit)
            return n
        held = self.g[n] | self.c[n] | self.s[n]
        if not (held & self.live):  # the usual case: a leaf nobody holds any more
            self.maybe_delete(n)
            return n
        pp = self.par[n]  # a leaf still held: its masks follow from the parent's alone
        ca, cg = self.ca, self.cg
        ca[n] = (ca[n] & ~bit) | (ca[pp] & bit if held & bit else 0)
        cg[n] = (cg[n] & ~bit) | (cg[pp] & bit if (self.g[n] | self.s[n]) & bit else 0)
        if held & bit and pp > ROOT and (not ca[n] & bit or ((self.g[n] | self.s[n]) & bit and not cg[n] & bit)):
            self.pend[pp] |= bit
        return n

    def _refresh_bit(self, n: int, bit: int) -> None:
        """``refresh(n, bit)`` for a node with children, inlined for the one bit that changed."""
        ca, cg = self.ca, self.cg
        gs = (self.g[n] | self.s[n]) & bit
        mine = gs | (self.c[n] & bit)
        pp = self.par[n]
        new_a = ca[pp] & bit if mine else 0
        new_g = cg[pp] & bit if gs else 0
        if mine and pp > ROOT and (not new_a or (gs and not new_g)):
            self.pend[pp] |= bit
        old_a = ca[n] & bit
        old_g = cg[n] & bit
        if new_a != old_a or new_g != old_g:
            ca[n] ^= old_a ^ new_a
            cg[n] ^= old_g ^ new_g
            self.descend(n, (old_a & ~new_a) | (old_g & ~new_g), (new_a & ~old_a) | (new_g & ~old_g))

    def maybe_delete(self, n: int) -> None:
        """Delete node ``n`` and then each ancestor left without live holder and child."""
        live = self.live
        g, c, s = self.g, self.c, self.s
        while n > ROOT and self.kid[n] == 0 and not ((g[n] | c[n] | s[n]) & live):
            parent = self.par[n]
            stamp = self.stamp[n] if self.budget else 0
            self.free_node(n)
            if parent <= ROOT:
                return
            if self.budget:  # the parent inherits the recency (kept until it is a leaf)
                self.stamp[parent] = max(self.stamp[parent], stamp)
                if self.kid[parent] == 0:
                    heappush(self.lru, (self.stamp[parent], parent))
            n = parent

    # ------------------------------------------------------------------ budget
    def touch(self, n: int) -> None:
        if n <= ROOT:
            return
        self.clock += 1
        self.stamp[n] = self.clock
        if self.kid[n] == 0:
            heappush(self.lru, (self.clock, n))

    def trim(self) -> None:
        """With a budget, evict least recently stored/matched leaves until the nodes fit it."""
        if self.budget and len(self.id) > self.budget:
            self._evict()

    def _evict(self) -> None:
        heap = self.lru
        if len(heap) > 2 * len(self.id) + 1024:  # drop stale entries now and then
            heap[:] = [(self.stamp[n], n) for n in self.id.values() if self.kid[n] == 0]
            heapify(heap)
        while len(self.id) > self.budget and heap:
            stamp, n = heappop(heap)
            if self.stamp[n] != stamp or self.kid[n] != 0 or self.id.get(self.key[n]) != n:
                continue  # stale entry
            self._drop(n)

    def _drop(self, n: int) -> None:
        """Evict a leaf for every holder (its parent becomes a leaf with the leaf's recency)."""
        parent = self.par[n]
        stamp = self.stamp[n]
        self.free_node(n)
        self.evicted += 1
        if parent <= ROOT or self.kid[parent] != 0:
            return
        self.stamp[parent] = max(self.stamp[parent], stamp)  # passed on past a holder-less parent too
        if not ((self.g[parent] | self.c[parent] | self.s[parent]) & self.live):
            self._drop(parent)
            return
        heappush(self.lru, (self.stamp[parent], parent))

    # ------------------------------------------------------------------ scrubbing
    def retire(self, bit: int) -> None:
        """Retire a slot in O(1): its bit leaves ``live`` now, and the nodes incrementally."""
        self.live &= ~bit
        self.dying |= bit

    def scrub_step(self, budget: int) -> int:
        """Clear retired bits from up to ``budget`` nids (deleting nodes left holder-less).
        Returns the bits whose pass over every nid this call completed (0: none): those slots
        hold no stale bit anywhere and may be reused."""
        if self.scrub is None:
            if not self.dying:
                return 0
            self.scrub = (ROOT + 1, self.dying)
        start, bits = self.scrub
        keep = ~bits
        end = min(self.top, start + budget)
        for field in (self.g, self.c, self.s, self.ca, self.cg, self.pend):
            field[start:end] = [v & keep for v in field[start:end]]
        g, c, s, kid, key, ids = self.g, self.c, self.s, self.kid, self.key, self.id
        for n in range(start, end):
            if not (g[n] | c[n] | s[n]) and kid[n] == 0 and ids.get(key[n]) == n:
                self.maybe_delete(n)
        if end < self.top:
            self.scrub = (end, bits)
            return 0
        self.scrub = None
        self.dying &= ~bits
        return bits
