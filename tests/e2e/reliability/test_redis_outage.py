"""Two gateway replicas sharing a real redis-server through an outage (``state.backend: redis``).

Sessions are bound through replica A; Redis is then frozen (SIGSTOP: it keeps its keys, as a
hung or partitioned server does) and the same sessions come to replica B, which has never seen
them and cannot read the shared bindings: it decides on its own, and sends some to other workers
than A did (split brain). Every request is still served. Once Redis answers again:

- the shared binding wins: B's bindings made during the outage were claims (written only where
  Redis has none), so each session's binding on A, on B and in Redis is A's original one;
- each of B's outage decisions that differed from the shared binding is counted, exactly, in
  ``mesh_session_replica_moves_total{reason="redis_unavailable"}`` (``mesh_session_moves_total``
  counts only a replica's own re-binds, and stayed 0 through all of this); A, whose outage
  decisions matched, counts none;
- a request of every session, through either replica, goes to that one worker.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.procs import ProcessGroup, free_port, wait_until
from tests.support.redis_server import RedisServer

SESSIONS = 24
PREFIX = "outage17:"


def metric(http: httpx.Client, name: str, labels: str = "") -> float:
    text = http.get("/metrics").text
    labels_re = re.escape(labels) if labels else r"(?:\{[^}]*\})?"
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}{labels_re} (\S+)$", text, re.M))


def chat(session: str) -> dict[str, object]:
    return {"model": "echo", "messages": [{"role": "user", "content": f"turn of {session}"}], "max_tokens": 2}


def turn(http: httpx.Client, session: str) -> str:
    resp = http.post("/v1/chat/completions", json=chat(session), headers={"x-session-id": session})
    assert resp.status_code == 200, resp.text
    return resp.headers["x-mesh-worker"]


def bound(http: httpx.Client, session: str) -> tuple[str | None, str]:
    """(the replica's binding of the session, its hashed id) as ``/debug/route`` reports them."""
    out = http.post("/debug/route", json=chat(session), headers={"x-session-id": session}).json()
    return out["session"]["bound_target"], out["request"]["session_id"]


@pytest.fixture
def replicas(procs: ProcessGroup, tmp_path: Path) -> Iterator[tuple[RedisServer, httpx.Client, httpx.Client]]:
    server = RedisServer(procs)
    server.start()
    workers = [{"name": n, "url": procs.echo_worker(n).url} for n in ("e0", "e1")]
    config = tmp_path / "replica.yaml"
    config.write_text(yaml.safe_dump({
        "workers": workers,
        "health": {"interval_s": 0.3, "timeout_s": 1},
        "sessions": {"idle_ttl_s": 120},
        "state": {"backend": "redis", "url": server.url, "key_prefix": PREFIX, "timeout_s": 0.2, "load_sync_s": 0},
    }))
    clients = []
    for name in ("a", "b"):
        gw = procs.gateway(config, port=free_port(), name=f"gateway-{name}", ready_path="/ready")
        clients.append(httpx.Client(base_url=gw.url, timeout=30))
    try:
        yield server, clients[0], clients[1]
    finally:
        if server.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(server.proc.pid, signal.SIGCONT)
        for c in clients:
            c.close()


def test_a_redis_outage_splits_sessions_counts_the_moves_and_converges_on_the_shared_binding(
        replicas: tuple[RedisServer, httpx.Client, httpx.Client]) -> None:
    server, a, b = replicas
    sessions = [f"sess-{i}" for i in range(SESSIONS)]
    home = {s: turn(a, s) for s in sessions}  # bound through A, shared
    assert set(home.values()) == {"e0", "e1"}
    with server.client() as c:
        wait_until(lambda: len(list(c.scan_iter(PREFIX + "s:*"))) == SESSIONS, what="A's bindings in Redis")

    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        # B sees the sessions in another order than A bound them, so its own spreading places many
        # elsewhere; A keeps its bindings. Every request is served (the local table decides).
        outage_b = {s: turn(b, s) for s in sessions[1:] + sessions[:1]}
        outage_a = {s: turn(a, s) for s in sessions}
        assert metric(b, "mesh_state_backend_errors_total") > 0
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    assert outage_a == home
    split = [s for s in sessions if outage_b[s] != home[s]]
    assert split, "B placed every session where A had: no split brain to observe"
    assert metric(b, "mesh_session_moves_total") == 0  # no replica re-bound a session of its own

    # Every outage decision of B that differed from the shared binding is counted, once.
    wait_until(lambda: metric(b, "mesh_session_replica_moves_total", '{reason="redis_unavailable"}') == len(split),
               timeout_s=30, what=f"B counting its {len(split)} split sessions")
    assert metric(a, "mesh_session_replica_moves_total") == 0

    # Converged on the shared binding: A, B and Redis agree on every session, and so do requests.
    with server.client() as c:
        for s in sessions:
            (on_a, sid), (on_b, _) = bound(a, s), bound(b, s)
            assert (on_a, on_b, c.get(f"{PREFIX}s:{sid}")) == (home[s],) * 3, s
    assert {s: turn(b, s) for s in sessions} == home
    assert {s: turn(a, s) for s in sessions} == home
    assert metric(b, "mesh_session_replica_moves_total", '{reason="redis_unavailable"}') == len(split)
