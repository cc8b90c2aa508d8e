"""A misbehaving worker and a stalling client against a real gateway process.

The worker is a raw-socket fake (no framework, so it can answer anything): HTML or empty error
pages, FastAPI's ``{"detail": ...}``, vLLM's flat ``{"object": "error", ...}``, a response head
without end, answers that never come. Whatever it does, the client gets the OpenAI error shape.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import httpx
import pytest
import yaml

from tests.procs import PYTHON, ProcessGroup, free_port, wait_until

ADMIN = {"authorization": "Bearer adm"}

# The fake worker: GET answers health and /v1/models; a POST's "model" picks the misbehaviour.
FAKE_WORKER = r'''
import asyncio, json, sys

MODELS = ["html500", "gzip500", "plain404", "empty502", "fastapi422", "vllm400", "openai400", "hugehead", "ok", "hang",
          "hangstream", "endless", "headers"]
OPENAI_400 = b'{"error":{"message":"bad temperature","type":"invalid_request_error","param":"temperature","code":null}}'


def answer(status, body, ctype=b"application/json"):
    return b"HTTP/1.1 %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s" % (status, ctype, len(body), body)


async def handle(reader, writer):
    try:
        while True:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            method, path = head[0].split(" ")[:2]
            size = next((int(l.split(":")[1]) for l in head if l.lower().startswith("content-length:")), 0)
            body = await reader.readexactly(size) if size else b""
            if method == "GET":
                models = [{"id": m, "object": "model"} for m in MODELS]
                out = json.dumps({"object": "list", "data": models}).encode() if path == "/v1/models" else b"{}"
                writer.write(answer(b"200 OK", out))
                await writer.drain()
                continue
            model = json.loads(body)["model"]
            if model == "html500":
                writer.write(answer(b"500 Internal Server Error", b"<html>oops</html>", b"text/html"))
            elif model == "gzip500":  # an error page the gateway cannot read: it must not stay "gzip"
                writer.write(b"HTTP/1.1 500 Internal Server Error\r\ncontent-encoding: gzip\r\ncontent-type: text/html\r\n"
                             b"content-length: 4\r\n\r\n\x1f\x8b\x08\x00")
            elif model == "plain404":
                writer.write(answer(b"404 Not Found", b"Not Found", b"text/plain"))
            elif model == "empty502":
                writer.write(b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\n\r\n")
            elif model == "fastapi422":
                writer.write(answer(b"422 Unprocessable Entity", b'{"detail":[{"loc":["body","x"],"msg":"bad x"}]}'))
            elif model == "vllm400":
                writer.write(answer(b"400 Bad Request", b'{"object":"error","message":"bad prompt","type":"BadRequestError","param":null,"code":400}'))
            elif model == "openai400":
                writer.write(answer(b"400 Bad Request", OPENAI_400))
            elif model == "hugehead":
                writer.write(b"HTTP/1.1 200 OK\r\nx-big: " + b"a" * (1 << 20) + b"\r\ncontent-length: 2\r\n\r\n{}")
            elif model == "ok":
                writer.write(answer(b"200 OK", b'{"id":"x","object":"text_completion","choices":[]}'))
            elif model == "headers":  # which data-parallel rank headers arrived
                ranks = [l.split(":", 1)[1].strip() for l in head if l.lower().startswith("x-data-parallel-rank:")]
                writer.write(answer(b"200 OK", json.dumps({"ranks": ranks}).encode()))
            elif model == "endless":  # a body that never ends, as fast as the gateway reads it
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n")
                chunk = b"%x\r\n%s\r\n" % (1 << 20, b" " * (1 << 20))
                while True:
                    writer.write(chunk)
                    await writer.drain()
            elif model == "hangstream":
                event = b'data: {"choices":[{"index":0,"text":"a"}]}\n\n'
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                             b"%x\r\n%s\r\n" % (len(event), event))
                await writer.drain()
                await reader.read()
                return
            else:  # hang: never answer
                await reader.read()
                return
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def main(port):
    server = await asyncio.start_server(handle, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


asyncio.run(main(int(sys.argv[1])))
'''


@pytest.fixture(scope="module")
def gateway(module_procs: ProcessGroup) -> Iterator[httpx.Client]:
    script = module_procs.log_dir / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    wport = free_port()
    module_procs.start_http([PYTHON, str(script), str(wport)], name="fake-worker", port=wport, ready_path="/health")
    config = module_procs.log_dir / "mesh.yaml"
    config.write_text(yaml.safe_dump({
        "server": {"admin_key": "adm", "request_timeout_s": 60, "body_idle_timeout_s": 1},
        "circuit_breaker": {"failure_threshold": 10_000, "open_s": 1},  # the fake fails on purpose, often
        "workers": [{"name": "fake", "url": f"http://127.0.0.1:{wport}"}],
    }))
    port = free_port()
    cmd = [PYTHON, "-m", "mesh.commands.serve", "--config", str(config), "--port", str(port), "--log-level", "warning"]
    module_procs.start_http(cmd, name="gateway", port=port, ready_path="/ready")
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
        yield client


def _error(resp: httpx.Response) -> dict[str, object]:
    assert resp.headers["content-type"] == "application/json", resp.headers
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("model", "status", "says"),
    [("html500", 500, "oops"), ("gzip500", 500, "answered 500"), ("plain404", 404, "Not Found"), ("empty502", 502, "answered 502"),
     ("fastapi422", 422, "bad x"), ("vllm400", 400, "bad prompt")],
)
@pytest.mark.parametrize("stream", [False, True])
def test_worker_errors_not_in_the_openai_shape_are_rewrapped(
    gateway: httpx.Client, model: str, status: int, says: str, stream: bool
) -> None:
    resp = gateway.post("/v1/completions", json={"model": model, "prompt": "x", "stream": stream})
    assert resp.status_code == status, resp.text
    assert says in str(_error(resp)["message"])
    assert resp.headers["x-mesh-worker"] == "fake"


def test_worker_errors_in_the_openai_shape_pass_through_unchanged(gateway: httpx.Client) -> None:
    resp = gateway.post("/v1/chat/completions", json={"model": "openai400", "messages": [{"role": "user", "content": "x"}]})
    assert resp.status_code == 400
    assert _error(resp) == {"message": "bad temperature", "type": "invalid_request_error", "param": "temperature", "code": None}


def test_endless_worker_response_head_is_a_502(gateway: httpx.Client) -> None:
    resp = gateway.post("/v1/completions", json={"model": "hugehead", "prompt": "x"})
    assert resp.status_code == 502
    assert "head" in str(_error(resp)["message"])
    assert gateway.post("/v1/completions", json={"model": "ok", "prompt": "x"}).status_code == 200


def test_endless_non_streamed_answer_is_a_502(gateway: httpx.Client) -> None:
    # the gateway holds a non-streamed answer whole: it grew without bound until the request timeout
    resp = gateway.post("/v1/completions", json={"model": "endless", "prompt": "x"})
    assert resp.status_code == 502
    assert "MiB" in str(_error(resp)["message"])
    assert gateway.post("/v1/completions", json={"model": "ok", "prompt": "x"}).status_code == 200


def test_a_client_cannot_pick_the_data_parallel_rank(gateway: httpx.Client) -> None:
    resp = gateway.post("/v1/completions", json={"model": "headers", "prompt": "x"}, headers={"x-data-parallel-rank": "7"})
    assert resp.status_code == 200 and resp.json() == {"ranks": []}  # the router sets it (dp_size > 1) or nobody


def _port(client: httpx.Client) -> int:
    return int(str(client.base_url).rstrip("/").rsplit(":", 1)[1])


def _read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


@pytest.mark.parametrize("path", [b"/v1/completions", b"/v1/chat/completions", b"/debug/route"])
@pytest.mark.parametrize(
    "start",
    [b"transfer-encoding: chunked\r\n\r\n5\r\n{\"mod\r\n",  # a chunked body that never ends
     b"content-length: 100\r\n\r\n{\"model\"",  # fewer bytes than announced
     b"content-length: 100\r\n\r\n"],  # headers, then nothing
)
def test_a_body_that_stops_coming_is_a_408_and_the_connection_closes(gateway: httpx.Client, path: bytes, start: bytes) -> None:
    with socket.create_connection(("127.0.0.1", _port(gateway)), timeout=20) as sock:
        sock.sendall(b"POST " + path + b" HTTP/1.1\r\nhost: x\r\n" + start)
        data = _read_until_closed(sock)  # the gateway closes it: recv would time out otherwise
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), data[:300]
    assert json.loads(body)["error"]["code"] == "body_timeout"


def _in_flight(client: httpx.Client) -> int:
    return int(client.get("/workers", headers=ADMIN).json()["workers"][0]["targets"][0]["in_flight"])


@pytest.mark.parametrize(("model", "stream"), [("hang", False), ("hangstream", True)])
def test_client_that_leaves_releases_its_worker_slot(gateway: httpx.Client, model: str, stream: bool) -> None:
    body = json.dumps({"model": model, "prompt": "x", "stream": stream}).encode()
    with socket.create_connection(("127.0.0.1", _port(gateway)), timeout=20) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        wait_until(lambda: _in_flight(gateway) == 1, what="the request in flight")
    wait_until(lambda: _in_flight(gateway) == 0, what="the slot released after the client left")
    assert gateway.post("/v1/completions", json={"model": "ok", "prompt": "x"}).status_code == 200
