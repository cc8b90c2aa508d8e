"""The prefix index: which target holds which block, on which tier.

Semantics (kept from the reference implementation; ``tests/test_index.py`` checks them against a
brute-force oracle):

- Keys are router block keys (``mesh.core.keys``): a key names a whole prefix.
- ``match(keys)`` returns, per target, its longest *consecutive* cached prefix of ``keys``
  (``Overlap.gpu_blocks`` leading blocks on the GPU, then ``cpu_blocks`` from the CPU tier).
  Targets with no overlap are absent.
- Speculative entries (``store_speculative``) count as GPU blocks until ``expire(now)`` passes
  their deadline or the engine's own store of the same key for that target confirms them.
- Engine events (``apply_stored``/``apply_removed``) name blocks by engine hash, mapped per target
  to router keys. An engine may hold several copies of one hash on a tier, each stored and
  removed by its own event: vLLM does not deduplicate GPU blocks (a block-aligned prompt served
  again recomputes its last block into a new block with the same hash), and its offloading
  connector's overlapping chunks list a block twice on the CPU tier. So a store on a tier of a
  hash that the target holds on that tier for the same key (tokens, or a tier update by hash) is
  one more copy; a removal without counts takes one copy away, and the block leaves the tier
  only with the last (the hash goes when no tier holds it). A removal's ``remaining`` counts
  (vLLM's ``remaining_copy_counts``) are the engine's word: 0 removes, n > 0 keeps the block
  with n copies. A hash stored again for other content (or named twice in one event) is a
  rename, not a copy: the block it named goes with every copy, as does every copy with
  ``tier=None`` removals, ``AllBlocksCleared`` and ``clear_target``. Engines that deduplicate
  (SGLang, the bundled engine) never store a held hash twice: for them nothing changes.

Structure (DESIGN.md, "Block keys"): a radix tree over blocks in which every node is addressed by
its chained key, so a node is one dict lookup away. Targets get bit *slots*; every node keeps
Python-int bitmasks of its holders per tier (``g`` GPU, ``c`` CPU, ``s`` speculative) and two
*consecutive* masks:

    ca(node) = (g | c | s)(node) & ca(parent)      targets holding the whole path, any tier
    cg(node) = (g | s)(node)     & cg(parent)      targets holding the whole path on the GPU

with ``ca(root) = cg(root) = all``. Along a request's chain both masks only lose bits, so as
integers they never increase: ``match`` finds each target's depth by binary search over the
chain (``bisect`` with a key) instead of visiting every block, and switches to a C-speed linear
pass (``map``) when a request has many distinct depths.

Nodes live in parallel arrays indexed by a node id (no Python object per node), so the garbage
collector never walks the index (a full collection over 1M list-shaped nodes took ~200 ms).
Usage notes: call ``expire(now)`` periodically (it ends speculation and scrubs removed targets);
``match`` results are plain dicts, valid as a snapshot.

Event-sized work (an event carries a chain): a new chain is written by slice assignments into
contiguous nids (fresh ones from arrays preallocated by ``_grow``, or one contiguous run of
recycled ones; scattered recycled nids by C-speed scatters); a holder joining ``_BULK_MIN`` or
more blocks laid out contiguously (a worker storing a shared system prompt) is added by slice
assignments after two key lookups (``_join_run``); a removal of ``_BULK_MIN`` or more blocks that
only one target holds on the GPU, each a leaf or the single parent of another removed block
(engines evict sessions' tails), is dropped by ``_drop_tail`` in a few C-speed passes; anything
else takes the per-block path, which defines the semantics (``tests/test_index_bulk.py`` checks
the bulk paths against it). Node memory: per node a dict entry and key object (shared with the
engine maps), 4+4-byte links, six mask pointers, a 4-byte ``_iota`` entry, up to a quarter of
preallocated slack; recency stamps only with a budget.

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
children's parent key. A store of a hash whose node the budget evicted is never counted as a
copy (the index cannot tell whether the tier held it): the index then forgets the block one copy
early, an under-claim, never an over-claim.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections import deque
from collections.abc import Mapping, Sequence
from heapq import heapify, heappop, heappush
from itertools import chain, repeat
from operator import eq, neg
from typing import Any

import numpy as np
import xxhash

from mesh.core.keys import block_keys
from policies.base import Overlap, Tier

_xxh3 = xxhash.xxh3_64_intdigest

# Node ids (nids) index parallel arrays, so that the index holds no per-node Python container:
# the garbage collector never walks millions of nodes (a full collection over 1M list nodes took
# ~200 ms; over these arrays a few ms). Two nids are reserved:
EMPTY = 0  # masks all 0: the parent of a node whose parent is unknown, and a missing key in scans
ROOT = 1  # masks all 1 (-1): the parent of a prompt's first block
_MANY = -1  # kid[n] when n has several children (they are in ``_kids[n]``); 0 = no child
_BULK_MIN = 16  # blocks from which one event's C-speed bulk passes beat the per-block loop
_SPEC = "spec"  # the tier of speculative stores (internal)


def chain_keys(tokens: Sequence[int] | np.ndarray, block_size: int, parent: int) -> list[int]:
    """Keys of the full blocks of ``tokens`` chained from ``parent`` (``mesh.core.keys.block_keys``)."""
    return block_keys(tokens, block_size, parent)


class PrefixIndex:
    def __init__(self, max_keys: int = 0, scrub_budget: int = 4096) -> None:
        if max_keys < 0:
            raise ValueError(f"max_keys must be >= 0, got {max_keys}")
        self.max_keys = max_keys  # 0 = unbounded
        self.scrub_budget = scrub_budget  # nodes scrubbed per expire() call
        # nodes: key -> nid, then one array or list per field, indexed by nid
        self._id: dict[int, int] = {}
        self._key: list[int] = [0, 0]  # the key objects of ``_id`` itself (engine maps share them)
        self._par = array("i", [EMPTY, EMPTY])  # EMPTY: parent unknown; ROOT: first block
        self._kid = array("i", [0, 0])  # 0: none; > ROOT: the only child; _MANY: see _kids
        self._kids: dict[int, set[int]] = {}
        self._stamp = array("q", [0, 0])  # LRU recency: one per node with a budget only (else never indexed)
        self._g = [0, -1]  # holders on the GPU
        self._c = [0, -1]  # holders on the CPU
        self._s = [0, -1]  # speculative holders (count as GPU)
        self._ca = [0, -1]  # holders of the whole path, any tier
        self._cg = [0, -1]  # holders of the whole path on the GPU
        self._pend = [0, 0]  # targets that may hold a child without this node's whole path
        # nids below ``_top`` are in use or in ``_free``; the arrays are preallocated beyond it
        # (``_grow``), with every field 0; ``_iota[n] == n`` (for slice-assigned links)
        self._top = 2
        self._iota = array("i", [0, 1])
        self._free: list[int] = []
        self._orphans: set[int] = set()  # placeholders: nodes whose parent is unknown
        # targets
        self._slot: dict[str, int] = {}  # live target -> slot (bit)
        self._tids: list[str | None] = []  # slot -> target (None: free or dying)
        self._gen: list[int] = []  # slot -> incarnation, bumped on retirement
        self._slots_free: list[int] = []  # scrubbed slots, reusable
        self._live = 0  # bits of live slots
        self._dying = 0  # bits retired and not yet scrubbed
        self._scrub: tuple[int, int] | None = None  # (next nid, bits being scrubbed)
        # engine layer and speculation
        self._emap: dict[str, dict[int, int]] = {}  # target -> engine hash -> key
        # target -> tier -> engine hash -> copies beyond the first: only hashes held 2+ times on
        # a tier (vLLM's duplicate blocks), so chains without duplicates never touch it. Its
        # hashes are always in the target's ``_emap``; empty dicts are dropped at once.
        self._copies: dict[str, dict[Tier, dict[int, int]]] = {}
        # With a budget only: target -> engine hashes the engine holds on its CPU tier. A node the
        # budget evicted takes its CPU bit with it, and the engine's later GPU removal must not
        # forget the hash (children stored below the CPU copy need it as their parent).
        self._offloaded: dict[str, set[int]] = {}
        self._spec: dict[int, dict[int, float]] = {}  # slot -> key -> speculative deadline
        self._spec_heap: list[tuple[float, int, int, int, Sequence[int]]] = []
        self._spec_seq = 0
        self._names_cache: dict[Any, tuple[str, ...]] = {}  # mask or (word, bits) -> targets
        self._hints_ca: dict[int, int] = {}  # match's search hints (verified before use)
        self._hints_cg: dict[int, int] = {}
        self._clock = 0
        self._lru: list[tuple[int, int]] = []  # (stamp, nid) of leaves, lazily invalidated
        self.evicted = 0  # keys evicted by the budget (a counter for metrics)

    # ------------------------------------------------------------------ slots
    def _slot_of(self, target: str) -> int:
        slot = self._slot.get(target)
        if slot is None:
            if self._slots_free:
                slot = self._slots_free.pop()
                self._tids[slot] = target
            else:
                slot = len(self._tids)
                self._tids.append(target)
                self._gen.append(0)
            self._slot[target] = slot
            self._live |= 1 << slot
            self._names_cache.clear()
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
        self._store_chain(slot, keys, tier, self._parent_nid(parent))
        self._after_store()

    def remove(self, target: str, keys: Sequence[int], tier: Tier | None = None) -> None:
        """Forget ``keys`` for ``target`` on ``tier`` (None: every tier, speculative included)."""
        slot = self._slot.get(target)
        if slot is None:
            return
        if tier is Tier.CPU:
            for key in reversed(keys):  # leaf first: no cascade below an already-removed node
                self._remove_key(slot, key, tier)
            return
        bit = 1 << slot
        if len(keys) >= _BULK_MIN and self._drop_tail(bit, keys[::-1]):
            return
        live = self._live
        ids, par, kid, free = self._id, self._par, self._kid, self._free
        g, c, s = self._g, self._c, self._s
        budget = self.max_keys
        for key in reversed(keys):  # leaf first: no cascade below an already-removed node
            n = ids.get(key)
            if n is None:
                continue
            if kid[n] == 0 and not s[n] & bit and not ((g[n] & ~bit) | c[n] | s[n]) & live:
                # the usual case, inlined (as in apply_removed): a leaf only this target held
                del ids[key]
                p = par[n]
                if p > ROOT:
                    if kid[p] == n:
                        kid[p] = 0
                        if not ((g[p] | c[p] | s[p]) & live):
                            self._maybe_delete(p)  # a placeholder left without children
                        elif budget:  # the parent became a leaf: it inherits the recency
                            stamp_a = self._stamp
                            stamp_a[p] = max(stamp_a[p], stamp_a[n])
                            heappush(self._lru, (stamp_a[p], p))
                    else:
                        self._del_kid(p, n)
                        if budget:  # a parent keeps its subtree's recency for when it is a leaf
                            stamp_a = self._stamp
                            stamp_a[p] = max(stamp_a[p], stamp_a[n])
                elif p == EMPTY:
                    self._orphans.discard(n)
                free.append(n)
                continue
            self._remove_key(slot, key, tier)

    def clear_target(self, target: str) -> None:
        """Drop every entry of ``target`` at once (O(1); nodes are scrubbed incrementally)."""
        self._emap.pop(target, None)
        self._copies.pop(target, None)
        self._offloaded.pop(target, None)
        slot = self._slot.pop(target, None)
        if slot is None:
            return
        bit = 1 << slot
        self._spec.pop(slot, None)
        self._live &= ~bit
        self._dying |= bit
        self._tids[slot] = None
        self._gen[slot] += 1
        self._names_cache.clear()

    def store_speculative(self, target: str, keys: Sequence[int], expires_at: float) -> None:
        """Count ``keys`` (a chain from a prompt's first block) as held on the GPU by ``target``
        until ``expires_at`` (see ``expire``) or until the engine's event confirms a key."""
        n = len(keys)
        if not n:
            return
        slot = self._slot_of(target)
        bit = 1 << slot
        get = self._id.get
        cg = self._cg
        # blocks already consecutive on the GPU need nothing: skip them with one binary search
        depth = bisect_right(range(n), 0, key=lambda i: 0 if cg[get(keys[i], EMPTY)] & bit else 1)
        if depth >= n:
            return
        tail = keys[depth:]
        parent = self._id[keys[depth - 1]] if depth else ROOT
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
            bit = 1 << slot
            for key in reversed(keys):
                if specs.get(key) == deadline:
                    del specs[key]
                    ended += 1
                    n = self._id.get(key)
                    if n is not None:
                        self._s[n] &= ~bit
                        self._refresh(n, bit)
                        self._maybe_delete(n)
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
        *,
        keys: Sequence[int] | None = None,
    ) -> int:
        """Apply an engine's BlockStored; returns the number of blocks applied.

        Router keys are chained from the parent's router key (the seed at a prompt's start), so
        they never depend on the engine's hash function. A store whose parent engine hash is
        unknown cannot be keyed and is skipped (returns 0). A store without tokens is a tier
        update of blocks already known by engine hash. A store on a tier of a hash the target
        holds on that tier for the same key is one more copy of it (module notes). Raises
        ValueError when ``token_ids`` do not cover exactly ``len(engine_hashes)`` blocks or hold
        a bad token id.

        ``keys``: the blocks' router keys when the caller already has them (they must equal
        ``chain_keys(token_ids, block_size, <the parent's key or seed>)``; not rechecked), so
        hashing can run elsewhere (benchmarks measure the index alone with it).
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
            parent_key = seed
        else:
            found = emap.get(parent_engine_hash) if emap else None
            if found is None:
                return 0
            parent_key = found
        if keys is None:
            keys = chain_keys(token_ids, block_size, parent_key)
        elif len(keys) != n:
            raise ValueError(f"BlockStored has {n} blocks but {len(keys)} keys were given")
        slot = self._slot_of(target)
        if emap is None:
            emap = self._emap[target] = {}
        elif not emap.keys().isdisjoint(engine_hashes):
            self._forget_renamed(target, emap, engine_hashes, keys)
            self._count_copies(target, slot, emap, engine_hashes, keys, tier)
        if tier is Tier.CPU and self.max_keys:
            self._offloaded.setdefault(target, set()).update(engine_hashes)
        # the parent's nid only now: a renamed hash may have removed the parent's node
        parent = ROOT if parent_engine_hash is None else self._parent_nid(parent_key)
        ids = self._id
        size = len(emap)
        joined = keys[0] in ids  # e.g. a shared system prompt: the map shares the index's key objects
        if not joined and not self._orphans:  # the usual agentic turn: a new chain (see _store_chain)
            self._clock += 1
            gpu = tier is Tier.GPU
            self._new_chain(1 << slot, keys, self._g if gpu else self._c, gpu, parent, self._clock)
            if self.max_keys:
                heappush(self._lru, (self._clock, ids[keys[-1]]))
            emap.update(zip(engine_hashes, keys))
            if len(emap) - size != n:  # some hash was known, or named two blocks of this event
                self._forget_repeated(slot, engine_hashes, keys)
            self._after_store()
            return n
        run = self._store_chain(slot, keys, tier, parent)
        if joined:
            key_a = self._key
            if run is not None and run[1] == n:  # joined in bulk: the chain's nids are contiguous
                keys = key_a[run[0] : run[0] + n]
            else:
                keys = list(map(key_a.__getitem__, map(ids.__getitem__, keys)))
        emap.update(zip(engine_hashes, keys))
        if len(emap) - size != n:  # some hash was known, or named two blocks of this event
            self._forget_repeated(slot, engine_hashes, keys)
        self._after_store()
        return n

    def _forget_renamed(
        self, target: str, emap: dict[int, int], engine_hashes: Sequence[int], keys: Sequence[int]
    ) -> None:
        """An engine hash names one block of its engine: stored again for other content (an engine
        restarted with another hash seed and no reset, a colliding or careless publisher), the
        block it named is gone from that engine. Its old key is removed for ``target`` on every
        tier and every copy, as BlockRemoved events would (else the target kept claiming it for
        good). A hash stored again for the same key is another copy (``_count_copies``)."""
        renamed = [h for h, key in zip(engine_hashes, keys) if emap.get(h, key) != key]
        if renamed:
            self.apply_removed(target, renamed, None)

    def _count_copies(
        self, target: str, slot: int, emap: dict[int, int], engine_hashes: Sequence[int], keys: Sequence[int],
        tier: Tier,
    ) -> None:
        """Before a store on ``tier`` is written: each of its hashes already mapped to the same key
        (after ``_forget_renamed``) is one more copy when the target holds that key on ``tier``,
        else (held on the other tier only, or its node evicted by the budget) the first again."""
        bit = 1 << slot
        ids = self._id
        field = self._g if tier is Tier.GPU else self._c
        extra = self._tier_copies(target, tier)
        for h, key in zip(engine_hashes, keys):
            if emap.get(h) != key:
                continue  # new to the target (or renamed: forgotten with every copy)
            n = ids.get(key)
            if n is not None and field[n] & bit:
                extra[h] = extra.get(h, 0) + 1
            else:
                extra.pop(h, None)
        self._prune_copies(target)

    def _tier_copies(self, target: str, tier: Tier) -> dict[int, int]:
        """``target``'s copy counts on ``tier``, created empty (``_prune_copies`` drops it again)."""
        per = self._copies.get(target)
        if per is None:
            per = self._copies[target] = {}
        extra = per.get(tier)
        if extra is None:
            extra = per[tier] = {}
        return extra

    def _prune_copies(self, target: str, emap: dict[int, int] | None = None,
                      hashes: Sequence[int] = ()) -> None:
        """Drop ``target``'s empty count dicts, and first the counts of ``hashes`` that left
        ``emap`` (a hash no tier holds has no copy on any)."""
        per = self._copies.get(target)
        if per is None:
            return
        for tier, extra in list(per.items()):
            if emap is not None and extra and not extra.keys().isdisjoint(hashes):
                for h in hashes:
                    if h in extra and h not in emap:
                        del extra[h]
            if not extra:
                del per[tier]
        if not per:
            del self._copies[target]

    def _forget_repeated(self, slot: int, engine_hashes: Sequence[int], keys: Sequence[int]) -> None:
        """A hash that names two blocks of one event names the later one (the map kept it), as a
        hash stored again for other content does: the earlier block is gone from that engine and
        is removed for the target on every tier (else it stayed claimed for good)."""
        last = dict(zip(engine_hashes, keys))
        if len(last) == len(keys):
            return
        for h, key in zip(reversed(engine_hashes), reversed(keys)):  # leaf first
            if last[h] != key:
                self._remove_key(slot, key, None)

    def apply_removed(
        self,
        target: str,
        engine_hashes: Sequence[int],
        tier: Tier | None = Tier.GPU,
        remaining: Sequence[int] | None = None,
    ) -> int:
        """Apply an engine's BlockRemoved from ``tier`` (None: every tier and every copy).
        ``remaining``: the copies of each hash the engine still holds after this removal (vLLM's
        ``remaining_copy_counts``, one per hash; None when the engine does not say): 0 removes
        the block, n > 0 keeps it. Without it a removal takes one copy away. Returns the number
        of blocks that resolved to a known key (kept or removed)."""
        emap = self._emap.get(target)
        slot = self._slot.get(target)
        if not emap or slot is None:
            return 0
        kept = 0
        if target in self._copies or (remaining is not None and any(remaining)):
            engine_hashes, kept = self._take_copies(target, emap, engine_hashes, tier, remaining)
            if not engine_hashes:
                return kept
        elif remaining is not None and len(remaining) != len(engine_hashes):
            raise ValueError(f"BlockRemoved has {len(engine_hashes)} hashes but {len(remaining)} copy counts")
        bit = 1 << slot
        if tier is not Tier.CPU and len(engine_hashes) >= _BULK_MIN:
            keys = list(map(emap.get, engine_hashes))
            if None not in keys and self._drop_tail(bit, keys):
                deque(map(emap.__delitem__, engine_hashes), 0)
                if target in self._copies:
                    self._prune_copies(target, emap, engine_hashes)
                return kept + len(keys)
        live = self._live
        ids, par, kid, free = self._id, self._par, self._kid, self._free
        g, c, s = self._g, self._c, self._s
        budget = self.max_keys
        done = 0
        for h in engine_hashes:  # in eviction order: engines free a chain's tail first
            key = emap.get(h)
            if key is None:
                continue
            done += 1
            n = ids.get(key)
            if n is not None and tier is not Tier.CPU and kid[n] == 0 and not s[n] & bit \
                    and not ((g[n] & ~bit) | c[n] | s[n]) & live:
                # the usual case, inlined: a leaf that only this target held goes away
                del emap[h]
                del ids[key]
                p = par[n]
                if p > ROOT:
                    if kid[p] == n:
                        kid[p] = 0
                        if not ((g[p] | c[p] | s[p]) & live):
                            self._maybe_delete(p)  # a placeholder left without children
                        elif budget:  # the parent became a leaf: it inherits the recency (as in remove)
                            stamp_a = self._stamp
                            stamp_a[p] = max(stamp_a[p], stamp_a[n])
                            heappush(self._lru, (stamp_a[p], p))
                    else:
                        self._del_kid(p, n)
                        if budget:  # a parent keeps its subtree's recency for when it is a leaf
                            stamp_a = self._stamp
                            stamp_a[p] = max(stamp_a[p], stamp_a[n])
                elif p == EMPTY:
                    self._orphans.discard(n)
                free.append(n)
                continue
            n = self._remove_key(slot, key, tier)
            if n is None and tier is Tier.GPU and h in self._offloaded.get(target, ()):
                continue  # evicted from the index, still on the engine's CPU tier: keep its key
            if n is None or not ((g[n] | c[n]) & bit):
                del emap[h]
        if budget and tier is not Tier.GPU and target in self._offloaded:
            self._offloaded[target].difference_update(engine_hashes)
        if target in self._copies:  # a hash forgotten takes its counts along
            self._prune_copies(target, emap, engine_hashes)
        return kept + done

    def _take_copies(
        self,
        target: str,
        emap: dict[int, int],
        engine_hashes: Sequence[int],
        tier: Tier | None,
        remaining: Sequence[int] | None,
    ) -> tuple[Sequence[int], int]:
        """The copy accounting of a removal, before any block goes: returns the hashes whose
        block leaves ``tier`` (in order) and how many entries only took copies away (known hashes
        kept). Entries apply in order; a kept entry after one that removed the same hash is
        ignored (the engine cannot still hold a block it removed in the same event)."""
        if remaining is not None and len(remaining) != len(engine_hashes):
            raise ValueError(f"BlockRemoved has {len(engine_hashes)} hashes but {len(remaining)} copy counts")
        per = self._copies.get(target)
        if tier is None:  # every tier, every copy
            if per:
                for extra in per.values():
                    for h in engine_hashes:
                        extra.pop(h, None)
                self._prune_copies(target)
            return engine_hashes, 0
        extra = per.get(tier, {}) if per else {}
        counted = remaining is not None and any(remaining)
        if not counted and (not extra or extra.keys().isdisjoint(engine_hashes)):
            return engine_hashes, 0  # no copy of these on this tier (the usual case)
        out: list[int] = []
        kept = 0
        if remaining is None:  # one copy goes
            for h in engine_hashes:
                c = extra.get(h)
                if c is None:
                    out.append(h)
                    continue
                kept += 1
                if c > 1:
                    extra[h] = c - 1
                else:
                    del extra[h]
        else:  # the engine's counts: authoritative
            extra = self._tier_copies(target, tier)
            gone: set[int] = set()
            for h, r in zip(engine_hashes, remaining):
                if not r:
                    gone.add(h)
                    out.append(h)
                    extra.pop(h, None)
                elif h not in gone and h in emap:
                    kept += 1
                    if r > 1:
                        extra[h] = r - 1
                    else:
                        extra.pop(h, None)
        self._prune_copies(target)
        return out, kept

    def apply_cleared(self, target: str) -> None:
        """Apply an engine's AllBlocksCleared."""
        self.clear_target(target)

    # ------------------------------------------------------------------ reads
    def match(self, keys: Sequence[int]) -> Mapping[str, Overlap]:
        n = len(keys)
        if not n:
            return {}
        get = self._id.get
        first = get(keys[0], EMPTY)
        live = self._live
        if self._scrub is None:
            ca, cg = self._ca, self._cg
        else:  # a scrub pass clears parents before children: compare live bits only
            ca = [v & live for v in map(self._ca.__getitem__, map(get, keys, repeat(EMPTY)))]
            cg = [v & live for v in map(self._cg.__getitem__, map(get, keys, repeat(EMPTY)))]
            get = _position(keys).get
            first = 0
        if not (ca[first] & live):
            return {}
        total = _live_groups(_depths(keys, n, get, ca[first], ca, self._hints_ca), live)
        if not total:
            return {}
        if self.max_keys:
            self._touch(self._id.get(keys[total[-1][0] - 1], EMPTY))
        # a target whose whole prefix is on the GPU is in CG at its last block; only when some
        # target is not (a CPU-tier block in its prefix) does the GPU depth need its own search
        gpu: list[tuple[int, int]] | None = None
        for depth, mask in total:
            if cg[get(keys[depth - 1], EMPTY)] & mask != mask:
                gpu = _live_groups(_depths(keys, n, get, cg[first], cg, self._hints_cg), live) if cg[first] & live else []
                break
        names = self._names
        if gpu is None:  # the usual case: every target's prefix is on the GPU
            # all holders of the first block (the same set for every prompt that starts alike,
            # so its names are cached) at the shallowest depth, then the deeper groups on top
            out = dict.fromkeys(names(ca[first] & live), Overlap(total[0][0], 0))
            for depth, mask in total[1:]:
                out.update(dict.fromkeys(names(mask), Overlap(depth, 0)))
            return out
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

    def _names(self, mask: int) -> tuple[str, ...]:
        """The targets of the bits of ``mask``. Holder sets recur from query to query (the
        holders of a system prompt), and so do their 64-bit words when the sets differ a little:
        both are cached until a slot changes hands."""
        cache = self._names_cache
        names = cache.get(mask)
        if names is None:
            if len(cache) >= 8192:
                cache.clear()
            if mask >> 64 == 0:
                names = self._word_names(0, mask)
            else:
                words = array("Q")
                words.frombytes(mask.to_bytes(((mask.bit_length() + 63) >> 6) << 3, "little"))
                word_names = self._word_names
                names = tuple(chain.from_iterable([word_names(i, w) for i, w in enumerate(words) if w]))
            cache[mask] = names
        return names

    def _word_names(self, word: int, bits: int) -> tuple[str, ...]:
        key = -((bits << 16) | word) - 1  # negative: never a mask
        names = self._names_cache.get(key)
        if names is None:
            tids = self._tids
            base = word << 6
            names = self._names_cache[key] = tuple([tids[base + i] for i in _bits(bits)])  # type: ignore[misc]
        return names

    def holds(self, target: str, key: int) -> Tier | None:
        slot = self._slot.get(target)
        n = self._id.get(key)
        if slot is None or n is None:
            return None
        bit = 1 << slot
        if (self._g[n] | self._s[n]) & bit:
            return Tier.GPU
        return Tier.CPU if self._c[n] & bit else None

    def keys_of(self, target: str) -> set[int]:
        slot = self._slot.get(target)
        if slot is None:
            return set()
        bit = 1 << slot
        g, c, s = self._g, self._c, self._s
        return {k for k, n in self._id.items() if (g[n] | c[n] | s[n]) & bit}

    def engine_map(self, target: str) -> dict[int, int]:
        """A copy of ``target``'s engine hash -> router key map (tests, debugging)."""
        return dict(self._emap.get(target, {}))

    def engine_copies(self, target: str, tier: Tier = Tier.GPU) -> dict[int, int]:
        """``target``'s engine hashes held in 2+ copies on ``tier`` -> their copies (tests, debugging)."""
        return {h: c + 1 for h, c in self._copies.get(target, {}).get(tier, {}).items()}

    def stats(self) -> dict[str, int]:
        return {
            "keys": len(self._id),
            "targets": len(self._slot),
            "engine_hashes": sum(map(len, self._emap.values())),
            "engine_copies": sum(sum(d.values()) for per in self._copies.values() for d in per.values()),  # beyond the first
            "speculative": sum(map(len, self._spec.values())),
            "dying_slots": self._dying.bit_count(),
            "evicted": self.evicted,
        }

    def __len__(self) -> int:
        return len(self._id)

    # -------------------------------------------------------------- node storage
    def _alloc(self, key: int, parent: int, stamp: int) -> int:
        """A fresh node (masks 0, no child) under ``parent``; links it as a child."""
        if self._free:
            n = self._free.pop()
            self._key[n] = key
            self._par[n] = parent
            self._kid[n] = 0
            if self.max_keys:
                self._stamp[n] = stamp
            self._g[n] = self._c[n] = self._s[n] = self._ca[n] = self._cg[n] = self._pend[n] = 0
        else:  # a fresh slot: its fields are still all 0
            n = self._top
            self._top += 1
            if n >= len(self._key):
                self._grow(n + 1)
            self._key[n] = key
            self._par[n] = parent
            if self.max_keys:
                self._stamp[n] = stamp
        self._id[key] = n
        if parent > ROOT:
            self._add_kid(parent, n)
        return n

    def _add_kid(self, parent: int, kid: int) -> None:
        kids = self._kid[parent]
        if kids == 0:
            self._kid[parent] = kid
        elif kids == _MANY:
            self._kids[parent].add(kid)
        else:
            self._kids[parent] = {kids, kid}
            self._kid[parent] = _MANY

    def _del_kid(self, parent: int, kid: int) -> None:
        kids = self._kid[parent]
        if kids == kid:
            self._kid[parent] = 0
        elif kids == _MANY:
            many = self._kids[parent]
            many.discard(kid)
            if len(many) == 1:
                self._kid[parent] = many.pop()
                del self._kids[parent]

    def _children(self, n: int) -> list[int]:
        kids = self._kid[n]
        if kids == 0:
            return []
        return list(self._kids[n]) if kids == _MANY else [kids]

    def _free_node(self, n: int) -> None:
        """Forget node ``n`` (a leaf): unlink it from its parent, recycle its nid."""
        del self._id[self._key[n]]
        parent = self._par[n]
        if parent > ROOT:
            self._del_kid(parent, n)
        elif parent == EMPTY:
            self._orphans.discard(n)
        self._free.append(n)  # its fields are all rewritten when the nid is reused

    def _parent_nid(self, parent: int | None) -> int:
        """The node of key ``parent`` (ROOT for None), a holder-less placeholder if unknown."""
        if parent is None:
            return ROOT
        n = self._id.get(parent)
        if n is None:
            n = self._alloc(parent, EMPTY, self._clock)
            self._orphans.add(n)
        return n

    # -------------------------------------------------------------- the store path
    def _store_chain(
        self,
        slot: int,
        keys: Sequence[int],
        tier: Tier | str,
        parent: int,
        spec_deadline: float | None = None,
    ) -> tuple[int, int] | None:
        """The hot path of every store: one pass down the chain, parent before child. Returns
        ``(first nid, length)`` of the leading run that was joined in bulk (``_join_run``), if any."""
        bit = 1 << slot
        get = self._id.get
        spec = tier is _SPEC
        gpuish = spec or tier is Tier.GPU
        field = self._s if spec else self._g if gpuish else self._c
        s = self._s
        specs = self._spec.get(slot)
        if spec and specs is None:
            specs = self._spec[slot] = {}
        self._clock += 1
        stamp = self._clock
        par, kid, stamp_a, budget = self._par, self._kid, self._stamp, self.max_keys
        g, ca, cg, pend = self._g, self._ca, self._cg, self._pend
        p = parent
        todo, joined = keys, None
        if not spec and len(keys) >= _BULK_MIN and keys[0] in self._id:
            joined = self._join_run(bit, keys, field, gpuish, p, stamp)
            if joined is not None:
                lo, run = joined
                p = lo + run - 1
                todo = keys[run:] if run < len(keys) else ()
        for i, key in enumerate(todo):
            x = get(key)
            if x is None:
                rest = todo[i:] if i else todo
                # the usual case: the rest is new (only a placeholder can lie below a new block)
                if not self._orphans or not any(map(get, rest)):
                    self._new_chain(bit, rest, field, gpuish, p, stamp)
                    break
                self._new_chain(bit, rest[:1], field, gpuish, p, stamp)  # a placeholder lies below
                x = self._id[key]
            else:  # a block already indexed (for someone): add this holder
                if par[x] == EMPTY and x != p:
                    self._relink(x, p)
                if not spec and s[x] & bit:  # the engine confirms a speculation
                    s[x] ^= bit
                    if specs is not None:
                        specs.pop(key, None)
                field[x] |= bit
                # _refresh(x, bit), inlined for the one bit that changed
                pp = par[x]
                new_a = ca[pp] & bit
                new_g = cg[pp] & bit if (g[x] | s[x]) & bit else 0
                old_a = ca[x] & bit
                old_g = cg[x] & bit
                if new_a != old_a or new_g != old_g:
                    ca[x] ^= old_a ^ new_a
                    cg[x] ^= old_g ^ new_g
                    if kid[x]:
                        lost = (old_a & ~new_a) | (old_g & ~new_g)
                        # gained bits matter only where a child may wait for them (pend)
                        if lost or (new_a | new_g) & pend[x]:
                            self._descend(x, lost, (new_a & ~old_a) | (new_g & ~old_g))
                if (not new_a or ((g[x] | s[x]) & bit and not new_g)) and pp > ROOT:
                    pend[pp] |= bit
                if budget:
                    stamp_a[x] = stamp
            p = x
        if spec:
            specs.update(dict.fromkeys(keys, spec_deadline))  # type: ignore[union-attr]
        if self.max_keys:
            last = get(keys[-1])
            if last is not None and self._kid[last] == 0:
                heappush(self._lru, (stamp, last))
        return joined

    def _join_run(
        self, bit: int, keys: Sequence[int], field: list[int], gpuish: bool, p: int, stamp: int
    ) -> tuple[int, int] | None:
        """The bulk form of adding a holder to blocks already indexed (a worker storing a shared
        system prompt): the leading run of ``keys`` that is indexed as a chain below ``p`` in
        *contiguous* nids (as ``_new_chain`` lays chains out), that the target holds on no tier,
        and where no child waits for its bit (``pend``). Then the run needs no key lookup but
        its two ends (a live last node makes its ancestors live, and live nodes' keys and links
        are exact), and its masks gain the bit by slice assignments. Returns the run's first nid
        and length (None: nothing done, the per-block path handles every block)."""
        ids = self._id
        lo = ids.get(keys[0])
        g, c, s = self._g, self._c, self._s
        if lo is None or self._par[lo] != p or (g[lo] | c[lo] | s[lo]) & bit:  # cheapest checks first
            return None
        head = self._key[lo : lo + len(keys)]
        if type(keys) is list and head == keys:
            run = len(keys)
        else:
            same = list(map(eq, head, keys))  # as long as the shorter of the two
            run = same.index(False) if False in same else len(same)
        if run < _BULK_MIN:
            return None
        hi = lo + run
        par = self._par
        if ids.get(keys[run - 1]) != hi - 1 or par[lo + 1 : hi] != array("i", range(lo, hi - 1)):
            return None
        ca, cg, pend = self._ca, self._cg, self._pend
        for arr in (g, c, s, pend):
            vals = arr[lo:hi]
            first = vals[0]
            if first & bit or (vals.count(first) != run and any(map(bit.__and__, vals))):
                return None
        ca_v = bit if ca[p] & bit else 0
        cg_v = bit if gpuish and cg[p] & bit else 0
        _or_range(field, lo, hi, bit)
        if ca_v:
            _or_range(ca, lo, hi, bit)
        if cg_v:
            _or_range(cg, lo, hi, bit)
        if not ca_v or (gpuish and not cg_v):  # not consecutive: every parent may have a child waiting
            if p > ROOT:
                pend[p] |= bit
            _or_range(pend, lo, hi - 1, bit)
        if self.max_keys:
            self._stamp[lo:hi] = array("q", [stamp]) * run
        return lo, run

    def _new_chain(self, bit: int, keys: Sequence[int], field: list[int], gpuish: bool, p: int, stamp: int) -> None:
        """Blocks new to the index, under node ``p``: every one gets the same masks (each is
        consecutive exactly when ``p`` is), so they are written in one tight pass: a few
        recycled nids one by one, a contiguous run of them (an evicted tail's) or fresh nids by
        slice assignments, any other recycled ones by C-speed scatters."""
        ca_v = bit if self._ca[p] & bit else 0
        cg_v = bit if gpuish and self._cg[p] & bit else 0
        waiting = bit if not ca_v or (gpuish and not cg_v) else 0
        if waiting and p > ROOT:
            self._pend[p] |= waiting
        g, c, s, ca, cg, pend = self._g, self._c, self._s, self._ca, self._cg, self._pend
        masks = ((bit if field is g else 0), (bit if field is c else 0), (bit if field is s else 0), ca_v, cg_v, waiting)
        key_a, par, kid, stamp_a, ids, free = self._key, self._par, self._kid, self._stamp, self._id, self._free
        m = len(keys)
        k = min(m, len(free))
        if 0 < k < _BULK_MIN:  # a few recycled nids: one by one
            gv, cv, sv = masks[:3]
            for key in keys[:k] if k < m else keys:
                x = free.pop()
                key_a[x] = key
                par[x] = p
                kid[x] = 0
                if self.max_keys:
                    stamp_a[x] = stamp
                g[x], c[x], s[x], ca[x], cg[x], pend[x] = gv, cv, sv, ca_v, cg_v, waiting
                ids[key] = x
                if p > ROOT:
                    if kid[p] == 0:
                        kid[p] = x
                    else:
                        self._add_kid(p, x)
                p = x
        elif k:
            xs = free[-k:]
            del free[-k:]
            head = keys[:k] if k < m else keys
            lo = min(xs)
            if max(xs) - lo == k - 1:  # one contiguous run (the nids are distinct): the usual evicted tail
                p = self._write_run(lo, head, p, masks, stamp)
            else:  # scattered (sorting them into runs cost more than it saved): C-speed scatters
                for arr, vals in ((key_a, head), (par, chain((p,), xs[:-1])), (kid, chain(xs[1:], (0,))),
                                  *((arr, repeat(v, k)) for arr, v in zip((g, c, s, ca, cg, pend), masks))):
                    deque(map(arr.__setitem__, xs, vals), 0)
                if self.max_keys:
                    deque(map(stamp_a.__setitem__, xs, repeat(stamp, k)), 0)
                ids.update(zip(head, xs))
                if p > ROOT:
                    if kid[p] == 0:
                        kid[p] = xs[0]
                    else:
                        self._add_kid(p, xs[0])
                p = xs[-1]
        if k < m:
            tail = keys[k:] if k else keys
            n0 = self._top
            self._top = n0 + m - k
            if self._top > len(key_a):
                self._grow(self._top)
            p = self._write_run(n0, tail if type(tail) is list else [int(x) for x in tail], p, masks, stamp, fresh=True)
        pend[p] = 0  # the last new block has no child yet

    def _write_run(
        self, lo: int, keys: Sequence[int], p: int, masks: tuple[int, ...], stamp: int, fresh: bool = False
    ) -> int:
        """Write the chain ``keys`` below ``p`` into the free nids ``lo .. lo + len(keys) - 1``
        (ascending: each the parent of the next), masks ``(g, c, s, ca, cg, pend)`` on every
        one, by slice assignments. ``fresh``: the nids were never used (every field still 0, so
        zero masks need no write). Returns the last nid."""
        r = len(keys)
        hi = lo + r
        iota, par, kid = self._iota, self._par, self._kid
        self._key[lo:hi] = keys
        par[lo] = p
        par[lo + 1 : hi] = iota[lo : hi - 1]
        kid[lo : hi - 1] = iota[lo + 1 : hi]
        kid[hi - 1] = 0
        filled: dict[int, list[int]] = {}  # one list per distinct mask value (usually 0 and the bit)
        for arr, v in zip((self._g, self._c, self._s, self._ca, self._cg, self._pend), masks):
            if fresh and not v:
                continue
            vals = filled.get(v)
            if vals is None:
                vals = filled[v] = [v] * r
            arr[lo:hi] = vals
        if self.max_keys:
            self._stamp[lo:hi] = array("q", [stamp]) * r
        self._id.update(zip(keys, range(lo, hi)))
        if p > ROOT:
            if kid[p] == 0:
                kid[p] = lo
            else:
                self._add_kid(p, lo)
        return hi - 1

    def _grow(self, need: int) -> None:
        """Make the node arrays hold at least ``need`` nids, by a quarter of their size at least: nodes
        are written into preallocated slots (a list grown by ``extend`` a little at a time is
        copied to new memory over and over; this costs ~100 ns per block over 6 lists)."""
        old = len(self._key)
        add = max(need, old + (old >> 2), 1024) - old
        for arr in (self._key, self._g, self._c, self._s, self._ca, self._cg, self._pend):
            arr += [0] * add
        zeros = bytes(4 * add)
        self._par.frombytes(zeros)
        self._kid.frombytes(zeros)
        self._iota.frombytes(np.arange(old, old + add, dtype=np.int32).tobytes())
        if self.max_keys:
            self._stamp.frombytes(bytes(8 * add))

    def _refresh(self, x: int, m: int) -> None:
        """Recompute the consecutive masks for the bits of ``m`` at node ``x`` and below it.

        Descends into children only for bits that changed: lost bits always (children may hold
        them), gained bits only where ``pend`` says a child may be waiting for them. Allocates
        nothing unless it must descend (the common case: a leaf, or an unchanged node).
        """
        par, g, c, s, ca, cg, pend = self._par, self._g, self._c, self._s, self._ca, self._cg, self._pend
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
                if self._kid[x]:
                    down = self._down(x, (old_a & ~new_a) | (old_g & ~new_g), (new_a & ~old_a) | (new_g & ~old_g))
                    if down:
                        if stack is None:
                            stack = []
                        stack.extend(zip(self._children(x), repeat(down)))
            if not stack:
                return
            x, m = stack.pop()

    def _down(self, x: int, lost: int, gained: int) -> int:
        """Bits to recompute in ``x``'s children after its consecutive masks lost ``lost`` and
        gained ``gained``: every lost bit, and the gained bits a child may be waiting for."""
        pend = self._pend
        gained &= pend[x]
        down = lost | gained
        if down:
            pend[x] = (pend[x] & ~gained) | lost
        return down

    def _descend(self, x: int, lost: int, gained: int) -> None:
        down = self._down(x, lost, gained)
        if down:
            g, c, s, ca, cg = self._g, self._c, self._s, self._ca, self._cg
            for child in self._children(x):
                # a child that neither holds nor has consecutive any bit of ``down`` is unchanged
                if (g[child] | c[child] | s[child] | ca[child] | cg[child]) & down:
                    self._refresh(child, down)

    def _relink(self, n: int, parent: int) -> None:
        """Give a placeholder (parent unknown) its parent, then fix every holder's masks."""
        self._par[n] = parent
        self._orphans.discard(n)
        if parent > ROOT:
            self._add_kid(parent, n)
        held = self._g[n] | self._c[n] | self._s[n]
        if held:
            self._refresh(n, held)

    # ------------------------------------------------------------ the remove path
    def _drop_tail(self, bit: int, keys: Sequence[int]) -> bool:
        """The bulk form of the usual removal: ``keys`` are blocks that only ``bit``'s target
        holds, on the GPU only, each a leaf or the parent of a single child that is removed too
        (the tails of one or several chains: an engine evicting sessions' tails). Then they all
        go in a few C-speed passes and True is returned; otherwise nothing changes and False is
        returned (the per-block path runs). The order of ``keys`` does not matter."""
        nids = list(map(self._id.get, keys))
        if None in nids:
            return False
        g, c, s, kid = self._g, self._c, self._s, self._kid
        if list(map(g.__getitem__, nids)).count(bit) != len(nids):  # shared, or a retired slot's bit
            return False
        kids = list(map(kid.__getitem__, nids))
        gone = set(nids)
        if (
            len(gone) != len(nids)
            or _MANY in kids
            or not gone.issuperset(filter(None, kids))
            or any(map(c.__getitem__, nids))
            or any(map(s.__getitem__, nids))
        ):
            return False
        deque(map(self._id.__delitem__, keys), 0)
        self._free.extend(nids)
        par, live, budget = self._par, self._live, self.max_keys
        for top in gone.difference(kids):  # the removed nodes whose parent stays
            p = par[top]
            if p > ROOT:
                if kid[p] == top:
                    kid[p] = 0
                    if not ((g[p] | c[p] | s[p]) & live):
                        self._maybe_delete(p)  # a placeholder left without children
                    elif budget:  # the parent became a leaf: it inherits the recency
                        stamp_a = self._stamp
                        stamp_a[p] = max(stamp_a[p], max(map(stamp_a.__getitem__, nids)))
                        heappush(self._lru, (stamp_a[p], p))
                else:
                    self._del_kid(p, top)
                    if budget:  # a parent keeps its subtree's recency for when it is a leaf
                        stamp_a = self._stamp
                        stamp_a[p] = max(stamp_a[p], max(map(stamp_a.__getitem__, nids)))
            elif p == EMPTY:
                self._orphans.discard(top)
        return True

    def _remove_key(self, slot: int, key: int, tier: Tier | None) -> int | None:
        n = self._id.get(key)
        if n is None:
            return None
        bit = 1 << slot
        if tier is not Tier.CPU:  # GPU or every tier
            if self._s[n] & bit:
                specs = self._spec.get(slot)
                if specs is not None:
                    specs.pop(key, None)
                self._s[n] &= ~bit
            self._g[n] &= ~bit
        if tier is not Tier.GPU:  # CPU or every tier
            self._c[n] &= ~bit
        if self._kid[n]:
            # _refresh(n, bit), inlined for the one bit that changed
            ca, cg = self._ca, self._cg
            gs = (self._g[n] | self._s[n]) & bit
            mine = gs | (self._c[n] & bit)
            pp = self._par[n]
            new_a = ca[pp] & bit if mine else 0
            new_g = cg[pp] & bit if gs else 0
            if mine and pp > ROOT and (not new_a or (gs and not new_g)):
                self._pend[pp] |= bit
            old_a = ca[n] & bit
            old_g = cg[n] & bit
            if new_a != old_a or new_g != old_g:
                ca[n] ^= old_a ^ new_a
                cg[n] ^= old_g ^ new_g
                self._descend(n, (old_a & ~new_a) | (old_g & ~new_g), (new_a & ~old_a) | (new_g & ~old_g))
            return n
        held = self._g[n] | self._c[n] | self._s[n]
        if not (held & self._live):  # the usual case: a leaf nobody holds any more
            self._maybe_delete(n)
            return n
        pp = self._par[n]  # a leaf still held: its masks follow from the parent's alone
        ca, cg = self._ca, self._cg
        ca[n] = (ca[n] & ~bit) | (ca[pp] & bit if held & bit else 0)
        cg[n] = (cg[n] & ~bit) | (cg[pp] & bit if (self._g[n] | self._s[n]) & bit else 0)
        if held & bit and pp > ROOT and (not ca[n] & bit or ((self._g[n] | self._s[n]) & bit and not cg[n] & bit)):
            self._pend[pp] |= bit
        return n

    def _tier_update(
        self, target: str, emap: dict[int, int] | None, hashes: Sequence[int], tier: Tier
    ) -> int:
        slot = self._slot.get(target)
        if not emap or slot is None:
            return 0
        bit = 1 << slot
        field = self._g if tier is Tier.GPU else self._c
        if tier is Tier.CPU and self.max_keys:
            self._offloaded.setdefault(target, set()).update(h for h in hashes if h in emap)
        done = 0
        extra = None
        for h in hashes:
            key = emap.get(h)
            n = self._id.get(key) if key is not None else None
            if n is None:
                continue
            done += 1
            if field[n] & bit:  # held on this tier already: one more copy
                if extra is None:
                    extra = self._tier_copies(target, tier)
                extra[h] = extra.get(h, 0) + 1
                continue
            if extra is None and target in self._copies:
                extra = self._tier_copies(target, tier)
            if extra:
                extra.pop(h, None)  # the first copy again
            field[n] |= bit
            self._refresh(n, bit)
        if extra is not None:
            self._prune_copies(target)
        return done

    def _maybe_delete(self, n: int) -> None:
        """Delete node ``n`` and then each ancestor left without live holder and child."""
        live = self._live
        g, c, s = self._g, self._c, self._s
        while n > ROOT and self._kid[n] == 0 and not ((g[n] | c[n] | s[n]) & live):
            parent = self._par[n]
            stamp = self._stamp[n] if self.max_keys else 0
            self._free_node(n)
            if parent <= ROOT:
                return
            if self.max_keys:  # the parent inherits the recency (kept until it is a leaf)
                self._stamp[parent] = max(self._stamp[parent], stamp)
                if self._kid[parent] == 0:
                    heappush(self._lru, (self._stamp[parent], parent))
            n = parent

    # ------------------------------------------------------------------ budget
    def _touch(self, n: int) -> None:
        if n <= ROOT:
            return
        self._clock += 1
        self._stamp[n] = self._clock
        if self._kid[n] == 0:
            heappush(self._lru, (self._clock, n))

    def _after_store(self) -> None:
        if self.max_keys and len(self._id) > self.max_keys:
            self._evict()

    def _evict(self) -> None:
        heap = self._lru
        if len(heap) > 2 * len(self._id) + 1024:  # drop stale entries now and then
            heap[:] = [(self._stamp[n], n) for n in self._id.values() if self._kid[n] == 0]
            heapify(heap)
        while len(self._id) > self.max_keys and heap:
            stamp, n = heappop(heap)
            if self._stamp[n] != stamp or self._kid[n] != 0 or self._id.get(self._key[n]) != n:
                continue  # stale entry
            self._drop(n)

    def _drop(self, n: int) -> None:
        """Evict a leaf for every holder (its parent becomes a leaf with the leaf's recency)."""
        parent = self._par[n]
        stamp = self._stamp[n]
        self._free_node(n)
        self.evicted += 1
        if parent <= ROOT or self._kid[parent] != 0:
            return
        self._stamp[parent] = max(self._stamp[parent], stamp)  # passed on past a holder-less parent too
        if not ((self._g[parent] | self._c[parent] | self._s[parent]) & self._live):
            self._drop(parent)
            return
        heappush(self._lru, (self._stamp[parent], parent))

    # ------------------------------------------------------------------ scrubbing
    def _scrub_step(self, budget: int) -> None:
        if self._scrub is None:
            if not self._dying:
                return
            self._scrub = (ROOT + 1, self._dying)
        start, bits = self._scrub
        keep = ~bits
        end = min(self._top, start + budget)
        for field in (self._g, self._c, self._s, self._ca, self._cg, self._pend):
            field[start:end] = [v & keep for v in field[start:end]]
        g, c, s, kid, key, ids = self._g, self._c, self._s, self._kid, self._key, self._id
        for n in range(start, end):
            if not (g[n] | c[n] | s[n]) and kid[n] == 0 and ids.get(key[n]) == n:
                self._maybe_delete(n)
        if end < self._top:
            self._scrub = (end, bits)
            return
        # a full pass is done: these slots hold no stale bit anywhere, reuse them
        self._scrub = None
        self._dying &= ~bits
        self._slots_free.extend(_bits(bits))


