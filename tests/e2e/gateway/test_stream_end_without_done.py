"""An OpenAI SSE stream that ends without ``data: [DONE]`` is a worker failing mid-stream.

A worker that delimits its answer by closing the connection (HTTP/1.0 style: no Content-Length,
no chunked encoding, or a proxy in between doing so) and dies mid-stream sends a plain FIN: the
body's end, to the HTTP layer. Relayed as a clean end, the client would get a truncated stream
that looks complete, and the worker's passive health would not be told. OpenAI servers end every
completion stream with ``data: [DONE]``: one that ends without it is treated as a reset
mid-stream is (whole events only, an OpenAI-shaped error event, then the end; a failure for the
worker's circuit breaker; ``mesh_stream_errors_total``), in the ordinary path and in the
disaggregated relay. A well-formed close-delimited stream (with ``[DONE]``), a stream
that is not SSE, and a stream whose client left first are not failures.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import yaml

from tests.procs import PYTHON, Proc, ProcessGroup, free_port, wait_http, wait_until
from tests.support.pd_gateway import PD_POLICY
from tests.support.sse import sse_data

ADMIN = {"authorization": "Bearer adm"}

# An HTTP/1.0 worker on raw sockets (one process, several ports: one worker entry each). Every
# answer is delimited by closing the connection. The prompt's first word picks the answer.
RAW_WORKER = r'''
import asyncio, json, sys

finished = {"slow": 0}


def event(text):
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
    return b"data: %s\n\n" % json.dumps({"id": "x", "object": "text_completion", "created": 0, "model": "m",
                                         "choices": [choice]}).encode()


async def handle(reader, writer):
    try:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        method = head[0].split(" ")[0]
        size = next((int(l.split(":")[1]) for l in head if l.lower().startswith("content-length:")), 0)
        body = await reader.readexactly(size) if size else b""
        if method == "GET":  # /health, /v1/models, /count
            out = json.dumps({"object": "list", "data": [], "finished": finished}).encode()
            writer.write(b"HTTP/1.0 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(out), out))
            return
        mode = json.loads(body)["prompt"].split()[0]
        if mode == "json":  # stream requested, a JSON answer given (no SSE, no [DONE]): relayed as is
            writer.write(b'HTTP/1.0 200 OK\r\ncontent-type: application/json\r\n\r\n{"id":"j","object":"text_completion",'
                         b'"choices":[{"index":0,"text":"json","finish_reason":"stop"}]}')
            return
        writer.write(b"HTTP/1.0 200 OK\r\ncontent-type: text/event-stream\r\n\r\n")
        if mode == "slow":  # one event, then a long pause (its client leaves), then a cut
            writer.write(event("t0 "))
            await writer.drain()
            await asyncio.sleep(1.0)
            writer.write(event("late"))
            finished["slow"] += 1
            return
        for i in range(3):
            writer.write(event(f"t{i} "))
            if mode != "cutfast":  # cutfast: the whole truncated stream in one write
                await writer.drain()
                await asyncio.sleep(0.05)
        if mode in ("cut", "cutfast"):
            writer.write(event("lost")[:25])  # the worker dies mid-event: a FIN, no [DONE]
        elif mode == "error":  # the worker's own error event, no [DONE] (as the bundled worker's engine failure)
            writer.write(b'data: {"error": {"message": "engine died", "type": "server_error", "param": null, "code": 503}}\n\n')
        else:
            writer.write(event("") + b"data: [DONE]\n\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        try:
            await writer.drain()
        except ConnectionError:
            pass
        writer.close()  # a plain FIN: the end of a close-delimited body


async def main(ports):
    servers = [await asyncio.start_server(handle, "127.0.0.1", p) for p in ports]
    await asyncio.gather(*(s.serve_forever() for s in servers))


asyncio.run(main([int(p) for p in sys.argv[1:]]))
'''

RAW = ("cut", "cutfast", "good", "dcut", "dgood")  # a worker entry each (a port of the raw worker)


@dataclass
class Gateway:
    proc: Proc
    http: httpx.Client

    def metric(self, name: str) -> float:
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        raise AssertionError(f"{name} is not exported")

    def worker(self, name: str) -> dict[str, Any]:
        return next(w for w in self.http.get("/workers", headers=ADMIN).json()["workers"] if w["name"] == name)

    def stream(self, model: str, prompt: str) -> tuple[httpx.Response, bytes]:
        with self.http.stream("POST", "/v1/completions",
                              json={"model": model, "prompt": prompt, "stream": True, "max_tokens": 4}) as resp:
            return resp, resp.read()


@pytest.fixture(scope="module")
def raw(module_procs: ProcessGroup) -> dict[str, str]:
    script = module_procs.log_dir / "raw_worker.py"
    script.write_text(RAW_WORKER)
    ports = {name: free_port() for name in RAW}
    proc = module_procs.start([PYTHON, str(script), *map(str, ports.values())], name="raw")
    for port in ports.values():
        wait_http(f"http://127.0.0.1:{port}/health", proc=proc)
    return {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}


def _gateway(procs: ProcessGroup, name: str, workers: list[dict[str, Any]], **extra: Any) -> Iterator[Gateway]:
    path = procs.log_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "server": {"admin_key": "adm", "request_timeout_s": 60},
        "circuit_breaker": {"failure_threshold": 1, "open_s": 3600},  # one failure opens it
        "health": {"interval_s": 3600},  # only passive health acts within the tests
        "workers": workers, **extra,
    }))
    proc = procs.gateway(path, port=free_port(), name=name, ready_path="/ready")
    with httpx.Client(base_url=proc.url, timeout=30) as http:
        yield Gateway(proc, http)


@pytest.fixture(scope="module")
def mixed(raw: dict[str, str], module_procs: ProcessGroup) -> Iterator[Gateway]:
    workers = [{"name": n, "url": raw[n], "models": [n]} for n in ("cut", "cutfast", "good")]
    yield from _gateway(module_procs, "gateway", workers)


@pytest.fixture(scope="module")
def disagg(raw: dict[str, str], module_procs: ProcessGroup) -> Iterator[Gateway]:
    prefill = module_procs.echo_worker("p0", "--model", "cut", "--model", "good")
    yield from _gateway(module_procs, "gateway-pd", [
        {"name": "p0", "url": prefill.url, "models": ["cut", "good"], "role": "prefill"},
        {"name": "dcut", "url": raw["dcut"], "models": ["cut"], "role": "decode"},
        {"name": "dgood", "url": raw["dgood"], "models": ["good"], "role": "decode"},
    ], policy=PD_POLICY)


def _assert_cut(resp: httpx.Response, raw_body: bytes, worker: str) -> None:
    assert resp.status_code == 200 and resp.headers["x-mesh-worker"] == worker, resp.headers
    events = sse_data(raw_body)  # whole events only: the worker's unfinished one is not relayed
    assert [json.loads(e)["choices"][0]["text"] for e in events[:3]] == ["t0 ", "t1 ", "t2 "], events
    error = json.loads(events[3])["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "upstream_error", error
    assert worker in error["message"], error
    assert "[DONE]" not in events[:4]  # the truncated stream never looked complete before the error
    assert events[4:] == ["[DONE]"], events  # then the stream ends as on a reset mid-stream


@pytest.mark.parametrize("model", ["cut", "cutfast"])
def test_a_close_delimited_stream_cut_before_done_ends_with_an_error_and_opens_the_circuit(
        mixed: Gateway, model: str) -> None:
    before = mixed.metric("mesh_stream_errors_total")
    assert mixed.worker(model)["circuit"] == "closed"
    resp, body = mixed.stream(model, f"{model} please")
    _assert_cut(resp, body, model)
    assert mixed.metric("mesh_stream_errors_total") == before + 1
    worker = mixed.worker(model)
    assert worker["circuit"] == "open" and "[DONE]" in worker["last_error"], worker


@pytest.mark.parametrize("prompt", ["whole stream", "json stream", "error stream"])
def test_a_close_delimited_stream_with_done_or_not_sse_passes_unchanged(mixed: Gateway, prompt: str) -> None:
    before = mixed.metric("mesh_stream_errors_total")
    resp, body = mixed.stream("good", prompt)
    assert resp.status_code == 200 and resp.headers["x-mesh-worker"] == "good"
    if prompt.startswith("json"):
        assert json.loads(body)["choices"][0]["text"] == "json"
    elif prompt.startswith("error"):  # the worker ended its stream with its own error: relayed as sent
        events = sse_data(body)
        assert len(events) == 4 and json.loads(events[3])["error"]["message"] == "engine died", events
    else:
        events = sse_data(body)
        assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == ["t0 ", "t1 ", "t2 ", ""]
        assert events[-1] == "[DONE]"
    assert mixed.metric("mesh_stream_errors_total") == before
    worker = mixed.worker("good")
    assert worker["circuit"] == "closed" and worker["last_error"] is None, worker


def test_a_client_that_leaves_before_the_cut_is_not_a_worker_failure(mixed: Gateway, raw: dict[str, str]) -> None:
    before, errors = mixed.metric("mesh_client_disconnects_total"), mixed.metric("mesh_stream_errors_total")
    count = lambda: httpx.get(raw["good"] + "/count", timeout=10).json()["finished"]["slow"]  # noqa: E731
    finished = count()
    with mixed.http.stream("POST", "/v1/completions",
                           json={"model": "good", "prompt": "slow", "stream": True, "max_tokens": 4}) as resp:
        assert next(resp.iter_bytes()).startswith(b"data: ")  # then the client leaves
    wait_until(lambda: count() > finished, what="the worker's slow stream over")
    wait_until(lambda: mixed.metric("mesh_client_disconnects_total") > before, what="the disconnect counted")
    assert mixed.metric("mesh_stream_errors_total") == errors
    worker = mixed.worker("good")
    assert worker["circuit"] == "closed" and worker["last_error"] is None, worker


def test_the_disaggregated_relay_passes_a_whole_close_delimited_stream(disagg: Gateway) -> None:
    before = disagg.metric("mesh_stream_errors_total")
    resp, body = disagg.stream("good", "whole stream")
    assert resp.status_code == 200 and resp.headers["x-mesh-worker"] == "dgood", resp.headers
    events = sse_data(body)
    assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), events
    assert disagg.metric("mesh_stream_errors_total") == before
    assert disagg.worker("dgood")["circuit"] == "closed"


def test_the_disaggregated_relay_ends_a_stream_cut_before_done_with_an_error(disagg: Gateway) -> None:
    before = disagg.metric("mesh_stream_errors_total")
    resp, body = disagg.stream("cut", "cut please")
    _assert_cut(resp, body, "dcut")
    assert disagg.metric("mesh_stream_errors_total") == before + 1
    worker = disagg.worker("dcut")
    assert worker["circuit"] == "open" and "[DONE]" in worker["last_error"], worker
    assert disagg.worker("p0")["circuit"] == "closed"
