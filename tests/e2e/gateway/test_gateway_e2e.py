"""End to end: a real gateway process in front of real echo worker processes.

The official ``openai`` client (streaming and not), x-mesh-worker, /v1/models, /debug/route,
/metrics, the admin API (add, drain, remove, auth), retries when a worker is killed mid-run,
SSE error events after a mid-stream crash, no-healthy-worker 503, client
disconnects cancelling the upstream, config reload (endpoint and SIGHUP), and ``mesh up``.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from tests.procs import PYTHON, ProcessGroup, free_port, kill_process, stop_process, wait_http, wait_until

ADMIN = {"authorization": "Bearer admin-secret"}
WORKERS = ("e0", "e1", "e2")
CHAT = {"model": "echo", "messages": [{"role": "user", "content": "hello mesh gateway"}]}


def write_config(path: Path, workers: dict[str, str], **extra: Any) -> Path:
    data = {
        "server": {"admin_key": "admin-secret", "request_timeout_s": 30},
        "workers": [{"name": n, "url": u} for n, u in workers.items()],
        "health": {"interval_s": 0.3, "timeout_s": 1, "unhealthy_threshold": 1},
        "circuit_breaker": {"failure_threshold": 2, "open_s": 30},
        "retries": {"max_attempts": 3, "backoff_base_s": 0.01},
        "policy": "round_robin",
        **extra,
    }
    path.write_text(yaml.safe_dump(data))
    return path


class Cluster:
    def __init__(self, procs: ProcessGroup, config: Path, gateway: Any, extra: dict[str, Any]) -> None:
        self.procs = procs
        self.config = config
        self.gateway = gateway
        self.url = gateway.url
        self.extra = extra  # name -> echo worker Proc, not registered at start
        self.http = httpx.Client(base_url=self.url, timeout=30)

    def workers(self) -> dict[str, dict[str, Any]]:
        resp = self.http.get("/workers", headers=ADMIN)
        assert resp.status_code == 200, resp.text
        return {w["name"]: w for w in resp.json()["workers"]}

    def add(self, name: str, **fields: Any) -> httpx.Response:
        return self.http.post("/workers", json={"name": name, "url": self.extra[name].url, **fields}, headers=ADMIN)

    def metric(self, line_prefix: str) -> float:
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith(line_prefix + " "):
                return float(line.split()[-1])
        return 0.0


def start_echo_workers(procs: ProcessGroup, specs: dict[str, list[str]]) -> dict[str, Any]:
    """Start all, then wait for all (in parallel: process start-up dominates test time)."""
    started = {}
    for name, extra in specs.items():
        port = free_port()
        cmd = [PYTHON, "-m", "mesh.echo_worker", "--port", str(port), "--name", name, *extra]
        started[name] = procs.start(cmd, name=name, port=port)
    for proc in started.values():
        wait_http(proc.url + "/health", proc=proc, timeout_s=60)
    for name, proc in started.items():  # each port is answered by the worker started for it
        owner = httpx.get(proc.url + "/v1/models", timeout=10).json()["data"][0]["owned_by"]
        assert owner == name, f"{proc.url} is served by {owner}, not {name}"
    return started


@pytest.fixture(scope="module")
def cluster(module_procs: ProcessGroup) -> Iterator[Cluster]:
    specs = {name: [] for name in WORKERS}
    specs |= {
        "e3": [],
        "crashy": ["--model", "crashy", "--crash-after-tokens", "2"],
        "slow": ["--model", "slow", "--first-token-delay-s", "2"],
        "drip": ["--model", "drip", "--token-delay-s", "0.1"],
        "flaky": ["--model", "pair", "--fail-rate", "1"],
        "poisoned-a": ["--model", "poison", "--fail-on", "POISON"],
        "poisoned-b": ["--model", "poison", "--fail-on", "POISON"],
        "steady": ["--model", "pair"],
    }
    echo = start_echo_workers(module_procs, specs)
    config = write_config(module_procs.log_dir / "mesh.yaml", {n: echo[n].url for n in WORKERS})
    gateway = module_procs.gateway(config, port=free_port(), ready_path="/ready")
    c = Cluster(module_procs, config, gateway, {n: p for n, p in echo.items() if n not in WORKERS})
    wait_until(lambda: all(w["healthy"] for w in c.workers().values()), what="all workers healthy")
    yield c
    c.http.close()


def test_openai_client_non_streaming(cluster: Cluster) -> None:
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(model="echo", messages=CHAT["messages"])
    assert raw.headers["x-mesh-worker"] in WORKERS
    assert raw.headers["x-echo-worker"] == raw.headers["x-mesh-worker"]  # the named worker really served it
    chat = raw.parse()
    assert chat.choices[0].message.content == "hello mesh gateway"
    assert chat.usage is not None and chat.usage.prompt_tokens > 0
    assert chat.usage.prompt_tokens_details is not None and chat.usage.prompt_tokens_details.cached_tokens == 0
    completion = client.completions.create(model="echo", prompt="one two three", max_tokens=2)
    assert completion.choices[0].text == "one two " and completion.choices[0].finish_reason == "length"


def test_openai_client_streaming(cluster: Cluster) -> None:
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model="echo", messages=[{"role": "user", "content": "a b c d e"}], stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "a b c d e"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    pieces = list(client.completions.create(model="echo", prompt="x y z", stream=True))
    assert "".join(p.choices[0].text for p in pieces) == "x y z"


def test_round_robin_spreads_and_names_the_worker(cluster: Cluster) -> None:
    served = [cluster.http.post("/v1/chat/completions", json=CHAT).headers["x-mesh-worker"] for _ in range(9)]
    assert sorted(set(served)) == list(WORKERS)


def test_models_is_the_union_of_healthy_workers(cluster: Cluster) -> None:
    data = cluster.http.get("/v1/models").json()
    assert data["object"] == "list" and [m["id"] for m in data["data"]] == ["echo"]


def test_debug_route_explains_and_commits_nothing(cluster: Cluster) -> None:
    before = cluster.metric('mesh_requests_total{route="chat",status="200"}')
    sessions_before = cluster.metric("mesh_sessions")
    resp = cluster.http.post("/debug/route", json=CHAT, headers={"x-session-id": "debug-only"})
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["decision"]["target"] in WORKERS and out["decision"]["reason"]
    assert set(out["decision"]["candidates"]) <= set(WORKERS)
    assert out["policy"]["name"] == "round_robin"
    assert out["request"]["model"] == "echo" and out["request"]["prompt_tokens"] > 0
    assert out["request"]["session_id"] and out["request"]["session_id"] != "debug-only"  # hashed
    assert cluster.metric('mesh_requests_total{route="chat",status="200"}') == before
    assert cluster.metric("mesh_sessions") == sessions_before
    assert all(t["in_flight"] == 0 for w in cluster.workers().values() for t in w["targets"])


def test_metrics_exposes_mesh_series(cluster: Cluster) -> None:
    cluster.http.post("/v1/chat/completions", json=CHAT)
    text = cluster.http.get("/metrics").text
    for series in (
        'mesh_requests_total{route="chat",status="200"}',
        'mesh_worker_healthy{worker="e0"} 1.0',
        'mesh_circuit_open{worker="e0"} 0.0',
        "mesh_worker_in_flight{",
        "mesh_ttfb_seconds_bucket{",
        "mesh_routing_decision_seconds_count",
        "mesh_session_moves_total",
    ):
        assert series in text, series


def test_admin_requires_the_admin_key(cluster: Cluster) -> None:
    assert cluster.http.get("/workers").status_code == 401
    bad = cluster.http.get("/workers", headers={"authorization": "Bearer nope"})
    assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
    assert cluster.http.post("/admin/reload").status_code == 401


def test_admin_add_drain_remove(cluster: Cluster) -> None:
    resp = cluster.add("e3")
    assert resp.status_code == 201, resp.text
    assert resp.json()["healthy"] is True and resp.json()["models"] == ["echo"]
    assert cluster.add("e3").status_code == 409
    served = {cluster.http.post("/v1/chat/completions", json=CHAT).headers["x-mesh-worker"] for _ in range(8)}
    assert "e3" in served

    assert cluster.http.post("/workers/e3/drain", headers=ADMIN).json()["draining"] is True
    served = {cluster.http.post("/v1/chat/completions", json=CHAT).headers["x-mesh-worker"] for _ in range(8)}
    assert "e3" not in served
    assert cluster.http.post("/workers/e3/drain?undo=true", headers=ADMIN).json()["draining"] is False

    assert cluster.http.delete("/workers/e3", headers=ADMIN).status_code == 200
    assert "e3" not in cluster.workers()
    assert cluster.http.delete("/workers/e3", headers=ADMIN).status_code == 404


@pytest.mark.parametrize(
    ("body", "status", "text"),
    [
        ({"name": "x1", "url": "ftp://127.0.0.1:1"}, 400, "scheme 'ftp'"),
        ({"name": "x2", "url": "http://h:1/\r\nx-injected: 1"}, 422, "control characters"),
        ({"name": "bad name", "url": "http://h:1"}, 422, "worker name"),
        ({"name": "x3"}, 422, "url"),
        ({"name": "x4", "url": "http://h:1", "role": "chef"}, 422, "role"),
    ],
)
def test_admin_rejects_bad_workers(cluster: Cluster, body: dict[str, Any], status: int, text: str) -> None:
    resp = cluster.http.post("/workers", json=body, headers=ADMIN)
    assert resp.status_code == status, resp.text
    assert text in resp.json()["error"]["message"]
    assert body.get("name") not in cluster.workers()


def sse_events(raw: str) -> list[str]:
    return [line[len("data: ") :] for line in raw.splitlines() if line.startswith("data: ")]


def test_crash_mid_stream_ends_with_an_error_event(cluster: Cluster) -> None:
    assert cluster.add("crashy", models=["crashy"]).status_code == 201
    try:
        body = {"model": "crashy", "prompt": "one two three four five", "stream": True}
        with cluster.http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200 and resp.headers["x-mesh-worker"] == "crashy"
            events = sse_events(resp.read().decode())
        assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["one ", "two "]
        assert json.loads(events[-2])["error"]["type"] == "upstream_error"
        assert events[-1] == "[DONE]"
        assert cluster.http.get("/health").status_code == 200  # the gateway keeps serving
    finally:
        cluster.http.delete("/workers/crashy", headers=ADMIN)


def test_no_healthy_worker_is_503(cluster: Cluster) -> None:
    resp = cluster.http.post("/workers", json={"name": "ghost", "url": f"http://127.0.0.1:{free_port()}", "models": ["ghost"]}, headers=ADMIN)
    assert resp.status_code == 201 and resp.json()["healthy"] is False
    try:
        out = cluster.http.post("/v1/chat/completions", json={**CHAT, "model": "ghost"})
        assert out.status_code == 503 and out.json()["error"]["code"] == "no_healthy_worker"
    finally:
        cluster.http.delete("/workers/ghost", headers=ADMIN)


def test_worker_500_is_retried_elsewhere_and_opens_its_circuit(cluster: Cluster) -> None:
    assert cluster.add("flaky", models=["pair"]).status_code == 201
    assert cluster.add("steady", models=["pair"]).status_code == 201
    try:
        before = cluster.metric('mesh_retries_total{reason="status_500"}')
        body = {"model": "pair", "prompt": "p q"}
        results = [cluster.http.post("/v1/completions", json=body) for _ in range(6)]
        assert all(r.status_code == 200 and r.headers["x-mesh-worker"] == "steady" for r in results)
        assert cluster.metric('mesh_retries_total{reason="status_500"}') >= before + 1
        workers = cluster.workers()
        assert workers["flaky"]["circuit"] == "open" and "500" in workers["flaky"]["last_error"]
        assert workers["steady"]["circuit"] == "closed"
    finally:
        cluster.http.delete("/workers/flaky", headers=ADMIN)
        cluster.http.delete("/workers/steady", headers=ADMIN)


def test_a_request_that_fails_everywhere_opens_no_circuit(cluster: Cluster) -> None:
    # Both workers answer 500 to any prompt containing POISON (an input that crashes every
    # worker). Retried on each, it fails: the client gets the worker's 500, but the workers stay
    # in service for everyone else (threshold 2: three poison requests would have opened both).
    assert cluster.add("poisoned-a", models=["poison"]).status_code == 201
    assert cluster.add("poisoned-b", models=["poison"]).status_code == 201
    try:
        for _ in range(3):
            out = cluster.http.post("/v1/completions", json={"model": "poison", "prompt": "a POISON b"})
            assert out.status_code == 500 and out.json()["error"]["type"] == "server_error"
        workers = cluster.workers()
        assert workers["poisoned-a"]["circuit"] == "closed" and workers["poisoned-b"]["circuit"] == "closed"
        served = {cluster.http.post("/v1/completions", json={"model": "poison", "prompt": "fine"}).headers["x-mesh-worker"]
                  for _ in range(4)}
        assert served == {"poisoned-a", "poisoned-b"}
    finally:
        cluster.http.delete("/workers/poisoned-a", headers=ADMIN)
        cluster.http.delete("/workers/poisoned-b", headers=ADMIN)


def raw_request(port: int, body: dict[str, Any]) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(data), data))
    return sock


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_cancels_the_upstream(cluster: Cluster, stream: bool) -> None:
    assert cluster.add("drip", models=["drip"]).status_code == 201
    try:
        in_flight = lambda: cluster.workers()["drip"]["targets"][0]["in_flight"]  # noqa: E731
        # 60 tokens at 0.1 s each: the full answer would take 6 s.
        sock = raw_request(cluster.gateway.port, {"model": "drip", "prompt": "w " * 60, "max_tokens": 60, "stream": stream})
        if stream:
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        else:
            wait_until(lambda: in_flight() == 1, what="request in flight")
            time.sleep(0.2)
        start = time.monotonic()
        sock.close()
        wait_until(lambda: in_flight() == 0, timeout_s=5, what="lease released after disconnect")
        assert time.monotonic() - start < 5
        assert cluster.metric("mesh_client_disconnects_total") >= 1
    finally:
        cluster.http.delete("/workers/drip", headers=ADMIN)


def test_reload_endpoint_and_sighup(cluster: Cluster) -> None:
    original = cluster.config.read_text()
    policy = lambda: cluster.http.post("/debug/route", json=CHAT).json()["policy"]["name"]  # noqa: E731
    try:
        cluster.config.write_text(original.replace("round_robin", "no_such_policy"))
        resp = cluster.http.post("/admin/reload", headers=ADMIN)
        assert resp.status_code == 400 and "no_such_policy" in resp.json()["error"]["message"]
        assert policy() == "round_robin"  # the broken file changed nothing

        cluster.config.write_text(original.replace("round_robin", "power_of_two"))
        resp = cluster.http.post("/admin/reload", headers=ADMIN)
        assert resp.status_code == 200 and resp.json()["policy"]["name"] == "power_of_two"
        assert policy() == "power_of_two"
        assert set(cluster.workers()) >= set(WORKERS)  # static workers kept

        cluster.config.write_text(original + "sessions: {max_sessions: 7}\n")  # the table follows a reload
        assert cluster.http.post("/admin/reload", headers=ADMIN).status_code == 200
        route = cluster.http.post("/debug/route", json=CHAT, headers={"x-session-id": "r"}).json()
        assert route["session"]["max_sessions"] == 7

        cluster.config.write_text(original)
        cluster.gateway.popen.send_signal(signal.SIGHUP)
        wait_until(lambda: policy() == "round_robin", what="SIGHUP reload")
    finally:
        cluster.config.write_text(original)
        cluster.http.post("/admin/reload", headers=ADMIN)


def test_killed_worker_requests_are_retried_elsewhere(procs: ProcessGroup) -> None:
    """SIGKILL one of three workers while 24 requests are in flight.

    Non-streaming requests never sent a byte to the client, so every one must succeed (on another
    worker); streaming ones either complete or end with an error event and [DONE].
    """
    names = ("k0", "k1", "k2")
    echo = start_echo_workers(procs, {n: ["--token-delay-s", "0.05"] for n in names})
    config = write_config(procs.log_dir / "kill.yaml", {n: echo[n].url for n in names})
    gateway = procs.gateway(config, port=free_port(), ready_path="/ready")
    http = httpx.Client(base_url=gateway.url, timeout=30)
    wait_until(lambda: all(w["healthy"] for w in http.get("/workers", headers=ADMIN).json()["workers"]), what="healthy")
    words = " ".join(f"w{i}" for i in range(16))  # 16 tokens x 0.05 s = 0.8 s per request

    def one(i: int) -> tuple[bool, int, str, str]:
        stream = i % 2 == 1
        body = {"model": "echo", "prompt": words, "max_tokens": 16, "stream": stream}
        if not stream:
            resp = http.post("/v1/completions", json=body)
            text = resp.json()["choices"][0]["text"] if resp.status_code == 200 else resp.text
            return stream, resp.status_code, resp.headers.get("x-mesh-worker", ""), text
        with http.stream("POST", "/v1/completions", json=body) as resp:
            return stream, resp.status_code, resp.headers.get("x-mesh-worker", ""), resp.read().decode()

    try:
        with concurrent.futures.ThreadPoolExecutor(24) as pool:
            futures = [pool.submit(one, i) for i in range(24)]
            wait_until(
                lambda: sum(t["in_flight"] for w in http.get("/workers", headers=ADMIN).json()["workers"] for t in w["targets"]) >= 12,
                what="requests in flight",
            )
            kill_process(echo["k1"])
            results = [f.result() for f in futures]
        for stream, status, worker, text in results:
            assert status == 200, text
            if not stream:
                assert text == words and worker != "k1"
            else:
                events = sse_events(text)
                assert events[-1] == "[DONE]"
                if worker == "k1":
                    assert json.loads(events[-2])["error"]["type"] == "upstream_error"
                else:
                    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == words
        retried = sum(
            float(line.split()[-1]) for line in http.get("/metrics").text.splitlines() if line.startswith("mesh_retries_total{")
        )
        assert retried >= 1
        after = [http.post("/v1/completions", json={"model": "echo", "prompt": "ok", "max_tokens": 1}) for _ in range(6)]
        assert all(r.status_code == 200 and r.headers["x-mesh-worker"] != "k1" for r in after)
    finally:
        http.close()


def test_mesh_up_serves_and_stops_cleanly(procs: ProcessGroup) -> None:
    port = free_port()
    up = procs.start([PYTHON, "-m", "mesh.commands.up", "--engine", "echo", "--workers", "2", "--port", str(port)],
                     name="up", port=port)
    wait_http(f"http://127.0.0.1:{port}/ready", proc=up, timeout_s=90)
    resp = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=CHAT, timeout=30)
    assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] == "hello mesh gateway"
    wait_until(lambda: "curl http://127.0.0.1:" in up.log_tail(), what="banner printed")
    worker_ports = [int(p) for p in re.findall(r"worker-\d+:(\d+)", up.log_tail())]
    assert len(worker_ports) == 2
    assert stop_process(up, signal.SIGTERM) == 0
    for wp in worker_ports:  # the workers went down with it
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{wp}/health", timeout=2)