def _or_range(arr: list[int], lo: int, hi: int, add: int) -> None:
    """``arr[lo:hi] |= add`` elementwise; equal old values share one new value object."""
    if hi <= lo:
        return
    vals = arr[lo:hi]
    first = vals[0]
    if vals.count(first) == hi - lo:  # the usual case: one mask object down a whole chain
        arr[lo:hi] = [first | add] * (hi - lo)
    else:
        new = {v: v | add for v in set(vals)}
        arr[lo:hi] = list(map(new.__getitem__, vals))


def _live_groups(groups: list[tuple[int, int]], live: int) -> list[tuple[int, int]]:
    return [(d, m & live) for d, m in groups if m & live]


class _position(dict):  # type: ignore[type-arg]
    """Stands in for the key -> nid lookup over masks already gathered per position."""

    def __init__(self, keys: Sequence[int]) -> None:
        super().__init__((k, i) for i, k in enumerate(keys))


# the set bits of every byte value, for _bits
_BYTE_BITS = [tuple(j for j in range(8) if v >> j & 1) for v in range(256)]


def _bits(mask: int) -> list[int]:
    """Indices of the set bits of a non-negative ``mask``."""
    if mask & (mask - 1) == 0:
        return [mask.bit_length() - 1] if mask else []
    if mask < 1 << 64:
        return [j for j in _BYTE_BITS[mask & 0xFF]] + [
            (i << 3) + j for i in range(1, (mask.bit_length() + 7) >> 3) for j in _BYTE_BITS[mask >> (i << 3) & 0xFF]
        ]
    raw = np.frombuffer(mask.to_bytes((mask.bit_length() + 7) // 8, "little"), np.uint8)
    return np.flatnonzero(np.unpackbits(raw, bitorder="little")).tolist()


def _depths(
    keys: Sequence[int], n: int, get: Any, first: int, masks: list[int], hints: dict[int, int]
) -> list[tuple[int, int]]:
    """Change points of a consecutive mask along ``keys``: ``[(depth, bits), ...]`` where the
    targets of ``bits`` hold exactly ``depth`` leading blocks (``bits`` may include retired
    slots: the caller masks them out).

    Along the chain the mask only loses bits, so the positions where it still equals its value
    at ``pos`` form a prefix: each change point is one binary search on equality (no big-int
    arithmetic per probe). ``hints`` remembers, per key where a run of equal masks starts, where
    that run ended last time (the end of a shared system prompt, of a session's last turn): two
    probes confirm it, else the search runs. With many distinct depths a C-speed linear pass
    takes over.
    """
    out: list[tuple[int, int]] = []
    cur = first
    pos = 0
    budget = max(8, n >> 5)  # a search costs ~log2(n) Python steps; the scan ~n C steps
    while cur:
        if budget == 0:
            return out + _depths_linear(keys, n, get, cur, pos, masks)
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


def _depths_linear(
    keys: Sequence[int], n: int, get: Any, cur: int, pos: int, masks: list[int]
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
