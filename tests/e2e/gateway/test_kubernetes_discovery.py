"""Kubernetes discovery end to end: a real gateway watching a fake API server
(``tests.fakes.kube_api``), real echo workers as the endpoints of its EndpointSlices (or pods).

What it proves: ready endpoints become workers that serve completions; an endpoint turning
unready, or its slice deleted, removes its worker; a terminating endpoint that still serves is
drained; a watch cut mid-stream is resumed from the last resourceVersion (no relist) and misses
nothing; a 410 Gone lists again and keeps the workers still there as they were (their health
check counters run on); an address the connect policy refuses never becomes a worker.
"""

from __future__ import annotations

import re
import shutil
import ssl
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.procs import PYTHON, Proc, ProcessGroup, free_port, wait_until

ADMIN = {"authorization": "Bearer adm"}
TOKEN = "sa-token-1"


def endpoint_slice(name: str, port: int, pods: list[tuple[str, str]], *, ready: bool = True,
                   labels: dict[str, str] | None = None, **conditions: bool) -> dict[str, Any]:
    """An EndpointSlice of ``pods`` ((pod name, address)), all on ``port`` (named http)."""
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
        "metadata": {"name": name, "namespace": "ml",
                     "labels": labels or {"app": "echo", "kubernetes.io/service-name": "echo"}},
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": [address], "conditions": {"ready": ready, **conditions},
                       "targetRef": {"kind": "Pod", "name": pod, "namespace": "ml"}} for pod, address in pods],
    }


class Cluster:
    """The fake API server, echo workers and a gateway discovering them."""

    def __init__(self, procs: ProcessGroup, resource: str = "endpointslices", tls: tuple[Path, Path] | None = None,
                 **discovery: Any) -> None:
        port = free_port()
        cmd = [PYTHON, "-m", "tests.fakes.kube_api", "--port", str(port), "--token", TOKEN]
        if tls is None:
            self.api: Proc = procs.start_http(cmd, name="kube-api", port=port)
            self.http = httpx.Client(timeout=10)
        else:  # an https API server with its own CA, as in a cluster
            self.api = procs.start([*cmd, "--certfile", str(tls[0]), "--keyfile", str(tls[1])], name="kube-api", port=port)
            self.http = httpx.Client(timeout=10, verify=ssl.create_default_context(cafile=str(tls[0])))
            wait_until(lambda: _answers(self.http, f"https://127.0.0.1:{port}/health"), timeout_s=30, what="https fake up")
        self.api_url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
        self.procs, self.resource, self.discovery = procs, resource, discovery

    def put(self, obj: dict[str, Any]) -> None:
        self.control("put", resource=self.resource, object=obj)

    def control(self, op: str, **body: Any) -> Any:
        resp = self.http.post(f"{self.api_url}/control/{op}", json=body)
        assert resp.status_code == 200, resp.text
        return resp.json()

    def log(self) -> list[dict[str, Any]]:
        return self.http.get(f"{self.api_url}/control/log").json()

    @property
    def token_file(self) -> Path:
        return Path(self.procs.log_dir) / "token"

    def gateway(self, env: dict[str, str] | None = None, **server: Any) -> Proc:
        self.token_file.write_text(TOKEN + "\n")
        kube = {"namespace": "ml", "selector": {"app": "echo"}, "port": "http", "resource": self.resource,
                "token_file": str(self.token_file), "backoff_max_s": 0.5, **self.discovery}
        kube.setdefault("api_server", self.api_url)
        config = {"server": {"admin_key": "adm", **server}, "health": {"interval_s": 0.3, "timeout_s": 2},
                  "discovery": {"kubernetes": {k: v for k, v in kube.items() if v is not None}}}
        path = Path(self.procs.log_dir) / "gateway.yaml"
        path.write_text(yaml.safe_dump(config))
        port = free_port()
        cmd = [PYTHON, "-m", "mesh.commands.serve", "--config", str(path), "--port", str(port), "--log-level", "warning"]
        self.gw = self.procs.start_http(cmd, name="gateway", port=port, env=env)
        return self.gw

    def view(self) -> dict[str, Any]:
        resp = self.http.get(f"{self.gw.url}/workers", headers=ADMIN)
        assert resp.status_code == 200, resp.text
        return resp.json()

    def healthy(self) -> set[str]:
        return {w["name"] for w in self.view()["workers"] if w["healthy"] and not w["draining"]}

    def names(self) -> set[str]:
        return {w["name"] for w in self.view()["workers"]}

    def wait_names(self, want: set[str], what: str) -> None:
        wait_until(lambda: self.names() == want, timeout_s=15, what=f"{what}: workers {sorted(want)}")

    def served_by(self, n: int = 6) -> set[str]:
        seen = set()
        for i in range(n):
            resp = self.http.post(f"{self.gw.url}/v1/completions", json={"model": "echo", "prompt": f"p{i}",
                                  "max_tokens": 2}, headers={"x-session-id": f"s{i}-{free_port()}"})
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["text"]
            seen.add(resp.headers["x-mesh-worker"])
        return seen

    def health_checks(self, worker: str) -> float:
        text = self.http.get(f"{self.gw.url}/metrics").text
        m = re.search(r'^mesh_health_checks_total\{result="ok",worker="%s"\} (\S+)$' % worker, text, re.M)
        return float(m.group(1)) if m else 0.0


