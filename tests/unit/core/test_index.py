"""The prefix index against a brute-force oracle (hypothesis), plus its budget, speculation,
engine-hash layer and target removal."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mesh.core.index import PrefixIndex
from mesh.core.keys import block_keys, namespace_seed
from policies.base import Overlap, Tier
from tests.support.index_oracle import consistent_with_holdings

TARGETS = ["a", "b", "c", "d@1"]


# ------------------------------------------------------------------ the universe of keys
@dataclass(frozen=True)
class Universe:
    """A fixed tree of chained keys: ``parent[k]`` is the key before ``k`` (None at a root)."""

    parent: dict[int, int | None]

    def path(self, key: int) -> list[int]:
        out: list[int] = []
        cur: int | None = key
        while cur is not None:
            out.append(cur)
            cur = self.parent[cur]
        return out[::-1]

    def segment(self, top: int, bottom: int) -> list[int]:
        """Keys from ``top`` down to ``bottom`` (``top`` an ancestor-or-self of ``bottom``)."""
        path = self.path(bottom)
        return path[path.index(top) :]


def make_universe(seed: int, size: int = 24) -> Universe:
    rng = random.Random(seed)
    keys = list({rng.getrandbits(64) | 1 for _ in range(size)})
    parent: dict[int, int | None] = {}
    for i, k in enumerate(keys):
        parent[k] = None if i < 3 or rng.random() < 0.1 else keys[rng.randrange(max(0, i - 8), i)]
    return Universe(parent)


UNI = make_universe(7)
KEYS = list(UNI.parent)


# ------------------------------------------------------------------------ the oracle
@dataclass
class Oracle:
    """Holdings as plain sets; match walks every key (the reference semantics)."""

    tiers: dict[tuple[str, int], set[str]] = field(default_factory=dict)
    spec: dict[tuple[str, int], float] = field(default_factory=dict)

    def _gpuish(self, t: str, k: int) -> bool:
        return "G" in self.tiers.get((t, k), ()) or (t, k) in self.spec

    def _held(self, t: str, k: int) -> bool:
        return bool(self.tiers.get((t, k))) or (t, k) in self.spec

    def store(self, t: str, keys: list[int], tier: Tier) -> None:
        for k in keys:
            self.tiers.setdefault((t, k), set()).add("G" if tier is Tier.GPU else "C")
            self.spec.pop((t, k), None)

    def remove(self, t: str, keys: list[int], tier: Tier | None) -> None:
        for k in keys:
            s = self.tiers.get((t, k), set())
            if tier in (None, Tier.GPU):
                s.discard("G")
                self.spec.pop((t, k), None)
            if tier in (None, Tier.CPU):
                s.discard("C")

    def clear(self, t: str) -> None:
        self.tiers = {tk: v for tk, v in self.tiers.items() if tk[0] != t}
        self.spec = {tk: v for tk, v in self.spec.items() if tk[0] != t}

    def speculate(self, t: str, keys: list[int], deadline: float) -> None:
        d = 0
        while d < len(keys) and self._gpuish(t, keys[d]):
            d += 1
        for k in keys[d:]:
            self.spec[(t, k)] = deadline

    def expire(self, now: float) -> None:
        self.spec = {tk: v for tk, v in self.spec.items() if v > now}

    def holds(self, t: str, k: int) -> Tier | None:
        if self._gpuish(t, k):
            return Tier.GPU
        return Tier.CPU if self._held(t, k) else None

    def match(self, keys: list[int]) -> dict[str, Overlap]:
        out = {}
        for t in TARGETS:
            total = gpu = 0
            for k in keys:
                if not self._held(t, k):
                    break
                if gpu == total and self._gpuish(t, k):
                    gpu += 1
                total += 1
            if total:
                out[t] = Overlap(gpu, total - gpu)
        return out


# ------------------------------------------------------------------------ operations
target_st = st.sampled_from(TARGETS)
key_st = st.sampled_from(KEYS)
tier_st = st.sampled_from([Tier.GPU, Tier.CPU])


@st.composite
def segment_st(draw: st.DrawFn) -> list[int]:
    bottom = draw(key_st)
    path = UNI.path(bottom)
    return path[draw(st.integers(0, len(path) - 1)) :]


op_st = st.one_of(
    st.tuples(st.just("store"), target_st, segment_st(), tier_st),
    st.tuples(st.just("store"), st.sampled_from(TARGETS[:2]), segment_st(), st.just(None)),
    st.tuples(st.just("remove"), target_st, st.lists(key_st, max_size=6), st.sampled_from([None, Tier.GPU, Tier.CPU])),
    st.tuples(st.just("clear"), target_st),
    st.tuples(st.just("spec"), target_st, key_st, st.integers(1, 5)),
    st.tuples(st.just("expire"), st.integers(0, 3)),
    st.tuples(st.just("compact")),
)


def apply(index: PrefixIndex, oracle: Oracle, op: tuple, clock: list[float]) -> None:
    kind = op[0]
    if kind == "store":
        _, t, seg, tier = op
        for tr in [Tier.GPU, Tier.CPU] if tier is None else [tier]:  # None: on both tiers
            index.store(t, seg, tr, parent=UNI.parent[seg[0]])
            oracle.store(t, seg, tr)
    elif kind == "remove":
        _, t, keys, tier = op
        index.remove(t, keys, tier)
        oracle.remove(t, keys, tier)
    elif kind == "clear":
        index.clear_target(op[1])
        oracle.clear(op[1])
    elif kind == "spec":
        _, t, bottom, ttl = op
        index.store_speculative(t, UNI.path(bottom), clock[0] + ttl)
        oracle.speculate(t, UNI.path(bottom), clock[0] + ttl)
    elif kind == "expire":
        clock[0] += op[1]
        index.expire(clock[0])
        oracle.expire(clock[0])
    else:
        index.compact()


def check(index: PrefixIndex, oracle: Oracle) -> None:
    for k in KEYS:
        path = UNI.path(k)
        assert dict(index.match(path)) == oracle.match(path), f"match of path to {k}"
        for t in TARGETS:
            assert index.holds(t, k) == oracle.holds(t, k)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op_st, min_size=5, max_size=60))
def test_match_equals_brute_force_oracle_after_random_operations(ops: list[tuple]) -> None:
    index, oracle, clock = PrefixIndex(scrub_budget=7), Oracle(), [0.0]
    for op in ops:
        apply(index, oracle, op, clock)
        check(index, oracle)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op_st, max_size=40), st.integers(3, 25))
def test_budget_keeps_size_and_consistency(ops: list[tuple], budget: int) -> None:
    index, oracle, clock = PrefixIndex(max_keys=budget), Oracle(), [0.0]
    for op in ops:
        apply(index, oracle, op, clock)
        assert len(index) <= budget
        for k in KEYS:
            path = UNI.path(k)
            assert dict(index.match(path)) == consistent_with_holdings(index, path, TARGETS)


def test_partial_matches_split_gpu_and_cpu() -> None:
    index = PrefixIndex()
    index.store("a", [1, 2, 3, 4])
    index.store("b", [1, 2])
    index.store("b", [3, 4], Tier.CPU, parent=2)
    index.store("c", [1], Tier.CPU)
    index.store("c", [2], parent=1)
    got = index.match([1, 2, 3, 4, 5])
    assert got == {"a": Overlap(4, 0), "b": Overlap(2, 2), "c": Overlap(0, 2)}
    assert index.match([9, 1]) == {}


def test_removing_a_middle_block_cuts_the_consecutive_prefix_and_restoring_heals_it() -> None:
    index = PrefixIndex()
    index.store("a", [1, 2, 3, 4])
    index.remove("a", [2])
    assert index.match([1, 2, 3, 4]) == {"a": Overlap(1, 0)}
    index.store("a", [2], parent=1)
    assert index.match([1, 2, 3, 4]) == {"a": Overlap(4, 0)}


def test_losing_the_gpu_copy_of_a_middle_block_moves_the_rest_to_the_cpu_count() -> None:
    index = PrefixIndex()
    index.store("a", [1, 2, 3])
    index.store("a", [1, 2, 3], Tier.CPU)
    index.remove("a", [2], Tier.GPU)
    assert index.match([1, 2, 3]) == {"a": Overlap(1, 2)}
    index.store("a", [2], parent=1)
    assert index.match([1, 2, 3]) == {"a": Overlap(3, 0)}


def test_many_targets_with_distinct_depths_take_the_linear_path() -> None:
    index = PrefixIndex()
    chain = list(range(1, 301))
    for t in range(200):
        index.store(f"w{t}", chain[: t + 1])
    got = index.match(chain)
    assert got == {f"w{t}": Overlap(t + 1, 0) for t in range(200)}


# ------------------------------------------------------------------ speculative entries
def test_speculative_entries_count_as_gpu_until_expiry() -> None:
    index = PrefixIndex()
    index.store("a", [1, 2])
    index.store_speculative("a", [1, 2, 3, 4], expires_at=10.0)
    index.store_speculative("b", [1, 2, 3], expires_at=5.0)
    assert index.match([1, 2, 3, 4]) == {"a": Overlap(4, 0), "b": Overlap(3, 0)}
    index.expire(5.0)
    assert index.match([1, 2, 3, 4]) == {"a": Overlap(4, 0)}
    index.expire(10.0)
    assert index.match([1, 2, 3, 4]) == {"a": Overlap(2, 0)}
    assert len(index) == 2  # the speculative-only keys are gone


def test_engine_event_confirms_a_speculative_entry() -> None:
    index = PrefixIndex()
    seed = namespace_seed("m")
    tokens = list(range(64))
    keys = block_keys(tokens, 16, seed)
    index.store_speculative("a", keys, expires_at=1.0)
    index.apply_stored("a", [101, 102, 103, 104], None, tokens, 16, seed)
    assert index.expire(2.0) == 0  # every entry was confirmed, none ended
    assert index.match(keys) == {"a": Overlap(4, 0)}


# ------------------------------------------------------------------------ budget / LRU
def test_budget_evicts_cold_sessions_and_keeps_the_hot_shared_prefix() -> None:
    index = PrefixIndex(max_keys=40)
    system = list(range(1, 11))  # a shared 10-block prefix
    index.store("a", system)
    for s in range(10):
        session = [1000 * (s + 1) + i for i in range(10)]
        index.store("a", session, parent=system[-1])
        index.match(system + [0])  # a new session's request matches the shared prefix
    assert len(index) <= 40
    assert index.match(system) == {"a": Overlap(10, 0)}
    assert index.match(system + [1000, 1001]) == {"a": Overlap(10, 0)}  # the oldest session left
    newest = [10000 + i for i in range(10)]
    assert index.match(system + newest) == {"a": Overlap(20, 0)}
    assert index.evicted > 0


def test_budget_eviction_leaves_no_orphan_claim() -> None:
    index = PrefixIndex(max_keys=5)
    index.store("a", [1, 2, 3])
    index.store("b", [1, 2, 3, 4, 5, 6, 7])
    assert len(index) <= 5
    got = index.match([1, 2, 3, 4, 5, 6, 7])
    assert got == consistent_with_holdings(index, [1, 2, 3, 4, 5, 6, 7], ["a", "b"])


# ------------------------------------------------------------------------ clear_target
def test_clear_target_drops_everything_at_once_and_the_slot_is_reused_cleanly() -> None:
    index = PrefixIndex()
    index.store("a", [1, 2, 3])
    index.store("b", [1, 2])
    index.clear_target("a")
    assert index.match([1, 2, 3]) == {"b": Overlap(2, 0)}
    assert index.keys_of("a") == set()
    index.compact()
    assert len(index) == 2
    index.store("c", [1])  # reuses a's scrubbed slot: no stale bit may show
    assert index.match([1, 2, 3]) == {"b": Overlap(2, 0), "c": Overlap(1, 0)}


def test_scrubbing_is_incremental_through_expire() -> None:
    index = PrefixIndex(scrub_budget=10)
    index.store("a", list(range(1, 101)))
    index.clear_target("a")
    index.expire(0.0)
    assert index.stats()["dying_slots"] == 1 and len(index) > 0
    for _ in range(20):
        index.expire(0.0)
    assert index.stats()["dying_slots"] == 0 and len(index) == 0


# ------------------------------------------------------------------------ engine layer
class FakeEngine:
    """A minimal engine: opaque random engine hashes, a cache of token blocks, events out."""

    def __init__(self, rng: random.Random, block_size: int = 4) -> None:
        self.rng = rng
        self.bs = block_size
        self.blocks: dict[tuple[int, ...], int] = {}  # token prefix -> engine hash
        self.cpu: set[tuple[int, ...]] = set()

    def store(self, tokens: list[int], index: PrefixIndex, target: str, seed: int) -> None:
        n = len(tokens) // self.bs
        start = 0
        while start < n and tuple(tokens[: (start + 1) * self.bs]) in self.blocks:
            start += 1
        if start == n:
            return
        parent = self.blocks[tuple(tokens[: start * self.bs])] if start else None
        hashes = []
        for i in range(start, n):
            h = self.rng.getrandbits(64)
            self.blocks[tuple(tokens[: (i + 1) * self.bs])] = h
            hashes.append(h)
        applied = index.apply_stored(
            target, hashes, parent, tokens[start * self.bs : n * self.bs], self.bs, seed
        )
        assert applied == len(hashes)

    def evict_leaf(self, index: PrefixIndex, target: str) -> None:
        leaves = [p for p in self.blocks if not any(len(q) > len(p) and q[: len(p)] == p for q in self.blocks)]
        if leaves:
            p = self.rng.choice(leaves)
            h = self.blocks.pop(p)
            self.cpu.discard(p)
            assert index.apply_removed(target, [h], None) == 1

    def offload(self, index: PrefixIndex, target: str) -> None:
        if self.blocks:
            p = self.rng.choice(list(self.blocks))
            self.cpu.add(p)
            assert index.apply_stored(target, [self.blocks[p]], None, None, self.bs, 0, Tier.CPU) == 1

    def expected(self, tokens: list[int]) -> Overlap:
        n = 0
        while n < len(tokens) // self.bs and tuple(tokens[: (n + 1) * self.bs]) in self.blocks:
            n += 1
        return Overlap(n, 0)


@pytest.mark.parametrize("seed", range(5))
def test_engine_layer_tracks_a_random_workload_exactly(seed: int) -> None:
    rng = random.Random(seed)
    index = PrefixIndex()
    ns = namespace_seed("model")
    engines = {t: FakeEngine(rng) for t in TARGETS}
    prompts = [[rng.randrange(3) for _ in range(rng.choice([8, 12, 16, 20]))] for _ in range(25)]
    for _ in range(300):
        t = rng.choice(TARGETS)
        r = rng.random()
        if r < 0.6:
            engines[t].store(rng.choice(prompts), index, t, ns)
        elif r < 0.95:
            engines[t].evict_leaf(index, t)
        else:
            index.apply_cleared(t)
            engines[t] = FakeEngine(rng)
    for p in prompts:
        keys = block_keys(p, 4, ns)
        want = {t: e.expected(p) for t, e in engines.items() if e.expected(p).blocks}
        assert dict(index.match(keys)) == want
    for t, e in engines.items():
        assert len(index.engine_map(t)) == len(e.blocks)


def test_cpu_store_without_tokens_updates_known_blocks_and_gpu_removal_keeps_the_cpu_copy() -> None:
    index = PrefixIndex()
    ns = namespace_seed("m")
    tokens = list(range(32))
    keys = block_keys(tokens, 8, ns)
    index.apply_stored("a", [11, 12, 13, 14], None, tokens, 8, ns)
    assert index.apply_stored("a", [13, 14, 99], None, None, 8, ns, Tier.CPU) == 2  # 99: unknown
    index.apply_removed("a", [13, 14], Tier.GPU)
    assert index.match(keys) == {"a": Overlap(2, 2)}
    index.apply_removed("a", [14], Tier.CPU)
    assert index.match(keys) == {"a": Overlap(2, 1)}
    assert set(index.engine_map("a")) == {11, 12, 13}


def test_unknown_parent_is_skipped_and_bad_token_counts_raise() -> None:
    index = PrefixIndex()
    assert index.apply_stored("a", [5], 12345, [1, 2, 3, 4], 4, 0) == 0
    assert len(index) == 0
    with pytest.raises(ValueError):
        index.apply_stored("a", [5, 6], None, [1, 2, 3, 4], 4, 0)
    with pytest.raises(ValueError):
        index.apply_stored("a", [5], None, [1, 2, 3, -4], 4, 0)
    with pytest.raises(ValueError):
        index.apply_stored("a", [5], None, [1, 2, 3, 2**32], 4, 0)


def test_an_engine_hash_stored_again_for_other_content_drops_the_block_it_named() -> None:
    """The target stops claiming the old block, which no later event could remove."""
    index = PrefixIndex()
    ns = namespace_seed("m")
    old_tokens, new_tokens = list(range(32)), list(range(100, 132))
    index.apply_stored("a", [1, 2], None, old_tokens, 16, ns)
    index.apply_stored("b", [7, 8], None, old_tokens, 16, ns)
    index.apply_stored("a", [1, 2], None, new_tokens, 16, ns)  # same hashes, other content
    assert index.match(block_keys(old_tokens, 16, ns)) == {"b": Overlap(2, 0)}
    assert index.match(block_keys(new_tokens, 16, ns)) == {"a": Overlap(2, 0)}
    index.apply_stored("a", [1, 2], None, new_tokens, 16, ns)  # a duplicate changes nothing
    assert index.match(block_keys(new_tokens, 16, ns)) == {"a": Overlap(2, 0)}
    assert index.apply_removed("a", [2, 1], None) == 2
    assert index.match(block_keys(new_tokens, 16, ns)) == {}
    assert index.engine_map("a") == {}


def test_budget_after_engine_removals_evicts_the_cold_leftover_not_the_newest_chain() -> None:
    """An engine's BlockRemoved that leaves the parent a leaf gives it an LRU entry: the next
    eviction takes the cold leftover, not the newest chain's last block."""
    ns = namespace_seed("m")
    index = PrefixIndex(max_keys=10)
    cold, hot = list(range(40)), list(range(1000, 1040))
    index.apply_stored("w", list(range(1, 11)), None, cold, 4, ns)
    index.apply_removed("w", list(range(10, 1, -1)))  # leaf first: block 1 is left
    index.apply_stored("w", list(range(101, 111)), None, hot, 4, ns)  # 11 keys: one must go
    assert index.match(block_keys(cold, 4, ns)) == {}
    assert index.match(block_keys(hot, 4, ns)) == {"w": Overlap(10, 0)}


