"""The simulated worker as a hybrid model against the bundled engine's block manager with
recurrent-state checkpoints (``enable_states``, no model, no torch): the same requests resume at
the same checkpoints; and the simulated router's matches end at checkpoints too."""

from __future__ import annotations

import itertools
import random
from typing import Any

import numpy as np

from simulator.engine import SimConfig, Simulator
from simulator.profile import DecodeTiming, PrefillTiming, Profile
from simulator.traces import DONE, Trace, TraceRequest
from tests.support.worker_model import BS, SEED, Req, sessions
from workers.config import EngineConfig
from workers.engine.block_manager import BlockManager
from workers.engine.scheduler import Scheduler
from workers.engine.sequence import SamplingParams, Sequence


def engine_hits(reqs: list[Req], blocks: int, budget: int, checkpoints: int, interval_blocks: int) -> list[int]:
    """Cached tokens of each request at its first admission, on the engine's scheduler and block
    manager with state checkpoints (snapshots planned each step, as ``LLMEngine.step`` does)."""
    bm = BlockManager(blocks, BS)
    states = bm.enable_states(256, checkpoints, interval_blocks * BS)
    sched = Scheduler(EngineConfig(block_size=BS, num_kv_blocks=blocks, max_num_batched_tokens=budget), bm)
    seqs = [Sequence(str(i), toks, SamplingParams(max_tokens=1, ignore_eos=True), BS, SEED)
            for i, (_, _, toks) in enumerate(reqs)]
    after = {d[0]: (i, d[1]) for i, (_, d, _) in enumerate(reqs) if d is not None}
    order = itertools.count()
    pending = sorted((a, next(order), i) for i, (a, _, _) in enumerate(reqs) if a is not None)
    t, busy = 0.0, False
    while pending or sched.has_unfinished():
        if not busy and not sched.has_unfinished():
            t = max(t, pending[0][0])
        while pending and (pending[0][0] <= t if not busy else pending[0][0] < t):
            sched.add(seqs[pending.pop(0)[2]])
        batch = sched.schedule()
        if not batch:
            busy = False
            continue
        for s, n in batch.items():
            states.plan(s, s.num_computed_tokens, n)
        states.take_copies()
        rank = {s.seq_id: k for k, s in enumerate(sched.running)}
        sampled = {s.seq_id: 1 for s, n in batch.items() if s.num_computed_tokens + n == len(s.token_ids)}
        done = sorted((s for s in sched.postprocess(batch, sampled, None, 10**9) if s.is_finished),
                      key=lambda s: rank[s.seq_id])
        t, busy = t + 1, True
        for s in done:
            if int(s.request_id) in after:
                j, think = after[int(s.request_id)]
                pending = sorted([*pending, (t + think, next(order), j)])
        bm.check(sched.all_seqs())
    return [s.num_cached_tokens for s in seqs]


class _Recorder:
    """Each routed request's predicted overlap on its target (the index's match, as routed)."""

    def __init__(self) -> None:
        # by the request's block keys, in routing order (a session's next turn may add no full block)
        self.predicted: dict[tuple[int, ...], list[int]] = {}

    def route(self, t: float, info: Any, decision: Any) -> None:
        ov = decision.overlaps.get(decision.target)
        self.predicted.setdefault(tuple(info.block_keys), []).append(ov.blocks * BS if ov is not None else 0)

    def __getattr__(self, name: str) -> Any:  # the other hooks (events, first tokens, ...): ignored
        return lambda *args, **kw: None


