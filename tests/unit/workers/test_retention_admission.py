"""Admission under the router's retention hint: a request of a session that does not fit this
worker waits, while another such request runs, until the eviction front covers it, so it
evicts no prefix of the sessions the router keeps here; requests behind it go first; with no
hinted request running it is admitted (nothing else would refill the front)."""

from __future__ import annotations

from mesh.core.keys import block_keys, namespace_seed
from workers.config import EngineConfig
from workers.engine.block_manager import BlockManager
from workers.engine.scheduler import Scheduler
from workers.engine.sequence import SamplingParams, Sequence, SequenceStatus

BS = 4
SEED = namespace_seed("test-model")


def _seq(rid: str, start: int, n_tokens: int, spill: bool = False) -> Sequence:
    return Sequence(rid, list(range(start, start + n_tokens)), SamplingParams(max_tokens=1), BS, SEED,
                    evict_first=spill)


def _cluster(blocks: int = 12) -> tuple[Scheduler, BlockManager]:
    bm = BlockManager(blocks, BS)
    return Scheduler(EngineConfig(block_size=BS, num_kv_blocks=blocks), bm), bm


def _run_to_end(sched: Scheduler, seq: Sequence) -> None:
    """Compute ``seq``'s prompt and finish it (its blocks freed, still cached)."""
    seq.num_computed_tokens = len(seq)
    sched.block_manager.commit(seq)
    sched.finish(seq, "length")


def _admitted(sched: Scheduler) -> list[str]:
    """The requests one step admits (prefills of requests not running before it)."""
    before = {s.seq_id for s in sched.running}
    return [s.request_id for s, _ in sched.schedule().prefills if s.seq_id not in before]


def _cached(bm: BlockManager, start: int, n_tokens: int) -> bool:
    return all(k in bm.cached for k in block_keys(list(range(start, start + n_tokens)), BS, SEED))


def test_a_spilled_request_waits_for_the_front_and_the_kept_request_behind_it_goes_first() -> None:
    sched, bm = _cluster()
    kept = _seq("kept", 100, 16)  # 4 blocks, cached and free: a session the router keeps here
    sched.add(kept)
    assert _admitted(sched) == ["kept"]
    _run_to_end(sched, kept)
    spill_a = _seq("spill-a", 200, 16, spill=True)  # 4 blocks, running
    sched.add(spill_a)
    assert _admitted(sched) == ["spill-a"]
    spill_b = _seq("spill-b", 300, 20, spill=True)  # 5 blocks: the front holds 4 empty ones
    kept_turn = _seq("kept-2", 400, 8)  # 2 blocks, behind it
    sched.add(spill_b)
    sched.add(kept_turn)
    assert _admitted(sched) == ["kept-2"]  # spill-b held back; the request behind it admitted
    assert spill_b.status is SequenceStatus.WAITING and sched.held == 1
    assert list(sched.waiting) == [spill_b]  # held only: a decode step may still be scheduled ahead
    assert _cached(bm, 100, 16)
    _run_to_end(sched, spill_a)  # its 4 blocks go to the eviction front
    assert sched.held == 0
    assert _admitted(sched) == ["spill-b"]  # 2 empty + 4 spilled blocks cover its 5
    assert _cached(bm, 100, 16)  # the kept session's prefix survived both spilled requests
    bm.check(sched.running)


def test_with_no_spilled_request_running_a_spilled_request_is_admitted_even_if_it_evicts() -> None:
    sched, bm = _cluster(8)
    kept = _seq("kept", 100, 16)  # 4 blocks cached
    sched.add(kept)
    _admitted(sched)
    _run_to_end(sched, kept)
    spill = _seq("spill", 200, 24, spill=True)  # 6 blocks: 4 empty, then 2 of the kept chain
    sched.add(spill)
    assert _admitted(sched) == ["spill"]  # nothing running would refill the front: no wait
    assert not _cached(bm, 100, 16)


def test_requests_without_the_hint_are_never_held() -> None:
    sched, bm = _cluster()
    kept = _seq("kept", 100, 16)
    sched.add(kept)
    _admitted(sched)
    _run_to_end(sched, kept)
    spill = _seq("spill", 200, 16, spill=True)
    sched.add(spill)
    _admitted(sched)
    plain = _seq("plain", 300, 24)  # 6 blocks: 4 empty, then 2 of the kept chain (plain LRU)
    sched.add(plain)
    assert _admitted(sched) == ["plain"]
    assert sched.held == 0