@pytest.mark.parametrize("offload", ["tier update", "cpu store"])
def test_budget_keeps_the_hash_of_a_block_evicted_from_the_index_but_held_on_the_engines_cpu(offload: str) -> None:
    """With a key budget, a node evicted from the index keeps its engine hash while the engine holds
    a CPU copy: the engine's GPU removal does not forget the hash, so a later store below the
    engine's CPU copy is applied."""
    ns = namespace_seed("m")
    index = PrefixIndex(max_keys=4)
    parent = list(range(16))
    if offload == "tier update":
        index.apply_stored("w", [1], None, parent, 16, ns)
        assert index.apply_stored("w", [1], None, None, 16, ns, Tier.CPU) == 1
    else:
        index.apply_stored("w", [1], None, parent, 16, ns, Tier.CPU)
    index.apply_stored("w", [2, 3, 4, 5], None, list(range(100, 164)), 16, ns)  # evicts block 1's node
    assert index.holds("w", block_keys(parent, 16, ns)[0]) is None
    index.apply_removed("w", [1], Tier.GPU)  # the engine drops its GPU copy, keeps the CPU one
    child = list(range(16, 32))
    assert index.apply_stored("w", [6], 1, child, 16, ns) == 1
    assert index.holds("w", block_keys(parent + child, 16, ns)[1]) is Tier.GPU
    index.apply_removed("w", [1], Tier.CPU)  # now gone from the engine: the hash goes too
    assert 1 not in index.engine_map("w")


