"""The retention planner: senior sessions that fit a target's capacity are kept, the rest spill;
idle sessions stop counting, a moved session leaves its old plan, unknown capacity spills nothing."""

from __future__ import annotations

import pytest

from mesh.core.retention import REPLAN_S, RetentionPlanner
from policies.base import TargetState


def target(tid: str = "w0", capacity: int = 100) -> TargetState:
    return TargetState(id=tid, worker=tid, kv_capacity_blocks=capacity)


def test_sessions_past_the_fill_of_the_capacity_spill_in_seniority_order() -> None:
    plan, w = RetentionPlanner(fill=0.9), target(capacity=100)
    assert [plan.spill(s, w, 40, 0.0) for s in ("a", "b")] == [False, False]  # 80 of 90
    assert plan.spill("c", w, 40, 0.0) is True  # 120 > 90: the youngest spills
    assert plan.spill("d", w, 10, 0.0) is False  # a small one still fits (80 + 10)
    assert plan.spilling("w0") == 1
    assert plan.spill("a", w, 45, 1.0) is False  # a senior session keeps its place as it grows ...
    assert plan.spilling("w0") == 2 and plan.spill("d", w, 10, 1.0) is True  # ... and displaces the junior one
    assert plan.spilled == 2


def test_a_session_that_grows_past_the_budget_spills_the_youngest_first() -> None:
    plan, w = RetentionPlanner(fill=1.0), target(capacity=100)
    plan.spill("old", w, 50, 0.0)
    plan.spill("young", w, 40, 0.0)
    assert plan.spill("old", w, 70, REPLAN_S) is False  # 70 + 40 > 100: young no longer fits
    assert plan.spill("young", w, 40, REPLAN_S) is True


def test_idle_sessions_stop_counting() -> None:
    plan, w = RetentionPlanner(fill=1.0, active_s=10.0), target(capacity=100)
    plan.spill("gone", w, 90, 0.0)
    assert plan.spill("new", w, 50, 1.0) is True
    assert plan.spill("new", w, 50, 20.0) is False  # "gone" was idle for 20 s: dropped from the plan


def test_a_moved_session_leaves_its_old_plan() -> None:
    plan, w0, w1 = RetentionPlanner(fill=1.0), target("w0"), target("w1")
    plan.spill("big", w0, 90, 0.0)
    assert plan.spill("small", w0, 20, 0.0) is True
    plan.spill("big", w1, 90, 0.0)  # moved
    assert plan.spill("small", w0, 20, REPLAN_S) is False


def test_unknown_capacity_spills_nothing_and_a_removed_target_is_forgotten() -> None:
    plan = RetentionPlanner()
    w = target(capacity=0)
    assert not any(plan.spill(s, w, 10_000, 0.0) for s in ("a", "b", "c"))
    plan.forget_target("w0")
    assert plan.spilling("w0") == 0


@pytest.mark.parametrize("fill, active_s", [(0.0, 1.0), (1.5, 1.0), (0.5, 0.0)])
def test_bad_parameters_are_refused(fill: float, active_s: float) -> None:
    with pytest.raises(ValueError):
        RetentionPlanner(fill, active_s)
