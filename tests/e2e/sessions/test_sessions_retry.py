"""A retried request keeps its session pinned: the retry's lease is committed with the session
(without binding it), so a retried turn longer than ``sessions.idle_ttl_s`` does not expire its
own binding mid-turn (a concurrent turn would then route as a new session). Real gateway and
echo workers; the first worker answers 500 (a retry), the second streams slowly."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import yaml

from tests.procs import ProcessGroup, free_port, wait_until

ADMIN = {"authorization": "Bearer adm"}


def test_a_retried_turn_longer_than_the_idle_time_keeps_its_session(procs: ProcessGroup, tmp_path: Path) -> None:
    workers = {name: procs.echo_worker(name) for name in ("e0", "e1")}
    config = tmp_path / "mesh.yaml"
    config.write_text(yaml.safe_dump({
        "server": {"admin_key": "adm"},
        "sessions": {"idle_ttl_s": 1.0},
        "health": {"interval_s": 3600},
        "workers": [{"name": n, "url": p.url, "models": ["echo"]} for n, p in workers.items()],
    }))
    gateway = procs.gateway(config, port=free_port())
    with httpx.Client(base_url=gateway.url, timeout=60) as http:
        first = http.post("/v1/completions", json={"model": "echo", "prompt": "turn one", "max_tokens": 2},
                          headers={"x-session-id": "s"})
        bound = first.headers["x-mesh-worker"]
        other = next(n for n in workers if n != bound)
        httpx.post(workers[bound].url + "/admin/faults", json={"fail_rate": 1.0}, timeout=10).raise_for_status()
        httpx.post(workers[other].url + "/admin/faults", json={"token_delay_s": 0.1}, timeout=10).raise_for_status()
        done: list[httpx.Response] = []
        body = {"model": "echo", "prompt": " ".join(["word"] * 30), "max_tokens": 30, "stream": True}  # ~3 s on the retry
        turn = threading.Thread(target=lambda: done.append(
            httpx.post(gateway.url + "/v1/completions", json=body, headers={"x-session-id": "s"}, timeout=60)))
        turn.start()

        def bound_now() -> str | None:
            route = http.post("/debug/route", json={"model": "echo", "prompt": "probe"}, headers={"x-session-id": "s"})
            return route.json()["session"]["bound_target"]  # type: ignore[no-any-return]

        # Past the idle time, well inside the retried stream: the session is still bound.
        def streaming_on_other() -> bool:
            listed = http.get("/workers", headers=ADMIN).json()["workers"]
            return any(t["in_flight"] for w in listed if w["name"] == other for t in w["targets"])

        wait_until(streaming_on_other, what="the retry streaming on the other worker")
        threading.Event().wait(1.6)  # > idle_ttl_s with the retry still streaming (3 s)
        assert turn.is_alive(), "the retried stream ended too soon for this test"
        assert bound_now() is not None  # not expired mid-turn
        turn.join()
        assert done[0].status_code == 200 and done[0].headers["x-mesh-worker"] == other
        assert bound_now() == other  # bound to the worker that served it, once it did