def test_chained_keys_from_an_engine_parent_continue_the_router_chain() -> None:
    index = PrefixIndex()
    ns = namespace_seed("m")
    tokens = list(range(48))
    index.apply_stored("a", [1], None, tokens[:16], 16, ns)
    index.apply_stored("a", [2, 3], 1, tokens[16:], 16, ns)
    assert index.match(block_keys(tokens, 16, ns)) == {"a": Overlap(3, 0)}


def test_keys_chained_from_a_seed_equal_keys_extending_that_parent() -> None:
    rng = random.Random(3)
    for bs in (1, 3, 16, 64):
        tokens = [rng.randrange(2**32) for _ in range(bs * 7 + 2)]
        assert block_keys(tokens, bs, 42) == block_keys(tokens, bs, 0, parent=42)


class DupEngine:
    """vLLM v1's prefix cache in miniature, which does not deduplicate: a prompt reuses the cached
    blocks of its longest cached prefix (the first copy of each hash), and every later block is
    computed into a new physical block, stored under its hash even when another copy holds it
    already (the last block of a block-aligned prompt is always recomputed). Blocks freed by a
    finished request are evicted tail first, least recently used first; each physical eviction
    sends its own removal, with the copies left (``remaining_copy_counts``) when ``counts``."""

    def __init__(self, rng: random.Random, capacity: int = 24, block_size: int = 4, counts: bool = False) -> None:
        self.rng, self.cap, self.bs, self.counts = rng, capacity, block_size, counts
        self.salt = rng.getrandbits(64)
        self.copies: dict[tuple[int, ...], list[int]] = {}  # prefix -> its physical blocks
        self.block: dict[int, tuple[int, ...]] = {}  # physical block -> prefix
        self.lru: dict[int, None] = {}  # free cached blocks, oldest first
        self.next_id = 0

    def ehash(self, prefix: tuple[int, ...]) -> int:
        return xxhash.xxh3_64_intdigest(repr(prefix).encode(), self.salt)

    def serve(self, tokens: list[int], index: PrefixIndex, target: str, seed: int) -> None:
        n = len(tokens) // self.bs
        prefixes = [tuple(tokens[: (i + 1) * self.bs]) for i in range(n)]
        hit: list[int] = []
        while len(hit) < n - 1 and self.copies.get(prefixes[len(hit)]):  # the last block is recomputed
            hit.append(self.copies[prefixes[len(hit)]][0])
        while len(self.block) + n - len(hit) > self.cap:
            self._evict(next(b for b in self.lru if b not in hit), index, target)
        new = []
        for p in prefixes[len(hit) :]:
            bid, self.next_id = self.next_id, self.next_id + 1
            self.block[bid] = p
            self.copies.setdefault(p, []).append(bid)
            new.append(bid)
        s = len(hit)
        parent = self.ehash(prefixes[s - 1]) if s else None
        got = index.apply_stored(target, [self.ehash(p) for p in prefixes[s:]], parent,
                                 tokens[s * self.bs : n * self.bs], self.bs, seed)
        assert got == n - s  # the parent hash is always known: every continuation is indexed
        for bid in reversed(hit + new):  # freed tail first: the tail is evicted first
            self.lru.pop(bid, None)
            self.lru[bid] = None

    def _evict(self, bid: int, index: PrefixIndex, target: str) -> None:
        del self.lru[bid]
        p = self.block.pop(bid)
        self.copies[p].remove(bid)
        left = len(self.copies[p])
        if not left:
            del self.copies[p]
        counts = [left] if self.counts and self.rng.random() < 0.7 else None  # some events do not say
        assert index.apply_removed(target, [self.ehash(p)], Tier.GPU, counts) == 1

    def evict_some(self, index: PrefixIndex, target: str) -> None:
        for bid in list(self.lru)[: self.rng.randint(1, 4)]:
            self._evict(bid, index, target)

    def held(self, tokens: list[int]) -> int:
        n = 0
        while n < len(tokens) // self.bs and tuple(tokens[: (n + 1) * self.bs]) in self.copies:
            n += 1
        return n


