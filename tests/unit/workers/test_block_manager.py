"""The block manager: reference counts, the free pool that keeps content, revival, eviction,
token verification, and the integrity check, under a hypothesis state machine that also keeps a
fake KV store (what each slot really holds) and rebuilds the cached set from the events."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mesh.core.keys import block_keys, namespace_seed
from workers.engine.block_manager import AllBlocksCleared, BlockManager, BlockRemoved, BlockStored
from workers.engine.sequence import SamplingParams, Sequence

BS = 4
SEED = namespace_seed("test-model")


def _seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, tokens, SamplingParams(max_tokens=64), BS, SEED)


def _compute_all(bm: BlockManager, seq: Sequence) -> None:
    seq.num_computed_tokens = len(seq)
    bm.commit(seq)


# ---- unit behaviour ---------------------------------------------------------------------------


def test_keys_are_the_router_keys() -> None:
    bm = BlockManager(8, BS)
    seq = _seq(list(range(10)))
    bm.allocate(seq)
    _compute_all(bm, seq)
    (stored,) = bm.drain_events()
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == block_keys(list(range(10)), BS, SEED)
    assert stored.parent_block_hash is None and stored.token_ids == list(range(8))


def test_free_keeps_content_and_a_hit_revives_without_eviction() -> None:
    bm = BlockManager(8, BS)
    a = _seq(list(range(13)))
    bm.allocate(a)
    _compute_all(bm, a)
    bm.free_seq(a)
    bm.drain_events()
    assert bm.num_free_blocks == 8 and len(bm.cached) == 3  # freed, still cached
    b = _seq(list(range(13)) + [99])
    assert bm.allocate(b) == 12  # three blocks revived from the free pool
    assert bm.num_revived == 3 and bm.num_evicted == 0
    assert bm.drain_events() == []  # no BlockRemoved: revival never takes the eviction path
    bm.check([b])


def test_blocks_freed_with_the_retention_hint_are_evicted_first_tail_first() -> None:
    bm = BlockManager(8, BS)
    kept = _seq(list(range(100, 112)), "kept")  # 3 blocks, freed first: the LRU victim without the hint
    spill = Sequence("spill", list(range(200, 208)), SamplingParams(max_tokens=64), BS, SEED, evict_first=True)
    for seq in (kept, spill):
        bm.allocate(seq)
        _compute_all(bm, seq)
    bm.free_seq(kept)
    bm.free_seq(spill)
    bm.check()
    bm.drain_events()
    newcomer = _seq(list(range(300, 312)), "new")  # 3 blocks: 3 empty ones, then the spilled chain's tail
    bm.allocate(newcomer)
    assert bm.num_evicted == 0  # the empty blocks went first
    bm.free_seq(newcomer)  # (no content committed: back to the front)
    big = _seq(list(range(400, 420)), "big")  # 5 blocks: 3 empty, then both spilled blocks, tail first
    bm.allocate(big)
    removed = [k for e in bm.drain_events() if isinstance(e, BlockRemoved) for k in e.block_hashes]
    spill_keys = block_keys(list(range(200, 208)), BS, SEED)
    assert removed == spill_keys[::-1]
    assert all(k in bm.cached for k in block_keys(list(range(100, 112)), BS, SEED))  # the kept session survived
    bm.check([big])


def test_block_holding_the_last_prompt_token_is_never_reused() -> None:
    bm = BlockManager(8, BS)
    a = _seq(list(range(8)))
    bm.allocate(a)
    _compute_all(bm, a)
    b = _seq(list(range(8)))  # the same 2 full blocks: the second holds the last token
    assert bm.allocate(b) == 4
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    bm.check([a, b])


def test_hit_is_verified_against_stored_tokens() -> None:
    bm = BlockManager(8, BS)
    a = _seq(list(range(9)))
    bm.allocate(a)
    _compute_all(bm, a)
    b = _seq([50, 51, 52, 53, 54, 55, 56, 57, 58])
    b.block_hashes = list(a.keys_upto(2))  # forge a collision: b claims a's keys
    assert bm.match_prefix(b) == []


def test_eviction_takes_empty_blocks_first_then_chain_tails() -> None:
    bm = BlockManager(6, BS)
    a = _seq(list(range(14)))  # 3 full blocks + 1 partial
    bm.allocate(a)
    _compute_all(bm, a)
    keys = a.keys_upto(3)
    bm.free_seq(a)
    bm.drain_events()
    # 4 fresh blocks: the 2 never used, a's partial block, then the tail of a's chain.
    b = _seq([200 + i for i in range(13)])
    bm.allocate(b)
    assert bm.drain_events() == [BlockRemoved([keys[2]])]
    assert set(bm.cached) == set(keys[:2])  # the surviving prefix is contiguous
    bm.check([b])


def test_generated_tokens_become_cached_blocks() -> None:
    bm = BlockManager(8, BS)
    a = _seq(list(range(6)))
    bm.allocate(a)
    _compute_all(bm, a)
    for t in (60, 61, 62):  # decode: each step computes the previous token
        a.token_ids.append(t)
        bm.append_slots(a, len(a))
        a.num_computed_tokens = len(a) - 1
        bm.commit(a)
    assert len(bm.cached) == 2  # tokens 0..7: prompt 0..5 + generated 60, 61
    turn2 = _seq(list(range(6)) + [60, 61, 62, 70, 71])
    assert bm.allocate(turn2) == 8


def test_duplicate_compute_in_one_step_registers_once() -> None:
    bm = BlockManager(8, BS)
    a, b = _seq(list(range(9)), "a"), _seq(list(range(9)), "b")
    bm.allocate(a)
    bm.allocate(b)  # a is not computed yet: no hit
    _compute_all(bm, a)
    _compute_all(bm, b)
    assert len(bm.cached) == 2 and len([e for e in bm.drain_events() if isinstance(e, BlockStored)]) == 1
    bm.check([a, b])
    bm.free_seq(a)
    bm.free_seq(b)
    bm.check([])


def test_reset_refused_while_blocks_are_used() -> None:
    bm = BlockManager(4, BS)
    a = _seq(list(range(5)))
    bm.allocate(a)
    _compute_all(bm, a)
    assert not bm.reset_prefix_cache()
    bm.free_seq(a)
    assert bm.reset_prefix_cache() and not bm.cached
    assert bm.drain_events()[-1] == AllBlocksCleared()


def test_check_detects_a_refcount_leak() -> None:
    bm = BlockManager(4, BS)
    a = _seq(list(range(5)))
    bm.allocate(a)
    bm.blocks[a.block_table[0]].ref_count += 1
    with pytest.raises(RuntimeError, match="holders"):
        bm.check([a])


# ---- state machine -------------------------------------------------------------------------------

PREFIXES = [[(p * 37 + i) % 50 for i in range(12)] for p in range(3)]


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(12, BS)
        self.live: list[Sequence] = []
        self.kv: dict[int, list[int | None]] = {b: [None] * BS for b in range(12)}  # the fake cache
        self.subscriber: set[int] = set()  # cached keys rebuilt from events alone
        self.rng = random.Random(0)
        take = self.bm._take_fresh

        def poisoning_take() -> int:  # a fresh block's old content is gone
            bid = take()
            self.kv[bid] = [None] * BS
            return bid

        self.bm._take_fresh = poisoning_take  # type: ignore[method-assign]

    def _write(self, seq: Sequence, start: int, end: int) -> None:
        for p in range(start, end):
            self.kv[seq.block_table[p // BS]][p % BS] = seq.token_ids[p]

    @rule(prefix=st.sampled_from(range(len(PREFIXES))), cut=st.integers(1, 12), tail=st.lists(st.integers(0, 49), max_size=9))
    def admit(self, prefix: int, cut: int, tail: list[int]) -> None:
        seq = _seq(PREFIXES[prefix][:cut] + tail)
        if not self.bm.can_allocate(seq):
            return
        hit = self.bm.allocate(seq)
        assert hit % BS == 0 and hit < len(seq)
        # Maximal: the match stops at the limit or at a key that is not cached.
        limit = (len(seq) - 1) // BS
        nxt = hit // BS
        if nxt < limit:
            assert seq.keys_upto(limit)[nxt] not in self.bm.cached
        self.live.append(seq)

    @precondition(lambda self: any(s.num_computed_tokens < len(s) for s in self.live))
    @rule(data=st.data())
    def compute(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from([s for s in self.live if s.num_computed_tokens < len(s)]))
        todo = len(seq) - seq.num_computed_tokens
        n = data.draw(st.integers(1, todo))
        self._write(seq, seq.num_computed_tokens, seq.num_computed_tokens + n)
        seq.num_computed_tokens += n
        self.bm.commit(seq)

    @precondition(lambda self: any(s.num_computed_tokens == len(s) for s in self.live))
    @rule(data=st.data(), token=st.integers(0, 49))
    def decode(self, data: st.DataObject, token: int) -> None:
        seq = data.draw(st.sampled_from([s for s in self.live if s.num_computed_tokens == len(s)]))
        seq.token_ids.append(token)
        if self.bm.can_append(seq, len(seq)):
            self.bm.append_slots(seq, len(seq))
        else:  # preemption: free and forget it (recompute would be a new admission)
            self.live.remove(seq)
            self.bm.free_seq(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.live))
        self.live.remove(seq)
        self.bm.free_seq(seq)

    @invariant()
    def consistent(self) -> None:
        self.bm.check(self.live)
        for seq in self.live:  # every computed token is really in its slot
            for p in range(seq.num_computed_tokens):
                assert self.kv[seq.block_table[p // BS]][p % BS] == seq.token_ids[p], (seq.seq_id, p)
        for bid in self.bm.cached.values():  # cached content is intact
            assert tuple(self.kv[bid]) == self.bm.blocks[bid].token_ids
        for event in self.bm.drain_events():
            if isinstance(event, BlockStored):
                self.subscriber |= set(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.subscriber -= set(event.block_hashes)
        assert self.subscriber == self.bm.cached_keys()


BlockManagerMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestBlockManagerMachine = BlockManagerMachine.TestCase
