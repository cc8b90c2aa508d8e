"""The retention planner: senior sessions that fit a target's capacity are kept, the rest spill;
idle sessions stop counting, a moved session leaves its old plan, unknown capacity spills nothing;
every target's session footprint follows its plan."""

from __future__ import annotations

import pytest

from mesh.core.retention import REFRESH_S, REPLAN_S, RetentionPlanner
from policies.base import TargetState

TARGETS: dict[str, TargetState] = {}  # the router's targets, as the planner updates their footprints


def target(tid: str = "w0", capacity: int = 100) -> TargetState:
    TARGETS[tid] = TargetState(id=tid, worker=tid, kv_capacity_blocks=capacity)
    return TARGETS[tid]


def test_sessions_past_the_fill_of_the_capacity_spill_in_seniority_order() -> None:
    plan, w = RetentionPlanner(fill=0.9), target(capacity=100)
    assert [plan.spill(s, w, 40, 0.0, TARGETS) for s in ("a", "b")] == [False, False]  # 80 of 90
    assert plan.spill("c", w, 40, 0.0, TARGETS) is True  # 120 > 90: the youngest spills
    assert plan.spill("d", w, 10, 0.0, TARGETS) is False  # a small one still fits (80 + 10)
    assert plan.spilling("w0") == 1
    assert plan.spill("a", w, 45, 1.0, TARGETS) is False  # a senior session keeps its place as it grows ...
    assert plan.spilling("w0") == 2 and plan.spill("d", w, 10, 1.0, TARGETS) is True  # ... and displaces the junior one
    assert plan.spilled == 2


def test_a_session_that_grows_past_the_budget_spills_the_youngest_first() -> None:
    plan, w = RetentionPlanner(fill=1.0), target(capacity=100)
    plan.spill("old", w, 50, 0.0, TARGETS)
    plan.spill("young", w, 40, 0.0, TARGETS)
    assert plan.spill("old", w, 70, REPLAN_S, TARGETS) is False  # 70 + 40 > 100: young no longer fits
    assert plan.spill("young", w, 40, REPLAN_S, TARGETS) is True


def test_idle_sessions_stop_counting() -> None:
    plan, w = RetentionPlanner(fill=1.0, active_s=10.0, idle_factor=0), target(capacity=100)
    plan.spill("gone", w, 90, 0.0, TARGETS)
    plan.ended("gone", 0.5)
    assert plan.spill("new", w, 50, 1.0, TARGETS) is True
    assert plan.spill("new", w, 50, 20.0, TARGETS) is False  # "gone" was idle for 20 s: dropped from the plan


def test_a_session_with_a_request_running_never_goes_idle() -> None:
    plan, w = RetentionPlanner(fill=1.0, active_s=10.0), target(capacity=100)
    plan.spill("long", w, 90, 0.0, TARGETS)  # a request that runs for a minute
    assert plan.spill("new", w, 50, 60.0, TARGETS) is True  # "long" still counts: "new" does not fit
    plan.ended("long", 61.0)
    assert plan.spill("new", w, 50, 72.0, TARGETS) is False  # idle for 11 s (> active_s): dropped


def test_a_session_stops_counting_after_idle_factor_times_its_longest_think_gap() -> None:
    plan, w = RetentionPlanner(fill=1.0, active_s=30.0, idle_factor=3.0), target(capacity=100)
    for start, end in ((0.0, 1.0), (2.0, 3.0), (4.0, 5.0)):  # think gaps of 1 s
        plan.spill("agent", w, 90, start, TARGETS)
        plan.ended("agent", end)
    assert plan.spill("new", w, 50, 7.5, TARGETS) is True  # "agent" idle 2.5 s < 3 x 1 s: still counts
    plan.ended("new", 7.6)
    assert plan.spill("other", w, 50, 8.5, TARGETS) is False  # idle 3.5 s: "agent" ended its work
    assert w.session_blocks == 100  # "new" (idle 0.9 s, typical gap 1 s) and "other"


