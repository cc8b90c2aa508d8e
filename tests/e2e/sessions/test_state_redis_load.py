"""In-flight load shared by gateway replicas through a real ``redis-server`` (``SharedLoad``).

Unit part: two ``SharedLoad``s in one process, each over its own ``Router`` and ``TargetState``s,
as two replicas. A's lease shows in B's totals (prefill, then decode tokens), B's policy steers
away from it, both replicas' leases add up on each side, the load leaves with A's lease and
with A itself (its hash's TTL). Redis killed: remote load withdrawn (local only), errors
counted, never negative; sharing heals on restart. A target removed from the registry loses its
remote part. Config validation of ``state.load_sync_s``.

End to end: two real gateway processes (``least_load``) in front of two real echo workers whose
first token is delayed, so requests stay in flight: a request held through replica A shows on B's
``/debug/route`` and ``mesh_remote_in_flight``, B steers away from that worker, and the load
goes back to 0 on both afterwards. With redis-server killed both fall back to local-only load
and keep answering 200.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import httpx
import pytest
import yaml

from mesh.config import ConfigError, MeshConfig, parse_config
from mesh.core.router import Lease, Router
from mesh.state.redis_state import RedisStateBackend
from mesh.state.shared_load import ZERO, SharedLoad, sum_loads
from policies.base import RequestInfo, TargetState
from policies.least_load import LeastLoad
from tests.procs import ProcessGroup, free_port, wait_until
from tests.support.redis_server import RedisServer, server  # noqa: F401 (server: the redis-server fixture)

TARGETS = ("w0", "w1")
CHAT = {"model": "echo", "messages": [{"role": "user", "content": "hello shared load"}], "max_tokens": 2}


# -- unit: two replicas in one process --
class Side:
    """One replica's router, targets and load sync."""

    def __init__(self, url: str, prefix: str, errors: list[str] | None = None, ttl_s: float = 0.5) -> None:
        self.targets = {t: TargetState(id=t, worker=t, models=frozenset({"echo"})) for t in TARGETS}
        self.router = Router(LeastLoad(), self.targets, seed=1)
        backend = RedisStateBackend(url, 30, key_prefix=prefix, timeout_s=0.2, retry_after_s=0.05,
                                    on_error=errors.append if errors is not None else None)
        self.load = SharedLoad(backend, self.targets, 0.05, ttl_s=ttl_s)

    def lease(self, tokens: int = 100) -> Lease:
        return self.router.route(RequestInfo(model="echo", block_keys=(), block_size=16, prompt_tokens=tokens), 0.0)[1]

    def totals(self, tid: str) -> tuple[int, int, int]:
        t = self.targets[tid]
        return (t.in_flight, t.prefill_tokens, t.decode_tokens)

    def pick(self) -> str | None:
        return self.router.decide(RequestInfo(model="echo", block_keys=(), block_size=16, prompt_tokens=1), 0.0).target


