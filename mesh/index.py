"""The prefix index: which target holds which block, on which tier.

Semantics (kept from the reference implementation; ``tests/test_index.py`` checks them against a
brute-force oracle):

- Keys are router block keys (``mesh.keys``): a key names a whole prefix.
- ``match(keys)`` returns, per target, its longest *consecutive* cached prefix of ``keys``
  (``Overlap.gpu_blocks`` leading blocks on the GPU, then ``cpu_blocks`` from the CPU tier).
  Targets with no overlap are absent.
- Speculative entries (``store_speculative``) count as GPU blocks until ``expire(now)`` passes
  their deadline or the engine's own store of the same key for that target confirms them.

Structure (DESIGN.md, "Block keys"): a radix tree over blocks in which every node is addressed by
its chained key, so a node is one dict lookup away. Targets get bit *slots*; every node keeps
Python-int bitmasks of its holders per tier (``g`` GPU, ``c`` CPU, ``s`` speculative) and two
*consecutive* masks:

    ca(node) = (g | c | s)(node) & ca(parent)      targets holding the whole path, any tier
    cg(node) = (g | s)(node)     & cg(parent)      targets holding the whole path on the GPU

with ``ca(root) = cg(root) = all``. Along a request's chain both masks only lose bits, so as
integers they never increase: ``match`` finds each target's depth by binary search over the
chain (``bisect`` with a key) instead of visiting every block, and switches to a C-speed linear
pass (``map``/``attrgetter``) when a request has many distinct depths.

Invariants (ownership: only this module mutates nodes):
- ``ca``/``cg`` are exact for live slots after every public call; ``_refresh`` restores them
  below a node whose holders changed, descending only where a bit really changed.
- ``pend`` over-approximates the targets that hold some child without holding this node's whole
  path, so gaining a bit descends only where a child may be waiting for it.
- A node with no live holder and no child is deleted at once (placeholders for unknown parents
  keep their children consecutive-free).
- Removing a target retires its slot in O(1): its bits leave ``_live`` (every query masks with
  it) and are scrubbed from nodes incrementally by ``expire``/``compact``; the slot is reused only
  after a full scrub pass.

Bounded memory: with ``max_keys`` > 0, nodes beyond the budget are evicted least recently
stored/matched first, leaves first (a parent waits until its children are gone, then inherits
their recency), so a hot shared prefix outlives the cold sessions below it. The per-target maps
from engine hash to key are bounded by each engine's own cache: entries leave with the engine's
removals or the target's reset, and an entry whose node was evicted still resolves its
children's parent key.
"""

from __future__ import annotations

import sys
from array import array
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from heapq import heapify, heappop, heappush
from itertools import repeat
from operator import and_, attrgetter, neg
from typing import Any

import numpy as np
import xxhash

from mesh.keys import block_keys
from policies.base import Overlap, Tier

_xxh3 = xxhash.xxh3_64_intdigest
_SPEC = None  # tier marker for speculative stores (internal)
_FAST_ARRAY = array("I").itemsize == 4


class _Node:
    __slots__ = ("key", "parent", "kids", "g", "c", "s", "ca", "cg", "pend", "stamp")

    def __init__(self, key: int, parent: _Node | None) -> None:
        self.key = key
        self.parent = parent  # None: parent unknown (consecutive masks stay 0)
        self.kids: Any = None  # None | _Node | set[_Node]
        self.g = 0
        self.c = 0
        self.s = 0
        self.ca = 0
        self.cg = 0
        self.pend = 0
        self.stamp = 0


_ROOT = _Node(0, None)
_ROOT.ca = _ROOT.cg = -1  # every bit: a first block's path is just itself
_EMPTY = _Node(0, None)  # stands in for a missing key in C-speed scans
_get_ca = attrgetter("ca")
_get_cg = attrgetter("cg")