def test_a_session_without_a_gap_yet_stops_after_the_typical_gap_and_never_past_active_s() -> None:
    plan, w = RetentionPlanner(fill=1.0, active_s=5.0, idle_factor=3.0), target(capacity=100)
    assert plan.spill("lone", w, 90, 0.0, TARGETS) is False
    plan.ended("lone", 1.0)
    assert plan.spill("new", w, 50, 5.5, TARGETS) is True  # no gap seen anywhere: active_s (5 s) applies
    plan.ended("new", 5.6)
    plan.spill("slow", w, 5, 6.0, TARGETS)
    plan.ended("slow", 6.1)
    plan.spill("slow", w, 5, 8.1, TARGETS)  # a gap of 2 s: 3 x 2 = 6 s, capped at active_s
    plan.ended("slow", 8.2)
    assert plan.spill("probe", w, 1, 13.0, TARGETS) is False
    assert w.session_blocks == 6  # "lone" (idle 12 s) and "new" (7.4 s > 3 x the typical 2 s) left; "slow" stays


def test_a_moved_session_leaves_its_old_plan() -> None:
    plan, w0, w1 = RetentionPlanner(fill=1.0), target("w0"), target("w1")
    plan.spill("big", w0, 90, 0.0, TARGETS)
    assert plan.spill("small", w0, 20, 0.0, TARGETS) is True
    plan.spill("big", w1, 90, 0.0, TARGETS)  # moved
    assert plan.spill("small", w0, 20, REPLAN_S, TARGETS) is False


def test_unknown_capacity_spills_nothing_and_a_removed_target_is_forgotten() -> None:
    plan = RetentionPlanner()
    w = target(capacity=0)
    assert not any(plan.spill(s, w, 10_000, 0.0, TARGETS) for s in ("a", "b", "c"))
    plan.forget_target("w0")
    assert plan.spilling("w0") == 0


@pytest.mark.parametrize("fill, active_s", [(0.0, 1.0), (1.5, 1.0), (0.5, 0.0)])
def test_bad_parameters_are_refused(fill: float, active_s: float) -> None:
    with pytest.raises(ValueError):
        RetentionPlanner(fill, active_s)


def test_session_footprints_follow_commits_moves_and_idle_expiry() -> None:
    plan, w0, w1 = RetentionPlanner(fill=1.0, active_s=10.0, idle_factor=0), target("w0"), target("w1")
    for sid, blocks, at, home in (("a", 30, 0.0, w0), ("b", 50, 0.0, w0)):
        plan.spill(sid, home, blocks, at, TARGETS)
        plan.ended(sid, at)
    assert (w0.session_blocks, w1.session_blocks) == (80, 0)
    plan.spill("a", w0, 35, 1.0, TARGETS)  # a's next turn: its footprint grew
    plan.ended("a", 1.0)
    assert w0.session_blocks == 85
    plan.spill("b", w1, 55, 2.0, TARGETS)  # b moved: it leaves w0's footprint
    plan.ended("b", 2.0)
    assert (w0.session_blocks, w1.session_blocks) == (35, 55)
    plan.refresh(TARGETS, 11.5)  # a idle since 1.0, b since 2.0: a is dropped
    assert (w0.session_blocks, w1.session_blocks) == (0, 55)
    plan.refresh(TARGETS, 11.5 + REFRESH_S / 2)  # rate-limited: nothing recomputed
    plan.refresh(TARGETS, 11.5 + REFRESH_S)
    assert w1.session_blocks == 0


def test_without_the_hint_footprints_are_kept_and_nothing_is_marked() -> None:
    plan, w = RetentionPlanner(fill=0.5, spill_hint=False), target("w0", capacity=100)
    assert not any(plan.spill(s, w, 40, 0.0, TARGETS) for s in ("a", "b", "c"))
    assert w.session_blocks == 120 and plan.spilled == 0