def _answers(client: httpx.Client, url: str) -> bool:
    try:
        return client.get(url).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def echoes(module_procs: ProcessGroup) -> tuple[Proc, Proc]:
    """Two echo workers, shared by the tests (each test's gateway sees them anew)."""
    return tuple(module_procs.echo_worker(f"echo-w{i}", "--model", "echo", "--model", "tiny-chat")  # type: ignore[return-value]
                 for i in range(2))


@pytest.fixture
def cluster(procs: ProcessGroup) -> Cluster:
    return Cluster(procs)


def test_endpoints_become_workers_and_leave_with_their_readiness(cluster: Cluster, echoes: tuple[Proc, Proc]) -> None:
    w0, w1 = echoes
    # a second endpoint at the cloud metadata address: the connect policy keeps it out
    cluster.put(endpoint_slice("echo-a", w0.port, [("echo-0", "127.0.0.1"), ("meta-0", "169.254.169.254")]))
    cluster.put(endpoint_slice("echo-b", w1.port, [("echo-1", "127.0.0.1")]))
    cluster.put(endpoint_slice("other", w1.port, [("other-0", "127.0.0.1")], labels={"app": "other"}))
    cluster.gateway()
    wait_until(lambda: cluster.healthy() == {"echo-0", "echo-1"}, timeout_s=15, what="both discovered and healthy")
    view = cluster.view()
    assert {w["source"] for w in view["workers"]} == {"discovery"}
    assert {w["url"] for w in view["workers"]} == {w0.url, w1.url}
    assert view["discovery"]["kubernetes"]["state"] == "watching"
    refused = view["discovery"]["kubernetes"]["refused"]
    assert list(refused) == ["meta-0 (http://169.254.169.254:%d)" % w0.port], refused
    assert "169.254.169.254" in refused["meta-0 (http://169.254.169.254:%d)" % w0.port]
    assert "left out" in cluster.gw.log_tail(20_000)  # a WARNING, not silence
    assert wait_until(lambda: cluster.served_by() == {"echo-0", "echo-1"} or None, timeout_s=15, what="both serve")

    # MODIFIED: unready -> removed; ready again -> back, and serving
    cluster.put(endpoint_slice("echo-b", w1.port, [("echo-1", "127.0.0.1")], ready=False))
    cluster.wait_names({"echo-0"}, "unready endpoint removed")
    assert cluster.served_by() == {"echo-0"}
    cluster.put(endpoint_slice("echo-b", w1.port, [("echo-1", "127.0.0.1")]))
    wait_until(lambda: cluster.healthy() == {"echo-0", "echo-1"}, timeout_s=15, what="echo-1 back")

    # terminating but serving: drained (kept, takes no new requests)
    cluster.put(endpoint_slice("echo-b", w1.port, [("echo-1", "127.0.0.1")], ready=False, serving=True, terminating=True))
    wait_until(lambda: {w["name"]: w["draining"] for w in cluster.view()["workers"]} == {"echo-0": False, "echo-1": True},
               timeout_s=15, what="terminating endpoint drained")
    assert cluster.served_by() == {"echo-0"}

    # DELETED: the slice goes, its worker with it
    cluster.control("delete", resource="endpointslices", name="echo-b")
    cluster.wait_names({"echo-0"}, "deleted slice's worker removed")
    assert [e["verb"] for e in cluster.log()].count("list") == 1  # all of it over one list and its watch

    # The service account token rotates: the reconnect reads the new one from its file.
    cluster.token_file.write_text("sa-token-2\n")
    cluster.control("token", token="sa-token-2")
    cluster.control("drop")
    cluster.put(endpoint_slice("echo-b", w1.port, [("echo-1", "127.0.0.1")]))
    wait_until(lambda: cluster.healthy() == {"echo-0", "echo-1"}, timeout_s=15, what="seen with the rotated token")

    # A reload keeps the discovered workers; a changed discovery section needs a restart.
    resp = cluster.http.post(f"{cluster.gw.url}/admin/reload", headers=ADMIN)
    assert resp.status_code == 200 and resp.json()["workers"] == ["echo-0", "echo-1"], resp.text
    config_path = Path(cluster.procs.log_dir) / "gateway.yaml"
    config = yaml.safe_load(config_path.read_text())
    config["discovery"]["kubernetes"]["selector"] = {"app": "other"}
    config_path.write_text(yaml.safe_dump(config))
    resp = cluster.http.post(f"{cluster.gw.url}/admin/reload", headers=ADMIN)
    assert resp.status_code == 400 and "discovery.kubernetes" in resp.json()["error"]["message"], resp.text
    assert cluster.healthy() == {"echo-0", "echo-1"}


