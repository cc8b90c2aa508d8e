"""mesh.cluster.registry: membership, dp targets, URL validation, health thresholds, circuit breaker, discovery.

Health checks run against real echo worker processes (and a port nobody listens on).
"""

from __future__ import annotations

import urllib.request
from collections.abc import AsyncIterator

import pytest

from mesh.cluster.registry import CircuitBreaker, RegistryError, Worker, WorkerRegistry
from mesh.config import CircuitBreakerConfig, MeshConfig, WorkerConfig, parse_config
from mesh.gateway.upstream import UpstreamPool
from policies.base import Role
from tests.procs import ProcessGroup, free_port


def config(**sections: object) -> MeshConfig:
    return parse_config(dict(sections))


@pytest.fixture
async def pool() -> AsyncIterator[UpstreamPool]:
    p = UpstreamPool(connect_timeout_s=1.0)
    yield p
    await p.close()


def set_faults(url: str, **faults: object) -> None:
    import json

    req = urllib.request.Request(url + "/admin/faults", data=json.dumps(faults).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=5) as resp:
        assert resp.status == 200


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def on_worker_added(self, worker: Worker) -> None:
        self.events.append(("added", worker.name))

    def on_worker_removed(self, worker: Worker) -> None:
        self.events.append(("removed", worker.name))


def test_add_remove_and_dp_targets() -> None:
    reg = WorkerRegistry(config())
    rec = Recorder()
    reg.add_listener(rec)
    targets = reg.targets  # the Router holds this very dict
    w = reg.add(WorkerConfig(name="a", url="http://h:1", dp_size=3, role=Role.DECODE, block_size=32, max_in_flight=4))
    assert sorted(targets) == ["a@0", "a@1", "a@2"]
    assert [t.dp_rank for t in w.targets] == [0, 1, 2]
    assert all(t.role is Role.DECODE and t.block_size == 32 and t.max_in_flight == 4 for t in w.targets)
    assert not any(t.healthy for t in w.targets)  # unknown until the first check passes
    reg.add(WorkerConfig(name="b", url="http://h:2"))
    assert "b" in targets and reg.worker_of("a@1") is w
    v = reg.version
    reg.remove("a")
    assert sorted(targets) == ["b"] and reg.version > v
    assert rec.events == [("added", "a"), ("added", "b"), ("removed", "a")]
    assert reg.targets is targets


def test_admin_errors_carry_http_status() -> None:
    reg = WorkerRegistry(config(server={"allowed_worker_hosts": ["ok-host"], "allowed_schemes": ["http"]}))
    reg.add(WorkerConfig(name="a", url="http://ok-host:1"))
    cases = [
        (lambda: reg.add(WorkerConfig(name="a", url="http://ok-host:2")), 409, "already exists"),
        (lambda: reg.add(WorkerConfig(name="c", url="http://evil:1")), 400, "not in allowed_worker_hosts"),
        (lambda: reg.add(WorkerConfig(name="d", url="https://ok-host:1")), 400, "not in allowed_schemes"),
        (lambda: reg.remove("zzz"), 404, "no worker named"),
        (lambda: reg.drain("zzz"), 404, "no worker named"),
    ]
    for call, status, text in cases:
        with pytest.raises(RegistryError, match=text) as info:
            call()
        assert info.value.status == status


def test_drain_makes_targets_unavailable() -> None:
    reg = WorkerRegistry(config())
    w = reg.add(WorkerConfig(name="a", url="http://h:1"))
    w.healthy = True
    w.sync()
    assert reg.targets["a"].available
    reg.drain("a")
    assert reg.targets["a"].draining and not reg.targets["a"].available
    reg.drain("a", False)
    assert reg.targets["a"].available


