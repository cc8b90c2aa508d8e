"""A request the prefill/decode policy keeps on one decode worker ("prefill locally") is served
by that worker, never by a prefill worker: the gateway's ordinary path commits that decision
instead of deciding again (a second answer naming a pair, from a random tie-break in the decode
profile, would run the WHOLE request on the pair's prefill worker), and a pair reaching the
ordinary path is served whole by its decode worker (``Decision.served_whole``)."""

from __future__ import annotations

from pathlib import Path

import httpx
import yaml

from tests.procs import PYTHON, ProcessGroup, free_port

POLICY = {"name": "tests.plugins.hostile_policies:Redecider", "params": {"local": "d0", "prefill": "p0", "decode": "d1"}}


def test_a_local_decision_is_served_by_its_decode_worker_never_the_prefill_one(procs: ProcessGroup, tmp_path: Path) -> None:
    workers = {n: procs.echo_worker(n) for n in ("p0", "d0", "d1")}
    roles = {"p0": "prefill", "d0": "decode", "d1": "decode"}
    port = free_port()
    config = {"server": {"port": port, "admin_key": "adm"}, "policy": POLICY,
              "workers": [{"name": n, "url": p.url, "role": roles[n]} for n, p in workers.items()]}
    path = tmp_path / "pd.yaml"
    path.write_text(yaml.safe_dump(config))
    gateway = procs.start_http([PYTHON, "-m", "mesh", "serve", "--config", str(path), "--log-level", "warning"],
                               name="gateway", port=port, ready_path="/ready")
    served = []
    for i in range(6):
        resp = httpx.post(f"{gateway.url}/v1/completions", timeout=30,
                          json={"model": "echo", "prompt": f"hello {i}", "max_tokens": 2, "stream": bool(i % 2)})
        assert resp.status_code == 200, resp.text
        served.append((resp.headers.get("x-mesh-prefill-worker"), resp.headers["x-mesh-worker"]))
    # each request is one decision: the odd calls keep it on d0, the even ones relay p0 -> d1
    assert all(pair in ((None, "d0"), ("p0", "d1")) for pair in served), served
    assert ("p0", "d1") in served and (None, "d0") in served, served