def test_dropped_watch_resumes_and_gone_relists_keeping_workers(cluster: Cluster, echoes: tuple[Proc, Proc]) -> None:
    w0, w1 = echoes
    cluster.put(endpoint_slice("echo-a", w0.port, [("echo-0", "127.0.0.1")]))
    cluster.gateway()
    wait_until(lambda: cluster.healthy() == {"echo-0"}, timeout_s=15, what="echo-0 discovered")

    # An event moves the gateway's resourceVersion past the list's.
    seen = str(cluster.control("put", resource="endpointslices",
                               object=endpoint_slice("echo-a", w0.port, [("echo-0", "127.0.0.1")]))["resourceVersion"])
    wait_until(lambda: cluster.view()["discovery"]["kubernetes"]["resource_version"] == seen, timeout_s=15,
               what="the MODIFIED event seen")
    # The watch is cut; a change made while it is down arrives through the watch resumed from there.
    cluster.control("drop")
    cluster.put(endpoint_slice("echo-b", w1.port, [("echo-1", "127.0.0.1")]))
    wait_until(lambda: cluster.healthy() == {"echo-0", "echo-1"}, timeout_s=15, what="echo-1 after the reconnect")
    log = cluster.log()
    assert [e["verb"] for e in log].count("list") == 1, log  # resumed, not listed again
    watches = [e["resourceVersion"] for e in log if e["verb"] == "watch"]
    assert watches[0] < int(seen) and watches[1:] == [int(seen)], (seen, watches)
    assert cluster.view()["discovery"]["kubernetes"]["watch_restarts"]["error"] >= 1

    # 410: echo-a disappears with no event; only a relist can tell. echo-1 stays as it was.
    wait_until(lambda: cluster.health_checks("echo-1") >= 3, timeout_s=15, what="echo-1 health checked")
    before = cluster.health_checks("echo-1")
    cluster.control("compact", resource="endpointslices", delete=["echo-a"])
    cluster.wait_names({"echo-1"}, "relist after 410 removes echo-0")
    assert [e["verb"] for e in cluster.log()].count("list") == 2
    state = cluster.view()["discovery"]["kubernetes"]
    assert state["watch_restarts"]["gone"] >= 1 and state["lists"] == 2
    assert cluster.health_checks("echo-1") >= before  # the same worker: its counters were never reset
    assert cluster.served_by(3) == {"echo-1"}
    metrics = cluster.http.get(f"{cluster.gw.url}/metrics").text
    assert re.search(r"^mesh_discovery_workers 1\.0$", metrics, re.M)
    assert re.search(r'^mesh_discovery_watch_restarts_total\{reason="gone"\} [1-9]', metrics, re.M)


