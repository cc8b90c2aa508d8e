"""Gateway replicas sharing state through a real Redis Cluster (``state.cluster: true``).

One module-scoped cluster: six real ``redis-server --cluster-enabled yes`` processes (three
masters, a replica each; ``cluster-node-timeout`` 1 s, so a replica takes a dead master's slots
within seconds; ``cluster-require-full-coverage no``, so the other masters answer meanwhile), made a cluster by ``redis-cli --cluster create``. In front of three real echo
workers, two real gateway processes with ``state: {backend: redis, cluster: true}``:

- a session's second turn through the other replica lands on the same worker (``bound``), and the
  session keys keep their single-server names, spread over several masters;
- each replica sees the other's in-flight request (``mesh_remote_in_flight``), and every load key
  shares the slot of the hash tag ``{key_prefix}``;
- a manual failover (the old master answers MOVED) is followed: no error, bindings and load read;
- a master SIGKILLed mid-run: every request still succeeds (locally), each replica logs the outage
  once when it starts and once when it ends (every master back, after a replica took the slots),
  however many calls to the other masters succeed meanwhile, and sharing resumes;
- a flush alone (pipelines, no single command) finds the replica that took a dead master's slots;
- a gateway whose cluster is unreachable at startup serves locally and counts the errors; a dead
  seed in ``url`` is outlived by ``cluster_seeds``; a single-server client pointed at a cluster
  node refuses it (one ERROR naming ``state.cluster: true``) and stays local: no Redis writes;
- an ACL without the load keys' pattern (``{key_prefix}*``) is named in the warning.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import xxhash
import yaml
from redis.crc import key_slot

from mesh.state.redis_state import RedisStateBackend, SharedSessionTable
from mesh.state.shared_load import SharedLoad
from policies.base import TargetState
from tests.procs import Proc, ProcessGroup, free_port, kill_process, wait_until

PREFIX = "c1:"  # the gateways' key_prefix: load keys are {c1:}load:...
WORKERS = ("e0", "e1", "e2")
CHAT = {"model": "echo", "messages": [{"role": "user", "content": "hello cluster"}], "max_tokens": 2}
Slots = list[tuple[int, int, int, list[int]]]  # (first slot, last slot, master port, replica ports)


def cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000, so at most 55535) is free too."""
    for _ in range(200):
        port = free_port()
        if port <= 55535:
            with socket.socket() as s:
                with contextlib.suppress(OSError):
                    s.bind(("127.0.0.1", port + 10000))
                    return port
    raise RuntimeError("no free port with a free cluster bus port")


