"""The closed-loop admission of session groups: slots, shifts, the horizon, and in a whole run."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from simulator.engine import SimConfig, Simulator
from simulator.profile import DecodeTiming, PrefillTiming, Profile
from simulator.session_gate import SessionGate, session_groups
from simulator.traces import DONE, START, Trace, TraceRequest


@dataclass
class Req:
    arrival: float | None
    deps: tuple[tuple[int, int, float], ...] = ()


def chain(start: float, turns: int, first: int, think: float = 1.0) -> list[Req]:
    """A session of ``turns`` requests, each released ``think`` s after its predecessor ended."""
    reqs = [Req(start)]
    reqs += [Req(None, ((first + i, DONE, think),)) for i in range(turns - 1)]
    return reqs


def test_groups_are_the_requests_linked_by_dependencies() -> None:
    reqs = [Req(0.0), Req(0.0), Req(None, ((0, DONE, 1.0),)), Req(None, ((1, START, 0.5), (2, DONE, 0.0))), Req(3.0)]
    assert session_groups(reqs) == [0, 0, 0, 0, 1]  # 3 depends on 1 and 2: 1 joins 0's group


def test_at_most_n_groups_run_and_the_next_starts_when_one_ends() -> None:
    reqs = chain(0.0, 2, 0) + chain(0.0, 1, 2) + chain(0.0, 1, 3)
    gate = SessionGate(reqs, session_groups(reqs), concurrency=2)
    assert gate.open() == [(0, 0.0), (2, 0.0)]  # groups 0 and 1; group 2 waits for a slot
    assert gate.fired(1, 6.0, 5.0) == [(1, 6.0)]  # group 0 goes on: its slot stays taken
    assert gate.ended(2, 4.0) == [(3, 4.0)]  # group 1 done at 4 s: group 2 starts then, shifted by 4 s
    assert gate.ended(0, 5.0) == []


def test_a_late_group_is_shifted_and_the_horizon_skips_what_it_reaches() -> None:
    reqs = chain(0.0, 1, 0) + chain(1.0, 3, 1)
    gate = SessionGate(reqs, session_groups(reqs), concurrency=1, horizon_s=10.0)
    assert gate.open() == [(0, 0.0)]
    assert gate.ended(0, 3.0) == [(1, 3.0)]  # admitted at 3 s, 2 s after its first arrival
    assert gate.fired(2, 9.5, 8.5) == [(2, 9.5)]
    assert gate.fired(3, 12.0, 11.0) == []  # past the horizon: skipped
    assert gate.released(2) and not gate.released(3)


def test_a_skipped_request_takes_its_waiting_dependents_and_frees_the_slot() -> None:
    reqs = chain(0.0, 3, 0) + chain(0.0, 1, 3)
    gate = SessionGate(reqs, session_groups(reqs), concurrency=1, horizon_s=5.0)
    assert gate.open() == [(0, 0.0)]
    assert gate.ended(0, 2.0) == []
    # request 1's release (6 s) is past the horizon: it and request 2 are skipped, the group
    # is done, and the next group is admitted at 4 s, whose arrival (4 s) is still in time
    assert gate.fired(1, 6.0, 4.0) == [(3, 4.0)]
    assert gate.skipped == {1, 2}
    assert gate.fired(2, 7.0, 7.0) == []  # settled already


def test_a_group_past_the_horizon_is_never_admitted() -> None:
    reqs = chain(0.0, 1, 0) + chain(20.0, 1, 1)
    gate = SessionGate(reqs, session_groups(reqs), concurrency=0, horizon_s=10.0)
    assert gate.open() == [(0, 0.0)]
    assert not gate.released(1)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="concurrency"):
        SessionGate([Req(0.0)], [0], concurrency=-1)
    with pytest.raises(ValueError, match="group labels"):
        SessionGate([Req(0.0)], [0, 1])


def _trace(sessions: int, turns: int) -> Trace:
    reqs = []
    for s in range(sessions):
        for t in range(turns):
            i = len(reqs)
            deps = () if t == 0 else ((i - 1, DONE, 0.5),)
            keys = np.arange(s * 1000, s * 1000 + 4 + t, dtype=np.uint64) + 1
            reqs.append(TraceRequest(i, f"s{s}", 0.0 if t == 0 else None, deps, 64 + 16 * t + 3, 4, keys, f"r{i}"))
    return Trace(reqs, 16, ["mesh"], ["test"])


PROFILE = Profile(name="t", block_size=16, kv_blocks=0, prefill=PrefillTiming(base_ms=100.0),
                  decode=DecodeTiming(base_ms=10.0))


def test_a_run_never_has_more_sessions_in_flight_than_the_limit() -> None:
    trace = _trace(sessions=6, turns=3)
    result = Simulator(trace, "round_robin", SimConfig(workers=2, profile=PROFILE, concurrency=2)).run()
    assert result.worker.min() >= 0 and len(result.arrival) == 18  # every request served
    by_session = {}
    for r, a, f in zip(trace.requests, result.arrival, result.finish, strict=True):
        lo, hi = by_session.get(r.session, (a, f))
        by_session[r.session] = (min(lo, a), max(hi, f))
    spans = sorted(by_session.values())
    for t, _ in spans:  # at each session's start, at most 2 sessions have started and not ended
        live = sum(1 for a, f in spans if a <= t < f)
        assert live <= 2
    assert spans[2][0] >= min(f for _, f in spans[:2])  # the third starts once one of the first ends


def test_a_horizon_cuts_the_run_and_reports_the_requests_not_sent() -> None:
    trace = _trace(sessions=2, turns=20)
    full = Simulator(trace, "round_robin", SimConfig(workers=2, profile=PROFILE)).run()
    cut = Simulator(trace, "round_robin", SimConfig(workers=2, profile=PROFILE, horizon_s=3.2)).run()
    assert len(full.arrival) == 40 and full.not_sent == 0
    assert 0 < len(cut.arrival) < 40 and cut.not_sent == 40 - len(cut.arrival)
    assert cut.arrival.max() <= 3.2 < cut.finish.max()  # in flight at the horizon: finished
