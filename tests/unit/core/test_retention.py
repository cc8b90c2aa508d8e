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
    plan, w = RetentionPlanner(fill=1.0, active_s=10.0), target(capacity=100)
    plan.spill("gone", w, 90, 0.0, TARGETS)
    assert plan.spill("new", w, 50, 1.0, TARGETS) is True
    assert plan.spill("new", w, 50, 20.0, TARGETS) is False  # "gone" was idle for 20 s: dropped from the plan


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
    plan, w0, w1 = RetentionPlanner(fill=1.0, active_s=10.0), target("w0"), target("w1")
    plan.spill("a", w0, 30, 0.0, TARGETS)
    plan.spill("b", w0, 50, 0.0, TARGETS)
    assert (w0.session_blocks, w1.session_blocks) == (80, 0)
    plan.spill("a", w0, 35, 1.0, TARGETS)  # a's next turn: its footprint grew
    assert w0.session_blocks == 85
    plan.spill("b", w1, 55, 2.0, TARGETS)  # b moved: it leaves w0's footprint
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