class Cluster:
    """Six redis-server processes in cluster mode: three masters with one replica each."""

    def __init__(self, procs: ProcessGroup) -> None:
        self.procs = procs
        self.ports = [cluster_port() for _ in range(6)]
        self.nodes: dict[int, Proc] = {}

    @property
    def url(self) -> str:
        """A seed node's URL: a live one."""
        return f"redis://127.0.0.1:{self.live()[0]}"

    def start(self) -> None:
        for port in self.ports:
            data = self.procs.log_dir / f"cluster-{port}"
            data.mkdir()
            cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data), "--save", "",
                   "--appendonly", "no", "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                   "--cluster-node-timeout", "1000", "--cluster-replica-validity-factor", "0",
                   # the live masters keep serving their slots while one is down (Redis' default
                   # refuses every slot from the master's FAIL until its replica takes over)
                   "--cluster-require-full-coverage", "no"]
            self.nodes[port] = self.procs.start(cmd, name=f"redis-cluster-{port}", port=port)
        for port in self.ports:
            wait_until(lambda port=port: self._pings(port), what=f"redis-server {port} answering PING")
        create = ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                  "--cluster-replicas", "1", "--cluster-yes"]
        done = subprocess.run(create, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        wait_until(lambda: self.healthy() and sum(len(r) for *_, r in self.slots()) == 3, timeout_s=30,
                   what="the cluster ok, three replicas in sync")

    def node(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, decode_responses=True, socket_timeout=2)

    def live(self) -> list[int]:
        return [p for p, proc in self.nodes.items() if proc.alive()]

    def slots(self) -> Slots:
        with self.node(self.live()[0]) as c:
            rows = c.execute_command("CLUSTER SLOTS")
        return [(int(r[0]), int(r[1]), int(r[2][1]), [int(n[1]) for n in r[3:]]) for r in rows]

    def master_of(self, key: str) -> int:
        slot = key_slot(key.encode())
        return next(m for first, last, m, _ in self.slots() if first <= slot <= last)

    def replica_of(self, master: int) -> int:
        return next(r[0] for _, _, m, r in self.slots() if m == master and r)

    def healthy(self) -> bool:
        """Every live node says ok, every slot's master is alive, every live replica is in sync."""
        try:
            for port in self.live():
                with self.node(port) as c:
                    if c.cluster("info")["cluster_state"] != "ok":
                        return False
                    info = c.info("replication")
                    if info["role"] == "slave" and info.get("master_link_status") != "up":
                        return False
            return all(m in self.live() for _, _, m, _ in self.slots())
        except redis.RedisError:
            return False

    def kill(self, port: int) -> None:
        kill_process(self.nodes[port])

    def get(self, key: str) -> str | None:
        with self.node(self.master_of(key)) as c:
            return c.get(key)  # type: ignore[no-any-return]

    def _pings(self, port: int) -> bool:
        try:
            with self.node(port) as c:
                return bool(c.ping())
        except redis.RedisError:
            return False


@pytest.fixture(scope="module")
def cluster(module_procs: ProcessGroup) -> Iterator[Cluster]:
    c = Cluster(module_procs)
    c.start()
    yield c


def session_key(session: str) -> str:
    """The Redis key of a client's session id (the gateway keys a session by its id's hash)."""
    return PREFIX + "s:" + xxhash.xxh3_128_hexdigest(session.encode())


# -- two gateway replicas --
class Replica:
    def __init__(self, proc: Proc) -> None:
        self.proc = proc
        self.client = httpx.Client(base_url=proc.url, timeout=15)

    def chat(self, session: str) -> str:
        resp = self.client.post("/v1/chat/completions", json=CHAT, headers={"x-session-id": session})
        assert resp.status_code == 200, resp.text
        return resp.headers["x-mesh-worker"]

    def route(self, session: str) -> tuple[str, str]:
        resp = self.client.post("/debug/route", json=CHAT, headers={"x-session-id": session})
        assert resp.status_code == 200, resp.text
        decision = resp.json()["decision"]
        return decision["target"], decision["reason"]

    def metric(self, name: str) -> float:
        text = self.client.get("/metrics").text
        return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))

    def log(self) -> str:
        return self.proc.log_path.read_text(errors="replace")


def write_config(path: Path, workers: dict[str, str], state: dict[str, Any]) -> Path:
    data = {
        "workers": [{"name": n, "url": u} for n, u in workers.items()],
        "health": {"interval_s": 0.3, "timeout_s": 1, "unhealthy_threshold": 1},
        "sessions": {"idle_ttl_s": 60},
        # Echo workers publish no KV events: round robin spreads new sessions, so B's own choice
        # would differ from A's and agreement below is not a coincidence.
        "policy": {"name": "session_sticky", "params": {"inner": "round_robin"}},
        "state": {"backend": "redis", "cluster": True, "key_prefix": PREFIX, "timeout_s": 0.2, "load_sync_s": 0.1,
                  **state},
    }
    path.write_text(yaml.safe_dump(data))
    return path


def start_gateway(procs: ProcessGroup, config: Path, name: str) -> Replica:
    replica = Replica(procs.gateway(config, port=free_port(), name=name))
    wait_until(lambda: replica.client.get("/health").json()["healthy_workers"] == len(WORKERS), what=f"{name}'s workers")
    return replica