def test_pods_with_role_and_model_metadata(procs: ProcessGroup, echoes: tuple[Proc, Proc]) -> None:
    cluster = Cluster(procs, resource="pods")
    w0 = echoes[0]

    def pod(ready: bool) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "worker-0", "namespace": "ml", "labels": {"app": "echo", "mesh.dev/role": "mixed"},
                             "annotations": {"mesh.dev/models": "tiny-chat", "mesh.dev/block-size": "32"}},
                "spec": {"containers": [{"name": "w", "ports": [{"name": "http", "containerPort": w0.port}]}]},
                "status": {"phase": "Running", "podIP": "127.0.0.1",
                           "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}

    cluster.put(pod(True))
    cluster.gateway()
    wait_until(lambda: cluster.healthy() == {"worker-0"}, timeout_s=15, what="pod discovered")
    worker = cluster.view()["workers"][0]
    assert (worker["models"], worker["block_size"], worker["url"]) == (["tiny-chat"], 32, w0.url)
    resp = cluster.http.post(f"{cluster.gw.url}/v1/completions", json={"model": "tiny-chat", "prompt": "hi", "max_tokens": 2})
    assert resp.status_code == 200, resp.text
    cluster.put(pod(False))
    cluster.wait_names(set(), "unready pod removed")


def test_serve_flags_turn_discovery_on_over_the_file(procs: ProcessGroup, cluster: Cluster, echoes: tuple[Proc, Proc]) -> None:
    """`mesh serve --service-discovery --selector ...` (sglang-router's flags): the file only names
    the API server; the flags choose what is watched."""
    cluster.put(endpoint_slice("echo-a", echoes[0].port, [("echo-0", "127.0.0.1")]))
    cluster.put(endpoint_slice("other", echoes[1].port, [("other-0", "127.0.0.1")], labels={"app": "other"}))
    token = Path(procs.log_dir) / "token"
    token.write_text(TOKEN)
    path = Path(procs.log_dir) / "api.yaml"
    path.write_text(yaml.safe_dump({"server": {"admin_key": "adm"}, "discovery": {"kubernetes": {
        "api_server": cluster.api_url, "selector": {"app": "nothing"}, "token_file": str(token)}}}))
    port = free_port()
    cluster.gw = procs.start_http([PYTHON, "-m", "mesh.commands.serve", "--config", str(path), "--port", str(port),
                                   "--service-discovery", "--selector", "app=other", "--service-discovery-namespace", "ml",
                                   "--service-discovery-port", "http"], name="gateway", port=port)
    # healthy, and its models known (a worker is healthy before its /v1/models answer is read)
    wait_until(lambda: {w["name"] for w in cluster.view()["workers"] if w["healthy"] and "echo" in w["models"]}
               == {"other-0"}, timeout_s=15, what="the flags' selector watched")
    assert cluster.served_by(2) == {"other-0"}


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")
def test_in_cluster_https_api_server_from_the_service_environment(procs: ProcessGroup, echoes: tuple[Proc, Proc]) -> None:
    """No api_server: the address comes from KUBERNETES_SERVICE_HOST/PORT, https verified
    against ca_file (the cluster's CA), the bearer token from token_file."""
    cert, key = Path(procs.log_dir) / "ca.crt", Path(procs.log_dir) / "ca.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=kube-api",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    cluster = Cluster(procs, tls=(cert, key), api_server=None, ca_file=str(cert))
    cluster.put(endpoint_slice("echo-a", echoes[0].port, [("echo-0", "127.0.0.1")]))
    port = cluster.api_url.rpartition(":")[2]
    cluster.gateway(env={"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": port})
    wait_until(lambda: cluster.healthy() == {"echo-0"}, timeout_s=15, what="discovered over https")
    assert cluster.view()["discovery"]["kubernetes"]["watching"].startswith(f"https://127.0.0.1:{port}/apis/")
