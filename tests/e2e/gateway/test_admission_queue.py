"""Late binding end to end: a real gateway in front of echo workers that each take one request at
a time (``max_in_flight: 1``). A request that finds both full waits at the gateway and goes to the
worker that frees first; the line's bound answers 429, the wait's bound 503, a held client that
leaves is dropped from the line, with holding turned off (a reload) a full cluster is a 429 at
once, and a session whose worker is full waits for it (``home_wait_s``) before it moves.

Workers: ``fast`` answers after 0.6 s, ``slow`` after 3 s and alone serves model ``z``; the
gateway runs the default policy (session_sticky over kv_aware).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.procs import PYTHON, ProcessGroup, free_port, wait_http, wait_until

ADMISSION = {"max_waiting": 1, "max_wait_s": 1.5, "home_wait_s": 1.0}
ADMIN = {"authorization": "Bearer admin"}


class Gateway:
    def __init__(self, url: str, config: Path) -> None:
        self.url = url
        self.config = config
        self.http = httpx.Client(base_url=url, timeout=30)

    def post(self, model: str, timeout: float = 30, session: str | None = None) -> httpx.Response:
        headers = {"x-session-id": session} if session else {}
        return self.http.post("/v1/completions", json={"model": model, "prompt": "x"}, timeout=timeout, headers=headers)

    def metric(self, name: str) -> float:
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        return 0.0

    def in_flight(self) -> int:
        workers = self.http.get("/workers", headers=ADMIN).json()["workers"]
        return sum(t["in_flight"] for w in workers for t in w["targets"])


def _echo(procs: ProcessGroup, name: str, delay_s: float, models: list[str]) -> str:
    port = free_port()
    cmd = [PYTHON, "-m", "mesh.echo_worker", "--port", str(port), "--name", name, "--first-token-delay-s", str(delay_s),
           *[a for m in models for a in ("--model", m)]]
    proc = procs.start(cmd, name=name, port=port)
    wait_http(proc.url + "/health", proc=proc, timeout_s=60)
    return proc.url


@pytest.fixture(scope="module")
def gateway(module_procs: ProcessGroup, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    fast = _echo(module_procs, "fast", 0.6, ["m"])
    slow = _echo(module_procs, "slow", 3.0, ["m", "z"])
    config: Path = tmp_path_factory.mktemp("admission") / "mesh.yaml"
    _write(config, fast, slow, ADMISSION)
    proc = module_procs.gateway(config, port=free_port(), ready_path="/ready")
    gw = Gateway(proc.url, config)
    yield gw
    gw.http.close()


def _write(config: Path, fast: str, slow: str, admission: dict[str, float]) -> None:
    config.write_text(yaml.safe_dump({
        "server": {"admin_key": "admin"},
        "workers": [{"name": "fast", "url": fast, "models": ["m"], "max_in_flight": 1},
                    {"name": "slow", "url": slow, "models": ["m", "z"], "max_in_flight": 1}],
        "health": {"interval_s": 0.5},
        "admission": admission,
    }))


def _fill_both(gw: Gateway, pool: concurrent.futures.ThreadPoolExecutor) -> list[concurrent.futures.Future[httpx.Response]]:
    busy = [pool.submit(gw.post, "m"), pool.submit(gw.post, "m")]
    wait_until(lambda: gw.in_flight() == 2, what="both workers busy")
    return busy


def test_a_held_request_goes_to_the_worker_that_frees_first(gateway: Gateway) -> None:
    held_before = gateway.metric("mesh_admission_held_total")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        busy = _fill_both(gateway, pool)
        # both full: a new session waits, then takes fast's slot (free at 0.6 s, slow's at 3 s)
        held = gateway.post("m", session="new-conversation")
        assert held.status_code == 200, held.text
        assert held.headers["x-mesh-worker"] == "fast"
        assert sorted(f.result().headers["x-mesh-worker"] for f in busy) == ["fast", "slow"]
    assert gateway.metric("mesh_admission_held_total") == held_before + 1
    assert gateway.metric("mesh_admission_waiting") == 0


def test_past_the_line_bound_a_request_is_refused_with_429(gateway: Gateway) -> None:
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        busy = _fill_both(gateway, pool)
        held = pool.submit(gateway.post, "m")
        wait_until(lambda: gateway.metric("mesh_admission_waiting") == 1, what="one request held")
        refused = gateway.post("m")
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert error["code"] == "over_capacity" and "admission.max_waiting" in error["message"]
        assert held.result().status_code == 200
        assert all(f.result().status_code == 200 for f in busy)


def test_a_request_no_worker_takes_within_the_wait_bound_is_a_503(gateway: Gateway) -> None:
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(gateway.post, "z")  # z runs on slow alone, for 3 s
        wait_until(lambda: gateway.in_flight() == 1, what="z in flight")
        late = gateway.post("z")  # fast's slot (free) serves no z: it waits 1.5 s, then gives up
        assert late.status_code == 503, late.text
        assert late.json()["error"]["code"] == "queue_timeout" and "admission.max_wait_s" in late.json()["error"]["message"]
        assert first.result().status_code == 200
    assert gateway.metric('mesh_admission_rejected_total{reason="timeout"}') >= 1


def test_a_held_client_that_leaves_is_dropped_from_the_line(gateway: Gateway) -> None:
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(gateway.post, "z")
        wait_until(lambda: gateway.in_flight() == 1, what="z in flight")
        with pytest.raises(httpx.ReadTimeout):
            gateway.post("z", timeout=0.5)  # held, then its client gives up
        wait_until(lambda: gateway.metric("mesh_admission_waiting") == 0, timeout_s=5, what="the line empty")
        assert first.result().status_code == 200
        assert gateway.post("z").status_code == 200  # the worker's slot came back: nothing leaked


def test_with_holding_off_a_full_cluster_is_a_429_at_once(gateway: Gateway) -> None:
    workers = {w["name"]: w["url"] for w in gateway.http.get("/workers", headers=ADMIN).json()["workers"]}
    _write(gateway.config, workers["fast"], workers["slow"], {**ADMISSION, "max_waiting": 0})
    assert gateway.http.post("/admin/reload", headers=ADMIN).status_code == 200
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(gateway.post, "z")
            wait_until(lambda: gateway.in_flight() == 1, what="z in flight")
            held = gateway.metric("mesh_admission_held_total")
            refused = gateway.post("z")
            assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_error"
            assert "in-flight limit" in refused.json()["error"]["message"]
            assert gateway.metric("mesh_admission_held_total") == held  # never held
            assert first.result().status_code == 200
    finally:
        _write(gateway.config, workers["fast"], workers["slow"], ADMISSION)
        assert gateway.http.post("/admin/reload", headers=ADMIN).status_code == 200


def test_a_session_waits_for_its_full_worker_rather_than_moving(gateway: Gateway) -> None:
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        busy = pool.submit(gateway.post, "z")  # slow is full: the new session binds to fast
        wait_until(lambda: gateway.in_flight() == 1, what="slow busy")
        assert gateway.post("m", session="stay").headers["x-mesh-worker"] == "fast"
        busy.result()
        held = gateway.metric("mesh_admission_held_total")
        first = pool.submit(gateway.post, "m", 30, "stay")
        wait_until(lambda: gateway.in_flight() == 1, what="the session's request in flight on fast")
        second = gateway.post("m", session="stay")  # fast full, slow free: it waits for fast (0.6 s)
        assert first.result().headers["x-mesh-worker"] == "fast"
        assert second.headers["x-mesh-worker"] == "fast"
        assert gateway.metric("mesh_admission_held_total") == held + 1


def test_a_session_moves_once_its_worker_stays_full_past_the_home_wait(gateway: Gateway) -> None:
    assert gateway.post("z", session="mover").headers["x-mesh-worker"] == "slow"  # bound to slow
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        busy = pool.submit(gateway.post, "z")  # slow full for 3 s
        wait_until(lambda: gateway.in_flight() == 1, what="slow busy")
        held = gateway.metric("mesh_admission_held_total")
        moved = gateway.post("m", session="mover")  # waits admission.home_wait_s (1 s), then takes fast
        assert moved.status_code == 200 and moved.headers["x-mesh-worker"] == "fast"
        assert gateway.metric("mesh_admission_held_total") == held + 1
        assert busy.result().status_code == 200
