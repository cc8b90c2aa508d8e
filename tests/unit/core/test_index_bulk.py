"""The index's bulk paths (tails of one or several chains removed in one pass; a holder added to a
chain of contiguous nodes by slice assignments; recycled node ids written by C-speed scatters) against the per-block paths they shortcut, on random workloads with
evictions, gaps in chains, both tiers, speculation, target removal and an LRU budget. The bulk
threshold is lowered so that the small workloads here take the bulk paths often."""

from __future__ import annotations

import random

import pytest

import mesh.core.index
from mesh.core.index import PrefixIndex
from mesh.core.keys import block_keys, namespace_seed
from policies.base import Tier
from tests.support.index_oracle import consistent_with_holdings

TARGETS = ["a", "b", "c", "d"]


@pytest.fixture(autouse=True)
def small_bulk_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mesh.core.index, "_BULK_MIN", 2)


class PerBlock(PrefixIndex):
    """The reference: every store and removal takes the per-block path."""

    def _drop_tail(self, bit: int, keys: object) -> bool:
        return False

    def _join_run(self, *args: object) -> None:
        return None


class Counting(PrefixIndex):
    """The index under test, counting how often each bulk path really ran."""

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.bulk = {"drop": 0, "join": 0}

    def _drop_tail(self, bit: int, keys: object) -> bool:
        done = super()._drop_tail(bit, keys)  # type: ignore[arg-type]
        self.bulk["drop"] += done
        return done

    def _join_run(self, *args: object) -> tuple[int, int] | None:
        run = super()._join_run(*args)  # type: ignore[arg-type]
        self.bulk["join"] += run is not None
        return run


def make_tree(rng: random.Random) -> tuple[dict[int, int | None], dict[str, list[int]]]:
    """Chained keys: 3 shared system prompts of 4 blocks, and sessions of 6-20 blocks below them
    (a few branching off another session), each session worked on mostly by one target (its
    ``homes`` list the sessions' last keys)."""
    parent: dict[int, int | None] = {}
    homes: dict[str, list[int]] = {t: [] for t in TARGETS}

    def chain(top: int | None, n: int) -> list[int]:
        out = []
        for _ in range(n):
            k = rng.getrandbits(64)
            parent[k] = top
            out.append(k)
            top = k
        return out

    systems = [chain(None, 4) for _ in range(3)]
    sessions: list[list[int]] = []
    for i in range(16):
        top = rng.choice(sessions)[rng.randrange(4)] if sessions and rng.random() < 0.2 else rng.choice(systems)[-1]
        sessions.append(chain(top, rng.randint(6, 20)))
        homes[TARGETS[i % len(TARGETS)]].append(sessions[-1][-1])
    return parent, homes


def path(parent: dict[int, int | None], key: int) -> list[int]:
    out = []
    cur: int | None = key
    while cur is not None:
        out.append(cur)
        cur = parent[cur]
    return out[::-1]


def held_depth(index: PrefixIndex, t: str, p: list[int]) -> int:
    d = 0
    while d < len(p) and index.holds(t, p[d]) is not None:
        d += 1
    return d


def random_op(rng: random.Random, parent: dict[int, int | None], homes: dict[str, list[int]],
              state: PrefixIndex) -> tuple:
    r = rng.random()
    t = rng.choice(TARGETS)
    keys = list(parent)
    pick = rng.choice(homes[t] if rng.random() < 0.8 else keys)
    if r < 0.4:  # store a segment of a path (a gap when its top's parent is not held)
        p = path(parent, pick)
        p = p[: rng.randint(1, len(p))] if rng.random() < 0.3 else p  # a session's earlier turn
        lo = rng.randrange(len(p)) if rng.random() < 0.2 else 0
        return ("store", t, p[lo:], Tier.CPU if rng.random() < 0.15 else Tier.GPU)
    if r < 0.7:  # remove the tail of a path, or tails of several paths, heads first
        tails = []
        for _ in range(rng.choice([1, 1, 2, 3])):  # the tails of what ``t`` holds, mostly
            p = path(parent, rng.choice(homes[t]))
            d = held_depth(state, t, p) if rng.random() < 0.8 else len(p)
            tails += p[max(0, d - rng.randint(1, 8)) : d]
        if not tails:
            tails = [rng.choice(keys)]
        return ("remove", t, list(dict.fromkeys(tails)), rng.choice([None, Tier.GPU, Tier.GPU, Tier.GPU, Tier.CPU]))
    if r < 0.77:
        return ("remove", t, rng.sample(keys, rng.randint(1, 4)), rng.choice([None, Tier.GPU]))
    if r < 0.85:
        return ("spec", t, path(parent, rng.choice(keys)), rng.randint(1, 3))
    if r < 0.9:
        return ("clear", t)
    return ("expire", rng.randint(0, 2))


