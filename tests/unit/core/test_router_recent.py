"""``Router.recent``: the bounded ring of committed decisions that the gateway's live view shows."""

from __future__ import annotations

from mesh.core.router import RECENT_DECISIONS, Router
from mesh.core.sessions import SessionTable
from policies.base import Decision, Overlap, RequestInfo, TargetState
from policies.round_robin import RoundRobin


def test_every_commit_is_recorded_with_its_cheap_fields_and_the_ring_stays_bounded() -> None:
    targets = {"a": TargetState(id="a", worker="a"), "b": TargetState(id="b", worker="b")}
    router = Router(RoundRobin(), targets, sessions=SessionTable())
    req = RequestInfo(model="m", block_keys=[1, 2, 3], block_size=16, prompt_tokens=48, session_id="s1")
    router.commit(req, Decision("b", "why b", overlaps={"b": Overlap(gpu_blocks=2, cpu_blocks=1)}), 5.0)
    router.commit(req, Decision("a", "retry on a"), 6.0, bind=False)
    assert list(router.recent) == [(5.0, "m", "s1", "b", "why b", 3, False), (6.0, "m", "s1", "a", "retry on a", 0, True)]
    for i in range(RECENT_DECISIONS + 50):
        router.route(RequestInfo(model="m", block_keys=[], block_size=16, prompt_tokens=1), float(10 + i))
    assert len(router.recent) == RECENT_DECISIONS
    assert router.recent[-1][0] == float(10 + RECENT_DECISIONS + 49)  # newest last, oldest dropped