@pytest.fixture(scope="module")
def workers(module_procs: ProcessGroup) -> dict[str, str]:
    return {n: module_procs.echo_worker(f"cluster-{n}").url for n in WORKERS}


@pytest.fixture(scope="module")
def pair(module_procs: ProcessGroup, cluster: Cluster, workers: dict[str, str]) -> Iterator[tuple[Replica, Replica]]:
    # url: one seed; the other masters as more seeds (any one answering is enough to find the rest)
    seeds = [f"127.0.0.1:{p}" for p in cluster.ports[1:3]]
    config = write_config(module_procs.log_dir / "cluster.yaml", workers, {"url": cluster.url, "cluster_seeds": seeds})
    a, b = (start_gateway(module_procs, config, f"gateway-cluster-{n}") for n in "ab")
    yield a, b
    a.client.close()
    b.client.close()


def test_a_session_routed_by_one_replica_is_bound_to_the_same_worker_by_the_other(
        cluster: Cluster, pair: tuple[Replica, Replica]) -> None:
    a, b = pair
    sessions = [f"cluster-share-{i}" for i in range(8)]
    first = {s: a.chat(s) for s in sessions}
    assert len(set(first.values())) > 1
    for s in sessions:
        wait_until(lambda s=s: cluster.get(session_key(s)) == first[s], what=f"{s} written to the cluster")
    # Session keys keep their single-server names and spread over the masters (no hash tag).
    assert len({cluster.master_of(session_key(s)) for s in sessions}) > 1
    for s in reversed(sessions):
        assert b.route(s) == (first[s], "bound")
        assert b.chat(s) == first[s]
    assert a.metric("mesh_state_backend_errors_total") == 0 and b.metric("mesh_state_backend_errors_total") == 0


def test_each_replica_sees_the_others_in_flight_request(
        cluster: Cluster, pair: tuple[Replica, Replica], workers: dict[str, str]) -> None:
    a, b = pair
    wait_until(lambda: a.metric("mesh_load_sync_peers") == 1 and b.metric("mesh_load_sync_peers") == 1,
               what="both replicas in the replica set")
    # Every load key is under the hash tag {c1:}: one slot, so the round's script may touch them together.
    with cluster.node(cluster.master_of("{c1:}load:replicas")) as c:
        keys = list(c.scan_iter("{c1:}load:*"))
    assert len(keys) == 3 and len({key_slot(k.encode()) for k in keys}) == 1, keys  # the set + two hashes
    for url in workers.values():
        httpx.post(url + "/admin/faults", json={"first_token_delay_s": 3.0}, timeout=5).raise_for_status()
    got: list[str] = []
    held = threading.Thread(target=lambda: got.append(b.chat("cluster-load-1")), daemon=True)
    try:
        held.start()  # in flight through B for 3 s
        wait_until(lambda: a.metric("mesh_remote_in_flight") == 1, timeout_s=10, what="B's request in A's remote load")
    finally:
        for url in workers.values():
            httpx.post(url + "/admin/faults", json={"first_token_delay_s": 0.0}, timeout=5)
        held.join(30)
    assert got and got[0] in workers
    wait_until(lambda: a.metric("mesh_remote_in_flight") == 0, what="its load gone from A once it ended")


