"""The index's engine layer (apply_stored / apply_removed / apply_cleared, tier updates without
tokens, speculation and expiry, target removal and slot reuse, the key budget, compact) driven by
seeded random event sequences, careless and hostile ones included, against an independent
brute-force model of what each engine says it holds.

The model keeps, per target, the engine's hash -> router key map and per key its tiers and
speculative deadline; router keys come from ``mesh.core.keys.block_keys`` chained from the parent's key.
It follows the index's documented rules for careless publishers: a removal of an unknown hash or a
store below an unknown parent does nothing; an engine hash stored again for other content (in an
earlier event or earlier in the same one) names the new block only, the block it named before is
gone from that engine on every tier; any store of a key confirms (ends) its speculation.

Copies (vLLM does not deduplicate blocks): a store on a tier of a hash already mapped to the same
key, while that key is on that tier, is one more copy there (a tier update by hash too), except
from a chain's root (no parent: a report of held blocks, vLLM's full report mode); a
removal without counts takes one copy away and the block leaves the tier with the last; a
removal's counts (``remaining_copy_counts``) are the engine's word: 0 removes, n > 0 keeps (n
copies on that tier)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

import mesh.core.index
from mesh.core.index import PrefixIndex
from mesh.core.keys import block_keys, namespace_seed
from policies.base import Overlap, Tier

NS = namespace_seed("oracle")


# ------------------------------------------------------------------------ the model
@dataclass
class Holder:
    """What one engine said it holds: hash -> key, key -> tiers, key -> speculative deadline."""

    hmap: dict[int, int] = field(default_factory=dict)
    tiers: dict[int, set[Tier]] = field(default_factory=dict)
    spec: dict[int, float] = field(default_factory=dict)
    asked: dict[int, float] = field(default_factory=dict)  # every key speculated, and until when
    copies: dict[tuple[int, Tier], int] = field(default_factory=dict)  # (hash, tier) -> copies beyond the first

    def forget(self, h: int) -> None:
        """The hash names no block any more: no copy on any tier."""
        del self.hmap[h]
        self.copies.pop((h, Tier.GPU), None)
        self.copies.pop((h, Tier.CPU), None)

    def add(self, h: int, k: int, tier: Tier, report: bool = False) -> None:
        """A store of ``h`` (named ``k``) on ``tier``: a copy more when the tier holds it already,
        unless the store is a ``report`` (from a chain's root: no copy, the count stays)."""
        if tier in self.tiers.get(k, ()):
            if not report:
                self.copies[(h, tier)] = self.copies.get((h, tier), 0) + 1
        else:
            self.copies.pop((h, tier), None)
            self.tiers.setdefault(k, set()).add(tier)

    def may_gpu(self, k: int) -> bool:
        """An upper bound for a budget: the key is on the GPU or was speculated, not expired."""
        return self.gpuish(k) or k in self.asked

    def held(self, k: int) -> bool:
        return bool(self.tiers.get(k)) or k in self.spec

    def gpuish(self, k: int) -> bool:
        return Tier.GPU in self.tiers.get(k, ()) or k in self.spec

    def drop(self, k: int, tier: Tier | None) -> None:
        tiers = self.tiers.get(k, set())
        if tier is not Tier.CPU:
            tiers.discard(Tier.GPU)
            self.spec.pop(k, None)  # (``asked`` stays: an evicted hash may miss this removal)
        if tier is not Tier.GPU:
            tiers.discard(Tier.CPU)
        if not tiers:
            self.tiers.pop(k, None)


class Model:
    def __init__(self) -> None:
        self.t: dict[str, Holder] = {}

    def h(self, target: str) -> Holder:
        return self.t.setdefault(target, Holder())

    def stored(self, target: str, hashes: list[int], parent: int | None, tokens: list[int] | None,
               bs: int, tier: Tier) -> int:
        m = self.h(target)
        if not hashes:
            return 0
        if not tokens:  # a tier update of known hashes
            done = 0
            for h in hashes:
                k = m.hmap.get(h)
                if k is not None:
                    m.add(h, k, tier)
                    done += 1
            return done
        if parent is None:
            pkey = NS
        elif parent in m.hmap:
            pkey = m.hmap[parent]
        else:
            return 0
        keys = block_keys(tokens, bs, pkey)
        for h, k in zip(hashes, keys):
            old = m.hmap.get(h)
            if old is not None and old != k:  # renamed: the old block is gone on every tier and copy
                m.drop(old, None)
                m.forget(h)
        for h, k in zip(hashes, keys):
            old = m.hmap.get(h)
            if old is not None and old != k:  # renamed within this event
                m.drop(old, None)
            if old == k:  # the same block again: a copy if the tier holds it (below a parent)
                m.add(h, k, tier, report=parent is None)
            else:
                m.tiers.setdefault(k, set()).add(tier)
            m.hmap[h] = k
            m.spec.pop(k, None)
        return len(hashes)

    def removed(self, target: str, hashes: list[int], tier: Tier | None,
                remaining: list[int] | None = None) -> int:
        m = self.h(target)
        done = 0
        gone: set[int] = set()  # hashes an entry of this event removed
        for i, h in enumerate(hashes):
            k = m.hmap.get(h)
            r = None if remaining is None or tier is None else remaining[i]
            if r:  # the engine keeps r copies
                if h in gone or k is None:
                    continue
                done += 1
                if r > 1:
                    m.copies[(h, tier)] = r - 1
                else:
                    m.copies.pop((h, tier), None)
                continue
            gone.add(h)
            if k is None:
                continue
            done += 1
            if r is None and tier is not None and m.copies.get((h, tier)):  # one copy of several goes
                m.copies[(h, tier)] -= 1
                if not m.copies[(h, tier)]:
                    del m.copies[(h, tier)]
                continue
            for t in (Tier.GPU, Tier.CPU) if tier is None else (tier,):
                m.copies.pop((h, t), None)
            m.drop(k, tier)
            if not m.tiers.get(k):
                m.forget(h)
        return done

    def cleared(self, target: str) -> None:
        self.t.pop(target, None)

    def speculate(self, target: str, keys: list[int], deadline: float) -> None:
        m = self.h(target)
        d = 0
        while d < len(keys) and m.gpuish(keys[d]):
            d += 1
        for k in keys[d:]:
            m.spec[k] = deadline
        for k in keys:
            m.asked[k] = max(deadline, m.asked.get(k, deadline))

    def expire(self, now: float) -> None:
        for m in self.t.values():
            m.spec = {k: v for k, v in m.spec.items() if v > now}
            m.asked = {k: v for k, v in m.asked.items() if v > now}

    def match(self, keys: list[int], loose: bool = False) -> dict[str, Overlap]:
        """Each target's overlap; ``loose``: counting every key speculated and not expired (the
        index, missing evicted keys, may speculate a suffix again that the model held already)."""
        out = {}
        for t, m in self.t.items():
            held, gpuish = (m.may_gpu, m.may_gpu) if loose else (m.held, m.gpuish)
            total = gpu = 0
            for k in keys:
                if not (held(k) or m.held(k)):
                    break
                if gpu == total and gpuish(k):
                    gpu += 1
                total += 1
            if total:
                out[t] = Overlap(gpu, total - gpu)
        return out


# ------------------------------------------------------------------------ the event generator
class Workload:
    """Prompts sharing prefixes (a 20-block system prompt, so chains reach the bulk paths), and
    random engine events over them, careless and hostile ones included, applied to the index
    and to the model alike."""

    def __init__(self, rng: random.Random, index: PrefixIndex, targets: list[str], *, bs: int = 2,
                 spec: bool = True, renames: bool = True, max_blocks: int = 44, counts: bool = True) -> None:
        self.rng, self.index, self.targets, self.bs, self.spec = rng, index, targets, bs, spec
        self.renames = renames  # hashes reused for other content (in one event or a later one)
        self.counts = counts  # removals may carry remaining_copy_counts
        self.model = Model()
        self.now = 0.0
        system = [rng.randrange(1000) for _ in range(20 * bs)]
        short = [rng.randrange(1000) for _ in range(3 * bs)]
        self.prompts: list[list[int]] = []
        for _ in range(24):
            head = rng.choice([system, short, []])
            n = rng.randint(1, max_blocks - len(head) // bs)
            self.prompts.append(head + [rng.randrange(3) for _ in range(n * bs)])
        self.pkeys = [block_keys(p, bs, NS) for p in self.prompts]
        self.events: dict[str, list[list[int]]] = {}  # target -> hashes of its stores, in order
        self.gone: list[int] = []  # hashes removed earlier (a careless publisher reuses them)
        self.log: list[tuple] = []

    def fresh(self) -> int:
        return self.rng.getrandbits(64)

    def step(self) -> None:
        rng = self.rng
        t = rng.choice(self.targets)
        r = rng.random()
        if r < 0.45:
            self.store(t)
        elif r < 0.70:
            self.remove(t)
        elif r < 0.78:
            self.tier_update(t)
        elif r < 0.86 and self.spec:
            p = rng.choice(self.pkeys)
            keys = p[: rng.randint(1, len(p))]
            deadline = self.now + rng.uniform(0.5, 8)
            self.do(("spec", t, keys, deadline))
        elif r < 0.92:
            self.do(("expire", self.now + rng.uniform(0, 3)))
        elif r < 0.975:
            self.do(("clear", t))
        else:
            self.do(("compact",))

    def store(self, t: str) -> None:
        rng, bs = self.rng, self.bs
        m = self.model.h(t)
        i = rng.randrange(len(self.prompts))
        tokens, pkeys = self.prompts[i], self.pkeys[i]
        nb = len(pkeys)
        s = rng.randrange(nb) if rng.random() < 0.6 else 0
        e = rng.randint(s + 1, nb)
        parent: int | None = None
        if s:
            have = [h for h, k in m.hmap.items() if k == pkeys[s - 1]]
            r = rng.random()
            if have and r < 0.85:
                parent = have[0]
            elif m.hmap and r < 0.93:
                parent = rng.choice(list(m.hmap))  # a parent of other content
            elif self.gone and r < 0.97:
                parent = rng.choice(self.gone)  # a parent removed earlier
            else:
                parent = self.fresh()  # never seen
        pkey = NS if parent is None else m.hmap.get(parent)
        keys = block_keys(tokens[s * bs : e * bs], bs, pkey) if pkey is not None else []
        by_key = {k: h for h, k in m.hmap.items()}
        hashes = [by_key.get(k) or self.fresh() for k in keys] or [self.fresh() for _ in range(e - s)]
        r = rng.random()
        if not keys or not self.renames:
            pass
        elif r < 0.08 and len(hashes) > 1:  # a duplicate hash inside one event
            a, b = sorted(rng.sample(range(len(hashes)), 2))
            if keys[b] not in by_key:
                hashes[b] = hashes[a]
        elif r < 0.16 and m.hmap:  # a hash stored again for other content
            j = rng.randrange(len(hashes))
            if keys[j] not in by_key:
                hashes[j] = rng.choice(list(m.hmap))
        elif r < 0.2 and self.gone:
            j = rng.randrange(len(hashes))
            if keys[j] not in by_key:
                hashes[j] = rng.choice(self.gone)
        tier = Tier.GPU if rng.random() < 0.8 else Tier.CPU
        self.do(("stored", t, hashes, parent, tokens[s * bs : e * bs], tier))

    def remove(self, t: str) -> None:
        rng = self.rng
        m = self.model.h(t)
        evs = [[h for h in ev if h in m.hmap] for ev in self.events.get(t, [])]
        evs = [ev for ev in evs if ev]
        hashes: list[int] = []
        r = rng.random()
        if evs and r < 0.6:  # tails of one or two chains, leaf first (engines evict so)
            for ev in rng.sample(evs, min(len(evs), rng.choice([1, 1, 2]))):
                hashes += ev[len(ev) - rng.randint(1, len(ev)) :][::-1]
        elif m.hmap:
            hashes = rng.sample(list(m.hmap), rng.randint(1, min(6, len(m.hmap))))
        if rng.random() < 0.15:
            hashes.insert(rng.randint(0, len(hashes)), self.fresh())  # unknown
        if hashes and rng.random() < 0.05:
            hashes.append(hashes[0])  # a duplicate removal
        tier = rng.choice([Tier.GPU, Tier.GPU, None, None, Tier.CPU])
        remaining = None
        if tier is not None and self.counts and rng.random() < 0.4:  # remaining_copy_counts
            if rng.random() < 0.8:  # the engine's truth: one copy of each goes
                remaining = [m.copies.get((h, tier), 0) for h in hashes]
            else:  # whatever it says is the word
                remaining = [rng.choice([0, 0, 1, 2, 3]) for _ in hashes]
        self.do(("removed", t, hashes, tier, remaining))

    def tier_update(self, t: str) -> None:
        rng = self.rng
        m = self.model.h(t)
        hashes = rng.sample(list(m.hmap), rng.randint(0, min(5, len(m.hmap))))
        if rng.random() < 0.2 or not hashes:
            hashes.append(self.fresh())
        tier = Tier.CPU if rng.random() < 0.7 else Tier.GPU
        self.do(("stored", t, hashes, None, None, tier))

    def do(self, op: tuple) -> None:
        self.log.append(op)
        apply(self.index, self.model, op, self.bs)
        kind = op[0]
        if kind == "stored" and op[4]:
            self.events.setdefault(op[1], []).append(list(op[2]))
        elif kind == "removed":
            self.gone += op[2]
        elif kind == "expire":
            self.now = op[1]
        elif kind == "clear":
            self.events.pop(op[1], None)


def apply(index: PrefixIndex, model: Model, op: tuple, bs: int) -> None:
    kind = op[0]
    if kind == "stored":
        _, t, hashes, parent, tokens, tier = op
        want = model.stored(t, hashes, parent, tokens, bs, tier)
        got = index.apply_stored(t, hashes, parent, tokens, bs, NS, tier)
        if not index.max_keys:  # with a budget an evicted parent or block may be unknown
            assert got == want, op
    elif kind == "removed":
        _, t, hashes, tier, remaining = op
        got = index.apply_removed(t, hashes, tier, remaining)
        if model.removed(t, hashes, tier, remaining) != got:
            assert index.max_keys, op
    elif kind == "clear":
        index.apply_cleared(op[1])
        model.cleared(op[1])
    elif kind == "spec":
        _, t, keys, deadline = op
        index.store_speculative(t, keys, deadline)
        model.speculate(t, keys, deadline)
    elif kind == "expire":
        index.expire(op[1])
        model.expire(op[1])
    elif kind == "compact":
        index.compact()


def check_exact(w: Workload, queries: list[list[int]]) -> None:
    for keys in queries:
        assert dict(w.index.match(keys)) == w.model.match(keys), keys


def check_maps(w: Workload) -> None:
    for t in w.targets:
        m = w.model.t.get(t, Holder())
        assert w.index.engine_map(t) == m.hmap, t
        for tier in (Tier.GPU, Tier.CPU):
            want_copies = {h: c + 1 for (h, ti), c in m.copies.items() if ti is tier}
            assert w.index.engine_copies(t, tier) == want_copies, (t, tier)
        want = {k for k in set(m.tiers) | set(m.spec) if m.held(k)}
        assert w.index.keys_of(t) == want, t
        for k in want:
            assert w.index.holds(t, k) is (Tier.GPU if m.gpuish(k) else Tier.CPU)


def run_exact(seed: int, targets: list[str], steps: int, every: int = 1, scrub_budget: int = 4096) -> Workload:
    w = Workload(random.Random(seed), PrefixIndex(scrub_budget=scrub_budget), targets)
    pick = random.Random(~seed)  # the queries' own stream: a replay of w.log needs no query
    for i in range(steps):
        w.step()
        if i % every == 0:
            check_exact(w, pick.sample(w.pkeys, 3))
        if len(targets) <= 4 and i % 25 == 0:  # every holding, below any parent
            check_maps(w)
    check_exact(w, w.pkeys)
    check_maps(w)
    return w


# ------------------------------------------------------------------------ bugs found, minimal
@pytest.mark.parametrize("shared", [False, True])
def test_a_hash_named_twice_in_one_event_names_the_later_block_only(shared: bool) -> None:
    """Only the later block stays claimed: the earlier one is released, not claimed for good (no
    hash resolves to it any more)."""
    index = PrefixIndex()
    tokens = list(range(40))  # 20 blocks of 2: long enough for the bulk paths
    keys = block_keys(tokens, 2, NS)
    if shared:  # the chain is indexed already: the join path
        index.apply_stored("b", list(range(100, 120)), None, tokens, 2, NS)
    hashes = list(range(1, 21))
    hashes[9] = 1  # hash 1 names block 0, then block 9
    assert index.apply_stored("a", hashes, None, tokens, 2, NS) == 20
    assert index.holds("a", keys[0]) is None and index.holds("a", keys[9]) is Tier.GPU
    assert index.engine_map("a") == dict(zip(hashes[1:], keys[1:]))
    want = {"b": Overlap(20, 0)} if shared else {}
    assert index.match(keys) == want
    assert index.apply_removed("a", hashes[::-1], None) == 19
    assert index.keys_of("a") == set()
    if not shared:
        assert len(index) == 0


def test_a_store_below_a_parent_hash_that_the_same_event_renames_keeps_the_tree_whole() -> None:
    """The chain is written below the parent's nid before that node is freed (its hash renamed),
    so it never hangs from a freed node (match would count the missing parent; a later scrub or
    eviction would raise KeyError or leak nodes)."""
    index = PrefixIndex()
    tokens = list(range(100, 108))
    keys = block_keys(tokens, 2, NS)
    index.apply_stored("a", [1, 2], None, tokens[:4], 2, NS)
    # parent hash 2 (block 1), and hash 2 again for block 3: block 1 is gone from the engine
    assert index.apply_stored("a", [3, 2], 2, tokens[4:], 2, NS) == 2
    assert index.keys_of("a") == {keys[0], keys[2], keys[3]}
    assert index.match(keys) == {"a": Overlap(1, 0)}
    index.apply_stored("b", [7, 8, 9], None, list(range(6)), 2, NS)  # takes recycled nids
    assert index.match(keys) == {"a": Overlap(1, 0)}
    index.apply_cleared("a")
    index.compact()
    assert len(index) == 3


def check_bounded(w: Workload, queries: list[list[int]]) -> None:
    """With a budget the index holds a subset of what the engines say (evicted keys are gone):
    it never claims a key or a tier, nor a match depth, that the engine does not hold."""
    index = w.index
    assert len(index) <= index.max_keys
    for t in w.targets:
        m = w.model.t.get(t, Holder())
        for k in index.keys_of(t):
            tier = index.holds(t, k)
            assert m.may_gpu(k) if tier is Tier.GPU else m.held(k), (t, k, tier)
        assert index.engine_map(t).items() <= m.hmap.items(), t
        for tier in (Tier.GPU, Tier.CPU):  # never more copies than the engine holds
            for h, c in index.engine_copies(t, tier).items():
                assert c <= m.copies.get((h, tier), 0) + 1, (t, h, tier, c)
    for keys in queries:
        want = w.model.match(keys, loose=True)
        for t, ov in index.match(keys).items():
            assert t in want and ov.blocks <= want[t].blocks, (t, ov, want.get(t))
            assert ov.gpu_blocks <= want[t].gpu_blocks, (t, ov, want[t])


def run_bounded(seed: int, targets: list[str], steps: int, max_keys: int, spec: bool = True) -> Workload:
    w = Workload(random.Random(seed), PrefixIndex(max_keys=max_keys), targets, spec=spec, renames=False)
    pick = random.Random(~seed)
    for _ in range(steps):
        w.step()
        queries = pick.sample(w.pkeys, 3)
        w.log.append(("match", queries))  # a match refreshes recency: part of the sequence
        check_bounded(w, queries)
    w.log.append(("match", w.pkeys))
    check_bounded(w, w.pkeys)
    return w


# ------------------------------------------------------------------------ LRU order
class LruModel:
    """The budget's documented order, for engines on one tier: a store stamps each of its blocks,
    a match stamps the deepest block any target matched; the leaf with the oldest stamp goes
    first (for every holder), and a parent's recency is its subtree's; a node without a holder
    goes with its last child. Nodes are keys; a parent key known only as a parent has no holder."""

    def __init__(self, max_keys: int) -> None:
        self.max_keys = max_keys
        self.parent: dict[int, int | None] = {}
        self.kids: dict[int, set[int]] = {}
        self.stamp: dict[int, int] = {}
        self.holders: dict[int, set[str]] = {}  # "t": its engine's block, "~t": speculated for t
        self.deadline: dict[tuple[str, int], float] = {}
        self.clock = 0

    def _add(self, k: int, parent: int | None, stamp: int) -> None:
        if k not in self.parent:
            self.parent[k], self.kids[k], self.holders[k] = None, set(), set()
        if self.parent[k] is None and parent is not None:  # new, or a placeholder's parent is known now
            self.parent[k] = parent
            self.kids[parent].add(k)
        self.stamp[k] = stamp

    def store(self, target: str, keys: list[int], parent: int | None) -> None:
        if parent is not None and parent not in self.parent:  # evicted: a placeholder comes back
            self._add(parent, None, self.clock)
        self.clock += 1
        for k in keys:
            self._add(k, parent, self.clock)
            self.holders[k].add(target)
            self.holders[k].discard("~" + target)  # the engine confirms a speculation
            self.deadline.pop((target, k), None)
            parent = k
        self._evict()

    def _evict(self) -> None:
        while len(self.parent) > self.max_keys:
            self._drop(min((s, k) for k, s in self.stamp.items() if not self.kids[k])[1])

    def _held(self, target: str, k: int) -> bool:
        return bool(self.holders.get(k, set()) & {target, "~" + target})

    def speculate(self, target: str, keys: list[int], deadline: float) -> None:
        d = 0
        while d < len(keys) and self._held(target, keys[d]):
            d += 1
        if d == len(keys):
            return
        self.clock += 1
        parent = keys[d - 1] if d else None
        for k in keys[d:]:
            self._add(k, parent, self.clock)
            self.holders[k].add("~" + target)
            self.deadline[(target, k)] = deadline
            parent = k
        self._evict()

    def expire(self, now: float) -> None:
        for (t, k), d in list(self.deadline.items()):
            if d <= now:
                del self.deadline[(t, k)]
                if k in self.parent:
                    self.remove("~" + t, k)

    def _drop(self, k: int) -> None:
        p = self.parent.pop(k)
        del self.kids[k], self.holders[k]
        s = self.stamp.pop(k)
        if p is not None:
            self.kids[p].discard(k)
            self.stamp[p] = max(self.stamp[p], s)  # the parent's recency is its subtree's
            if not self.kids[p] and not self.holders[p]:
                self._drop(p)

    def remove(self, target: str, k: int) -> None:
        if k in self.parent:
            self.holders[k].discard(target)
            if not target.startswith("~"):  # the engine's removal ends a speculation too
                self.holders[k].discard("~" + target)
                self.deadline.pop((target, k), None)
            if not self.kids[k] and not self.holders[k]:
                self._drop(k)

    def clear(self, target: str) -> None:
        for hs in self.holders.values():
            hs -= {target, "~" + target}
        self.deadline = {tk: d for tk, d in self.deadline.items() if tk[0] != target}
        for k in [k for k, hs in self.holders.items() if not hs and not self.kids[k]]:
            self._drop(k)  # (a holder-less parent goes with its last child)

    def match(self, keys: list[int]) -> dict[str, int]:
        out = {}
        for t in {h.lstrip("~") for hs in self.holders.values() for h in hs}:
            d = 0
            while d < len(keys) and self._held(t, keys[d]):
                d += 1
            if d:
                out[t] = d
        if out:
            self.clock += 1
            self.stamp[keys[max(out.values()) - 1]] = self.clock
        return out

    def keys_of(self, target: str) -> set[int]:
        return {k for k in self.holders if self._held(target, k)}


@pytest.mark.parametrize("seed", [*range(32), 257])  # 257: an eviction through holder-less parents
def test_budget_evicts_the_least_recently_stored_or_matched_leaf_first(seed: int) -> None:
    """Engines storing sessions (new prompts, turns and forks below a known parent hash, and
    another engine's prompts again under its own hashes), matches that refresh a prefix,
    speculation and its expiry, engine removals of leaves; the index's keys equal the model's
    after every step, so every eviction took the leaf the documented order names."""
    rng = random.Random(seed)
    targets = ["w"] if seed % 2 else ["a", "b", "c"]
    index, model = PrefixIndex(max_keys=40), LruModel(40)
    chains: dict[str, list[tuple[list[int], list[int], list[int]]]] = {t: [] for t in targets}  # hashes, keys, tokens
    now = 0.0
    for step in range(300):
        t = rng.choice(targets)
        mine = chains[t]
        r = rng.random()
        if r < 0.45 or not mine:
            n = rng.choice([1, 3, 8, 18])
            tokens = [rng.randrange(1 << 30) for _ in range(2 * n)]
            hashes = [rng.getrandbits(64) for _ in range(n)]
            others = [c for u in targets if u != t for c in chains[u]]
            if mine and rng.random() < 0.5:  # the next turn of a session, or a fork of it
                i = rng.randrange(len(mine))
                ph, pk, pt = mine[i]
                j = len(pk) if rng.random() < 0.6 else rng.randint(1, len(pk))
                ph, pk, pt = ph[:j], pk[:j], pt[: 2 * j]
                keys = block_keys(tokens, 2, pk[-1])
                assert index.apply_stored(t, hashes, ph[-1], tokens, 2, NS) == n
                model.store(t, keys, pk[-1])
                if j == len(mine[i][1]):
                    mine[i] = (ph + hashes, pk + keys, pt + tokens)
                else:
                    mine.append((ph + hashes, pk + keys, pt + tokens))
            else:
                if others and rng.random() < 0.5:  # another engine's prompt: shared nodes
                    _, okeys, otokens = rng.choice(others)
                    if any(okeys[0] == c[1][0] for c in mine):
                        continue
                    m = rng.randint(1, len(okeys))
                    tokens, hashes = otokens[: 2 * m], [rng.getrandbits(64) for _ in range(m)]
                keys = block_keys(tokens, 2, NS)
                index.apply_stored(t, hashes, None, tokens, 2, NS)
                model.store(t, keys, None)
                mine.append((hashes, keys, tokens))
        elif r < 0.72:
            _, keys, _ = rng.choice([c for u in targets for c in chains[u]])
            q = keys[: rng.randint(1, len(keys))]
            assert {u: ov.blocks for u, ov in index.match(q).items()} == model.match(q), step
        elif r < 0.8:  # a request routed here: its keys count as held until confirmed or expired
            _, keys, _ = rng.choice([c for u in targets for c in chains[u]])
            deadline = now + rng.uniform(1, 20)
            index.store_speculative(t, keys, deadline)
            model.speculate(t, keys, deadline)
        elif r < 0.84:
            now += rng.uniform(0, 6)
            index.expire(now)
            model.expire(now)
        elif r < 0.86:  # AllBlocksCleared: scrubbed at once, the slot is free for the next store
            index.apply_cleared(t)
            index.compact()
            model.clear(t)
            chains[t] = []
        else:  # the engine evicts a leaf (it holds every block of its sessions)
            inner = {k for _, pk, _ in mine for k in pk[:-1]}
            ph, pk, pt = rng.choice([c for c in mine if c[1][-1] not in inner])
            index.apply_removed(t, [ph[-1]])
            model.remove(t, pk[-1])
            chains[t] = mine = [c for c in mine if c[1] != pk]  # the session and any equal fork
            if pk[:-1] and all(c[1] != pk[:-1] for c in mine):
                mine.append((ph[:-1], pk[:-1], pt[:-2]))
        for u in targets:
            assert index.keys_of(u) == model.keys_of(u), step
        assert len(index) == len(model.parent), step


@pytest.mark.parametrize("bulk", [False, True])
def test_an_engine_removal_below_a_shared_prefix_keeps_the_prefix_recency(bulk: bool) -> None:
    """A session removed by its engine while its parent still has another child leaves the
    parent's recency in place: the shared prefix, used after the cold session below it and after
    an unrelated one, outlives the unrelated one once the cold session has gone."""
    n = 16 if bulk else 1  # 16 blocks: the hot session's removal takes _drop_tail
    index = PrefixIndex(max_keys=3 + n)
    tok = iter(range(10**6))
    def store(hashes: list[int], parent: int | None) -> list[int]:
        tokens = [next(tok) for _ in range(2 * len(hashes))]
        index.apply_stored("w", hashes, parent, tokens, 2, NS)
        return tokens
    prefix = store([1], None)  # a shared prefix
    store([2], 1)  # a cold session below it
    other = store([3], None)  # an unrelated session, used after the cold one
    hot = list(range(100, 100 + n))
    store(hot, 1)  # a session below the prefix, the newest
    index.apply_removed("w", hot[::-1])  # the engine frees it
    store(list(range(200, 202 + n)), None)  # two keys must go: the cold session, then the older of the others
    keys = block_keys(prefix, 2, NS)
    assert index.match(keys) == {"w": Overlap(1, 0)}
    assert index.match(block_keys(other, 2, NS)) == {}


# ------------------------------------------------------------------------ the random sequences
@pytest.fixture(params=[16, 3], ids=["bulk_at_16", "bulk_at_3"])
def bulk_min(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """The default bulk threshold (the 20-block system prompt and long sessions reach it), and a
    low one so that most events take _join_run, _drop_tail and the recycled-nid runs."""
    monkeypatch.setattr(mesh.core.index, "_BULK_MIN", request.param)
    return request.param


@pytest.mark.parametrize("seed", range(12))
def test_engine_events_match_the_model_exactly(seed: int, bulk_min: int) -> None:
    run_exact(seed, ["a", "b", "c", "d"], 300, scrub_budget=4096 if seed % 2 else 7)


@pytest.mark.parametrize("seed", range(2))
def test_engine_events_over_more_than_64_targets_match_the_model(seed: int, bulk_min: int) -> None:
    run_exact(seed, [f"w{i}@{i % 3}" for i in range(90)], 900, every=3, scrub_budget=64)


def test_engine_events_over_more_than_1024_slots_match_the_model(bulk_min: int) -> None:
    """Cleared targets leave their slots dying until a scrub pass: fresh ones come from the top,
    then the scrubbed ones are reused."""
    w = run_exact(5, [f"w{i}" for i in range(1500)], 9000, every=50)
    assert len(w.index._slots.tids) > 1024  # slots handed out: masks of several 64-bit words


@pytest.mark.parametrize("seed", range(8))
def test_engine_events_under_a_key_budget_never_overclaim(seed: int, bulk_min: int) -> None:
    w = run_bounded(seed, ["a", "b", "c", "d"], 300, max_keys=25 + 10 * (seed % 4))
    assert w.index.evicted > 0


def test_an_evicted_leaf_hands_its_recency_past_holderless_parents() -> None:
    """An eviction that takes a leaf's holder-less parents along (blocks an engine freed from the
    middle of a chain, expired speculation) passes the newest stamp below them up, not each one's
    own: the prefix above inherits it and outlives an unrelated session used before that stamp.
    (The key layer is the shortest route to such parents; the random LRU sequences reach it
    through speculation.)"""
    index = PrefixIndex(max_keys=5)
    g, p2, p1, leaf = block_keys(list(range(8)), 2, NS)
    index.store("w", [g, p2, p1, leaf])
    index.remove("w", [p2, p1])  # the middle blocks freed: holder-less parents of the leaf
    x = block_keys([100, 101], 2, NS)
    index.store("w", x)  # an unrelated session
    index.store("v", [p1], parent=p2)  # the newest use below the prefix
    index.remove("v", [p1])
    index.store("w", block_keys([200, 201], 2, NS))  # 6 keys: the leaf goes, with p1 and p2
    index.store("w", block_keys(list(range(300, 306)), 2, NS))  # 6 keys: one more must go
    assert index.holds("w", g) is Tier.GPU  # it inherited the newest stamp below it
    assert index.holds("w", x[0]) is None
