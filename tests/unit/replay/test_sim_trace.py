"""The replay's plan as a simulator trace: the same requests, lengths, dependencies and prefixes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mesh.replay.run import Prepared, ReplaySetup, prepare
from mesh.replay.sim_trace import plan_trace
from simulator.engine import SimConfig, Simulator
from simulator.profile import load_profile

SLICE = Path(__file__).resolve().parents[3] / "bench" / "data" / "weka-routing"
ENGINE_BLOCK = 16


@pytest.fixture(scope="module")
def prep() -> Prepared:
    # the benchmark's scaling (bench/e2e_routing.py): prompts at 1/16, 32 output tokens, think x0.01 capped at 2 s
    return prepare(ReplaySetup(traces=[str(SLICE)], sessions=3, prompt_scale=16.0, output_tokens=32,
                               time_scale=0.01, max_think_s=2.0))


def leading_equal(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    diff = np.nonzero(a[:n] != b[:n])[0]
    return int(diff[0]) if diff.size else n


def test_every_planned_turn_is_one_request_of_the_replays_length(prep: Prepared) -> None:
    trace = plan_trace(prep.trace, prep.plan, prep.builder, ENGINE_BLOCK)
    turns = prep.plan.turns
    assert len(trace.requests) == len(turns) > 100
    assert [r.prompt_tokens for r in trace.requests] == [t.units for t in turns]
    assert [r.prompt_tokens for r in trace.requests] == [prep.builder.codes(t.request).size for t in turns]
    assert {r.output_tokens for r in trace.requests} == {32}
    assert [r.deps for r in trace.requests] == [t.deps for t in turns]
    assert max(d for r in trace.requests for _, _, d in r.deps) <= 2.0  # the capped think time
    assert [r.arrival for r in trace.requests] == [t.arrival for t in turns]
    assert trace.groups == [t.group for t in turns] and trace.block_size == ENGINE_BLOCK
    assert [r.session for r in trace.requests] == [t.session for t in turns]
    assert {r.session for r in plan_trace(prep.trace, prep.plan, prep.builder, ENGINE_BLOCK,
                                          session_ids=False).requests} == {None}


def test_block_keys_are_equal_exactly_where_the_built_prompts_are(prep: Prepared) -> None:
    trace = plan_trace(prep.trace, prep.plan, prep.builder, ENGINE_BLOCK)
    turns = prep.plan.turns
    codes = [prep.builder.codes(t.request) for t in turns]
    upb = prep.builder.units_per_block
    for r, t in zip(trace.requests, turns, strict=True):
        covered = min(t.units, t.request.keys.size * upb)  # units spelled from trace blocks, not the tail
        assert r.keys.size == covered // ENGINE_BLOCK
    pairs = [(i, i + 1) for i in range(len(turns) - 1)] + [(0, len(turns) - 1), (3, 50), (7, 90)]
    shared = 0
    for i, j in pairs:
        a, b = trace.requests[i], trace.requests[j]
        n = min(a.keys.size, b.keys.size)
        blocks_a = codes[i][: n * ENGINE_BLOCK].reshape(n, ENGINE_BLOCK)
        blocks_b = codes[j][: n * ENGINE_BLOCK].reshape(n, ENGINE_BLOCK)
        equal_blocks = leading_equal(np.all(blocks_a == blocks_b, axis=1), np.ones(n, dtype=bool))
        assert leading_equal(a.keys, b.keys) == equal_blocks, (i, j)
        shared += equal_blocks
    assert shared > 1000  # the turns of a session share long prefixes


def test_a_closed_loop_run_serves_the_plans_requests(prep: Prepared) -> None:
    trace = plan_trace(prep.trace, prep.plan, prep.builder, ENGINE_BLOCK)
    profile = load_profile("h200-8b", kv_blocks=4000)
    whole = Simulator(trace, "session_sticky", SimConfig(workers=2, profile=profile, concurrency=2)).run()
    assert len(whole.arrival) == len(trace.requests) and whole.not_sent == 0 and whole.worker.min() >= 0
    cut = Simulator(trace, "session_sticky", SimConfig(workers=2, profile=profile, concurrency=2, horizon_s=5.0)).run()
    assert 0 < len(cut.arrival) < len(trace.requests) and cut.arrival.max() <= 5.0
