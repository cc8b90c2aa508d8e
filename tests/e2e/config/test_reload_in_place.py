"""A reload that changes only a worker's settings (admission limit, models, API key, tokenizer)
keeps the worker: its in-flight load, health, sessions and cached prefixes, rather than removing
and re-adding it (requests in flight forgotten, in_flight 0 while they run, and the worker
unhealthy, answering 503, until its next health check). A change of what names its engine
(url, role, data-parallel size, block size, KV event stream) still replaces it, and the reload
health-checks the new worker at once."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import yaml

from tests.procs import ProcessGroup, free_port, wait_until

ADMIN = {"authorization": "Bearer adm"}


def _config(path: Path, url: str, **worker: object) -> None:
    path.write_text(yaml.safe_dump({
        "server": {"admin_key": "adm", "request_timeout_s": 60},
        "health": {"interval_s": 3600},  # no health check comes to the rescue within the test
        "workers": [{"name": "e0", "url": url, "models": ["echo"], **worker}],
    }))


def test_a_settings_only_reload_keeps_the_workers_load_and_health(procs: ProcessGroup, tmp_path: Path) -> None:
    echo = procs.echo_worker("e0", "--token-delay-s", "0.05")
    config = tmp_path / "mesh.yaml"
    _config(config, echo.url, max_in_flight=4)
    gateway = procs.gateway(config, port=free_port())
    body = {"model": "echo", "prompt": "one two three four five six seven eight nine ten " * 4, "max_tokens": 40}
    with httpx.Client(base_url=gateway.url, timeout=60) as http:
        def in_flight() -> int:
            return int(http.get("/workers", headers=ADMIN).json()["workers"][0]["targets"][0]["in_flight"])

        results: list[int] = []
        threads = [threading.Thread(target=lambda: results.append(
            httpx.post(gateway.url + "/v1/completions", json=body, timeout=60).status_code)) for _ in range(3)]
        for t in threads:
            t.start()
        wait_until(lambda: in_flight() == 3, what="three requests in flight")
        _config(config, echo.url, max_in_flight=5)
        assert http.post("/admin/reload", headers=ADMIN).status_code == 200
        worker = http.get("/workers", headers=ADMIN).json()["workers"][0]
        assert worker["healthy"] and worker["targets"][0]["in_flight"] == 3  # not unhealthy, not 0
        assert http.post("/v1/completions", json={**body, "max_tokens": 2}).status_code == 200  # not a 503
        for t in threads:
            t.join()
        assert results == [200, 200, 200] and in_flight() == 0
        _config(config, echo.url.replace("127.0.0.1", "localhost"), max_in_flight=5)  # another engine address
        assert http.post("/admin/reload", headers=ADMIN).status_code == 200
        # a new worker, health-checked by the reload itself (not unhealthy until the next round,
        # an hour away here, with every request a 503)
        assert http.get("/workers", headers=ADMIN).json()["workers"][0]["url"].startswith("http://localhost")
        assert http.post("/v1/completions", json={**body, "max_tokens": 2}).status_code == 200
