"""The prefix index's event-sized writes: a chain of blocks stored or removed for one holder.

An event carries a chain, parent before child. Stores: blocks already indexed gain the holder
one by one (``add_holder``), or by slice assignments after two key lookups when ``bulk_min`` or
more of them are laid out in contiguous nids (``join_run``: a worker storing a shared system
prompt); new blocks are written by ``new_chain`` into contiguous nids (fresh ones, or one run of
recycled ones) by slice assignments, scattered recycled nids by C-speed scatters. Removals: the
usual leaf is dropped inline (``remove_chain``, ``remove_hashes``); ``bulk_min`` or more blocks
that only one target holds on the GPU, each a leaf or the single parent of another removed block
(engines evict sessions' tails), go in a few C-speed passes (``drop_tail``). The per-block paths
define the semantics; the bulk paths are shortcuts (``tests/unit/core/test_index_bulk.py`` checks them).
Ownership: plain functions over a ``Nodes`` (``mesh.core.index_nodes``), called by
``PrefixIndex``, which passes its ``bulk_min`` threshold in; they keep its invariants.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Collection, Iterable, Sequence
from heapq import heappush
from itertools import chain, repeat
from operator import eq
from typing import cast

from mesh.core.index_copies import CopyCounts
from mesh.core.index_nodes import EMPTY, MANY, ROOT, Nodes
from policies.base import Tier

Masks = tuple[int, int, int, int, int, int]  # the (g, c, s, ca, cg, pend) values of new nodes


# ------------------------------------------------------------------ stores
def add_holder(
    nodes: Nodes, bit: int, keys: Sequence[int], field: list[int], gpuish: bool, p: int, stamp: int,
    spec: bool, specs: dict[int, float] | None, bulk_min: int,
) -> None:
    """Add ``bit`` on ``field`` (``nodes.g``, ``c`` or ``s``) to the chain ``keys`` below node
    ``p``, parent before child: indexed blocks gain the holder (an engine store confirms a
    speculation), and the first new block and the rest below it go to ``new_chain``."""
    get = nodes.id.get
    par, kid, stamp_a, budget = nodes.par, nodes.kid, nodes.stamp, nodes.budget
    g, s, ca, cg, pend = nodes.g, nodes.s, nodes.ca, nodes.cg, nodes.pend
    for i, key in enumerate(keys):
        x = get(key)
        if x is None:
            rest = keys[i:] if i else keys
            # the usual case: the rest is new (only a placeholder can lie below a new block)
            if not nodes.orphans or not any(map(get, rest)):
                new_chain(nodes, bit, rest, field, gpuish, p, stamp, bulk_min)
                break
            new_chain(nodes, bit, rest[:1], field, gpuish, p, stamp, bulk_min)  # a placeholder lies below
            x = nodes.id[key]
        else:  # a block already indexed (for someone): add this holder
            if par[x] == EMPTY and x != p:
                nodes.relink(x, p)
            if not spec and s[x] & bit:  # the engine confirms a speculation
                s[x] ^= bit
                if specs is not None:
                    specs.pop(key, None)
            field[x] |= bit
            # nodes.refresh(x, bit), inlined for the one bit that changed
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
                        nodes.descend(x, lost, (new_a & ~old_a) | (new_g & ~old_g))
            if (not new_a or ((g[x] | s[x]) & bit and not new_g)) and pp > ROOT:
                pend[pp] |= bit
            if budget:
                stamp_a[x] = stamp
        p = x


def join_run(
    nodes: Nodes, bit: int, keys: Sequence[int], field: list[int], gpuish: bool, p: int, stamp: int, bulk_min: int
) -> tuple[int, int] | None:
    """The bulk form of adding a holder to indexed blocks: the leading run of ``keys`` that is
    indexed as a chain below ``p`` in *contiguous* nids (as ``new_chain`` lays chains out), that
    the target holds on no tier, and where no child waits for its bit (``pend``). Then the run
    needs no key lookup but its two ends (a live last node makes its ancestors live, and live
    nodes' keys and links are exact), and its masks gain the bit by slice assignments. Returns
    the run's first nid and length (None: nothing done, the per-block path handles every block)."""
    ids = nodes.id
    lo = ids.get(keys[0])
    g, c, s = nodes.g, nodes.c, nodes.s
    if lo is None or nodes.par[lo] != p or (g[lo] | c[lo] | s[lo]) & bit:  # cheapest checks first
        return None
    head = nodes.key[lo : lo + len(keys)]
    if type(keys) is list and head == keys:
        run = len(keys)
    else:
        same = list(map(eq, head, keys))  # as long as the shorter of the two
        run = same.index(False) if False in same else len(same)
    if run < bulk_min:
        return None
    hi = lo + run
    if ids.get(keys[run - 1]) != hi - 1 or nodes.par[lo + 1 : hi] != array("i", range(lo, hi - 1)):
        return None
    ca, cg, pend = nodes.ca, nodes.cg, nodes.pend
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
    if nodes.budget:
        nodes.stamp[lo:hi] = array("q", [stamp]) * run
    return lo, run


def new_chain(
    nodes: Nodes, bit: int, keys: Sequence[int], field: list[int], gpuish: bool, p: int, stamp: int, bulk_min: int
) -> None:
    """Blocks new to the index, under node ``p``: every one gets the same masks (each is
    consecutive exactly when ``p`` is), so they are written in one tight pass: fewer than
    ``bulk_min`` recycled nids one by one, a contiguous run of them (an evicted tail's) or fresh
    nids by slice assignments, any other recycled ones by C-speed scatters."""
    ca_v = bit if nodes.ca[p] & bit else 0
    cg_v = bit if gpuish and nodes.cg[p] & bit else 0
    waiting = bit if not ca_v or (gpuish and not cg_v) else 0
    if waiting and p > ROOT:
        nodes.pend[p] |= waiting
    masks = ((bit if field is nodes.g else 0), (bit if field is nodes.c else 0), (bit if field is nodes.s else 0),
             ca_v, cg_v, waiting)
    free = nodes.free
    m = len(keys)
    k = min(m, len(free))
    if 0 < k < bulk_min:  # a few recycled nids: one by one
        p = _write_few(nodes, keys[:k] if k < m else keys, p, masks, stamp)
    elif k:
        xs = free[-k:]
        del free[-k:]
        head = keys[:k] if k < m else keys
        lo = min(xs)
        if max(xs) - lo == k - 1:  # one contiguous run (the nids are distinct): the usual evicted tail
            p = _write_run(nodes, lo, head, p, masks, stamp)
        else:  # scattered (sorting them into runs cost more than it saved): C-speed scatters
            p = _write_scattered(nodes, xs, head, p, masks, stamp)
    if k < m:
        tail = keys[k:] if k else keys
        n0 = nodes.top
        nodes.top = n0 + m - k
        if nodes.top > len(nodes.key):
            nodes.grow(nodes.top)
        p = _write_run(nodes, n0, tail if type(tail) is list else [int(x) for x in tail], p, masks, stamp, fresh=True)
    nodes.pend[p] = 0  # the last new block has no child yet


def _write_few(nodes: Nodes, keys: Sequence[int], p: int, masks: Masks, stamp: int) -> int:
    """Write the chain ``keys`` below ``p`` into recycled nids popped one by one; returns the last."""
    key_a, par, kid, stamp_a, ids, free = nodes.key, nodes.par, nodes.kid, nodes.stamp, nodes.id, nodes.free
    g, c, s, ca, cg, pend = nodes.g, nodes.c, nodes.s, nodes.ca, nodes.cg, nodes.pend
    gv, cv, sv, ca_v, cg_v, waiting = masks
    for key in keys:
        x = free.pop()
        key_a[x] = key
        par[x] = p
        kid[x] = 0
        if nodes.budget:
            stamp_a[x] = stamp
        g[x], c[x], s[x], ca[x], cg[x], pend[x] = gv, cv, sv, ca_v, cg_v, waiting
        ids[key] = x
        if p > ROOT:
            if kid[p] == 0:
                kid[p] = x
            else:
                nodes.add_kid(p, x)
        p = x
    return p


def _write_scattered(nodes: Nodes, xs: list[int], keys: Sequence[int], p: int, masks: Masks, stamp: int) -> int:
    """Write the chain ``keys`` below ``p`` into the recycled nids ``xs`` (in that order, each
    the parent of the next) by C-speed scatters; returns the last nid."""
    k = len(xs)
    kid = nodes.kid
    fields = (nodes.g, nodes.c, nodes.s, nodes.ca, nodes.cg, nodes.pend)
    for arr, vals in ((nodes.key, keys), (nodes.par, chain((p,), xs[:-1])), (kid, chain(xs[1:], (0,))),
                      *((arr, repeat(v, k)) for arr, v in zip(fields, masks))):
        deque(map(arr.__setitem__, xs, vals), 0)
    if nodes.budget:
        deque(map(nodes.stamp.__setitem__, xs, repeat(stamp, k)), 0)
    nodes.id.update(zip(keys, xs))
    if p > ROOT:
        if kid[p] == 0:
            kid[p] = xs[0]
        else:
            nodes.add_kid(p, xs[0])
    return xs[-1]


def _write_run(
    nodes: Nodes, lo: int, keys: Sequence[int], p: int, masks: Masks, stamp: int, fresh: bool = False
) -> int:
    """Write the chain ``keys`` below ``p`` into the free nids ``lo .. lo + len(keys) - 1``
    (ascending: each the parent of the next), ``masks`` on every one, by slice assignments.
    ``fresh``: the nids were never used (every field still 0, so zero masks need no write).
    Returns the last nid."""
    r = len(keys)
    hi = lo + r
    iota, par, kid = nodes.iota, nodes.par, nodes.kid
    nodes.key[lo:hi] = keys
    par[lo] = p
    par[lo + 1 : hi] = iota[lo : hi - 1]
    kid[lo : hi - 1] = iota[lo + 1 : hi]
    kid[hi - 1] = 0
    filled: dict[int, list[int]] = {}  # one list per distinct mask value (usually 0 and the bit)
    for arr, v in zip((nodes.g, nodes.c, nodes.s, nodes.ca, nodes.cg, nodes.pend), masks):
        if fresh and not v:
            continue
        vals = filled.get(v)
        if vals is None:
            vals = filled[v] = [v] * r
        arr[lo:hi] = vals
    if nodes.budget:
        nodes.stamp[lo:hi] = array("q", [stamp]) * r
    nodes.id.update(zip(keys, range(lo, hi)))
    if p > ROOT:
        if kid[p] == 0:
            kid[p] = lo
        else:
            nodes.add_kid(p, lo)
    return hi - 1


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


# ------------------------------------------------------------------ removals
def remove_chain(
    nodes: Nodes, slot: int, keys: Iterable[int], tier: Tier | None, specs: dict[int, float] | None
) -> None:
    """Take ``slot`` off ``keys`` (leaf first: no cascade below an already-removed node) on
    ``tier``, GPU or every tier (None); a CPU removal takes ``Nodes.remove_key`` per key."""
    bit = 1 << slot
    live = nodes.live
    ids, par, kid, free = nodes.id, nodes.par, nodes.kid, nodes.free
    g, c, s = nodes.g, nodes.c, nodes.s
    budget = nodes.budget
    for key in keys:
        n = ids.get(key)
        if n is None:
            continue
        if kid[n] == 0 and not s[n] & bit and not ((g[n] & ~bit) | c[n] | s[n]) & live:
            # the usual case, inlined (as in remove_hashes): a leaf only this target held
            del ids[key]
            p = par[n]
            if p > ROOT and kid[p] == n and not budget and (g[p] | c[p] | s[p]) & live:
                kid[p] = 0  # its parent, still held, becomes a leaf
            else:
                nodes.unlink_leaf(n, p)
            free.append(n)
            continue
        nodes.remove_key(slot, key, tier, specs)


def remove_hashes(
    nodes: Nodes, slot: int, emap: dict[int, int], engine_hashes: Sequence[int], tier: Tier | None,
    specs: dict[int, float] | None, offloaded: set[int] | None,
) -> int:
    """The per-block path of an engine's removal from ``tier`` (None: every tier): each hash
    known to ``emap`` (engine hash -> key) is taken off its block, and leaves ``emap`` once no
    tier holds it, unless its node was evicted but the engine still holds it on its CPU tier
    (``offloaded``). Returns how many hashes were known."""
    bit = 1 << slot
    live = nodes.live
    ids, par, kid, free = nodes.id, nodes.par, nodes.kid, nodes.free
    g, c, s = nodes.g, nodes.c, nodes.s
    budget = nodes.budget
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
            if p > ROOT and kid[p] == n and not budget and (g[p] | c[p] | s[p]) & live:
                kid[p] = 0  # its parent, still held, becomes a leaf
            else:
                nodes.unlink_leaf(n, p)
            free.append(n)
            continue
        n = nodes.remove_key(slot, key, tier, specs)
        if n is None and tier is Tier.GPU and offloaded is not None and h in offloaded:
            continue  # evicted from the index, still on the engine's CPU tier: keep its key
        if n is None or not ((g[n] | c[n]) & bit):
            del emap[h]
    return done


def drop_tail(nodes: Nodes, bit: int, keys: Sequence[int]) -> bool:
    """The bulk form of the usual removal: ``keys`` are blocks that only ``bit``'s target
    holds, on the GPU only, each a leaf or the parent of a single child that is removed too
    (the tails of one or several chains: an engine evicting sessions' tails). Then they all
    go in a few C-speed passes and True is returned; otherwise nothing changes and False is
    returned (the per-block path runs). The order of ``keys`` does not matter."""
    found = list(map(nodes.id.get, keys))
    if None in found:
        return False
    nids = cast("list[int]", found)  # every key is indexed (checked just above)
    g, c, s, kid = nodes.g, nodes.c, nodes.s, nodes.kid
    if list(map(g.__getitem__, nids)).count(bit) != len(nids):  # shared, or a retired slot's bit
        return False
    kids = list(map(kid.__getitem__, nids))
    gone = set(nids)
    if (
        len(gone) != len(nids)
        or MANY in kids
        or not gone.issuperset(filter(None, kids))
        or any(map(c.__getitem__, nids))
        or any(map(s.__getitem__, nids))
    ):
        return False
    deque(map(nodes.id.__delitem__, keys), 0)
    nodes.free.extend(nids)
    par, live, budget = nodes.par, nodes.live, nodes.budget
    for top in gone.difference(kids):  # the removed nodes whose parent stays
        p = par[top]
        if p > ROOT:
            if kid[p] == top:
                kid[p] = 0
                if not ((g[p] | c[p] | s[p]) & live):
                    nodes.maybe_delete(p)  # a placeholder left without children
                elif budget:  # the parent became a leaf: it inherits the recency
                    stamp_a = nodes.stamp
                    stamp_a[p] = max(stamp_a[p], max(map(stamp_a.__getitem__, nids)))
                    heappush(nodes.lru, (stamp_a[p], p))
            else:
                nodes.del_kid(p, top)
                if budget:  # a parent keeps its subtree's recency for when it is a leaf
                    stamp_a = nodes.stamp
                    stamp_a[p] = max(stamp_a[p], max(map(stamp_a.__getitem__, nids)))
        elif p == EMPTY:
            nodes.orphans.discard(top)
    return True


def tier_update(
    nodes: Nodes, copies: CopyCounts, target: str, bit: int, emap: dict[int, int], hashes: Sequence[int], tier: Tier
) -> int:
    """A store without tokens: blocks known by engine hash move to (or gain a copy on) ``tier``;
    returns how many resolved to an indexed block."""
    field = nodes.g if tier is Tier.GPU else nodes.c
    done = 0
    extra = None
    copied = target in copies  # constant until ``extra`` is looked up
    for h in hashes:
        key = emap.get(h)
        n = nodes.id.get(key) if key is not None else None
        if n is None:
            continue
        done += 1
        if field[n] & bit:  # held on this tier already: one more copy
            if extra is None:
                extra = copies.tier(target, tier)
            extra[h] = extra.get(h, 0) + 1
            continue
        if extra is None and copied:
            extra = copies.tier(target, tier)
        if extra:
            extra.pop(h, None)  # the first copy again
        field[n] |= bit
        nodes.refresh(n, bit)
    if extra is not None:
        copies.prune(target)
    return done


def remove_repeated(
    nodes: Nodes, slot: int, specs: dict[int, float] | None, engine_hashes: Sequence[int], keys: Sequence[int]
) -> None:
    """A hash that names two blocks of one event names the later one (the engine map kept it), as
    a hash stored again for other content does: the earlier block is gone from that engine and is
    removed for the target on every tier (else it stayed claimed for good)."""
    last = dict(zip(engine_hashes, keys))
    if len(last) == len(keys):
        return
    for h, key in zip(reversed(engine_hashes), reversed(keys)):  # leaf first
        if last[h] != key:
            nodes.remove_key(slot, key, None, specs)


def sweep_engine_map(
    ids: dict[int, int], copies: CopyCounts, target: str, emap: dict[int, int], kept: Collection[int]
) -> None:
    """Forget ``target``'s engine hashes whose node the budget evicted (they claim nothing; they
    only resolved later stores' parents, which are now skipped: an under-claim), but for ``kept``,
    those the engine holds on its CPU tier (a later store's parent, bounded by that tier's
    removals). The index runs it when the map passes ``max(2 x max_keys, 65,536, 2 x its size
    after the last sweep)``: amortized O(1) a store, and a target's map stays within that however
    long an engine stores without removing (a flood, or an engine whose removals never arrive)."""
    gone = [h for h, key in emap.items() if key not in ids and h not in kept]
    deque(map(emap.__delitem__, gone), 0)
    if target in copies:
        copies.prune(target, emap, gone)
