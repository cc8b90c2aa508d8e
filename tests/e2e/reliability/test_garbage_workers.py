"""A fast worker whose 200s are not what was asked for is no black hole.

Two garbage workers (``200 text/html``; ``200 application/json`` with an HTML body) answer
faster than the good one: every client request is still answered with valid JSON (or a whole
event stream), retried past them; their circuits open and they draw almost no traffic after.
"""

from __future__ import annotations

import httpx

from tests.e2e.reliability.gateway_helpers import request, start_gateway, worker_view
from tests.fakes.misbehaving_worker import misbehaving, posts
from tests.procs import ProcessGroup

THRESHOLD = 3


def test_garbage_200s_are_retried_never_relayed_and_open_the_workers_circuits(procs: ProcessGroup) -> None:
    html = misbehaving(procs, "html", "garbage")
    html_json = misbehaving(procs, "htmljson", "html_as_json")
    good = misbehaving(procs, "good", "good")
    gateway = start_gateway(
        procs, [{"name": n, "url": p.url, "models": ["m"]} for n, p in (("html", html), ("htmljson", html_json),
                                                                         ("good", good))],
        policy="round_robin",  # each garbage worker gets its turns until its circuit opens
        health={"interval_s": 3600},  # they answer /health: passive health acts
        circuit_breaker={"failure_threshold": THRESHOLD, "open_s": 3600},
    )
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        outcomes = [request(client, stream=i % 3 == 0, prompt=f"request {i}") for i in range(40)]
    for o in outcomes:
        assert o.whole and o.worker == "good", o
        if not o.stream:
            assert o.body.startswith(b"{") and b"<html>" not in o.body, o
    for name, proc in (("html", html), ("htmljson", html_json)):
        view = worker_view(gateway, name)
        assert view["circuit"] == "open" and "200 with" in view["last_error"], view
        assert posts(proc) <= THRESHOLD, f"{name} drew {posts(proc)} of 40 requests"
    assert posts(good) == 40
