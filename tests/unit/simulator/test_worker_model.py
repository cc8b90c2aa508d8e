"""The simulated worker's cache against the bundled engine's: the same requests, the same hits.

The bundled engine's ``Scheduler`` and ``BlockManager`` (``workers/engine``, no model, no torch)
run the requests step by step, each step lasting one second; the simulator runs them on one
worker whose every step costs one second too. Keys: the engine's own block keys of each prompt.
"""

from __future__ import annotations

import itertools
import random

import numpy as np

from simulator.engine import SimConfig, Simulator
from simulator.profile import DecodeTiming, PrefillTiming, Profile
from simulator.traces import DONE, Trace, TraceRequest
from tests.support.worker_model import BS, SEED, Req, sessions
from workers.config import EngineConfig
from workers.engine.block_manager import BlockManager
from workers.engine.scheduler import Scheduler
from workers.engine.sequence import SamplingParams, Sequence


def engine_hits(reqs: list[Req], blocks: int, budget: int) -> tuple[list[int], bool]:
    """(cached tokens of each request at its admission, whether two ever finished in one step)."""
    sched = Scheduler(EngineConfig(block_size=BS, num_kv_blocks=blocks, max_num_batched_tokens=budget),
                      BlockManager(blocks, BS))
    seqs = [Sequence(str(i), toks, SamplingParams(max_tokens=1, ignore_eos=True), BS, SEED)
            for i, (_, _, toks) in enumerate(reqs)]
    after = {d[0]: (i, d[1]) for i, (_, d, _) in enumerate(reqs) if d is not None}
    order = itertools.count()
    pending = sorted((a, next(order), i) for i, (a, _, _) in enumerate(reqs) if a is not None)
    t, busy, ties = 0.0, False, False
    while pending or sched.has_unfinished():
        if not busy and not sched.has_unfinished():
            t = max(t, pending[0][0])
        while pending and (pending[0][0] <= t if not busy else pending[0][0] < t):
            sched.add(seqs[pending.pop(0)[2]])
        batch = sched.schedule()
        if not batch:
            busy = False
            continue
        rank = {s.seq_id: k for k, s in enumerate(sched.running)}
        sampled = {s.seq_id: 1 for s, n in batch.items() if s.num_computed_tokens + n == len(s.token_ids)}
        done = sorted((s for s in sched.postprocess(batch, sampled, None, 10**9) if s.is_finished),
                      key=lambda s: rank[s.seq_id])
        t, busy, ties = t + 1, True, ties or len(done) > 1
        for s in done:
            if int(s.request_id) in after:
                j, think = after[int(s.request_id)]
                pending = sorted([*pending, (t + think, next(order), j)])
    return [s.num_cached_tokens for s in seqs], ties


def simulated_hits(reqs: list[Req], blocks: int, budget: int) -> list[int]:
    trace = []
    for i, (a, d, toks) in enumerate(reqs):
        keys = Sequence("k", toks, SamplingParams(max_tokens=1), BS, SEED).keys_upto(len(toks) // BS)
        deps = () if d is None else ((d[0], DONE, d[1]),)
        trace.append(TraceRequest(i, None, a, deps, len(toks), 1, np.array(keys, dtype=np.uint64), f"r{i}"))
    profile = Profile(name="steps", block_size=BS, kv_blocks=blocks, max_batched_tokens=budget,
                      prefill=PrefillTiming(base_ms=1000.0), decode=DecodeTiming(base_ms=1000.0))
    result = Simulator(Trace(trace, BS, ["mesh"], ["test"]), "round_robin", SimConfig(workers=1, profile=profile)).run()
    return [int(h) for h in result.hit]


def test_a_request_that_does_not_fit_evicts_nothing_and_a_returning_session_hits() -> None:
    rng = random.Random(1)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1000) for _ in range(n)]

    old, a = tokens(24), tokens(20)
    small = [(4.5, None, tokens(3)) for _ in range(6)]
    reqs: list[Req] = [(0.5, None, old), (2.5, None, a), *small,
                       (4.5, None, tokens(60)),  # 15 blocks: more than the free ones while the small ones run
                       (7.5, None, a + tokens(4))]  # the session of ``a`` returns
    hits, _ = engine_hits(reqs, blocks=20, budget=64)
    assert hits[-1] == 20  # the engine kept its 5 blocks (the big request evicted the older chain)
    assert simulated_hits(reqs, blocks=20, budget=64) == hits


def test_under_pressure_every_request_hits_what_the_engine_hits() -> None:
    """Random closed-loop sessions on a cache of 25-45 blocks; compared where no two requests end
    in one step (the engine frees those in batch order, the simulator in admission order)."""
    compared = 0
    for seed in range(400):
        rng = random.Random(seed)
        reqs = sessions(rng)
        blocks, budget = rng.randrange(25, 45), rng.choice([8, 16, 32])
        if max(len(t) for _, _, t in reqs) > blocks * BS:
            continue
        hits, ties = engine_hits(reqs, blocks, budget)
        if ties:
            continue
        assert simulated_hits(reqs, blocks, budget) == hits, f"seed {seed}"
        assert 0 < sum(hits) < sum(len(t) for _, _, t in reqs)  # some reuse, some eviction
        compared += 1
        if compared == 12:
            break
    assert compared == 12