def test_circuit_breaker_opens_half_opens_and_closes() -> None:
    cb = CircuitBreaker(CircuitBreakerConfig(failure_threshold=3, open_s=10))
    assert not cb.record_failure(0.0) and not cb.record_failure(1.0)
    cb.record_success()  # consecutive failures only
    assert not cb.record_failure(2.0) and not cb.record_failure(3.0)
    assert cb.record_failure(4.0) and cb.is_open
    cb.record_success()  # a request sent before it opened, finishing whole: still open (it does not close it)
    cb.tick(13.9)
    assert cb.is_open
    cb.tick(14.0)
    assert cb.state == "half_open" and not cb.is_open
    assert cb.record_failure(15.0) and cb.is_open  # one failure while half-open reopens it
    cb.tick(25.0)
    cb.record_success()
    assert cb.state == "closed" and cb.failures == 0


def test_registry_breaker_flags_targets() -> None:
    reg = WorkerRegistry(config(circuit_breaker={"failure_threshold": 2, "open_s": 5}))
    w = reg.add(WorkerConfig(name="a", url="http://h:1"))
    w.healthy = True
    w.sync()
    reg.record_failure("a", 0.0, "boom")
    assert reg.targets["a"].available
    reg.record_failure("a", 1.0, "boom")
    assert reg.targets["a"].circuit_open and reg.any_circuit_open and w.last_error == "boom"
    reg.tick(5.9)
    assert reg.targets["a"].circuit_open
    reg.tick(6.0)
    assert not reg.targets["a"].circuit_open and not reg.any_circuit_open
    reg.record_success("a")
    assert w.breaker.state == "closed"


def test_reconfigure_reconciles_static_workers_and_keeps_admin_ones() -> None:
    reg = WorkerRegistry(config())
    reg.add(WorkerConfig(name="static-1", url="http://h:1"), source="config")
    reg.add(WorkerConfig(name="static-2", url="http://h:2"), source="config")
    reg.add(WorkerConfig(name="adhoc", url="http://h:3"), source="admin")
    new = config(
        workers=[{"name": "static-2", "url": "http://h:2"}, {"name": "static-3", "url": "http://h:4"}],
        circuit_breaker={"failure_threshold": 9},
    )
    kept = reg.workers["static-2"]
    reg.reconfigure(new)
    assert sorted(reg.workers) == ["adhoc", "static-2", "static-3"]
    assert reg.workers["static-2"] is kept  # unchanged worker keeps its state
    assert kept.breaker.config.failure_threshold == 9


async def test_health_thresholds_and_model_discovery(procs: ProcessGroup, pool: UpstreamPool) -> None:
    echo = procs.echo_worker("e1", "--model", "alpha", "--model", "beta")
    reg = WorkerRegistry(config(health={"unhealthy_threshold": 2, "healthy_threshold": 2, "timeout_s": 1}))
    w = reg.add(WorkerConfig(name="e1", url=echo.url))
    await reg.check(w, pool)
    assert not w.healthy and w.ok_streak == 1  # needs two passes
    await reg.check(w, pool)
    assert w.healthy and reg.targets["e1"].healthy
    assert w.models == {"alpha", "beta"} and reg.targets["e1"].models == {"alpha", "beta"}
    assert reg.models() == ["alpha", "beta"]
    assert reg.knows_model("alpha") and not reg.knows_model("gamma")

    set_faults(echo.url, unhealthy=True)
    await reg.check(w, pool)
    assert w.healthy and w.fail_streak == 1  # one failure is not enough
    await reg.check(w, pool)
    assert not w.healthy and not reg.targets["e1"].available
    assert "503" in (w.last_error or "")
    assert reg.models() == []

    set_faults(echo.url, unhealthy=False)
    await reg.check(w, pool)
    await reg.check(w, pool)
    assert w.healthy


async def test_dead_worker_is_unhealthy_and_configured_models_win(pool: UpstreamPool) -> None:
    reg = WorkerRegistry(config(health={"unhealthy_threshold": 1, "timeout_s": 1}))
    w = reg.add(WorkerConfig(name="dead", url=f"http://127.0.0.1:{free_port()}", models=["m"]))
    w.healthy = True
    await reg.check_all(pool)
    assert not w.healthy and "connect" in (w.last_error or "")
    assert w.models == {"m"}  # configured, never discovered
    assert reg.knows_model("m") and not reg.knows_model("x")
