"""Gateway replicas sharing one real redis-server (``state.backend: redis``).

- A replica whose wall clock is minutes off (no NTP on its host) still shares load with the
  others: the replica set is dated by Redis's clock, not each replica's own (pruned a minute
  either side of the reader's clock, two replicas two minutes apart would prune each other every
  round, silently: no error counted, ``mesh_load_sync_peers`` 0 on both).
- No key under the prefix lives forever: once every replica is gone (SIGKILL) the replica set
  expires too (it has a TTL: a live replica is not the only thing that prunes it).
- Bindings queued during a long outage are all written once Redis is back, in bounded
  pipelines: one pipeline of every queued binding would take longer than the call's time bound
  past ~10k sessions, fail, be queued again with the newer ones, and never get through.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
import time

import httpx
import pytest
import yaml

from mesh.state.redis_state import RedisStateBackend, SharedSessionTable
from mesh.state.shared_load import SharedLoad
from policies.base import TargetState
from tests.procs import PYTHON, ProcessGroup, free_port, kill_process, wait_until
from tests.support.redis_server import RedisServer, server  # noqa: F401 (server: the redis-server fixture)

CHAT = {"model": "echo", "messages": [{"role": "user", "content": "hello review six"}], "max_tokens": 2}
SKEW_S = 120  # replica B's wall clock is two minutes behind A's (and Redis's)
# A gateway process whose time.time() is SKEW_S behind: the host clock of a replica without NTP.
SKEWED = ("import runpy, sys, time; _t = time.time; time.time = lambda: _t() - %d; "
          "sys.argv = ['serve', *sys.argv[1:]]; runpy.run_module('mesh.commands.serve', run_name='__main__')")


def metric(http: httpx.Client, name: str, labels: str = "") -> float:
    text = http.get("/metrics").text
    labels_re = re.escape(labels) if labels else r"(?:\{[^}]*\})?"
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}{labels_re} (\S+)$", text, re.M))


def write_config(procs: ProcessGroup, name: str, workers: dict[str, str], url: str, prefix: str) -> str:
    data = {
        "workers": [{"name": n, "url": u} for n, u in workers.items()],
        "health": {"interval_s": 0.3, "timeout_s": 1, "unhealthy_threshold": 1},
        "sessions": {"idle_ttl_s": 30},
        "policy": {"name": "least_load"},
        "state": {"backend": "redis", "url": url, "key_prefix": prefix, "timeout_s": 0.5, "load_sync_s": 0.1},
    }
    path = procs.log_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def start_gateway(procs: ProcessGroup, config: str, name: str, skew_s: int = 0) -> httpx.Client:
    port = free_port()
    args = ["--config", config, "--port", str(port), "--log-level", "warning"]
    cmd = [PYTHON, "-c", SKEWED % skew_s, *args] if skew_s else [PYTHON, "-m", "mesh.commands.serve", *args]
    proc = procs.start_http(cmd, name=name, port=port)
    http = httpx.Client(base_url=proc.url, timeout=30)
    wait_until(lambda: http.get("/health").json()["healthy_workers"] >= 1, what=f"{name}'s workers healthy")
    return http


@pytest.fixture(scope="module")
def workers(module_procs: ProcessGroup) -> dict[str, str]:
    return {n: module_procs.echo_worker(n).url for n in ("e0", "e1")}


def test_a_replica_whose_clock_is_minutes_behind_still_shares_load(
        module_procs: ProcessGroup, server: RedisServer, workers: dict[str, str]) -> None:  # noqa: F811
    config = write_config(module_procs, "skew", workers, server.url, "skew:")
    a = start_gateway(module_procs, config, "gateway-skew-a")
    b = start_gateway(module_procs, config, "gateway-skew-b", skew_s=SKEW_S)
    with contextlib.closing(a), contextlib.closing(b):
        # Each sees the other (not 0 on both: neither prunes the other's entry).
        wait_until(lambda: metric(a, "mesh_load_sync_peers") == 1 and metric(b, "mesh_load_sync_peers") == 1,
                   timeout_s=10, what="both replicas seeing each other despite the skew")
        for url in workers.values():
            httpx.post(url + "/admin/faults", json={"first_token_delay_s": 3.0}, timeout=5).raise_for_status()
        got: list[str] = []
        held = threading.Thread(target=lambda: got.append(b.post("/v1/chat/completions", json=CHAT).headers["x-mesh-worker"]),
                                daemon=True)
        try:
            held.start()  # in flight through the skewed replica for 3 s
            wait_until(lambda: metric(a, "mesh_remote_in_flight") == 1, timeout_s=10,
                       what="the skewed replica's request in A's remote load")
        finally:
            for url in workers.values():
                httpx.post(url + "/admin/faults", json={"first_token_delay_s": 0.0}, timeout=5)
            held.join(30)
        assert got and got[0] in workers
        wait_until(lambda: metric(a, "mesh_remote_in_flight") == 0, what="its load gone from A once it ended")


def test_an_acl_without_time_still_shares_load_on_the_hosts_clock(server: RedisServer) -> None:  # noqa: F811
    # Replicas date their entries by Redis's TIME; a user the ACL denies TIME must not lose load sharing.
    with server.client() as c:
        c.execute_command("ACL", "SETUSER", "notime6", "on", ">pw6", "~*", "+@all", "-time")

    async def go() -> tuple[tuple[int, int, int], bool]:
        url = f"redis://notime6:pw6@127.0.0.1:{server.port}/0"
        backends = [RedisStateBackend(url, 60, key_prefix="acl6:", timeout_s=0.5) for _ in range(2)]
        states = [{"e0": TargetState("e0", "w0")} for _ in range(2)]
        loads = [SharedLoad(b, s, 0.1) for b, s in zip(backends, states)]
        try:
            states[0]["e0"].in_flight = 2  # two requests in flight through replica 0
            for _ in range(2):
                assert all([await load.sync_once() for load in loads])
            return loads[1].remote("e0"), loads[1]._clock_refused
        finally:
            for load, backend in zip(loads, backends):
                await load.leave()
                await backend.aclose()

    try:
        remote, refused = asyncio.run(go())
    finally:
        with server.client() as c:
            c.execute_command("ACL", "DELUSER", "notime6")
    assert refused and remote == (2, 0, 0)


def test_no_key_under_the_prefix_outlives_every_replica(
        module_procs: ProcessGroup, server: RedisServer, workers: dict[str, str]) -> None:  # noqa: F811
    prefix = "ttl6:"
    config = write_config(module_procs, "ttl", workers, server.url, prefix)
    http = start_gateway(module_procs, config, "gateway-ttl")
    with contextlib.closing(http):
        for i in range(3):
            resp = http.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": f"ttl-{i}"})
            assert resp.status_code == 200, resp.text
    with server.client() as c:
        wait_until(lambda: c.exists(prefix + "load:replicas") and len(list(c.scan_iter(prefix + "s:*"))) == 3,
                   what="the replica entry and bindings written")
    kill_process(module_procs.procs[-1])  # a crash: no leave(), nothing cleaned up
    with server.client() as c:
        keys = list(c.scan_iter(prefix + "*"))
        assert keys
        no_ttl = [k for k in keys if c.pttl(k) == -1]
    assert no_ttl == [], f"keys that would live forever: {no_ttl}"


def test_a_request_ending_on_one_replica_does_not_undo_another_replicas_newer_move(server: RedisServer) -> None:  # noqa: F811
    # Two replicas' tables. A routed the session's turn to e0; while it ran, B moved the session
    # to e1 (e0 drained, say) and shared that. A's turn then ended: its touch (the idle time
    # restarts at a request's end) wrote A's stale e0 over B's move, so B's next turn went back
    # to e0 (or moved again) and A kept e0: the binding flapped between the replicas.
    async def go() -> tuple[str | None, str | None, str | None, str | None]:
        a = SharedSessionTable(RedisStateBackend(server.url, 30, key_prefix="touch6:"), 30)
        b = SharedSessionTable(RedisStateBackend(server.url, 30, key_prefix="touch6:"), 30)
        try:
            a.bind("s", "e0", 1.0)  # A's commit of the turn
            assert await a.flush()
            await b.mirror("s", 2.0)
            b.bind("s", "e1", 2.0)  # B's move while A's request runs
            assert await b.flush()
            a.touch("s", "e0", 3.0)  # A's request ends
            assert await a.flush()
            with server.client() as c:
                shared = c.get("touch6:s:s")
                ttl_ms = c.pttl("touch6:s:s")
            await a.mirror("s", 4.0)
            # A binding Redis lost meanwhile (restart) is written back by the touch.
            a.touch("gone", "e0", 5.0)
            assert await a.flush()
            with server.client() as c:
                restored = c.get("touch6:s:gone")
            return shared, a.bound_target("s", 4.0), restored, "ttl" if ttl_ms > 0 else None
        finally:
            await a.backend.aclose()
            await b.backend.aclose()

    shared, a_now, restored, ttl = asyncio.run(go())
    assert shared == "e1" and ttl == "ttl"  # B's move kept (and its idle time refreshed)
    assert a_now == "e1"  # A follows it at its next read
    assert restored == "e0"


def test_bindings_queued_through_a_long_outage_are_all_written_once_redis_is_back(server: RedisServer) -> None:  # noqa: F811
    # 60k sessions bound locally while Redis is unreachable: one pipeline of all of them would take
    # longer than 2 x timeout_s, fail, and be queued again whole, forever.
    n = 60_000
    prefix = "outage6:"

    async def go() -> int:
        backend = RedisStateBackend(server.url, 600, key_prefix=prefix, timeout_s=0.1, retry_after_s=0.05)
        table = SharedSessionTable(backend, 600)
        now = time.monotonic()
        for i in range(n):
            table.bind(f"out-{i}", "e0" if i % 2 else "e1", now)
        flusher = asyncio.create_task(table.run_flusher())
        try:
            deadline = time.monotonic() + 20
            while (table._pending or table._flushing) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        finally:
            flusher.cancel()
            with pytest.raises(asyncio.CancelledError):
                await flusher
            await backend.aclose()
        with server.client() as c:
            return sum(1 for _ in c.scan_iter(prefix + "s:*", count=10_000))

    assert asyncio.run(go()) == n