async def until(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        if await check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{what} not reached within {timeout_s} s")


async def rounds(*sides: Side) -> bool:
    """One sync round of each side, in order; True when all went through Redis."""
    return all([await s.load.sync_once() for s in sides])


def test_a_lease_on_one_replica_shows_in_the_others_totals_and_leaves_with_it(server: RedisServer) -> None:
    async def go() -> None:
        a, b = Side(server.url, "u1:", ttl_s=1.0), Side(server.url, "u1:", ttl_s=1.0)
        try:
            lease = a.lease(100)
            tid, other = lease.target.id, next(t for t in TARGETS if t != lease.target.id)
            assert await rounds(a, b)
            assert b.totals(tid) == (1, 100, 0) and b.totals(other) == (0, 0, 0)
            assert b.load.own(b.targets[tid]) == ZERO and b.load.peers == 1
            assert {b.pick() for _ in range(8)} == {other}  # least_load steers away from A's load
            lease_b = b.lease(50)  # B's own lease goes to the other target
            assert lease_b.target.id == other
            await rounds(a, b, a)
            assert a.totals(tid) == (1, 100, 0) and a.totals(other) == (1, 50, 0)  # A's own + B's, no double count
            assert b.totals(tid) == (1, 100, 0) and b.totals(other) == (1, 50, 0)
            lease.first_token()
            await rounds(a, b)
            assert b.totals(tid) == (1, 0, 100)
            lease.finish(0.0)
            lease_b.finish(0.0)
            await rounds(a, b, a)
            for side in (a, b):
                assert [side.totals(t) for t in TARGETS] == [(0, 0, 0)] * 2
            # A leaves without a word (a crash): its hash expires by its TTL, and its load with it.
            a.lease(70)
            await rounds(a, b)
            assert sum(b.totals(t)[0] for t in TARGETS) == 1
            with server.client() as c:
                assert 0 < c.pttl(a.load.key) <= 1000
            await until(lambda: _all_zero(b), "A's load expiring with its hash (TTL)")
            assert b.load.peers == 0 and b.load.applied == {}
        finally:
            await a.load.backend.aclose()
            await b.load.backend.aclose()

    asyncio.run(go())


async def _all_zero(side: Side) -> bool:
    await side.load.sync_once()
    return all(side.totals(t) == (0, 0, 0) for t in TARGETS)


def test_the_run_loop_shares_within_a_few_periods_and_leave_removes_it_at_once(server: RedisServer) -> None:
    async def go() -> None:
        a, b = Side(server.url, "u2:", ttl_s=30), Side(server.url, "u2:", ttl_s=30)
        tasks = [asyncio.create_task(s.load.run()) for s in (a, b)]
        try:
            lease = a.lease(10)
            await until(lambda: _async(b.totals(lease.target.id)[0] == 1), "A's lease in B's totals")
            tasks[0].cancel()
            await asyncio.gather(tasks[0], return_exceptions=True)
            await a.load.leave()  # a clean stop: B drops A's load at once, not after the 30 s TTL
            await until(lambda: _async(b.totals(lease.target.id)[0] == 0), "A's load gone after leave()")
            assert a.totals(lease.target.id) == (1, 10, 0)  # A's own lease is still counted locally
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await a.load.backend.aclose()
            await b.load.backend.aclose()

    asyncio.run(go())


async def _async(value: bool) -> bool:
    return value


def test_redis_down_withdraws_remote_load_counts_never_negative_and_heals(server: RedisServer) -> None:
    errors: list[str] = []

    async def go() -> tuple[Any, ...]:
        a, b = Side(server.url, "u3:", ttl_s=30), Side(server.url, "u3:", errors, ttl_s=30)
        try:
            lease = a.lease(40)
            tid = lease.target.id
            mine = b.lease(5)
            await rounds(a, b)
            before = b.totals(tid)
            server.kill()
            ok = await b.load.sync_once()
            after = b.totals(tid)
            assert not ok and b.load.applied == {} and errors and set(errors) == {"load"}
            lease.finish(0.0)  # A's request ends while B cannot hear about it
            mine.finish(0.0)
            await b.load.sync_once()
            state = [b.totals(t) for t in TARGETS]
            server.start()
            await until(lambda: rounds(a, b), "sharing after the restart")
            again = a.lease(9)
            await rounds(a, b)
            return before, after, state, b.load.backend.errors["load"], b.totals(again.target.id)
        finally:
            if not server.pings():
                server.start()
            await a.load.backend.aclose()
            await b.load.backend.aclose()

    before, after, state, counted, healed = asyncio.run(go())
    assert before[0] >= 1 and before[1] >= 40
    assert after[0] == before[0] - 1 and after[1] == before[1] - 40  # only B's own lease is left
    assert state == [(0, 0, 0)] * 2  # back to zero, never negative
    assert counted >= 1
    assert healed == (1, 9, 0)


def test_a_target_removed_from_the_registry_loses_its_remote_part(server: RedisServer) -> None:
    async def go() -> None:
        a, b = Side(server.url, "u4:"), Side(server.url, "u4:")
        try:
            a.lease(30)
            tid = next(t for t in TARGETS if a.targets[t].in_flight)
            await rounds(a, b)
            old = b.targets.pop(tid)  # the registry removed it
            assert old.in_flight == 1
            await rounds(b)
            assert (old.in_flight, old.prefill_tokens) == (0, 0) and tid not in b.load.applied
            fresh = b.targets[tid] = TargetState(id=tid, worker=tid, models=frozenset({"echo"}))  # re-added
            await rounds(a, b)
            assert (fresh.in_flight, fresh.prefill_tokens) == (1, 30) and old.in_flight == 0
        finally:
            await a.load.backend.aclose()
            await b.load.backend.aclose()

    asyncio.run(go())


def test_sum_loads_skips_the_marker_and_bad_values_and_clamps() -> None:
    hashes = [{"_": "1", "w0": "1 10 0", "w1": "junk"}, {"_": "1", "w0": "2 -5 7", "w1": "1 2"}, {}]
    assert sum_loads(hashes) == {"w0": (3, 10, 7)}


def test_load_sync_s_is_validated() -> None:
    assert MeshConfig().state.load_sync_s == 0.1
    assert parse_config({"state": {"backend": "redis", "url": "redis://h:1/0", "load_sync_s": 0}}).state.load_sync_s == 0
    for bad in (-1, 0.001, 11, "fast"):
        with pytest.raises(ConfigError) as info:
            parse_config({"state": {"load_sync_s": bad}})
        assert any(line.startswith("state.load_sync_s:") for line in info.value.errors), info.value.errors
    with pytest.raises(ValueError, match="period"):
        SharedLoad(RedisStateBackend("redis://127.0.0.1:1/0", 10), {}, 0)


# -- end to end: two gateway replicas --
class Gw:
    def __init__(self, url: str) -> None:
        self.client = httpx.Client(base_url=url, timeout=30)

    def chat(self) -> str:
        resp = self.client.post("/v1/chat/completions", json=CHAT)
        assert resp.status_code == 200, resp.text
        return resp.headers["x-mesh-worker"]

    def route(self) -> dict[str, Any]:
        resp = self.client.post("/debug/route", json=CHAT)
        assert resp.status_code == 200, resp.text
        return resp.json()  # type: ignore[no-any-return]

    def loads(self) -> dict[str, float]:
        """Each worker's total load as the policy saw it (least_load's explanation)."""
        cands = self.route()["decision"]["candidates"]
        return {tid: c["scores"]["load"] for tid, c in cands.items()}

    def remote_in_flight(self, target: str) -> float:
        text = self.client.get("/metrics").text
        found = re.search(rf'^mesh_remote_in_flight{{target="{re.escape(target)}"}} (\S+)$', text, re.M)
        assert found, "mesh_remote_in_flight missing"
        return float(found.group(1))

    def errors(self) -> float:
        text = self.client.get("/metrics").text
        return sum(float(v) for v in re.findall(r'^mesh_state_backend_errors_total{op="load"} (\S+)$', text, re.M))


class Cluster:
    def __init__(self, server: RedisServer, workers: dict[str, str], a: Gw, b: Gw) -> None:
        self.server, self.workers, self.a, self.b = server, workers, a, b

    def delay(self, seconds: float) -> None:
        for url in self.workers.values():
            resp = httpx.post(url + "/admin/faults", json={"first_token_delay_s": seconds}, timeout=5)
            assert resp.status_code == 200, resp.text

    def hold_through_a(self) -> tuple[threading.Thread, list[str]]:
        """A request through A that stays in flight for the workers' first-token delay."""
        got: list[str] = []
        thread = threading.Thread(target=lambda: got.append(self.a.chat()), daemon=True)
        thread.start()
        return thread, got


@pytest.fixture(scope="module")
def cluster(module_procs: ProcessGroup, server: RedisServer) -> Iterator[Cluster]:
    workers = {n: module_procs.echo_worker(n).url for n in TARGETS}
    data = {
        "workers": [{"name": n, "url": u} for n, u in workers.items()],
        "health": {"interval_s": 0.3, "timeout_s": 1, "unhealthy_threshold": 1},
        "policy": {"name": "least_load"},
        "state": {"backend": "redis", "url": server.url, "key_prefix": "e2eload:", "timeout_s": 0.2, "load_sync_s": 0.1},
    }
    path = module_procs.log_dir / "load.yaml"
    path.write_text(yaml.safe_dump(data))
    gws = [Gw(module_procs.gateway(path, port=free_port(), name=f"gateway-load-{n}").url) for n in ("a", "b")]
    for gw in gws:
        wait_until(lambda gw=gw: gw.client.get("/health").json()["healthy_workers"] == len(TARGETS), what="workers healthy")
    c = Cluster(server, workers, gws[0], gws[1])
    yield c
    for gw in gws:
        gw.client.close()


def test_a_request_in_flight_through_one_replica_steers_the_other(cluster: Cluster) -> None:
    cluster.delay(4.0)
    try:
        thread, got = cluster.hold_through_a()
        wait_until(lambda: max(cluster.b.loads().values()) >= 1, what="A's request in B's /debug/route")
        loads = cluster.b.loads()
        busy = max(loads, key=loads.__getitem__)
        idle = next(t for t in TARGETS if t != busy)
        assert loads[idle] == 0 and cluster.b.remote_in_flight(busy) == 1
        assert cluster.a.remote_in_flight(busy) == 0  # A counts its own request locally, not twice
        assert cluster.a.loads()[busy] >= 1
        for _ in range(6):  # without shared load B would pick either at random
            assert cluster.b.route()["decision"]["target"] == idle
    finally:
        cluster.delay(0.0)
    thread.join(30)
    assert got == [busy]
    for gw in (cluster.a, cluster.b):
        wait_until(lambda gw=gw: all(v == 0 for v in gw.loads().values()), what="load back to 0")
        assert all(gw.remote_in_flight(t) == 0 for t in TARGETS)


def test_with_redis_killed_both_replicas_fall_back_to_local_load_and_answer(cluster: Cluster) -> None:
    cluster.delay(6.0)
    try:
        thread, got = cluster.hold_through_a()
        wait_until(lambda: max(cluster.b.loads().values()) >= 1, what="A's request in B's /debug/route")
        cluster.server.kill()
        wait_until(lambda: all(v == 0 for v in cluster.b.loads().values()), what="B back to local-only load")
        assert max(cluster.a.loads().values()) >= 1  # A still counts its own request
        assert all(cluster.b.remote_in_flight(t) == 0 for t in TARGETS)
        cluster.delay(0.0)
        for _ in range(4):
            cluster.a.chat()
            cluster.b.chat()
        assert cluster.a.errors() > 0 and cluster.b.errors() > 0
    finally:
        cluster.delay(0.0)
        if not cluster.server.pings():
            cluster.server.start()
    thread.join(30)
    assert len(got) == 1
    for gw in (cluster.a, cluster.b):
        wait_until(lambda gw=gw: all(v == 0 for v in gw.loads().values()), what="load back to 0")