def apply(index: PrefixIndex, op: tuple, parent: dict[int, int | None], clock: list[float]) -> None:
    kind = op[0]
    if kind == "store":
        _, t, seg, tier = op
        index.store(t, seg, tier, parent=parent[seg[0]])
    elif kind == "remove":
        index.remove(op[1], op[2], op[3])
    elif kind == "spec":
        index.store_speculative(op[1], op[2], clock[0] + op[3])
    elif kind == "clear":
        index.clear_target(op[1])
    else:
        clock[0] += op[1]
        index.expire(clock[0])


@pytest.mark.parametrize("seed", range(12))
def test_bulk_store_and_remove_equal_the_per_block_paths(seed: int) -> None:
    rng = random.Random(seed)
    parent, homes = make_tree(rng)
    keys = list(parent)
    bulk, ref = Counting(scrub_budget=5), PerBlock(scrub_budget=5)
    clocks = [[0.0], [0.0]]
    for step in range(400):
        op = random_op(rng, parent, homes, ref)
        apply(bulk, op, parent, clocks[0])
        apply(ref, op, parent, clocks[1])
        if step % 20 == 0 or step == 399:
            for k in keys:
                p = path(parent, k)
                assert bulk.match(p) == ref.match(p), f"step {step}: match of the path to {k}"
                for t in TARGETS:
                    assert bulk.holds(t, k) == ref.holds(t, k)
            assert len(bulk) == len(ref)
    assert bulk.bulk["drop"] > 0 and bulk.bulk["join"] > 0  # the bulk paths really ran


@pytest.mark.parametrize("seed", range(6))
def test_bulk_paths_under_a_budget_stay_consistent_with_holdings(seed: int) -> None:
    rng = random.Random(100 + seed)
    parent, homes = make_tree(rng)
    keys = list(parent)
    index, clock = Counting(max_keys=25), [0.0]
    for _ in range(400):
        apply(index, random_op(rng, parent, homes, index), parent, clock)
        assert len(index) <= 25
    for k in keys:
        p = path(parent, k)
        assert dict(index.match(p)) == consistent_with_holdings(index, p, TARGETS)
    assert index.bulk["drop"] > 0


class Engine:
    """An engine with opaque random hashes that stores prompts as chains and evicts the tails
    of one or several of them in one BlockRemoved (leaf first), as vLLM does under pressure."""

    def __init__(self, rng: random.Random, bs: int = 4) -> None:
        self.rng, self.bs = rng, bs
        self.blocks: dict[tuple[int, ...], int] = {}  # token prefix -> engine hash

    def store(self, tokens: list[int]) -> tuple[list[int], int | None, list[int]] | None:
        n = len(tokens) // self.bs
        start = 0
        while start < n and tuple(tokens[: (start + 1) * self.bs]) in self.blocks:
            start += 1
        if start == n:
            return None
        parent = self.blocks[tuple(tokens[: start * self.bs])] if start else None
        hashes = []
        for i in range(start, n):
            h = self.rng.getrandbits(64)
            self.blocks[tuple(tokens[: (i + 1) * self.bs])] = h
            hashes.append(h)
        return hashes, parent, tokens[start * self.bs : n * self.bs]

    def evict_tails(self) -> list[int]:
        out: list[int] = []
        for _ in range(self.rng.choice([1, 2, 3])):
            for _ in range(self.rng.randint(1, 5)):
                leaves = [p for p in self.blocks if not any(len(q) > len(p) and q[: len(p)] == p for q in self.blocks)]
                if not leaves:
                    return out
                out.append(self.blocks.pop(max(leaves, key=len) if self.rng.random() < 0.7 else self.rng.choice(leaves)))
        return out

    def held(self, tokens: list[int]) -> int:
        n = 0
        while n < len(tokens) // self.bs and tuple(tokens[: (n + 1) * self.bs]) in self.blocks:
            n += 1
        return n


