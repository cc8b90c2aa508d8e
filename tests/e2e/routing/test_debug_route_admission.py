"""/debug/route decides as the proxy routes: a target at its admission limit (max_in_flight) is
left out of the view. The built-in policies skip full targets themselves; a plugin that does not
is shown routing where the real request goes, never to the full target."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import yaml

from tests.procs import ProcessGroup, free_port, wait_until

ADMIN = {"authorization": "Bearer adm"}
PLUGIN = "tests.plugins.hostile_policies:Misbehaving"  # always picks its `good` worker


def test_debug_route_leaves_out_a_full_target_as_routing_does(procs: ProcessGroup, tmp_path: Path) -> None:
    slow = ["--token-delay-s", "0.05"]
    e0, e1 = procs.echo_worker("e0", *slow), procs.echo_worker("e1", *slow)
    config = tmp_path / "mesh.yaml"
    config.write_text(yaml.safe_dump({
        "server": {"admin_key": "adm", "request_timeout_s": 60},
        "policy": {"name": PLUGIN, "params": {"good": "e0"}},
        "workers": [{"name": n, "url": p.url, "models": ["echo"], "max_in_flight": 1} for n, p in (("e0", e0), ("e1", e1))],
    }))
    gateway = procs.gateway(config, port=free_port())
    body = {"model": "echo", "prompt": "hello there", "max_tokens": 2}
    with httpx.Client(base_url=gateway.url, timeout=60) as http:
        assert http.post("/debug/route", json=body).json()["decision"]["target"] == "e0"
        long_turn = threading.Thread(target=lambda: httpx.post(
            gateway.url + "/v1/completions", timeout=60, json={**body, "prompt": "one two three " * 20, "max_tokens": 40}))
        long_turn.start()
        in_flight = lambda: {w["name"]: w["targets"][0]["in_flight"] for w in http.get("/workers", headers=ADMIN).json()["workers"]}  # noqa: E731
        wait_until(lambda: in_flight()["e0"] == 1, what="e0 full")
        debug = http.post("/debug/route", json=body).json()
        served = http.post("/v1/completions", json=body)
        long_turn.join()
        assert served.status_code == 200
        assert debug["decision"]["target"] == served.headers["x-mesh-worker"] == "e1"


def test_debug_route_previews_without_drawing_the_policys_ties(procs: ProcessGroup, tmp_path: Path) -> None:
    """A preview leaves the policy and the router's RNG as it found them (Router.preview): kv_aware's random tie-break and
    round_robin's cursor. Each preview names where the next identical request really goes (a
    preview never consumes the live request's tie-break draw)."""
    e0, e1, e2 = (procs.echo_worker(n) for n in ("e0", "e1", "e2"))
    workers = [{"name": n, "url": p.url, "models": ["echo"]} for n, p in (("e0", e0), ("e1", e1), ("e2", e2))]
    body = {"model": "echo", "prompt": "x", "max_tokens": 1}  # shorter than a block: no prefix, all tie
    for policy in ("kv_aware", "round_robin"):
        config = tmp_path / f"mesh-{policy if isinstance(policy, str) else policy['name']}.yaml"
        config.write_text(yaml.safe_dump({"server": {"admin_key": "adm"}, "policy": policy, "workers": workers}))
        gateway = procs.gateway(config, port=free_port())
        with httpx.Client(base_url=gateway.url, timeout=60) as http:
            admin = {"authorization": "Bearer adm"}
            wait_until(lambda: sum(w["healthy"] for w in http.get("/workers", headers=admin).json()["workers"]) == 3,
                       what="three healthy workers")
            shown, served = [], []
            for _ in range(24):  # all 24 ties drawn among two of three: p = 3 * (2/3)^24 < 2e-4
                shown.append(http.post("/debug/route", json=body).json()["decision"]["target"])
                http.post("/debug/route", json=body)  # a second look changes nothing either
                served.append(http.post("/v1/completions", json=body).headers["x-mesh-worker"])
        assert shown == served, policy
        assert len(set(served)) == 3, served  # the ties (or the rotation) really spread
