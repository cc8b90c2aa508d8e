"""Session bindings shared through a real ``redis-server`` (``mesh.state.redis_state``).

Unit part: ``RedisStateBackend`` and ``SharedSessionTable`` against a real server (set/get/delete,
the idle TTL refreshed on every use and then expired by Redis, two tables as two replicas, an
unreachable server answered locally and counted, bad URLs refused with a clear config error).
Races and shutdown: ``mirror`` never overrides a local move that Redis does not have yet (queued,
or in the batch being written: writes held with ``CLIENT PAUSE WRITE``); a flush cancelled
mid-write is put back for the final flush; the stop hook writes the last bindings and leaves
even right after an error (back-off on); the Redis password never shows in errors, logs, stats.

End to end: two real gateway processes (``state.backend: redis``) in front of three real echo
workers. A session first routed by replica A is routed by replica B to the same worker, as a
``bound`` decision; the shared binding expires after ``idle_ttl_s``; with redis-server killed both
replicas keep answering 200 on their local bindings and count the errors; a restarted server
shares bindings again.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import xxhash
import yaml

from mesh.config import ConfigError, MeshConfig, parse_config
from mesh.core.sessions import MemoryStateBackend, SessionTable
from mesh.state.redis_state import RedisStateBackend, SharedSessionTable
from tests.procs import ProcessGroup, free_port, wait_until
from tests.support.redis_server import RedisServer, server  # noqa: F401 (server: the redis-server fixture)

IDLE_TTL_S = 3.0  # gateways' sessions.idle_ttl_s: long enough for a few turns on a busy machine
WORKERS = ("e0", "e1", "e2")
CHAT = {"model": "echo", "messages": [{"role": "user", "content": "hello shared sessions"}]}


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# -- unit: RedisStateBackend --
def test_set_get_delete_round_trip_and_moves(server: RedisServer) -> None:
    async def go() -> tuple[Any, ...]:
        b = RedisStateBackend(server.url, 30, key_prefix="unit1:")
        try:
            first = await b.set_session("s1", "w0", 0.0)
            same = await b.set_session("s1", "w0", 0.0)
            moved = await b.set_session("s1", "w1", 0.0)
            got = await b.get_session("s1", 0.0)
            await b.delete_session("s1")
            return first, same, moved, got, await b.get_session("s1", 0.0), b.errors
        finally:
            await b.aclose()

    first, same, moved, got, after_delete, errors = run(go())
    assert (first, same, moved) == (False, False, True)
    assert got == "w1" and after_delete is None
    assert sum(errors.values()) == 0
    with server.client() as c:
        assert c.exists("unit1:s:s1") == 0


def test_every_use_refreshes_the_idle_ttl_then_redis_expires_it(server: RedisServer) -> None:
    async def bind(ttl: float) -> None:
        b = RedisStateBackend(server.url, ttl, key_prefix="unit2:")
        try:
            await b.set_session("s", "w0", 0.0)
        finally:
            await b.aclose()

    with server.client() as c:
        run(bind(1.0))
        first = c.pttl("unit2:s:s")
        assert 0 < first <= 1000
        wait_until(lambda: c.pttl("unit2:s:s") < first - 300, what="the TTL running down")
        run(bind(1.0))  # a use: the idle time starts again
        assert c.pttl("unit2:s:s") > first - 300
        wait_until(lambda: c.exists("unit2:s:s") == 0, what="the idle binding expiring in Redis")


def test_an_unreachable_server_answers_locally_counts_and_backs_off() -> None:
    seen: list[str] = []

    async def go() -> tuple[Any, ...]:
        b = RedisStateBackend(f"redis://127.0.0.1:{free_port()}/0", 10, timeout_s=0.2, on_error=seen.append)
        try:
            got = await b.get_session("s", 0.0)
            moved = await b.set_session("s", "w0", 0.0)  # within retry_after_s: not even sent
            return got, moved, dict(b.errors), b.skipped
        finally:
            await b.aclose()

    got, moved, errors, skipped = run(go())
    assert got is None and moved is False
    assert errors["get"] == 1 and seen == ["get"] and skipped == 1


def test_bad_urls_are_clear_config_errors() -> None:
    for state, field in (
        ({"backend": "redis"}, "state: backend redis needs a url"),
        ({"backend": "redis", "url": "http://127.0.0.1:6379"}, "state.url: url 'http://127.0.0.1:6379' must be redis://"),
        ({"backend": "redis", "url": "redis://127.0.0.1:99999/0"}, "state.url:"),
        ({"backend": "memcached", "url": "redis://h"}, "state.backend:"),
        ({"timeout_s": 0}, "state.timeout_s:"),
    ):
        with pytest.raises(ConfigError) as info:
            parse_config({"state": state})
        assert any(line.startswith(field) for line in info.value.errors), info.value.errors
    with pytest.raises(ValueError, match="not a usable Redis URL"):
        RedisStateBackend("ftp://nowhere", 10)


def test_the_default_state_backend_is_memory() -> None:
    from mesh.gateway.app import build_gateway

    assert MeshConfig().state.backend == "memory"
    gateway = build_gateway(MeshConfig())
    assert type(gateway.sessions) is SessionTable
    table = SessionTable(5)
    mem = MemoryStateBackend(table)
    assert run(mem.set_session("s", "w0", 0.0)) is False and run(mem.get_session("s", 1.0)) == "w0"


def test_two_tables_share_bindings_write_behind_and_mirror(server: RedisServer) -> None:
    """Two ``SharedSessionTable``s on one server behave as two replicas' tables."""

    async def go() -> tuple[Any, ...]:
        a = SharedSessionTable(RedisStateBackend(server.url, 30, key_prefix="unit3:"), 30)
        b = SharedSessionTable(RedisStateBackend(server.url, 30, key_prefix="unit3:"), 30)
        try:
            a.bind("s", "w2", 1.0)
            before = b.bound_target("s", 1.0)
            assert await a.flush()
            shared = await b.mirror("s", 2.0)
            after = b.bound_target("s", 2.0)
            b.bind("s", "w0", 3.0)  # B moves it (its worker died, say); A follows at its next mirror
            await b.flush()
            await a.mirror("s", 4.0)
            moved = a.bound_target("s", 4.0)
            b.unbind("s")
            await b.flush()
            kept = await a.mirror("s", 5.0)  # gone from Redis: A keeps its local binding
            return before, shared, after, moved, kept, a.bound_target("s", 5.0), b.mirrored, a.live_sessions("w0")
        finally:
            await a.backend.aclose()
            await b.backend.aclose()

    before, shared, after, moved, kept, local, mirrored, live = run(go())
    assert before is None and shared == "w2" and after == "w2" and mirrored == 1
    assert moved == "w0" and live == 1
    assert kept is None and local == "w0"