def test_a_manual_failover_is_followed_through_moved_without_an_error(
        cluster: Cluster, pair: tuple[Replica, Replica]) -> None:
    load_key = "{c1:}load:replicas"
    master = cluster.master_of(load_key)
    sid = next(f"moved-{i}" for i in range(1000) if cluster.master_of(PREFIX + f"s:moved-{i}") == master)
    backend = RedisStateBackend(cluster.url, 60, key_prefix=PREFIX, timeout_s=0.5, cluster=True)
    load = SharedLoad(backend, {"e0": TargetState("e0", "w0")}, 0.1, replica_id="moved-test")

    async def before() -> bool:
        ok = await backend.set_session(sid, "e1", 0.0) is False and await load.sync_once()
        return ok and await backend.get_session(sid, 0.0) == "e1"  # the slot map is known now

    async def after() -> tuple[str | None, bool, dict[str, int]]:
        try:
            return await backend.get_session(sid, 0.0), await load.sync_once(), dict(backend.errors)
        finally:
            await load.leave()
            await backend.aclose()

    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(before())
        replica = cluster.replica_of(master)
        with cluster.node(replica) as c:
            c.execute_command("CLUSTER", "FAILOVER")
        # The old master is a replica now: a command for its slots is answered MOVED.
        wait_until(lambda: cluster.master_of(load_key) == replica and cluster.healthy(), what="the failover done")
        with cluster.node(master) as c, pytest.raises(redis.exceptions.MovedError):
            c.get(PREFIX + f"s:{sid}")
        shared, synced, errors = loop.run_until_complete(after())
    finally:
        loop.close()
    assert shared == "e1" and synced and sum(errors.values()) == 0, errors
    a, b = pair  # the gateways' clients had the old map too
    worker = a.chat("after-failover")
    wait_until(lambda: b.route("after-failover") == (worker, "bound"), what="B reading A's binding after the failover")


def test_a_master_killed_mid_run_routes_locally_logs_once_and_shares_again(
        cluster: Cluster, pair: tuple[Replica, Replica]) -> None:
    a, b = pair
    logs_before = [len(r.log()) for r in pair]
    errors_before = a.metric("mesh_state_backend_errors_total") + b.metric("mesh_state_backend_errors_total")
    # Not the load keys' master: load rounds go on succeeding through the outage, and so do the
    # sessions on the other masters; the outage must still be one line each way, not one per pair.
    victim = next(m for _, _, m, _ in cluster.slots() if m != cluster.master_of("{c1:}load:replicas"))

    def sessions(name: str) -> list[str]:  # three on the victim, three elsewhere
        on_victim = {f"{name}-{i}": cluster.master_of(session_key(f"{name}-{i}")) == victim for i in range(40)}
        return [s for s, v in on_victim.items() if v][:3] + [s for s, v in on_victim.items() if not v][:3]

    # Each replica its own sessions: a session used through both during an outage may be routed
    # apart by each (neither reads the other's binding), and the last write wins once it is over.
    bound = {s: a.chat(s) for s in sessions("kill-a")}
    b_sessions = sessions("kill-b")
    cluster.kill(victim)
    deadline = time.monotonic() + 3  # past cluster-node-timeout: the replica takes the slots meanwhile
    while time.monotonic() < deadline:
        for s, t in zip(bound, b_sessions):  # every answer a 200 (chat asserts it); sticky locally
            assert a.chat(s) == bound[s]
            b.chat(t)
    errors = a.metric("mesh_state_backend_errors_total") + b.metric("mesh_state_backend_errors_total")
    assert errors > errors_before
    wait_until(cluster.healthy, timeout_s=30, what="a replica serving the dead master's slots")
    # Sharing resumes: a new session through B is bound by A.
    worker = b.chat("after-kill")
    wait_until(lambda: a.route("after-kill") == (worker, "bound"), timeout_s=10, what="A reading B's binding")
    for replica, start in zip(pair, logs_before):  # one line when the outage began, one when it ended
        wait_until(lambda replica=replica, start=start: "answers again" in replica.log()[start:], timeout_s=10,
                   what=f"{replica.proc.name} logging the end of the outage")
        lines = [line for line in replica.log()[start:].splitlines() if "state backend" in line]
        assert sum("unreachable" in line for line in lines) == 1, lines
        assert sum("answers again" in line for line in lines) == 1, lines