def chain_keys(tokens: Sequence[int] | np.ndarray, block_size: int, parent: int) -> list[int]:
    """``mesh.keys.block_keys(tokens, block_size, seed, parent=parent)`` for full blocks,
    faster on Python lists (the KV event path). Raises ValueError on a bad token id."""
    if isinstance(tokens, np.ndarray) or not _FAST_ARRAY:
        return block_keys(tokens, block_size, parent)
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    try:
        arr = array("I", tokens)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from exc
    if sys.byteorder == "big":
        arr.byteswap()
    data = arr.tobytes()
    step = block_size * 4
    end = (len(arr) // block_size) * step
    out = []
    append = out.append
    key = parent
    for off in range(0, end, step):
        key = _xxh3(data[off : off + step], key)
        append(key)
    return out


class PrefixIndex:
    def __init__(self, max_keys: int = 0, scrub_budget: int = 20_000) -> None:
        if max_keys < 0:
            raise ValueError(f"max_keys must be >= 0, got {max_keys}")
        self.max_keys = max_keys  # 0 = unbounded
        self.scrub_budget = scrub_budget  # nodes scrubbed per expire() call
        self._nodes: dict[int, _Node] = {}
        self._slot: dict[str, int] = {}  # live target -> slot
        self._tids: list[str | None] = []  # slot -> target (None: free or dying)
        self._gen: list[int] = []  # slot -> incarnation, bumped on retirement
        self._free: list[int] = []  # scrubbed slots, reusable
        self._live = 0  # bits of live slots
        self._dying = 0  # bits retired and not yet scrubbed
        self._scrub: tuple[Any, int] | None = None  # (key iterator, bits being scrubbed)
        self._emap: dict[str, dict[int, int]] = {}  # target -> engine hash -> key
        self._spec: dict[int, dict[int, float]] = {}  # slot -> key -> speculative deadline
        self._spec_heap: list[tuple[float, int, int, int, Sequence[int]]] = []
        self._spec_seq = 0
        self._clock = 0  # LRU stamp
        self._lru: list[tuple[int, int]] = []  # (stamp, key) of leaves, lazily invalidated
        self.evicted = 0  # keys evicted by the budget (a counter for metrics)

    # ------------------------------------------------------------------ slots
    def _slot_of(self, target: str) -> int:
        slot = self._slot.get(target)
        if slot is None:
            if self._free:
                slot = self._free.pop()
                self._tids[slot] = target
            else:
                slot = len(self._tids)
                self._tids.append(target)
                self._gen.append(0)
            self._slot[target] = slot
            self._live |= 1 << slot
        return slot

    def targets(self) -> list[str]:
        return list(self._slot)

    # -------------------------------------------------------------- key layer
    def store(
        self, target: str, keys: Sequence[int], tier: Tier = Tier.GPU, *, parent: int | None = None
    ) -> None:
        """Record that ``target`` holds the chain ``keys`` on ``tier``.

        ``keys`` is consecutive (``keys[i]`` extends ``keys[i-1]``); ``parent`` is the key of the
        block before ``keys[0]``, None when ``keys[0]`` is a prompt's first block.
        """
        if not len(keys):
            return
        slot = self._slot_of(target)
        self._store_chain(slot, keys, tier, self._parent_node(parent))
        self._after_store()

    def remove(self, target: str, keys: Sequence[int], tier: Tier | None = None) -> None:
        """Forget ``keys`` for ``target`` on ``tier`` (None: every tier, speculative included)."""
        slot = self._slot.get(target)
        if slot is None:
            return
        for key in reversed(keys):  # leaf first: no cascade below an already-removed node
            self._remove_key(slot, key, tier)

    def clear_target(self, target: str) -> None:
        """Drop every entry of ``target`` at once (O(1); nodes are scrubbed incrementally)."""
        self._emap.pop(target, None)
        slot = self._slot.pop(target, None)
        if slot is None:
            return
        bit = 1 << slot
        self._spec.pop(slot, None)
        self._live &= ~bit
        self._dying |= bit
        self._tids[slot] = None
        self._gen[slot] += 1

    def store_speculative(self, target: str, keys: Sequence[int], expires_at: float) -> None:
        """Count ``keys`` (a chain from a prompt's first block) as held on the GPU by ``target``
        until ``expires_at`` (see ``expire``) or until the engine's event confirms a key."""
        n = len(keys)
        if not n:
            return
        slot = self._slot_of(target)
        bit = 1 << slot
        get = self._nodes.get
        # blocks already consecutive on the GPU need nothing: skip them with one binary search
        depth = bisect_right(range(n), 0, key=lambda i: 0 if get(keys[i], _EMPTY).cg & bit else 1)
        if depth >= n:
            return
        tail = keys[depth:]
        parent = self._nodes[keys[depth - 1]] if depth else _ROOT
        self._store_chain(slot, tail, _SPEC, parent, spec_deadline=expires_at)
        self._spec_seq += 1
        heappush(self._spec_heap, (expires_at, self._spec_seq, slot, self._gen[slot], tail))
        self._after_store()

    def expire(self, now: float) -> int:
        """End speculative entries whose deadline is <= ``now``; scrub a slice of retired slots.
        Returns the number of speculative entries ended."""
        heap = self._spec_heap
        ended = 0
        while heap and heap[0][0] <= now:
            deadline, _, slot, gen, keys = heappop(heap)
            specs = self._spec.get(slot)
            if specs is None or self._gen[slot] != gen:
                continue
            for key in reversed(keys):
                if specs.get(key) == deadline:
                    del specs[key]
                    ended += 1
                    self._clear_bits(slot, key, spec_only=True)
        if self._dying or self._scrub is not None:
            self._scrub_step(self.scrub_budget)
        return ended

    def compact(self) -> None:
        """Finish scrubbing every retired slot now (tests; otherwise ``expire`` does it)."""
        while self._dying or self._scrub is not None:
            self._scrub_step(1 << 62)

    # ----------------------------------------------------------- engine layer
    def apply_stored(
        self,
        target: str,
        engine_hashes: Sequence[int],
        parent_engine_hash: int | None,
        token_ids: Sequence[int] | None,
        block_size: int,
        seed: int,
        tier: Tier = Tier.GPU,
    ) -> int:
        """Apply an engine's BlockStored; returns the number of blocks applied.

        Router keys are chained from the parent's router key (the seed at a prompt's start), so
        they never depend on the engine's hash function. A store whose parent engine hash is
        unknown cannot be keyed and is skipped (returns 0). A store without tokens is a tier
        update of blocks already known by engine hash. Raises ValueError when ``token_ids`` do
        not cover exactly ``len(engine_hashes)`` blocks or hold a bad token id.
        """
        n = len(engine_hashes)
        if n == 0:
            return 0
        emap = self._emap.get(target)
        if not token_ids:
            return self._tier_update(target, emap, engine_hashes, tier)
        if len(token_ids) != n * block_size:
            raise ValueError(
                f"BlockStored carries {len(token_ids)} tokens for {n} blocks of {block_size}"
            )
        if parent_engine_hash is None:
            parent_key, parent = seed, _ROOT
        else:
            found = emap.get(parent_engine_hash) if emap else None
            if found is None:
                return 0
            parent_key, parent = found, self._parent_node(found)
        keys = chain_keys(token_ids, block_size, parent_key)
        slot = self._slot_of(target)
        if emap is None:
            emap = self._emap[target] = {}
        emap.update(zip(engine_hashes, keys))
        self._store_chain(slot, keys, tier, parent)
        self._after_store()
        return n

    def apply_removed(
        self, target: str, engine_hashes: Sequence[int], tier: Tier | None = Tier.GPU
    ) -> int:
        """Apply an engine's BlockRemoved from ``tier`` (None: every tier). Returns the number
        of blocks that resolved to a known key."""
        emap = self._emap.get(target)
        slot = self._slot.get(target)
        if not emap or slot is None:
            return 0
        bit = 1 << slot
        done = 0
        for h in reversed(engine_hashes):
            key = emap.get(h)
            if key is None:
                continue
            done += 1
            node = self._remove_key(slot, key, tier)
            if node is None or not ((node.g | node.c) & bit):
                del emap[h]
        return done

    def apply_cleared(self, target: str) -> None:
        """Apply an engine's AllBlocksCleared."""
        self.clear_target(target)

    # ------------------------------------------------------------------ reads
    def match(self, keys: Sequence[int]) -> Mapping[str, Overlap]:
        n = len(keys)
        if not n:
            return {}
        first = self._nodes.get(keys[0])
        live = self._live
        if first is None or not (first.ca & live):
            return {}
        get = self._nodes.get
        total = _depths(keys, n, get, live, first.ca & live, _get_ca)
        gpu = _depths(keys, n, get, live, first.cg & live, _get_cg) if first.cg & live else []
        if self.max_keys:
            self._touch(get(keys[total[-1][0] - 1]))
        out: dict[str, Overlap] = {}
        tids = self._tids
        for depth, mask in total:
            rest = mask
            for gdepth, gmask in gpu:
                both = rest & gmask
                if both:
                    ov = Overlap(gdepth, depth - gdepth)
                    for slot in _bits(both):
                        out[tids[slot]] = ov  # type: ignore[index]
                    rest ^= both
                    if not rest:
                        break
            if rest:
                ov = Overlap(0, depth)
                for slot in _bits(rest):
                    out[tids[slot]] = ov  # type: ignore[index]
        return out

    def holds(self, target: str, key: int) -> Tier | None:
        slot = self._slot.get(target)
        node = self._nodes.get(key)
        if slot is None or node is None:
            return None
        bit = 1 << slot
        if (node.g | node.s) & bit:
            return Tier.GPU
        return Tier.CPU if node.c & bit else None

    def keys_of(self, target: str) -> set[int]:
        slot = self._slot.get(target)
        if slot is None:
            return set()
        bit = 1 << slot
        return {k for k, x in self._nodes.items() if (x.g | x.c | x.s) & bit}

    def engine_map(self, target: str) -> dict[int, int]:
        """A copy of ``target``'s engine hash -> router key map (tests, debugging)."""
        return dict(self._emap.get(target, {}))

    def stats(self) -> dict[str, int]:
        return {
            "keys": len(self._nodes),
            "targets": len(self._slot),
            "engine_hashes": sum(map(len, self._emap.values())),
            "speculative": sum(map(len, self._spec.values())),
            "dying_slots": self._dying.bit_count(),
            "evicted": self.evicted,
        }

    def __len__(self) -> int:
        return len(self._nodes)

    # -------------------------------------------------------------- internals
    def _parent_node(self, parent: int | None) -> _Node:
        """The node of key ``parent`` (ROOT for None), a holder-less placeholder if unknown."""
        if parent is None:
            return _ROOT
        node = self._nodes.get(parent)
        if node is None:
            node = self._nodes[parent] = _Node(parent, None)
        return node

    def _store_chain(
        self,
        slot: int,
        keys: Sequence[int],
        tier: Tier | None,
        parent: _Node,
        spec_deadline: float | None = None,
    ) -> None:
        bit = 1 << slot
        nodes = self._nodes
        get = nodes.get
        gpu = tier is Tier.GPU
        spec = tier is _SPEC
        specs = self._spec.get(slot)
        if spec and specs is None:
            specs = self._spec[slot] = {}
        self._clock += 1
        stamp = self._clock
        p = parent
        for key in keys:
            x = get(key)
            if x is None:
                # a new leaf: its masks follow from the parent's alone
                x = _Node(key, p)
                nodes[key] = x
                if p is not _ROOT:
                    _add_kid(p, x)
                if spec:
                    x.s = bit
                elif gpu:
                    x.g = bit
                else:
                    x.c = bit
                if p.ca & bit:
                    x.ca = bit
                    if (spec or gpu) and p.cg & bit:
                        x.cg = bit
                    elif spec or gpu:
                        p.pend |= bit
                else:
                    p.pend |= bit
            else:
                if x.parent is None and x is not p and p is not None:
                    self._relink(x, p)
                if spec:
                    x.s |= bit
                else:
                    if x.s & bit and specs is not None:  # the engine confirms a speculation
                        x.s ^= bit
                        specs.pop(key, None)
                    if gpu:
                        x.g |= bit
                    else:
                        x.c |= bit
                _refresh(x, bit)
            x.stamp = stamp
            p = x
        if spec:
            specs.update(dict.fromkeys(keys, spec_deadline))  # type: ignore[union-attr]
        if self.max_keys and p.kids is None:
            heappush(self._lru, (stamp, p.key))

    def _relink(self, node: _Node, parent: _Node) -> None:
        """Give a placeholder (parent unknown) its parent, then fix every holder's masks."""
        node.parent = parent
        if parent is not _ROOT:
            _add_kid(parent, node)
        held = node.g | node.c | node.s
        if held:
            _refresh(node, held)

    def _remove_key(self, slot: int, key: int, tier: Tier | None) -> _Node | None:
        node = self._nodes.get(key)
        if node is None:
            return None
        bit = 1 << slot
        if tier is None or tier is Tier.GPU:
            if node.s & bit:
                specs = self._spec.get(slot)
                if specs is not None:
                    specs.pop(key, None)
            node.g &= ~bit
            node.s &= ~bit
        if tier is None or tier is Tier.CPU:
            node.c &= ~bit
        _refresh(node, bit)
        self._maybe_delete(node)
        return node

    def _clear_bits(self, slot: int, key: int, spec_only: bool) -> None:
        node = self._nodes.get(key)
        if node is None:
            return
        node.s &= ~(1 << slot)
        _refresh(node, 1 << slot)
        self._maybe_delete(node)

    def _tier_update(
        self, target: str, emap: dict[int, int] | None, hashes: Sequence[int], tier: Tier
    ) -> int:
        slot = self._slot.get(target)
        if not emap or slot is None:
            return 0
        bit = 1 << slot
        done = 0
        for h in hashes:
            key = emap.get(h)
            node = self._nodes.get(key) if key is not None else None
            if node is None:
                continue
            if tier is Tier.GPU:
                node.g |= bit
            else:
                node.c |= bit
            _refresh(node, bit)
            done += 1
        return done

    def _maybe_delete(self, node: _Node) -> None:
        """Delete ``node`` and then each ancestor left without live holder and child."""
        live = self._live
        nodes = self._nodes
        while node is not _ROOT and node.kids is None and not ((node.g | node.c | node.s) & live):
            if nodes.get(node.key) is node:
                del nodes[node.key]
            parent = node.parent
            if parent is None or parent is _ROOT:
                return
            _del_kid(parent, node)
            if parent.kids is None and self.max_keys:
                parent.stamp = max(parent.stamp, node.stamp)
                heappush(self._lru, (parent.stamp, parent.key))
            node = parent

    def _touch(self, node: _Node | None) -> None:
        if node is None:
            return
        self._clock += 1
        node.stamp = self._clock
        if node.kids is None:
            heappush(self._lru, (node.stamp, node.key))

    def _after_store(self) -> None:
        if self.max_keys and len(self._nodes) > self.max_keys:
            self._evict()

    def _evict(self) -> None:
        nodes = self._nodes
        heap = self._lru
        if len(heap) > 2 * len(nodes) + 1024:  # drop stale entries now and then
            heap[:] = [(x.stamp, k) for k, x in nodes.items() if x.kids is None]
            heapify(heap)
        while len(nodes) > self.max_keys and heap:
            stamp, key = heappop(heap)
            node = nodes.get(key)
            if node is None or node.stamp != stamp or node.kids is not None:
                continue  # stale entry
            self._drop(node)

    def _drop(self, node: _Node) -> None:
        """Evict a leaf for every holder (its parent becomes a leaf with the leaf's recency)."""
        del self._nodes[node.key]
        self.evicted += 1
        parent = node.parent
        if parent is None or parent is _ROOT:
            return
        _del_kid(parent, node)
        if parent.kids is None:
            if not ((parent.g | parent.c | parent.s) & self._live):
                self._drop(parent)
                return
            parent.stamp = max(parent.stamp, node.stamp)
            heappush(self._lru, (parent.stamp, parent.key))

    def _scrub_step(self, budget: int) -> None:
        if self._scrub is None:
            if not self._dying:
                return
            self._scrub = (iter(list(self._nodes)), self._dying)
        keys, bits = self._scrub
        keep = ~bits
        nodes = self._nodes
        for key in keys:
            node = nodes.get(key)
            if node is not None:
                node.g &= keep
                node.c &= keep
                node.s &= keep
                node.ca &= keep
                node.cg &= keep
                node.pend &= keep
                if node.kids is None and not (node.g | node.c | node.s):
                    self._maybe_delete(node)
            budget -= 1
            if budget <= 0:
                return
        # a full pass is done: these slots hold no stale bit anywhere, reuse them
        self._scrub = None
        self._dying &= ~bits
        self._free.extend(_bits(bits))


# ---------------------------------------------------------------- tree helpers
def _add_kid(parent: _Node, kid: _Node) -> None:
    kids = parent.kids
    if kids is None:
        parent.kids = kid
    elif type(kids) is set:
        kids.add(kid)
    else:
        parent.kids = {kids, kid}


def _del_kid(parent: _Node, kid: _Node) -> None:
    kids = parent.kids
    if kids is kid:
        parent.kids = None
    elif type(kids) is set:
        kids.discard(kid)
        if len(kids) == 1:
            parent.kids = next(iter(kids))
        elif not kids:
            parent.kids = None


def _refresh(node: _Node, mask: int) -> None:
    """Recompute the consecutive masks for the bits of ``mask`` at ``node`` and below it.

    Descends into children only for bits that changed: lost bits always (children may hold
    them), gained bits only where ``pend`` says a child may be waiting for them.
    """
    stack = [(node, mask)]
    pop = stack.pop
    while stack:
        x, m = pop()
        p = x.parent
        if p is None:
            pa = pg = 0
        else:
            pa, pg = p.ca, p.cg
        held = x.g | x.c | x.s
        gs = x.g | x.s
        new_a = held & pa & m
        new_g = gs & pg & m
        old_a = x.ca & m
        old_g = x.cg & m
        waiting = ((held & ~new_a) | (gs & ~new_g)) & m
        if waiting and p is not None:
            p.pend |= waiting
        if new_a == old_a and new_g == old_g:
            continue
        x.ca ^= old_a ^ new_a
        x.cg ^= old_g ^ new_g
        kids = x.kids
        if kids is None:
            continue
        lost = (old_a & ~new_a) | (old_g & ~new_g)
        gained = ((new_a & ~old_a) | (new_g & ~old_g)) & x.pend
        down = lost | gained
        if not down:
            continue
        x.pend = (x.pend & ~gained) | lost
        if type(kids) is set:
            stack.extend(zip(kids, repeat(down)))
        else:
            stack.append((kids, down))


def _bits(mask: int) -> list[int]:
    """Indices of the set bits of a non-negative ``mask``."""
    if mask & (mask - 1) == 0:
        return [mask.bit_length() - 1] if mask else []
    if mask.bit_count() > 24:
        raw = np.frombuffer(mask.to_bytes((mask.bit_length() + 7) // 8, "little"), np.uint8)
        return np.flatnonzero(np.unpackbits(raw, bitorder="little")).tolist()
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


def _depths(
    keys: Sequence[int], n: int, get: Any, live: int, first: int, attr: Any
) -> list[tuple[int, int]]:
    """Change points of a consecutive mask along ``keys``: ``[(depth, bits), ...]`` where the
    targets of ``bits`` hold exactly ``depth`` leading blocks. The mask (live bits) never grows
    along the chain, so as an integer it never increases: each change point is one binary
    search; with many distinct depths a C-speed linear pass takes over."""
    out: list[tuple[int, int]] = []
    cur = first
    pos = 0
    budget = max(8, n >> 5)  # bisect probes cost ~log2(n) Python calls; a scan ~n C steps

    def val(i: int) -> int:
        x = get(keys[i])
        return -(attr(x) & live) if x is not None else 0

    while cur:
        if budget == 0:
            return out + _depths_linear(keys, n, get, live, cur, pos, attr)
        budget -= 1
        j = bisect_right(range(n), -cur, lo=pos + 1, key=val)
        if j >= n:
            out.append((n, cur))
            return out
        nxt = -val(j)
        out.append((j, cur & ~nxt))
        cur = nxt
        pos = j
    return out


def _depths_linear(
    keys: Sequence[int], n: int, get: Any, live: int, cur: int, pos: int, attr: Any
) -> list[tuple[int, int]]:
    vals = list(map(neg, map(and_, map(attr, map(get, keys[pos:], repeat(_EMPTY))), repeat(live))))
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
