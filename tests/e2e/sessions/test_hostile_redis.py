"""Shared state in a Redis that holds someone else's data, against a real redis-server and a real
gateway (``state.backend: redis``): a key under the gateway's prefix of the wrong type (another app
sharing the prefix), or a peer entry whose load hash is not a hash, must cost that one part of the
sharing (counted), not all of it: session bindings keep being shared and the other peers' load
keeps being read."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import httpx
import pytest
import xxhash
import yaml

from tests.procs import ProcessGroup, free_port, wait_until
from tests.support.redis_server import RedisServer, server  # noqa: F401 (server: the redis-server fixture)

PREFIX = "hx:"
CHAT = {"model": "echo", "messages": [{"role": "user", "content": "hello hostile redis"}], "max_tokens": 2}


def session_key(session: str) -> str:
    return PREFIX + "s:" + xxhash.xxh3_128_hexdigest(session.encode())


def metric(http: httpx.Client, name: str, labels: str = "") -> float:
    text = http.get("/metrics").text
    labels_re = re.escape(labels) if labels else r"(?:\{[^}]*\})?"  # none given: every series
    found = re.findall(rf"^{re.escape(name)}{labels_re} (\S+)$", text, re.M)
    return sum(float(v) for v in found)


@pytest.fixture(scope="module")
def gateway(module_procs: ProcessGroup, server: RedisServer) -> Iterator[tuple[httpx.Client, RedisServer]]:  # noqa: F811
    workers = {n: module_procs.echo_worker(n).url for n in ("e0", "e1")}
    data = {
        "workers": [{"name": n, "url": u} for n, u in workers.items()],
        "health": {"interval_s": 0.3, "timeout_s": 1, "unhealthy_threshold": 1},
        "sessions": {"idle_ttl_s": 30},
        "policy": {"name": "session_sticky", "params": {"inner": "round_robin"}},
        "state": {"backend": "redis", "url": server.url, "key_prefix": PREFIX, "timeout_s": 0.5, "load_sync_s": 0.1},
    }
    path = module_procs.log_dir / "hostile-redis.yaml"
    path.write_text(yaml.safe_dump(data))
    proc = module_procs.gateway(path, port=free_port(), name="gateway-hostile-redis")
    with httpx.Client(base_url=proc.url, timeout=30) as http:
        wait_until(lambda: http.get("/health").json()["healthy_workers"] == 2, what="workers healthy")
        yield http, server


def chat(http: httpx.Client, session: str) -> str:
    resp = http.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": session})
    assert resp.status_code == 200, resp.text
    return resp.headers["x-mesh-worker"]


def test_a_wrong_type_load_key_does_not_stop_session_sharing(gateway: tuple) -> None:
    # Another app's string where the replica set lives: every load round fails, but that does not
    # put the whole backend in back-off: session bindings are still written to Redis.
    http, srv = gateway
    with srv.client() as c:
        c.set(PREFIX + "load:replicas", "another app's string")
    try:
        wait_until(lambda: metric(http, "mesh_state_backend_errors_total", '{op="load"}') >= 3,
                   what="load rounds failing on the wrong-type key")
        for i in range(4):
            worker = chat(http, f"wrongtype-{i}")
            with srv.client() as c:
                wait_until(lambda i=i, worker=worker: c.get(session_key(f"wrongtype-{i}")) == worker, timeout_s=3,
                           what=f"binding wrongtype-{i} shared while load sync fails")
        assert metric(http, "mesh_state_backend_errors_total", '{op="set"}') == 0
    finally:
        with srv.client() as c:
            c.delete(PREFIX + "load:replicas")
    wait_until(lambda: metric(http, "mesh_load_sync_peers") == 0 and chat(http, "after-fix"), what="load sync healthy")


def test_a_peer_whose_load_key_is_not_a_hash_does_not_hide_the_other_peers(gateway: tuple) -> None:
    # One bad entry in the replica set (a member whose key holds a string) is skipped, not a
    # failure of the whole round: the other peers' load is still read every 0.1 s.
    http, srv = gateway
    with srv.client() as c:
        c.set(PREFIX + "load:bad-peer", "not a hash")
    try:
        def good_peer_seen() -> bool:
            with srv.client() as c:  # live entries are refreshed, as a replica does every round
                now_ms = int(time.time() * 1000)
                c.zadd(PREFIX + "load:replicas", {"bad-peer": now_ms, "good-peer": now_ms})
                c.hset(PREFIX + "load:good-peer", mapping={"_": "1", "e0": "3 0 0"})
                c.pexpire(PREFIX + "load:good-peer", 2000)
            return metric(http, "mesh_remote_in_flight", '{target="e0"}') == 3

        wait_until(good_peer_seen, timeout_s=5, what="the good peer's load read despite the bad one")
        assert metric(http, "mesh_load_sync_peers") == 1
    finally:
        with srv.client() as c:
            c.zrem(PREFIX + "load:replicas", "bad-peer", "good-peer")
            c.delete(PREFIX + "load:bad-peer", PREFIX + "load:good-peer")
    wait_until(lambda: metric(http, "mesh_remote_in_flight", '{target="e0"}') == 0, what="the peer's load gone")


@pytest.mark.parametrize("value", ["no-such-worker", "", "x" * 100_000, "e1\\r\\nSET evil 1"])
def test_a_hostile_shared_binding_is_not_followed(gateway: tuple, value: str) -> None:
    # Someone else's value at a session's key: the gateway must still answer from a real worker.
    http, srv = gateway
    session = f"hostile-value-{len(value)}-{value[:3]}"
    with srv.client() as c:
        c.set(session_key(session), value, px=30_000)
    for _ in range(3):
        assert chat(http, session) in ("e0", "e1")
    route = http.post("/debug/route", json=CHAT, headers={"x-session-id": session})
    assert route.status_code == 200 and route.json()["decision"]["target"] in ("e0", "e1"), route.text[:500]
    assert len(route.text) < 20_000  # the hostile value is not echoed back whole


def test_bindings_made_while_redis_stalls_are_shared_once_it_answers(gateway: tuple) -> None:
    # A stalled Redis (CLIENT PAUSE: slow, not dead): requests answer locally meanwhile, and the
    # bindings they made are written once Redis answers again, not dropped with a failed or
    # backed-off batch: a session that went quiet is known to the other replicas, which route its
    # next turn to its worker.
    import threading

    http, srv = gateway
    stall = threading.Thread(target=lambda: _stall(srv, 1.5), daemon=True)
    stall.start()
    time.sleep(0.1)
    bound = {f"stall-{i}": chat(http, f"stall-{i}") for i in range(5)}
    stall.join()
    with srv.client() as c:
        for session, worker in bound.items():
            wait_until(lambda s=session, w=worker: c.get(session_key(s)) == w, timeout_s=5,
                       what=f"{session}'s binding written after the stall")
    assert metric(http, "mesh_state_backend_errors_total") > 0  # the stall was seen, not slept through


def _stall(srv: RedisServer, seconds: float) -> None:
    """Every client's commands wait ``seconds`` (DEBUG SLEEP is disabled by default since Redis 7)."""
    with srv.client() as c:
        c.execute_command("CLIENT", "PAUSE", int(seconds * 1000), "ALL")
    time.sleep(seconds)


