"""/metrics label cardinality. No gateway label takes client input (routes and statuses are fixed
sets, worker and target labels come from the config or the admin API), and a worker removed at
runtime has its series dropped (``Metrics`` is a registry listener), so an autoscaler naming
workers after pods (a new name each time) does not grow the registry without bound.

Real registry, real echo worker, real health checks over HTTP."""

from __future__ import annotations

import asyncio

from mesh.cluster.registry import WorkerRegistry
from mesh.config import WorkerConfig, parse_config
from mesh.gateway.upstream import UpstreamPool
from mesh.metrics import Metrics
from tests.procs import ProcessGroup


def series(metrics: Metrics, worker: str) -> list[str]:
    return [line for line in metrics.render().decode().splitlines()
            if not line.startswith("#") and f'worker="{worker}"' in line]


def test_churned_workers_leave_no_series_behind(procs: ProcessGroup) -> None:
    echo = procs.echo_worker("e0")
    reg = WorkerRegistry(parse_config({"health": {"timeout_s": 2}}))
    metrics = Metrics()
    reg.add_listener(metrics)

    async def churn() -> None:
        pool = UpstreamPool(connect_timeout_s=2.0)
        try:
            for i in range(20):  # pods come and go, each under a new name
                reg.add(WorkerConfig(name=f"pod-{i}", url=echo.url))
                reg.add(WorkerConfig(name=f"dead-{i}", url="http://127.0.0.1:9"))
                await reg.check_all(pool, metrics)
                metrics.upstream_errors_total.labels(f"dead-{i}", "connect").inc()
                assert series(metrics, f"pod-{i}") and series(metrics, f"dead-{i}")  # counted while there
                reg.remove_many([f"pod-{i}", f"dead-{i}"]) if i % 2 else (reg.remove(f"pod-{i}"), reg.remove(f"dead-{i}"))
        finally:
            await pool.close()

    asyncio.run(churn())
    text = metrics.render().decode()
    assert "pod-" not in text and "dead-" not in text, [x for x in text.splitlines() if "pod-" in x or "dead-" in x][:5]
    # a worker that stays keeps its series
    reg.add(WorkerConfig(name="stays", url=echo.url))
    metrics.health_checks_total.labels("stays", "ok").inc()
    reg.add(WorkerConfig(name="goes", url=echo.url))
    reg.remove("goes")
    assert series(metrics, "stays")


def test_a_gateway_drops_a_removed_workers_series(procs: ProcessGroup, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The gateway itself registers ``Metrics`` as a listener: workers added and removed through
    the admin API leave no health-check series behind on its /metrics."""
    import httpx
    import yaml

    from tests.procs import free_port, wait_until

    echo = procs.echo_worker("e0")
    config = tmp_path / "mesh.yaml"
    config.write_text(yaml.safe_dump({"server": {"admin_key": "k"}, "health": {"interval_s": 0.2}}))
    gateway = procs.gateway(config, port=free_port())
    admin = {"authorization": "Bearer k"}
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        for i in range(3):
            added = http.post("/workers", headers=admin, json={"name": f"pod-{i}", "url": echo.url})
            assert added.status_code in (200, 201), added.text
            checked = f'mesh_health_checks_total{{result="ok",worker="pod-{i}"}}'
            wait_until(lambda checked=checked: checked in http.get("/metrics").text, what=f"pod-{i} health-checked")
            assert http.delete(f"/workers/pod-{i}", headers=admin).status_code in (200, 204)
        wait_until(lambda: "pod-" not in http.get("/metrics").text, what="series of removed workers gone")