def simulated(reqs: list[Req], blocks: int, budget: int, checkpoints: int, interval_blocks: int,
              ) -> tuple[list[int], list[int]]:
    trace = []
    for i, (a, d, toks) in enumerate(reqs):
        keys = Sequence("k", toks, SamplingParams(max_tokens=1), BS, SEED).keys_upto(len(toks) // BS)
        deps = () if d is None else ((d[0], DONE, d[1]),)
        trace.append(TraceRequest(i, None, a, deps, len(toks), 1, np.array(keys, dtype=np.uint64), f"r{i}"))
    profile = Profile(name="steps", block_size=BS, kv_blocks=blocks, max_batched_tokens=budget,
                      prefill=PrefillTiming(base_ms=1000.0), decode=DecodeTiming(base_ms=1000.0))
    rec = _Recorder()
    config = SimConfig(workers=1, profile=profile, speculative_ttl_s=0, hybrid_checkpoints=checkpoints,
                       hybrid_interval_blocks=interval_blocks)
    result = Simulator(Trace(trace, BS, ["mesh"], ["test"]), "kv_aware", config, recorder=rec).run()
    # the worker never reuses the block holding a prompt's last token: the prediction, capped so
    cap = [(r.prompt_tokens - 1) // BS * BS for r in trace]
    return [int(h) for h in result.hit], [min(rec.predicted[tuple(int(k) for k in r.keys)].pop(0), c)
                                         for r, c in zip(trace, cap, strict=True)]


def test_hybrid_worker_resumes_where_the_engine_does() -> None:
    """Closed-loop multi-turn sessions, interval and end-of-turn checkpoints: every request's
    cached tokens equal the engine's. (Compared without evictions, of blocks or checkpoints: past
    a checkpoint the engine recomputes into fresh blocks, as vLLM does, where the simulator
    reuses the cached ones, and the two order LRU touches of one step differently, so under
    pressure their evictions can differ.)"""
    for seed in range(8):
        rng = random.Random(seed)
        reqs = sessions(rng)
        budget, interval, pool = rng.choice([8, 16, 32]), rng.choice([0, 2, 5]), 1000
        hits = engine_hits(reqs, 1000, budget, pool, interval)
        sim, predicted = simulated(reqs, 1000, budget, pool, interval)
        assert sim == hits, f"seed {seed}"
        assert predicted == sim  # the simulated router saw exactly that
        assert 0 < sum(hits)


class _Instant(_Recorder):
    """At every routing decision: the index's match against the worker's own resumable prefix
    at that instant (its cached blocks cut back to its deepest checkpoint; nothing touched)."""

    def __init__(self) -> None:
        super().__init__()
        self.sim: Any = None
        self.compared = self.claimed = 0

    def route(self, t: float, info: Any, decision: Any) -> None:
        w = self.sim.by_id[decision.target]
        keys = list(info.block_keys)
        h = w.cached_prefix(keys, len(keys))
        truth = next((j for j in range(h, 0, -1) if keys[j - 1] in w.states), 0)
        ov = decision.overlaps.get(decision.target)
        assert (ov.blocks if ov is not None else 0) == truth, (t, truth, ov)
        self.compared += 1
        self.claimed += truth > 0


def test_router_matches_the_workers_checkpoints_at_every_decision() -> None:
    """A tiny checkpoint pool (evictions between routing and admission): at every routing
    decision the index's match is the worker's resumable prefix at that instant, never more; and
    reuse drops below a plain worker's."""
    rng = random.Random(11)
    reqs = sessions(rng)
    trace = [TraceRequest(i, None, a, () if d is None else ((d[0], DONE, d[1]),), len(toks), 1,
                          np.array(Sequence("k", toks, SamplingParams(max_tokens=1), BS, SEED).keys_upto(len(toks) // BS),
                                   dtype=np.uint64), f"r{i}")
             for i, (a, d, toks) in enumerate(reqs)]
    profile = Profile(name="steps", block_size=BS, kv_blocks=60, max_batched_tokens=16,
                      prefill=PrefillTiming(base_ms=1000.0), decode=DecodeTiming(base_ms=1000.0))
    rec = _Instant()
    config = SimConfig(workers=2, profile=profile, speculative_ttl_s=0, hybrid_checkpoints=2, hybrid_interval_blocks=3)
    sim = Simulator(Trace(trace, BS, ["mesh"], ["test"]), "kv_aware", config, recorder=rec)
    rec.sim = sim
    hits = sim.run().hit
    assert rec.compared == len(reqs) and rec.claimed > 3
    plain = Simulator(Trace(trace, BS, ["mesh"], ["test"]), "kv_aware",
                      SimConfig(workers=2, profile=profile, speculative_ttl_s=0)).run().hit
    assert 0 < sum(hits) < sum(plain)
