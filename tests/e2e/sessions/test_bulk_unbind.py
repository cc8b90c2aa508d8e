"""A reload that removes several workers unbinds all their sessions in one pass over the table.

The removals of one reload (``mesh.cluster.registry.WorkerRegistry.reconfigure``) are one event
(``remove_many``), heard once by listeners that define ``on_workers_removed``, so the gateway's
housekeeping listener scans the session table once, not once per removed worker (100 workers at
1M sessions would be 100 full scans); ``SessionTable.scans`` counts the passes.

Shown in process (the real registry, listener and table; passes counted, never timed) and over a
real gateway process with echo workers: sessions bound to the removed workers are unbound, the
others keep their worker (``/debug/route`` session state).
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import yaml

from mesh.cluster.registry import Worker, WorkerRegistry
from mesh.config import parse_config
from mesh.core.index import PrefixIndex
from mesh.core.retention import RetentionPlanner
from mesh.core.sessions import SessionTable
from mesh.gateway.app import _Housekeeper
from tests.procs import ProcessGroup, free_port

POLICY = {"policy": {"name": "session_sticky", "params": {"inner": "round_robin"}}}  # spreads new sessions
ADMIN = {"authorization": "Bearer admin-secret"}


def config(names: list[str], urls: dict[str, str] | None = None) -> dict[str, Any]:
    return {"workers": [{"name": n, "url": (urls or {}).get(n, f"http://127.0.0.1:{9000 + sum(map(ord, n))}"), "models": ["toy"]}
                        for n in names],
            "server": {"admin_key": "admin-secret"}}


class PerWorker:
    """A listener without ``on_workers_removed``: still hears every removed worker, one by one."""

    def __init__(self) -> None:
        self.removed: list[str] = []

    def on_worker_added(self, worker: Worker) -> None:
        return None

    def on_worker_removed(self, worker: Worker) -> None:
        self.removed.append(worker.name)


def test_a_reload_removing_several_workers_scans_the_session_table_once() -> None:
    names = [f"w{i}" for i in range(8)]
    reg = WorkerRegistry(parse_config(config(names)))
    reg.reconfigure(parse_config(config(names)))  # adds them as config workers
    dp = reg.add(parse_config({"workers": [{"name": "dp", "url": "http://127.0.0.1:9100", "dp_size": 2}]}).workers[0],
                 "config")
    table = SessionTable()
    index = PrefixIndex()
    retention = RetentionPlanner()
    router = SimpleNamespace(retention=retention)
    reg.add_listener(_Housekeeper(SimpleNamespace(index=index, sessions=table, router=router)))  # type: ignore[arg-type]
    per_worker = PerWorker()
    reg.add_listener(per_worker)
    targets = [t for w in reg.workers.values() for t in w.targets]
    for i in range(400):
        table.bind(f"s{i}", targets[i % len(targets)].id, now=1.0)
        retention.spill(f"s{i}", targets[i % len(targets)], 10, 1.0, reg.targets)
    bound = {f"s{i}": targets[i % len(targets)].id for i in range(400)}
    assert {t.id for t in dp.targets} <= set(bound.values())

    keep = ["w0", "w3", "w7"]
    reg.reconfigure(parse_config(config(keep)))
    assert sorted(reg.workers) == keep
    assert table.scans == 1  # one pass for the 6 workers (7 targets) removed, not one per worker
    assert set(retention._plans) == {t.id for w in keep for t in reg.workers[w].targets}  # removed targets' plans forgotten
    assert sorted(per_worker.removed) == sorted([*set(names) - set(keep), "dp"])
    for sid, tid in bound.items():
        assert table.bound_target(sid, now=2.0) == (tid if tid in keep else None), sid
    assert sum(table.live_sessions(t) for t in keep) == len(table) == sum(1 for t in bound.values() if t in keep)

    reg.remove("w3")  # the single removal: one pass too
    assert table.scans == 2 and table.live_sessions("w3") == 0 and table.bound_target("s3", now=2.0) is None
    assert table.bound_target("s0", now=2.0) == "w0"


def test_a_large_unbind_keeps_the_table_consistent() -> None:
    """The bulk path (a large share of the table unbound: order rebuilt once) leaves the same
    table as unbinding one by one: expiry order, counts and LRU eviction still right."""
    counts: dict[str, int] = {}
    table = SessionTable(idle_ttl_s=10.0, max_sessions=1000)
    table.count_listener = counts.__setitem__
    for i in range(900):
        table.bind(f"s{i}", f"t{i % 3}", now=float(i) / 100)
    assert table.unbind_targets(["t1", "t2", "nope"]) == 600
    assert table.scans == 1 and len(table) == 300 and table.unbound == 600
    assert counts == {"t0": 300, "t1": 0, "t2": 0} and table.live_sessions("t1") == 0
    for i in range(800):  # new sessions fill the table: the oldest t0 bindings are evicted first
        table.bind(f"n{i}", "t1", now=9.5)
    assert len(table) == 1000 and table.evicted == 100
    assert table.bound_target("s0", now=9.5) is None and table.bound_target("s300", now=9.5) == "t0"
    assert table.expire(now=19.0) == 200 and table.live_sessions("t0") == 0  # t0's all idle by then


def _write(path: Path, cfg: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(cfg))
    tmp.replace(path)  # whole: a reload never reads a half-written file


def test_a_reload_over_a_real_gateway_unbinds_the_removed_workers_sessions(procs: ProcessGroup, tmp_path: Path) -> None:
    names = ["e0", "e1", "e2", "e3"]
    urls = {n: procs.echo_worker(n, "--model", "toy").url for n in names}
    cfg = config(names, urls) | POLICY
    path = tmp_path / "mesh.yaml"
    _write(path, cfg)
    port = free_port()
    procs.gateway(path, port=port)
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    body = {"model": "toy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}

    def bound(sid: str) -> str | None:
        resp = http.post("/debug/route", json=body, headers={"x-session-id": sid})
        assert resp.status_code == 200, resp.text
        return resp.json()["session"]["bound_target"]  # type: ignore[no-any-return]

    deadline = time.monotonic() + 20
    while http.get("/health").json()["healthy_workers"] < len(names):
        assert time.monotonic() < deadline, "workers not healthy"
        time.sleep(0.05)
    where: dict[str, str] = {}
    for i in range(24):
        sid = f"sess-{i}"
        resp = http.post("/v1/chat/completions", json=body, headers={"x-session-id": sid})
        assert resp.status_code == 200, resp.text
        where[sid] = resp.headers["x-mesh-worker"]
    assert all(bound(sid) == w for sid, w in where.items())  # (a dry run moves round robin's cursor)
    assert len(set(where.values())) >= 3, where  # spread over the workers

    keep = ["e0", "e2"]
    _write(path, config(keep, urls) | POLICY)
    resp = http.post("/admin/reload", headers=ADMIN)
    assert resp.status_code == 200 and resp.json()["workers"] == keep, resp.text
    for sid, worker in where.items():
        assert bound(sid) == (worker if worker in keep else None), (sid, worker)
