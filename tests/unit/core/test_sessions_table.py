"""A session is not idle while a request of it runs (``SessionTable.begin``/``end``,
called by the router's commit and its lease's end)."""

from __future__ import annotations

from mesh.core.router import Router
from mesh.core.sessions import SessionTable
from policies.base import RequestInfo, TargetState
from policies.session_sticky import SessionSticky


def test_a_running_session_never_expires_and_idles_from_its_last_end() -> None:
    t = SessionTable(idle_ttl_s=10, max_sessions=100)
    t.bind("s", "a", 0.0)
    t.begin("s", 0.0)
    t.begin("s", 5.0)  # a concurrent request of the same session
    assert t.expire(1000.0) == 0 and t.bound_target("s", 1000.0) == "a"
    t.end("s", 1000.0)  # one still runs
    assert t.expire(2000.0) == 0 and t.bound_target("s", 2000.0) == "a"
    t.end("s", 2000.0)
    assert t.bound_target("s", 2009.9) == "a" and t.bound_target("s", 2010.0) is None
    assert t.expire(2010.0) == 1 and t.stats()["in_use"] == 0 and t.created == 1


def test_lru_eviction_takes_an_idle_session_before_a_running_one() -> None:
    t = SessionTable(idle_ttl_s=100, max_sessions=2)
    t.bind("run", "a", 0.0)
    t.begin("run", 0.0)
    t.bind("idle", "b", 1.0)
    t.bind("new", "a", 2.0)  # full: the least recently used is "idle", not the older running one
    assert t.bound_target("run", 2.0) == "a" and t.bound_target("idle", 2.0) is None


def test_end_after_the_binding_was_dropped_is_harmless() -> None:
    t = SessionTable(idle_ttl_s=10)
    t.bind("s", "a", 0.0)
    t.begin("s", 0.0)
    t.unbind_target("a")  # the worker was removed while the request ran
    t.end("s", 50.0)
    assert t.bound_target("s", 50.0) is None and len(t) == 0 and t.stats()["in_use"] == 0


def test_the_router_pins_a_session_for_the_life_of_its_lease() -> None:
    targets = {tid: TargetState(tid, tid) for tid in ("a", "b")}
    table = SessionTable(idle_ttl_s=1.0)
    router = Router(SessionSticky(), targets, sessions=table)
    req = RequestInfo("m", [1, 2], 16, 32, session_id="s")
    _, lease = router.route(req, 0.0)
    assert router.decide(req, 50.0).reason == "bound"  # 50 s into the turn, 1 s idle time
    lease.finish(60.0)
    assert table.bound_target("s", 60.9) == lease.target.id and table.bound_target("s", 61.0) is None
    assert table.expired == 0 and table.created == 1


def test_a_bound_target_left_out_of_the_view_is_named_for_why() -> None:
    targets = {tid: TargetState(tid, tid) for tid in ("a", "b")}
    router = Router(SessionSticky(), targets, sessions=SessionTable(idle_ttl_s=100))
    req = RequestInfo("m", [1, 2], 16, 32, session_id="s")
    _, lease = router.route(req, 0.0)
    home = lease.target.id
    lease.finish(0.0)
    assert router.decide(req, 1.0, exclude=[home]).reason.startswith("rebound: bound target excluded (it failed")
    targets[home].max_in_flight, targets[home].in_flight = 2, 2
    assert router.decide(req, 1.0, exclude=[home]).reason.startswith("rebound: bound target at its admission limit (2/2)")
    targets[home].in_flight = 0
    del targets[home]
    assert router.decide(req, 1.0).reason.startswith("rebound: bound target gone")