async def until(check: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{what} not reached within {timeout_s} s")


def test_mirror_never_overrides_a_local_move_redis_does_not_have_yet(server: RedisServer) -> None:
    """A move still queued, or in the batch being written, is newer than what Redis answers."""

    async def go() -> tuple[Any, ...]:
        a = SharedSessionTable(RedisStateBackend(server.url, 30, key_prefix="unit5:", timeout_s=5.0), 30)
        c = server.client()
        try:
            a.bind("s", "w1", 1.0)
            assert await a.flush()
            a.bind("s", "w2", 2.0)  # the router moved it; the write-behind is still queued
            queued = (await a.mirror("s", 3.0), a.bound_target("s", 3.0))
            c.client_pause(20_000, all=False)  # writes wait on the server; reads still answer
            try:
                a.bind("s", "w3", 4.0)
                flushing = asyncio.create_task(a.flush())
                await until(lambda: not a._pending, "the flusher taking the batch")
                in_batch = (await a.mirror("s", 5.0), a.bound_target("s", 5.0), c.get("unit5:s:s"))
            finally:
                c.client_unpause()
            assert await flushing
            after = (await a.mirror("s", 6.0), a.bound_target("s", 6.0), c.get("unit5:s:s"), a.mirrored)
            return queued, in_batch, after
        finally:
            c.close()
            await a.backend.aclose()

    queued, in_batch, after = run(go())
    assert queued == (None, "w2")  # not the stale w1 from Redis
    assert in_batch == (None, "w3", "w1")  # Redis still had w1: the local w3 is kept
    assert after == ("w3", "w3", "w3", 0)  # local and shared agree once written; nothing mirrored


def test_a_flush_cancelled_mid_write_is_written_by_the_next_flush(server: RedisServer) -> None:
    async def go() -> tuple[Any, ...]:
        t = SharedSessionTable(RedisStateBackend(server.url, 30, key_prefix="unit6:", timeout_s=5.0), 30)
        c = server.client()
        flusher = asyncio.create_task(t.run_flusher())
        try:
            c.client_pause(20_000, all=False)
            try:
                t.bind("s", "w1", 1.0)
                await until(lambda: not t._pending, "the flusher taking the batch")
                await asyncio.sleep(0.05)  # its SET on the wire, held by the paused server
                flusher.cancel()  # shutdown, mid-flush
                await asyncio.gather(flusher, return_exceptions=True)
                requeued = dict(t._pending)
            finally:
                c.client_unpause()
            ok = await t.flush()  # the stop hook's final flush
            return requeued, ok, c.get("unit6:s:s")
        finally:
            flusher.cancel()
            c.close()
            await t.backend.aclose()

    requeued, ok, shared = run(go())
    assert requeued == {"s": "w1"} and ok and shared == "w1"


def state_gateway(url: str, prefix: str, load_sync_s: float) -> Any:
    """A real gateway object with ``state.backend: redis``; only its shared state is started."""
    from mesh.gateway.app import build_gateway

    config = parse_config({"state": {"backend": "redis", "url": url, "key_prefix": prefix, "timeout_s": 0.2,
                                     "load_sync_s": load_sync_s}})
    return build_gateway(config)


def test_shutdown_writes_the_last_bindings_and_leaves_even_right_after_an_error(server: RedisServer) -> None:
    gateway = state_gateway(server.url, "unit7:", 0.1)
    table: SharedSessionTable = gateway.sessions
    table.backend.retry_after_s = 60.0  # the back-off is surely still on at shutdown

    async def go() -> tuple[Any, ...]:
        c = server.client()
        try:
            await gateway.shared.start()
            await until(lambda: bool(c.exists(table.shared_load.key)), "the load sync publishing")
            c.client_pause(20_000, all=False)
            try:
                failed = await table.backend.write_many({"probe": "w0"})  # times out: an error, back-off on
            finally:
                c.client_unpause()
            table.bind("s", "w1", 1.0)  # the last commit before shutdown
            await gateway.shared.stop()
            members = c.zrange("unit7:load:replicas", 0, -1)
            return failed, table.backend.errors["set"], c.get("unit7:s:s"), c.exists(table.shared_load.key), members
        finally:
            c.close()

    failed, set_errors, shared, load_key, members = run(go())
    assert failed is False and set_errors == 1
    assert shared == "w1"  # the final flush ignored the back-off
    assert load_key == 0 and table.shared_load.replica_id not in members  # leave() too


def test_the_redis_password_is_never_shown(server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    secret = "hunter2"
    port = free_port()
    url = f"redis://:{secret}@127.0.0.1:{port}/0"  # nothing listens: PING fails, the warning names it
    with pytest.raises(ValueError) as info:
        RedisStateBackend(f"redis://:{secret}@127.0.0.1:notaport/0", 10)
    assert secret not in str(info.value) and "redis://:***@127.0.0.1:notaport/0" in str(info.value)
    query = RedisStateBackend(f"redis://127.0.0.1:{server.port}/0?password={secret}", 10)
    assert query.stats()["url"] == f"redis://127.0.0.1:{server.port}/0?password=***"
    gateway = state_gateway(url, "unit8:", 0)

    async def go() -> dict[str, Any]:
        await gateway.shared.start()
        try:
            return gateway.sessions.stats()  # type: ignore[no-any-return]
        finally:
            await gateway.shared.stop()
            await query.aclose()

    with caplog.at_level(logging.WARNING, logger="mesh.state.redis_state"):
        stats = run(go())
    assert stats["backend"]["url"] == f"redis://:***@127.0.0.1:{port}/0"
    assert "not reachable" in caplog.text and ":***@" in caplog.text
    assert secret not in caplog.text and secret not in repr(stats)


# -- end to end: two gateway replicas --
class Replica:
    def __init__(self, name: str, url: str) -> None:
        self.name = name
        self.client = httpx.Client(base_url=url, timeout=15)

    def chat(self, session: str) -> str:
        resp = self.client.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": session})
        assert resp.status_code == 200, resp.text
        return resp.headers["x-mesh-worker"]

    def route(self, session: str) -> dict[str, Any]:
        resp = self.client.post("/debug/route", json=CHAT, headers={"x-session-id": session})
        assert resp.status_code == 200, resp.text
        return resp.json()  # type: ignore[no-any-return]

    def metric(self, name: str) -> float:
        text = self.client.get("/metrics").text
        return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


class Replicas:
    def __init__(self, server: RedisServer, a: Replica, b: Replica) -> None:
        self.server, self.a, self.b = server, a, b

    def shared(self, session: str) -> str | None:
        try:
            with self.server.client() as c:
                return c.get(shared_key(session))  # type: ignore[no-any-return]
        except redis.RedisError:
            return None


def shared_key(session: str) -> str:
    """The Redis key of a client's session id: the gateway keys a session by its id's hash."""
    return "e2e:s:" + xxhash.xxh3_128_hexdigest(session.encode())


def write_config(path: Path, workers: dict[str, str], redis_url: str) -> Path:
    data = {
        "workers": [{"name": n, "url": u} for n, u in workers.items()],
        "health": {"interval_s": 0.3, "timeout_s": 1, "unhealthy_threshold": 1},
        "sessions": {"idle_ttl_s": IDLE_TTL_S},
        # Echo workers publish no KV events, so kv_aware would send every new session to one
        # worker on both replicas; round robin spreads them, so B's own choice would differ.
        "policy": {"name": "session_sticky", "params": {"inner": "round_robin"}},
        "state": {"backend": "redis", "url": redis_url, "key_prefix": "e2e:", "timeout_s": 0.2},
    }
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def replicas(module_procs: ProcessGroup, server: RedisServer) -> Iterator[Replicas]:
    workers = {n: module_procs.echo_worker(n).url for n in WORKERS}
    config = write_config(module_procs.log_dir / "replica.yaml", workers, server.url)
    procs = {n: module_procs.gateway(config, port=free_port(), name=f"gateway-{n}") for n in ("a", "b")}
    pair = Replicas(server, Replica("a", procs["a"].url), Replica("b", procs["b"].url))
    for r in (pair.a, pair.b):
        wait_until(lambda r=r: r.client.get("/health").json()["healthy_workers"] == len(WORKERS), what="workers healthy")
    yield pair
    pair.a.client.close()
    pair.b.client.close()


def test_a_session_routed_by_one_replica_is_routed_to_the_same_worker_by_the_other(replicas: Replicas) -> None:
    sessions = [f"share-{i}" for i in range(6)]
    first = {s: replicas.a.chat(s) for s in sessions}
    assert len(set(first.values())) > 1  # spread over workers: agreement below is not a coincidence
    for s in sessions:
        wait_until(lambda s=s: replicas.shared(s) == first[s], what=f"{s} written to Redis")
    for s in reversed(sessions):  # another order than A's: B's own choice would differ
        route = replicas.b.route(s)
        assert route["decision"]["target"] == first[s] and route["decision"]["reason"] == "bound", route
        assert replicas.b.chat(s) == first[s]
    assert replicas.a.chat(sessions[0]) == first[sessions[0]]


def test_the_shared_binding_expires_after_the_idle_time(replicas: Replicas) -> None:
    worker = replicas.a.chat("idle-1")
    wait_until(lambda: replicas.shared("idle-1") == worker, what="binding written")
    with replicas.server.client() as c:
        ttl_ms = c.pttl(shared_key("idle-1"))
    assert 0 < ttl_ms <= IDLE_TTL_S * 1000
    wait_until(lambda: replicas.shared("idle-1") is None, what="the idle binding expiring in Redis")
    route = replicas.b.route("idle-1")
    assert route["session"]["bound_target"] is None and route["decision"]["reason"] != "bound", route


def test_with_redis_down_both_replicas_answer_locally_and_count_errors_then_share_again(replicas: Replicas) -> None:
    worker = replicas.a.chat("down-1")
    wait_until(lambda: replicas.shared("down-1") == worker, what="binding written")
    errors_before = replicas.a.metric("mesh_state_backend_errors_total") + replicas.b.metric("mesh_state_backend_errors_total")
    replicas.server.kill()
    try:
        for i in range(12):  # every answer is a 200 (chat asserts it), sessions stay sticky locally
            assert replicas.a.chat("down-1") == worker
            replicas.b.chat(f"down-b-{i % 3}")
            time.sleep(0.05)
        errors = {r.name: r.metric("mesh_state_backend_errors_total") for r in (replicas.a, replicas.b)}
        assert sum(errors.values()) > errors_before and all(v > 0 for v in errors.values()), errors
    finally:
        replicas.server.start()  # same port, empty: nothing was persisted
    # Empty, unless A's retry of the writes that failed during the outage already landed (they are
    # queued again and retried, not dropped).
    assert replicas.shared("down-1") in (None, worker)
    # Sharing heals: A's next use writes its local binding back (after its short back-off).
    wait_until(lambda: replicas.a.chat("down-1") == worker and replicas.shared("down-1") == worker,
               what="A writing its binding to the restarted Redis")
    # B failed during the outage too: it reads Redis again once its own back-off ends (until then
    # it decides locally, where it never held "down-1")
    wait_until(lambda: (replicas.b.route("down-1")["decision"]["target"], replicas.b.route("down-1")["decision"]["reason"])
               == (worker, "bound"), what="B reading A's binding from the restarted Redis")
    fresh = replicas.b.chat("after-restart")
    wait_until(lambda: replicas.shared("after-restart") == fresh, what="B's new binding written")
    wait_until(lambda: replicas.a.route("after-restart")["decision"]["target"] == fresh,
               what="A reading B's new binding (once A's own back-off, if any, has ended)")