@pytest.mark.parametrize("seed", range(6))
def test_engine_events_through_the_bulk_paths_track_every_engine_exactly(seed: int) -> None:
    rng = random.Random(seed)
    ns = namespace_seed("m")
    system = [rng.randrange(50) for _ in range(12)]  # a shared 3-block prefix
    prompts = [system + [rng.randrange(3) for _ in range(rng.choice([8, 16, 24]))] for _ in range(20)]
    bulk, ref = Counting(), PerBlock()
    engines = {t: Engine(rng) for t in TARGETS}
    for _ in range(300):
        t = rng.choice(TARGETS)
        r = rng.random()
        if r < 0.55:
            ev = engines[t].store(rng.choice(prompts))
            if ev is not None:
                for index in (bulk, ref):
                    assert index.apply_stored(t, ev[0], ev[1], ev[2], 4, ns) == len(ev[0])
        elif r < 0.93:
            gone = engines[t].evict_tails()
            for index in (bulk, ref):
                assert index.apply_removed(t, gone, None) == len(gone)
        elif r < 0.97 and engines[t].blocks:
            h = rng.choice(list(engines[t].blocks.values()))
            for index in (bulk, ref):
                index.apply_stored(t, [h], None, None, 4, ns, Tier.CPU)
        else:
            for index in (bulk, ref):
                index.apply_cleared(t)
            engines[t] = Engine(rng)
    for p in prompts:
        keys = block_keys(p, 4, ns)
        assert bulk.match(keys) == ref.match(keys)
        assert {t: ov.blocks for t, ov in bulk.match(keys).items()} == {
            t: e.held(p) for t, e in engines.items() if e.held(p)}
    for t, e in engines.items():
        assert bulk.engine_map(t) == ref.engine_map(t)
        assert len(bulk.engine_map(t)) == len(e.blocks)
    assert bulk.bulk["drop"] > 0 and bulk.bulk["join"] > 0


def test_default_threshold_long_sessions_evicted_tail_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """At the default threshold: sessions of 40-80 blocks under a shared prefix, their tails
    evicted 16-48 blocks at a time (one or two sessions per event), as the bench's workload."""
    monkeypatch.setattr(mesh.core.index, "_BULK_MIN", 16)
    rng = random.Random(9)
    ns = namespace_seed("m")
    bs = 2
    system = [rng.randrange(100) for _ in range(20 * bs)]
    bulk, ref = Counting(), PerBlock()
    sessions: list[tuple[str, list[int], list[int], int]] = []  # target, tokens, hashes, cached blocks
    for i in range(24):
        t = TARGETS[i % 4]
        tokens = system + [rng.randrange(100) for _ in range(rng.randint(40, 80) * bs)]
        hashes = [rng.getrandbits(64) for _ in range(len(tokens) // bs)]
        for index in (bulk, ref):
            index.apply_stored(t, hashes[:20], None, tokens[: 20 * bs], bs, ns)  # repeated: a no-op
            index.apply_stored(t, hashes[20:], hashes[19], tokens[20 * bs :], bs, ns)
        sessions.append((t, tokens, hashes, len(hashes)))
    for _ in range(30):
        t = rng.choice(TARGETS)
        mine = [i for i, s in enumerate(sessions) if s[0] == t and s[3] > 20]
        gone: list[int] = []
        for i in rng.sample(mine, min(len(mine), rng.choice([1, 2]))):
            _, tokens, hashes, cached = sessions[i]
            k = min(cached - 20, rng.randint(16, 48))
            gone += hashes[cached - k : cached][::-1]
            sessions[i] = (t, tokens, hashes, cached - k)
        for index in (bulk, ref):
            assert index.apply_removed(t, gone) == len(gone)
    for t, tokens, hashes, cached in sessions:
        keys = block_keys(tokens, bs, ns)
        assert bulk.match(keys) == ref.match(keys)
        assert bulk.match(keys)[t].blocks >= cached
    assert len(bulk) == len(ref)
    assert bulk.stats()["engine_hashes"] == ref.stats()["engine_hashes"]
    assert bulk.bulk["drop"] > 0 and bulk.bulk["join"] > 0