def test_a_flood_of_future_dated_replica_entries_is_pruned_and_peers_still_read(gateway: tuple) -> None:
    # Entries dated in the future are pruned too, so junk in the replica set cannot grow each
    # round's work (every round reads each member's hash) for good.
    http, srv = gateway
    future = int(time.time() * 1000) + 10**9
    with srv.client() as c:
        c.zadd(PREFIX + "load:replicas", {f"junk-{i}": future for i in range(2000)})
    try:
        def pruned_and_peer_seen() -> bool:
            with srv.client() as c:
                c.zadd(PREFIX + "load:replicas", {"good-peer": int(time.time() * 1000)})
                c.hset(PREFIX + "load:good-peer", mapping={"_": "1", "e1": "2 0 0", **{f"x{i}": "1 1 1" for i in range(50)}})
                c.pexpire(PREFIX + "load:good-peer", 2000)
                junk = c.zcount(PREFIX + "load:replicas", future, future)
            return junk == 0 and metric(http, "mesh_remote_in_flight", '{target="e1"}') == 2

        wait_until(pruned_and_peer_seen, timeout_s=5, what="future entries pruned and the live peer read")
    finally:
        with srv.client() as c:
            c.zrem(PREFIX + "load:replicas", "good-peer", *[f"junk-{i}" for i in range(2000)])
            c.delete(PREFIX + "load:good-peer")
    wait_until(lambda: metric(http, "mesh_remote_in_flight", '{target="e1"}') == 0, what="the peer's load gone")


def test_a_write_batch_with_one_refused_key_is_written_and_not_queued_again(server: RedisServer) -> None:  # noqa: F811
    # One key Redis refuses for good (here an ACL that allows the other sessions' keys only) fails
    # the whole pipeline; the good bindings are written and the refused one dropped (counted), not
    # the whole batch queued again every retry_after_s, forever.
    import asyncio

    from mesh.state.redis_state import RedisStateBackend, SharedSessionTable

    with server.client() as c:
        c.execute_command("ACL", "SETUSER", "bq", "on", ">s3cret", "~bq:s:good-*", "+@all")
    url = server.url.replace("redis://", "redis://bq:s3cret@")

    async def go() -> tuple[bool, dict, dict[str, int]]:
        backend = RedisStateBackend(url, 60.0, key_prefix="bq:", timeout_s=0.5, retry_after_s=0.0)
        table = SharedSessionTable(backend, 60.0)
        try:
            for sid in ("good-0", "bad", "good-1"):
                table.bind(sid, "w1", 0.0)
            return await table.flush(), dict(table._pending), dict(backend.errors)
        finally:
            await backend.aclose()

    try:
        flushed, pending, errors = asyncio.run(go())
    finally:
        with server.client() as c:
            c.execute_command("ACL", "DELUSER", "bq")
    assert flushed and pending == {} and errors["set"] == 1, (pending, errors)
    with server.client() as c:
        assert c.get("bq:s:good-0") == "w1" and c.get("bq:s:good-1") == "w1" and c.get("bq:s:bad") is None
        c.delete("bq:s:good-0", "bq:s:good-1")


@pytest.mark.parametrize("url, shown", [
    ("unix:///tmp/r.sock", "unix:///tmp/r.sock"),
    ("unix:///tmp/r.sock?db=0&password=s3cret", "unix:///tmp/r.sock?db=0&password=***"),
    ("redis://u:s3cret@127.0.0.1:1/0", "redis://u:***@127.0.0.1:1/0"),
])
def test_a_redis_url_is_shown_redacted_and_whole(url: str, shown: str) -> None:
    # unix:///tmp/r.sock is shown whole (not as unix:/tmp/r.sock).
    from mesh.state.redis_state import RedisStateBackend

    assert RedisStateBackend(url, 60.0).url == shown