@pytest.mark.parametrize("counts", [False, True], ids=["one_copy_per_removal", "remaining_copy_counts"])
@pytest.mark.parametrize("seed", range(4))
def test_engine_layer_tracks_an_engine_holding_duplicate_copies_of_a_hash(seed: int, counts: bool) -> None:
    """Against the engine's own physical blocks: every prefix the engine holds (any copy) is
    matched, nothing it dropped is, the hash map holds exactly the hashes it still holds, and
    every store below a hash with several copies is indexed (the engine asserts it)."""
    rng = random.Random(seed)
    index = PrefixIndex()
    ns = namespace_seed("model")
    engines = {t: DupEngine(rng, counts=counts) for t in ("a", "b")}
    system = [rng.randrange(3) for _ in range(8)]
    prompts = [system + [rng.randrange(3) for _ in range(rng.choice([0, 4, 8, 12]))] for _ in range(12)]
    prompts += [p + [rng.randrange(3) for _ in range(4)] for p in prompts[:6]]  # next turns
    duplicated = 0
    for _ in range(400):
        t = rng.choice(list(engines))
        e = engines[t]
        if rng.random() < 0.8:
            e.serve(rng.choice(prompts), index, t, ns)
        else:
            e.evict_some(index, t)
        duplicated += any(len(c) > 1 for c in e.copies.values())
        p = rng.choice(prompts)
        want = {u: Overlap(x.held(p), 0) for u, x in engines.items() if x.held(p)}
        assert dict(index.match(block_keys(p, 4, ns))) == want
    assert duplicated > 100  # the workload really holds duplicates
    for t, e in engines.items():
        assert set(index.engine_map(t)) == {e.ehash(p) for p in e.copies}
        assert index.keys_of(t) == {block_keys(list(p), 4, ns)[-1] for p in e.copies}
        assert index.engine_copies(t) == {e.ehash(p): len(c) for p, c in e.copies.items() if len(c) > 1}


