"""A worker that serves requests while its configured KV event stream delivers nothing is loud and
visible: a WARNING naming the worker, its endpoint and the fix (the worker must bind
``tcp://*:PORT``), ``kv_events`` in ``GET /workers`` and ``index_problems`` in ``GET /ready`` and ``POST /debug/route``. A
bundled worker whose publisher binds is "live" and raises nothing; one without events is "none".

The blind worker is an echo worker (it publishes nothing, as a vLLM worker given a concrete
address publishes nothing the gateway can reach)."""

from __future__ import annotations

from pathlib import Path

import httpx
import yaml

from tests.procs import PYTHON, ProcessGroup, free_port, wait_http, wait_until

ADMIN = {"authorization": "Bearer adm"}


def test_a_worker_serving_with_a_silent_event_stream_is_reported_blind(procs: ProcessGroup, tmp_path: Path) -> None:
    echo_port, tiny_port, silent, kv, replay = (free_port() for _ in range(5))
    echo = procs.start([PYTHON, "-m", "mesh.echo_worker", "--port", str(echo_port), "--name", "quiet", "--model", "tiny"],
                       name="quiet", port=echo_port)
    tiny = procs.start([PYTHON, "-m", "mesh", "worker", "--preset", "tiny", "--device", "cpu", "--port", str(tiny_port),
                        "--kv-events-endpoint", f"tcp://*:{kv}", "--kv-events-replay-endpoint", f"tcp://*:{replay}",
                        "--log-level", "warning"], name="tiny", port=tiny_port)
    for proc in (echo, tiny):
        wait_http(proc.url + "/health", proc=proc, timeout_s=120)
    config = tmp_path / "mesh.yaml"
    config.write_text(yaml.safe_dump({
        "server": {"admin_key": "adm"},
        "workers": [
            {"name": "quiet", "url": echo.url, "models": ["tiny"], "kv_events": {"endpoint": f"tcp://127.0.0.1:{silent}"}},
            {"name": "live", "url": tiny.url, "models": ["tiny"],
             "kv_events": {"endpoint": f"tcp://127.0.0.1:{kv}", "replay_endpoint": f"tcp://127.0.0.1:{replay}"}},
        ],
        "health": {"interval_s": 0.5},
        "policy": "round_robin",
    }))
    gateway = procs.gateway(config, port=free_port(), ready_path="/ready")
    with httpx.Client(base_url=gateway.url, timeout=60) as client:
        def states() -> dict[str, str]:
            return {w["name"]: w["kv_events"] for w in client.get("/workers", headers=ADMIN).json()["workers"]}

        wait_until(lambda: states()["live"] == "live", timeout_s=30, what="the bundled worker's stream live")
        for i in range(8):  # round robin: four requests each, of a few blocks (the bundled worker announces them)
            prompt = f"request {i}: " + "a longer prompt that fills several KV blocks " * 3
            assert client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2}).status_code == 200
        def blind() -> str | None:
            now = states()
            return now["quiet"] if now["quiet"].startswith("index blind") else None

        quiet = wait_until(blind, timeout_s=30, what="the silent stream reported blind")
        assert f"tcp://127.0.0.1:{silent}" in quiet and "tcp://*:PORT" in quiet
        assert states()["live"] == "live"  # a stream that delivers raises nothing
        ready = client.get("/ready").json()
        assert ready["ready"] is True and set(ready["index_problems"]) == {"quiet"}
        route = client.post("/debug/route", json={"model": "tiny", "prompt": "where would this go?"}, headers=ADMIN)
        assert route.status_code == 200 and route.json()["index_problems"]["quiet"].startswith("index blind")
    log = gateway.log_tail(20_000)
    assert "WARNING" in log and "kv events of worker quiet" in log and "tcp://*:PORT" in log
    assert "kv events of worker live (target" not in log


def test_a_worker_without_kv_events_is_none_not_live(procs: ProcessGroup, tmp_path: Path) -> None:
    port = free_port()
    echo = procs.start([PYTHON, "-m", "mesh.echo_worker", "--port", str(port), "--name", "plain"], name="plain", port=port)
    wait_http(echo.url + "/health", proc=echo, timeout_s=60)
    config = tmp_path / "mesh.yaml"
    config.write_text(yaml.safe_dump({"server": {"admin_key": "adm"}, "workers": [{"name": "plain", "url": echo.url}]}))
    gateway = procs.gateway(config, port=free_port(), ready_path="/ready")
    workers = httpx.get(gateway.url + "/workers", headers=ADMIN, timeout=10).json()["workers"]
    assert [w["kv_events"] for w in workers] == ["none"]