def test_one_master_down_is_one_outage_while_calls_to_the_others_succeed(
        cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    # The single server's rule (the first call that succeeds ends the outage) logged an end and a
    # new start at every call to a live master followed by one to the dead one.
    victim = next(m for _, _, m, replicas in cluster.slots() if replicas)
    owner = {f"flap-{i}": cluster.master_of(f"flap6:s:flap-{i}") for i in range(100)}
    dead, live = next(s for s, m in owner.items() if m == victim), next(s for s, m in owner.items() if m != victim)
    backend = RedisStateBackend(cluster.url, 60, key_prefix="flap6:", timeout_s=0.5, retry_after_s=0.0, cluster=True)

    def lines(text: str) -> tuple[int, int]:
        return text.count("unreachable"), text.count("answers again")

    async def go() -> tuple[list[str | None], tuple[int, int], tuple[int, int]]:
        try:
            for sid in (dead, live):
                await backend.set_session(sid, "e0", 0.0)
            cluster.kill(victim)
            reads = []
            for _ in range(5):
                reads += [await backend.get_session(dead, 0.0), await backend.get_session(live, 0.0)]
                await asyncio.sleep(0.05)  # the background check of every master runs (and fails)
            during = lines(caplog.text)
            await asyncio.to_thread(wait_until, cluster.healthy, 30, "a replica serving the dead master's slots")
            for _ in range(100):  # calls go on; once every master says ok, the outage ends
                await backend.get_session(live, 0.0)
                await asyncio.sleep(0.05)
                if "answers again" in caplog.text:
                    break
            return reads, during, lines(caplog.text)
        finally:
            await backend.aclose()

    with caplog.at_level(logging.WARNING, logger="mesh.state.redis_state"):
        reads, during, after = asyncio.run(go())
    assert reads == [None, "e0"] * 5  # the live master's bindings are still shared
    assert during == (1, 0) and after == (1, 1), caplog.text
    # The line names the node that failed and the cause, not the seed and the error's category.
    down = next(r.getMessage() for r in caplog.records if "unreachable" in r.getMessage())
    assert f"127.0.0.1:{victim}" in down and "network:" not in down, down


def test_a_flush_alone_finds_the_replica_that_took_a_dead_masters_slots(cluster: Cluster) -> None:
    # Pipelines only (the write-behind flush): redis-py asks the cluster for its layout again after
    # a failed single command, not after a failed pipeline with retries off; the backend forgets
    # the layout itself, so a flush does not go to the dead master of slots a replica took over.
    victim = next(m for _, _, m, replicas in cluster.slots() if replicas)
    sids = [s for s in (f"flush-{i}" for i in range(100)) if cluster.master_of(f"flush5:s:{s}") == victim][:3]
    backend = RedisStateBackend(cluster.url, 60, key_prefix="flush5:", timeout_s=0.5, cluster=True)
    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(backend.write_many(dict.fromkeys(sids, "e0")))
        cluster.kill(victim)
        wait_until(cluster.healthy, timeout_s=30, what="a replica serving the dead master's slots")
        writes = dict.fromkeys(sids, "e1")
        results = [loop.run_until_complete(backend.write_many(writes, backoff=False)) for _ in range(3)]
        loop.run_until_complete(backend.aclose())
    finally:
        loop.close()
    assert results[0] is False and results[-1] is True, results  # the first one found the master dead
    assert [cluster.get(f"flush5:s:{s}") for s in sids] == ["e1"] * 3


# -- startup and configuration mistakes --
def test_a_gateway_whose_cluster_is_unreachable_at_startup_serves_locally(
        module_procs: ProcessGroup, workers: dict[str, str]) -> None:
    config = write_config(module_procs.log_dir / "dead.yaml", workers, {"url": f"redis://127.0.0.1:{free_port()}"})
    c = start_gateway(module_procs, config, "gateway-cluster-dead")
    with contextlib.closing(c.client):
        first = c.chat("dead-1")
        for _ in range(3):
            assert c.chat("dead-1") == first  # sticky on its local binding
        assert c.metric("mesh_state_backend_errors_total") > 0
        assert "not reachable at start" in c.log()


def test_a_dead_url_seed_is_outlived_by_cluster_seeds(cluster: Cluster) -> None:
    async def go() -> tuple[bool, str | None, dict[str, int]]:
        seeds = tuple(f"127.0.0.1:{p}" for p in cluster.live())
        backend = RedisStateBackend(f"redis://127.0.0.1:{free_port()}", 60, key_prefix="seed2:", timeout_s=0.5,
                                    cluster=True, seeds=seeds)
        try:
            pinged = await backend.ping()
            await backend.set_session("s", "w3", 0.0)
            return pinged, await backend.get_session("s", 0.0), dict(backend.errors)
        finally:
            await backend.aclose()

    pinged, got, errors = asyncio.run(go())
    assert pinged and got == "w3" and sum(errors.values()) == 0, errors


def test_a_single_server_config_on_a_cluster_node_is_refused_and_stays_local(
        cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    # state.cluster unset, url a cluster node: PING passes, but keys of the other masters' slots
    # would answer MOVED, sessions flap between replicas, and the write batch holding one such key
    # fail whole every 0.5 s, for good: the config is refused (an ERROR) and the state stays local.
    master = cluster.slots()[0][2]
    sids = [f"single-{i}" for i in range(30)]  # over every master's slots, this one's too

    async def go() -> tuple[bool, bool, dict, bool, str | None, bool]:
        backend = RedisStateBackend(f"redis://127.0.0.1:{master}/0", 60, key_prefix="one3:", timeout_s=0.5,
                                    retry_after_s=0.0)
        table = SharedSessionTable(backend, 60.0)
        load = SharedLoad(backend, {"e0": TargetState("e0", "w0")}, 0.1, replica_id="single-test")
        try:
            pinged = await backend.ping()
            for sid in sids:
                table.bind(sid, "w1", 0.0)
            flushed = await table.flush()
            synced = await load.sync_once()
            return pinged, flushed, dict(table._pending), synced, await table.mirror(sids[0], 0.0), backend.local_only
        finally:
            await backend.aclose()

    with caplog.at_level(logging.WARNING, logger="mesh.state.redis_state"):
        pinged, flushed, pending, synced, mirrored, local_only = asyncio.run(go())
    assert not pinged and local_only and not synced and mirrored is None
    assert flushed and pending == {}  # dropped, not queued again forever
    for port in cluster.live():
        with cluster.node(port) as c:
            assert c.keys("one3:*") == [] and c.keys("*single-test*") == [], port  # no Redis writes at all
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "state.cluster: true" in errors[0], caplog.text


def test_an_acl_without_the_load_keys_names_their_pattern(cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    # In a cluster the load keys are {aclp:}load:*, outside an ACL of ~aclp:*: the warning said
    # only NOPERM, not which pattern the ACL must allow.
    for port in cluster.live():
        with cluster.node(port) as c:
            c.execute_command("ACL", "SETUSER", "u", "on", ">s3cretpw", "~aclp:*", "+@all")

    async def go() -> bool:
        backend = RedisStateBackend(f"redis://u:s3cretpw@127.0.0.1:{cluster.live()[0]}", 60, key_prefix="aclp:",
                                    timeout_s=0.5, cluster=True)
        load = SharedLoad(backend, {"e0": TargetState("e0", "w0")}, 0.1, replica_id="acl-test")
        try:
            await backend.set_session("s", "w0", 0.0)
            return await load.sync_once()
        finally:
            await backend.aclose()

    try:
        with caplog.at_level(logging.WARNING, logger="mesh.state.redis_state"):
            assert asyncio.run(go()) is False
    finally:
        for port in cluster.live():
            with cluster.node(port) as c:
                c.execute_command("ACL", "DELUSER", "u")
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert refused and "~{aclp:}*" in refused[0] and "s3cretpw" not in caplog.text, caplog.text