def test_budget_keeps_a_prefix_that_keeps_being_matched_through_a_flood_of_new_chains() -> None:
    """A flood of new chains, each newer than the hot session: the session is matched between
    them, so it is never the least recently used, and stays whole while the flood is evicted."""
    index = PrefixIndex(max_keys=100)
    hot = [7_000_000 + i for i in range(30)]
    index.store("a", hot)
    for n in range(2_000):
        index.store("b", [n * 10 + i for i in range(1, 5)])
        if n % 10 == 0:
            assert index.match(hot) == {"a": Overlap(30, 0)}
    assert len(index) <= 100 and index.evicted >= 7_000
    assert index.match(hot) == {"a": Overlap(30, 0)}


def test_budget_bounds_the_engine_maps_of_a_target_that_stores_and_never_removes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine that only stores (a flood, or removals that never arrive): the hashes of evicted
    nodes are swept from its map, which stays within the sweep bound; live blocks still resolve."""
    import mesh.core.index as index_module

    monkeypatch.setattr(index_module, "_SWEEP_MIN", 1_000)
    ns = namespace_seed("m")
    index = PrefixIndex(max_keys=100)
    for h in range(1, 20_001):
        index.apply_stored("w", [h], None, [h % 30_000, h // 30_000, 3, 4], 4, ns)
    assert len(index) <= 100
    assert len(index.engine_map("w")) <= 2_000  # max(2 x max_keys, the floor) x 2 at most
    last = block_keys([20_000 % 30_000, 0, 3, 4], 4, ns)
    assert index.holds("w", last[0]) is Tier.GPU and index.engine_map("w")[20_000] == last[0]
    assert index.apply_stored("w", [20_001], 20_000, [9, 9, 9, 9], 4, ns) == 1  # its child still keyed
    index.apply_removed("w", [20_000, 20_001], Tier.GPU)
    assert index.holds("w", last[0]) is None
