"""``Router``'s prefill -> decode pair protocol (the relay's and the simulator's one path) and its
expiry of speculative index entries before every decision."""

from __future__ import annotations

from mesh.core.index import PrefixIndex
from mesh.core.router import Router
from mesh.core.sessions import SessionTable
from policies.base import RequestInfo, TargetState
from policies.round_robin import RoundRobin

TTL_S = 10.0


def _router(index: PrefixIndex | None = None) -> tuple[Router, SessionTable, dict[str, TargetState]]:
    targets = {t: TargetState(id=t, worker=t) for t in ("prefill", "decode", "other")}
    sessions = SessionTable(TTL_S)
    return Router(RoundRobin(), targets, index=index, sessions=sessions), sessions, targets


def _request(session: str | None = "s1") -> RequestInfo:
    return RequestInfo(model="m", block_keys=[1, 2, 3, 4], block_size=16, prompt_tokens=64, session_id=session)


def test_neither_leg_binds_the_session_until_the_decode_worker_answers() -> None:
    router, sessions, targets = _router()
    prefill = router.commit_prefill(_request(), "prefill", 0.0)
    assert prefill.uncached_tokens == 64 and targets["prefill"].prefill_tokens == 64
    prefill.finish(1.0)
    decode = router.commit_decode(_request(), "decode", 3, 1.0)
    assert decode.uncached_tokens == 64 - 3 * 16  # the handed-over blocks count as cached
    assert sessions.bound_target("s1", 1.0) is None  # a refusing decode worker must not take it
    router.decode_answered(decode, "s1", 1.5)
    assert sessions.bound_target("s1", 1.5) == "decode"
    decode.finish(2.0)
    assert targets["decode"].in_flight == 0 and targets["decode"].decode_tokens == 0


def test_a_pair_session_never_expires_while_its_decode_runs_and_idles_from_its_end() -> None:
    router, sessions, _ = _router()
    decode = router.commit_decode(_request(), "decode", 0, 0.0)
    router.decode_answered(decode, "s1", 0.0)
    sessions.expire(5 * TTL_S)  # a decode streaming for five idle times
    assert sessions.bound_target("s1", 5 * TTL_S) == "decode"
    decode.finish(5 * TTL_S)
    assert sessions.bound_target("s1", 6 * TTL_S - 1) == "decode"
    sessions.expire(6 * TTL_S)
    assert sessions.bound_target("s1", 6 * TTL_S) is None


def test_a_decode_worker_removed_mid_request_is_not_bound_again_at_its_end() -> None:
    router, sessions, targets = _router()
    decode = router.commit_decode(_request(), "decode", 0, 0.0)
    router.decode_answered(decode, "s1", 0.0)
    sessions.unbind_target("decode")
    del targets["decode"]
    decode.finish(1.0)
    assert sessions.bound_target("s1", 1.0) is None


def test_a_pair_without_a_session_binds_nothing() -> None:
    router, sessions, _ = _router()
    decode = router.commit_decode(_request(None), "decode", 0, 0.0)
    router.decode_answered(decode, None, 0.0)
    decode.finish(1.0)
    assert len(sessions) == 0


def test_speculative_entries_end_at_the_first_decision_past_their_deadline() -> None:
    index = PrefixIndex()
    router, _, _ = _router(index)
    router.speculative_ttl_s = 2.0
    request = _request(None)
    router.commit(request, router.decide(request, 0.0), 0.0)
    assert sum(o.blocks for o in index.match(request.block_keys).values()) == 4
    router.decide(request, 1.9)
    assert sum(o.blocks for o in index.match(request.block_keys).values()) == 4
    router.decide(request, 2.0)  # no timer: the view before this decision ends them
    assert not any(o.blocks for o in index.match(request.block_keys).values())
