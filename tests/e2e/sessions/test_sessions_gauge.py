"""``mesh_sessions_live`` counts only bindings that are not idle-expired (at once, not at the next
decision or housekeeping round, up to health.interval_s later), and a session id from the body is
stripped as a header value is (``" a"`` in ``user`` and ``a`` in the header are one session).
Real gateway, echo worker."""

from __future__ import annotations

from pathlib import Path

import httpx
import yaml

from tests.procs import ProcessGroup, free_port, wait_until


def _live(http: httpx.Client) -> float:
    line = next(x for x in http.get("/metrics").text.splitlines() if x.startswith("mesh_sessions_live "))
    return float(line.split()[1])


def test_live_sessions_drop_at_expiry_and_body_ids_are_stripped(procs: ProcessGroup, tmp_path: Path) -> None:
    echo = procs.echo_worker("e0")
    config = tmp_path / "mesh.yaml"
    config.write_text(yaml.safe_dump({"sessions": {"idle_ttl_s": 0.5}, "health": {"interval_s": 3600},
                                      "workers": [{"name": "e0", "url": echo.url, "models": ["echo"]}]}))
    gateway = procs.gateway(config, port=free_port())
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        body = {"model": "echo", "prompt": "hi", "max_tokens": 1}
        assert http.post("/v1/completions", json={**body, "user": " a "}).status_code == 200
        assert http.post("/v1/completions", json=body, headers={"x-session-id": "a"}).status_code == 200
        assert _live(http) == 1  # one session, not two
        wait_until(lambda: _live(http) == 0, timeout_s=10, what="the idle binding gone from the gauge")
