"""Every ``mesh_*`` family a running gateway exposes is documented in docs/metrics.md (real
``mesh up`` with echo workers, a real request, a real scrape)."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from tests.procs import PYTHON, ProcessGroup, free_port, wait_http

DOC = Path(__file__).resolve().parents[3] / "docs" / "metrics.md"



def _families(text: str) -> set[str]:
    return {m.group(1) for m in re.finditer(r"^# TYPE (mesh_\w+) (\w+)$", text, re.M)}


def test_every_exposed_family_is_documented_and_no_created_series(procs: ProcessGroup) -> None:
    port = free_port()
    up = procs.start([PYTHON, "-m", "mesh", "up", "--engine", "echo", "--workers", "2", "--port", str(port)],
                     name="up", port=port)
    base = f"http://127.0.0.1:{port}"
    wait_http(f"{base}/ready", proc=up, timeout_s=90)
    with httpx.Client(base_url=base, timeout=30) as client:
        body = {"model": "echo", "prompt": "hello metrics", "max_tokens": 4}
        assert client.post("/v1/completions", json=body, headers={"x-session-id": "s1"}).status_code == 200
        text = client.get("/metrics").text
    exposed = _families(text)
    assert {"mesh_requests_total", "mesh_worker_in_flight", "mesh_sessions_live"} <= exposed, exposed
    documented = set(re.findall(r"`(mesh_\w+)`", DOC.read_text()))
    # Older prometheus_client versions name a counter's family without `_total` in TYPE lines.
    missing = {f for f in exposed if f not in documented and f + "_total" not in documented}
    assert not missing, f"undocumented in docs/metrics.md: {sorted(missing)}"
    assert not re.search(r"^mesh_\w+_created[{ ]", text, re.M), "prometheus_client *_created series are exposed"
