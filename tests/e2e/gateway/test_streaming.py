"""Streaming, cancellation and retry semantics of a real gateway process.

A raw-socket fake worker (it can break a stream anywhere) and an echo worker serve model ``m``;
only the fake serves ``f``. The first word of a request's prompt picks the fake's misbehaviour.
What a client must see: a stream that breaks mid-event ends with a clean SSE error event (the
partial event is never relayed); a 200 without a body is retried elsewhere, never relayed; a
client leaving during the retry back-off sends nothing more upstream.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import yaml

from tests.fakes import streaming_worker
from tests.procs import PYTHON, Proc, ProcessGroup, free_port, wait_http, wait_until
from tests.support.sse import sse_data

ADMIN = {"authorization": "Bearer adm"}


@dataclass
class Cluster:
    http: httpx.Client
    gateway: Proc
    fake: Proc
    echo: Proc
    big: Proc
    tiny: Proc

    def metric(self, prefix: str) -> float:
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith(prefix + " "):
                return float(line.split()[-1])
        return 0.0

    def workers(self) -> dict[str, dict[str, Any]]:
        return {w["name"]: w for w in self.http.get("/workers", headers=ADMIN).json()["workers"]}

    def fake_count(self, what: str = "posts") -> int:
        return int(httpx.get(self.fake.url + "/count", timeout=10).json()[what])

    def echo_served(self) -> int:
        return int(httpx.post(self.echo.url + "/admin/faults", json={}, timeout=10).json()["served"])


@pytest.fixture(scope="module")
def cluster(module_procs: ProcessGroup) -> Iterator[Cluster]:
    script = module_procs.log_dir / "fake_worker.py"
    script.write_text(streaming_worker.SCRIPT)
    fport, eport, bport, tport, gport = free_port(), free_port(), free_port(), free_port(), free_port()
    # a bundled engine worker (started first: it takes longest)
    tiny = module_procs.start([PYTHON, "-m", "workers.server.cli", "--preset", "tiny", "--host", "127.0.0.1", "--port", str(tport),
                               "--block-size", "16", "--num-kv-blocks", "512", "--cpu-threads", "1",
                               "--max-model-len", "8192", "--log-level", "warning"], name="tiny", port=tport)
    fake = module_procs.start([PYTHON, str(script), str(fport)], name="fake", port=fport)
    echo = module_procs.start([PYTHON, "-m", "mesh.echo_worker", "--port", str(eport), "--name", "echo", "--model", "m"],
                              name="echo", port=eport)
    # a large answer from a small prompt: each 1 KiB word, 4000 times over (about 4.5 MB of SSE per word)
    big = module_procs.start([PYTHON, "-m", "mesh.echo_worker", "--port", str(bport), "--name", "big", "--model", "big",
                              "--repeat", "4000"], name="big", port=bport)
    for proc in (fake, echo, big, tiny):
        wait_http(proc.url + "/health", proc=proc, timeout_s=120)
    config = module_procs.log_dir / "mesh.yaml"
    config.write_text(yaml.safe_dump({
        "server": {"admin_key": "adm", "request_timeout_s": 60},
        "circuit_breaker": {"failure_threshold": 10_000, "open_s": 1},  # the fake fails on purpose, often
        # a long back-off: a client leaves inside it
        "retries": {"max_attempts": 2, "backoff_base_s": 1.0, "backoff_max_s": 1.0},
        "policy": "round_robin",
        "workers": [{"name": "fake", "url": fake.url, "models": ["m", "f"]}, {"name": "echo", "url": echo.url, "models": ["m"]},
                    {"name": "big", "url": big.url, "models": ["big"]},
                    {"name": "tiny", "url": tiny.url, "models": ["tiny"], "block_size": 16}],
    }))
    gateway = module_procs.gateway(config, port=gport, ready_path="/ready")
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        c = Cluster(client, gateway, fake, echo, big, tiny)
        wait_until(lambda: all(w["healthy"] for w in c.workers().values()), what="both workers healthy")
        yield c


def test_a_stream_broken_mid_event_ends_with_a_clean_error_event(cluster: Cluster) -> None:
    # The worker dies after sending the first 30 bytes of an event: those bytes are not relayed
    # with the error event glued onto them ('data: {"id":"x","object":"textdata: {"error":...').
    before = cluster.metric("mesh_stream_errors_total")
    with cluster.http.stream("POST", "/v1/completions", json={"model": "f", "prompt": "partial", "stream": True}) as resp:
        assert resp.status_code == 200
        events = sse_data(resp.read())
    assert json.loads(events[0])["choices"][0]["text"] == "a"
    error = json.loads(events[1])["error"]
    assert error["type"] == "upstream_error" and "mid-stream" in error["message"]
    assert events[2:] == ["[DONE]"]
    assert cluster.metric("mesh_stream_errors_total") == before + 1
    assert "stream broke" in cluster.workers()["fake"]["last_error"]  # counted toward its circuit breaker


def test_a_complete_stream_whose_framing_breaks_after_done_is_not_an_error(cluster: Cluster) -> None:
    # [DONE] had reached the client; an error event after it is garbage to every SSE client.
    with cluster.http.stream("POST", "/v1/completions", json={"model": "f", "prompt": "donenofinal", "stream": True}) as resp:
        events = sse_data(resp.read())
    assert len(events) == 2 and events[-1] == "[DONE]", events


@pytest.mark.parametrize("mode", ["empty200", "close200"])
def test_a_200_without_a_body_is_retried_not_relayed(cluster: Cluster, mode: str) -> None:
    # A non-streamed 200 with an empty body (or a head then a close) reached the client as an
    # empty 200: unparseable, and never retried. Round robin: one of two requests meets the fake first.
    before = cluster.fake_count()
    results = [cluster.http.post("/v1/completions", json={"model": "m", "prompt": f"{mode} one two"}) for _ in range(2)]
    assert cluster.fake_count() > before
    for resp in results:
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-mesh-worker"] == "echo"
        assert resp.json()["choices"][0]["text"] == f"{mode} one two"


def test_a_200_without_a_body_and_nowhere_else_to_go_is_a_502(cluster: Cluster) -> None:
    resp = cluster.http.post("/v1/completions", json={"model": "f", "prompt": "empty200"})
    assert resp.status_code == 502, resp.text
    assert resp.json()["error"]["type"] == "upstream_error"


def _raw_request(port: int, body: dict[str, Any], rcvbuf: int = 0) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%s" % (len(data), data))
    return sock


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_leaving_during_the_retry_back_off_sends_nothing_more_upstream(cluster: Cluster, stream: bool) -> None:
    retries = 'mesh_retries_total{reason="status_500"}'
    body = {"model": "m", "prompt": "err500 then echo", "stream": stream}
    for _ in range(4):  # round robin: until an attempt meets the fake (500) first
        before, served = cluster.metric(retries), cluster.echo_served()
        sock = _raw_request(cluster.gateway.port, body)
        sock.settimeout(10)
        in_back_off = wait_until(lambda: "back-off" if cluster.metric(retries) > before else
                                 ("answered" if cluster.echo_served() > served else None), what="an attempt")
        if in_back_off == "back-off":
            break
        sock.recv(65536)
        sock.close()
    else:
        raise AssertionError("no attempt met the failing worker first")
    disconnects = cluster.metric("mesh_client_disconnects_total")
    served = cluster.echo_served()
    sock.close()  # inside the 0.5-1 s back-off
    wait_until(lambda: cluster.metric("mesh_client_disconnects_total") > disconnects, what="the disconnect seen")
    # the disconnect is counted only where the handler was cancelled: no attempt came after it
    assert cluster.echo_served() == served
    assert all(t["in_flight"] == 0 for w in cluster.workers().values() for t in w["targets"])


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_a_client_that_stops_reading_holds_bounded_memory_and_stalls_nobody(cluster: Cluster) -> None:
    word = "w" * 1024
    body = {"model": "big", "prompt": word, "max_tokens": 4000, "stream": True}  # about 4.5 MB of SSE
    assert cluster.http.post("/v1/completions", json={**body, "max_tokens": 100}).status_code == 200  # warm
    base = _rss_kib(cluster.gateway.pid)
    stalled = [_raw_request(cluster.gateway.port, {**body, "prompt": f"{word} {i}", "max_tokens": 8000}, rcvbuf=4096)
               for i in range(2)]  # 2 x 9 MB answers nobody reads
    # and 2 endless ones, written as fast as the gateway takes them (unbounded, it would take GBs)
    stalled += [_raw_request(cluster.gateway.port, {"model": "f", "prompt": "flood", "stream": True}, rcvbuf=4096)
                for _ in range(2)]
    try:
        for sock in stalled:
            assert sock.recv(64).startswith(b"HTTP/1.1 200")
        peak = base
        for i in range(40):  # meanwhile other clients are served, whole
            peak = max(peak, _rss_kib(cluster.gateway.pid))
            with cluster.http.stream("POST", "/v1/completions", json={**body, "prompt": f"other{i} x", "max_tokens": 2}) as resp:
                events = sse_data(resp.read())
            assert events[-1] == "[DONE]" and "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == f"other{i} x "
        peak = max(peak, _rss_kib(cluster.gateway.pid))
        assert peak - base < 64 * 1024, f"gateway RSS grew {(peak - base) >> 10} MiB for answers nobody read"
    finally:
        for sock in stalled:
            sock.close()
    wait_until(lambda: all(cluster.workers()[w]["targets"][0]["in_flight"] == 0 for w in ("big", "fake")),
               what="stalled streams cancelled")


async def _streams(url: str, n: int) -> list[tuple[str, list[str]]]:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:

        async def one(i: int) -> tuple[str, list[str]]:
            prompt = f"req{i} alpha{i} beta{i} gamma{i}"
            body = {"model": "big", "prompt": prompt, "max_tokens": 4, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                return prompt, sse_data(await resp.aread())

        return await asyncio.gather(*(one(i) for i in range(n)))


def test_hundreds_of_concurrent_streams_complete_unmixed(cluster: Cluster) -> None:
    results = asyncio.run(_streams(cluster.gateway.url, 300))
    for prompt, events in results:
        assert events[-1] == "[DONE]", (prompt, events[-3:])
        chunks = [json.loads(e) for e in events[:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == prompt + " "
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4  # the usage chunk, last
        assert len({c["id"] for c in chunks}) == 1


def test_a_slow_reader_timing_out_frees_its_worker_and_does_not_count_against_it(cluster: Cluster, module_procs: ProcessGroup) -> None:
    # The request timeout fires while the gateway has stopped reading the worker (its client does
    # not read): the worker is not charged ('stream broke: UpstreamTimeout'), so two such clients
    # cannot open a healthy worker's circuit for everybody; and the stalled client's lease ends
    # (in_flight 1, an admission slot) rather than lasting until it reads again or closes.
    config = module_procs.log_dir / "short.yaml"
    config.write_text(yaml.safe_dump({
        "server": {"admin_key": "adm", "request_timeout_s": 1},
        "circuit_breaker": {"failure_threshold": 1, "open_s": 60},
        "workers": [{"name": "fake", "url": cluster.fake.url, "models": ["f"]}],
    }))
    gateway = module_procs.gateway(config, port=free_port(), name="short-gateway", ready_path="/ready")
    closed = cluster.fake_count("flood_closed")
    sock = _raw_request(gateway.port, {"model": "f", "prompt": "flood", "stream": True}, rcvbuf=4096)
    with sock:
        assert sock.recv(64).startswith(b"HTTP/1.1 200")
        # the endless stream ends only by the timeout, which closes the worker's connection
        wait_until(lambda: cluster.fake_count("flood_closed") > closed, what="the timeout")
        # the client still reads nothing, maybe never again: its worker slot is free all the same
        with httpx.Client(base_url=gateway.url, timeout=10) as client:
            in_flight = lambda: client.get("/workers", headers=ADMIN).json()["workers"][0]["targets"][0]["in_flight"]  # noqa: E731
            wait_until(lambda: in_flight() == 0, what="the stalled client's slot released")
        sock.settimeout(20)
        data = b""
        while not data.endswith(b"\r\n0\r\n\r\n"):
            more = sock.recv(1 << 20)
            assert more, "closed before the end of the response"
            data += more
    assert b"the client read the stream too slowly" in data[-400:] and data[-400:].count(b"data: [DONE]") == 1
    with httpx.Client(base_url=gateway.url, timeout=10) as client:
        worker = client.get("/workers", headers=ADMIN).json()["workers"][0]
        assert worker["circuit"] == "closed" and worker["last_error"] is None, worker
        assert client.post("/v1/completions", json={"model": "f", "prompt": "ok"}).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_a_second_unrequested_response_is_not_mixed_into_the_answer_or_the_next(cluster: Cluster, stream: bool) -> None:
    # The worker sends a response nobody asked for right behind its answer (one write): its body
    # is not appended to the answer ('{"id":"one",...}{"id":"two",...}').
    resp = cluster.http.post("/v1/completions", json={"model": "f", "prompt": "double", "stream": stream})
    assert resp.status_code == 200 and resp.json()["id"] == "one", resp.text
    for _ in range(3):  # the pooled connection is not reused with the stray answer on it
        resp = cluster.http.post("/v1/completions", json={"model": "f", "prompt": "fine"})
        assert resp.json()["choices"][0]["text"] == "fake", resp.text


def test_an_informational_response_before_the_answer_is_skipped(cluster: Cluster) -> None:
    # a 103 Early Hints reached the client as the status of its answer (an empty 103)
    resp = cluster.http.post("/v1/completions", json={"model": "f", "prompt": "early103"})
    assert resp.status_code == 200 and resp.json()["id"] == "hinted", (resp.status_code, resp.text)


def _engine(cluster: Cluster) -> dict[str, float]:
    text = httpx.get(cluster.tiny.url + "/metrics", timeout=10).text
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line.startswith(("mesh_worker_num_requests_running ", "mesh_worker_kv_blocks_used "))}


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_leaving_frees_the_request_on_a_bundled_worker(cluster: Cluster, stream: bool) -> None:
    body = {"model": "tiny", "prompt": "hello world " * 40, "max_tokens": 4000, "ignore_eos": True, "stream": stream}
    with _raw_request(cluster.gateway.port, body) as sock:
        if stream:
            assert sock.recv(64).startswith(b"HTTP/1.1 200")
        wait_until(lambda: _engine(cluster)["mesh_worker_num_requests_running"] == 1, what="the request running")
        assert _engine(cluster)["mesh_worker_kv_blocks_used"] > 0
    wait_until(lambda: _engine(cluster) == {"mesh_worker_num_requests_running": 0, "mesh_worker_kv_blocks_used": 0},
               what="the engine freeing the request and its KV blocks")
    assert cluster.workers()["tiny"]["targets"][0]["in_flight"] == 0


def test_streams_that_break_mid_way_open_the_workers_circuit(cluster: Cluster, module_procs: ProcessGroup) -> None:
    # A stream records its success once it ended whole, not at its first byte (the consecutive
    # count would go 1, 0, 1, 0...), so a worker that breaks every stream has its circuit opened.
    config = module_procs.log_dir / "strict.yaml"
    config.write_text(yaml.safe_dump({
        "server": {"admin_key": "adm"},
        "circuit_breaker": {"failure_threshold": 2, "open_s": 60},
        "workers": [{"name": "fake", "url": cluster.fake.url, "models": ["f"]}],
    }))
    gateway = module_procs.gateway(config, port=free_port(), name="strict-gateway", ready_path="/ready")
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        for _ in range(2):
            with client.stream("POST", "/v1/completions", json={"model": "f", "prompt": "partial", "stream": True}) as resp:
                assert json.loads(sse_data(resp.read())[-2])["error"]["type"] == "upstream_error"
        worker = client.get("/workers", headers=ADMIN).json()["workers"][0]
        assert worker["circuit"] == "open" and "stream broke" in worker["last_error"], worker


def test_a_retry_with_nowhere_left_to_go_is_not_waited_for_nor_counted(cluster: Cluster) -> None:
    """Model "f" is served by the failing fake alone: its 500 is the answer at once, with no
    back-off slept (1 s here) and no retry counted."""
    retries = 'mesh_retries_total{reason="status_500"}'
    before = cluster.metric(retries)
    resp = cluster.http.post("/v1/completions", json={"model": "f", "prompt": "err500", "max_tokens": 2})
    assert resp.status_code == 500, resp.text
    assert cluster.metric(retries) == before
