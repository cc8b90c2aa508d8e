"""The disaggregated relay reports its attempts to the workers' passive health, as the mixed-mode
proxy does: a decode worker that dies (connections refused) has its circuit opened by the
requests that met it, so routing leaves it before the next health round, without waiting for
the active health check (here an hour away)."""

from __future__ import annotations

from pathlib import Path

import httpx
import yaml

from tests.procs import ProcessGroup, free_port, kill_process, wait_until
from tests.support.pd_gateway import PD_POLICY

ADMIN = {"authorization": "Bearer adm"}


def test_a_dead_decode_worker_has_its_circuit_opened_by_the_relay(procs: ProcessGroup, tmp_path: Path) -> None:
    workers = {name: procs.echo_worker(name, "--model", "m") for name in ("p0", "d0", "d1")}
    roles = {"p0": "prefill", "d0": "decode", "d1": "decode"}
    config = tmp_path / "mesh.yaml"
    config.write_text(yaml.safe_dump({
        "server": {"admin_key": "adm", "request_timeout_s": 30},
        "health": {"interval_s": 3600},  # only passive health can act within the test
        "circuit_breaker": {"failure_threshold": 2, "open_s": 3600},
        "policy": PD_POLICY,
        "workers": [{"name": n, "url": workers[n].url, "models": ["m"], "role": r} for n, r in roles.items()],
    }))
    gateway = procs.gateway(config, port=free_port(), ready_path="/ready")
    body = {"model": "m", "prompt": "hello world", "max_tokens": 2}
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        def circuit(name: str) -> str:
            return next(w["circuit"] for w in http.get("/workers", headers=ADMIN).json()["workers"] if w["name"] == name)

        wait_until(lambda: all(w["healthy"] for w in http.get("/workers", headers=ADMIN).json()["workers"]),
                   what="all workers healthy")
        kill_process(workers["d1"])
        served_by = set()
        for _ in range(12):  # the load scorer spreads them: some meet the dead d1 first, then retry on d0
            resp = http.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            served_by.add(resp.headers["x-mesh-worker"])
            if circuit("d1") == "open":
                break
        assert served_by == {"d0"}
        assert circuit("d1") == "open" and circuit("d0") == "closed" and circuit("p0") == "closed"
