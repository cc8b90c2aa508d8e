"""A ``mesh serve`` gateway in front of prefill/decode workers, as the disaggregated tests start it
(``PD_POLICY``: the prefill load picks the prefill worker, the load the decode worker), and the
readers of what it and its workers did: circuits, a fake's ``/state``, an echo worker's count."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.procs import PYTHON, Proc, ProcessGroup, free_port

ADMIN = {"authorization": "Bearer adm"}
PD_POLICY = {"name": "pipeline", "params": {"profiles": {
    "prefill": {"scorers": [{"name": "prefill_load", "weight": 1}]},
    "decode": {"filters": ["healthy", "model_match"], "scorers": [{"name": "load", "weight": 1}]},
}}}


def pd_gateway(procs: ProcessGroup, tmp_path: Path, workers: dict[str, tuple[Proc, str]], *extra: str,
               server: dict[str, Any] | None = None, threshold: int = 1, sections: dict[str, Any] | None = None,
               worker_fields: dict[str, dict[str, Any]] | None = None) -> tuple[Proc, int]:
    """``mesh serve`` over ``workers`` (name -> (process, role)); by default every failure opens
    a circuit (for the whole test: no half-open probe). ``sections``: more top-level config
    sections; ``worker_fields``: more fields of a worker's entry, by name."""
    port = free_port()
    fields = worker_fields or {}
    config = {"server": {"port": port, "admin_key": "adm", **(server or {})}, "health": {"interval_s": 60},
              "circuit_breaker": {"failure_threshold": threshold, "open_s": 3600}, "policy": PD_POLICY,
              "workers": [{"name": n, "url": p.url, "role": r, **fields.get(n, {})} for n, (p, r) in workers.items()],
              **(sections or {})}
    path = tmp_path / "pd.yaml"
    path.write_text(yaml.safe_dump(config))
    cmd = [PYTHON, "-m", "mesh", "serve", "--config", str(path), "--log-level", "warning", *extra]
    return procs.start_http(cmd, name="gateway", port=port, ready_path="/ready"), port


def error_of(body: Any) -> dict[str, Any]:
    """The OpenAI error object of an answer (asserts its shape)."""
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), body
    err = body["error"]
    assert isinstance(err.get("message"), str) and "type" in err and "code" in err, err
    return dict(err)


def circuits(gateway: Proc) -> dict[str, str]:
    """Each worker's circuit state, as ``/workers`` reports it."""
    workers = httpx.get(gateway.url + "/workers", headers=ADMIN, timeout=10).json()["workers"]
    return {w["name"]: w["circuit"] for w in workers}


def fake_state(worker: Proc) -> dict[str, int]:
    """A raw-socket fake's ``GET /state`` (what it counted)."""
    return dict(httpx.get(worker.url + "/state", timeout=10).json())


def served(worker: Proc) -> int:
    """How many requests an echo worker served (its ``/admin/faults`` answer)."""
    return int(httpx.post(worker.url + "/admin/faults", json={}, timeout=10).json()["served"])


def kill_now(*workers: Proc) -> None:
    """Echo workers sleep through a request their client left (a SIGTERM would wait for it)."""
    for w in workers:
        w.popen.kill()
        w.popen.wait(10)
