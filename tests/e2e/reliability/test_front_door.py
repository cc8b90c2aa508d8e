"""Hostile clients at the gateway's front door: a real ``mesh serve`` over raw sockets.

Each test is a way a client once hurt the gateway or other clients: a header without end, heads
that never finish (with the descriptor limit a default box has), a nested body, a protocol
upgrade, a half-closed socket, a trailing slash with a forged Host, uploads that together hold
the memory, headers that are not the worker's business, the docs open with keys set.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.procs import PYTHON, ProcessGroup, free_port, wait_until

KEY = "sk-test"
AUTH = {"authorization": f"Bearer {KEY}"}
BODY = {"model": "m", "prompt": "hello", "max_tokens": 2}

# A worker that answers every completion with the headers it received (and health, models).
HEADER_ECHO = r'''
import asyncio, json, sys

async def handle(reader, writer):
    try:
        while True:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            method, path = head[0].split(" ")[:2]
            fields = [l.split(":", 1) for l in head[1:] if ":" in l]
            size = next((int(v) for k, v in fields if k.lower() == "content-length"), 0)
            if size:
                await reader.readexactly(size)
            if method == "GET":
                out = {"object": "list", "data": [{"id": "m", "object": "model"}]} if path == "/v1/models" else {}
            else:
                out = {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
                       "headers": {k.strip().lower(): v.strip() for k, v in fields}}
            data = json.dumps(out).encode()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(data), data))
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


class Gateway:
    def __init__(self, port: int, log: Path) -> None:
        self.port, self.log = port, log
        self.url = f"http://127.0.0.1:{port}"

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)

    def post(self, path: str = "/v1/completions", **kwargs: Any) -> httpx.Response:
        headers = {**AUTH, **kwargs.pop("headers", {})}
        return httpx.post(self.url + path, json=kwargs.pop("json", BODY), headers=headers, timeout=10, **kwargs)


@pytest.fixture(scope="module")
def gateway(module_procs: ProcessGroup) -> Iterator[Gateway]:
    script = module_procs.log_dir / "header_echo.py"
    script.write_text(HEADER_ECHO)
    wport = free_port()
    module_procs.start_http([PYTHON, str(script), str(wport)], name="header-echo", port=wport, ready_path="/health")
    config = module_procs.log_dir / "mesh.yaml"
    config.write_text(yaml.safe_dump({
        "server": {"api_keys": [KEY], "head_timeout_s": 1.0, "body_idle_timeout_s": 2.0,
                   "max_body_bytes": 1 << 20, "max_buffered_body_bytes": 3 << 20},
        "workers": [{"name": "w", "url": f"http://127.0.0.1:{wport}"}],
    }))
    port = free_port()
    # A default box's descriptor limit (soft 1,024): the gateway must lift it to the hard one.
    cmd = ["prlimit", "--nofile=1024:8192", PYTHON, "-m", "mesh.commands.serve", "--config", str(config),
           "--port", str(port), "--log-level", "warning"]
    proc = module_procs.start_http(cmd, name="gateway", port=port, ready_path="/ready")
    yield Gateway(port, proc.log_path)


def _error(resp: httpx.Response, status: int, code: str) -> None:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/json"
    assert resp.json()["error"]["code"] == code, resp.text


def _raw_answer(sock: socket.socket) -> tuple[int, dict[str, Any] | None]:
    """The status and JSON body of the one answer on ``sock`` (read to the close)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body) if body else None


def test_a_header_bomb_is_a_431_and_others_are_served_meanwhile(gateway: Gateway) -> None:
    bomb = gateway.connect()
    bomb.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-big: ")
    sent, answered = 0, None
    try:
        while sent < 48 << 20:
            bomb.sendall(b"a" * (1 << 20))
            sent += 1 << 20
    except (BrokenPipeError, ConnectionResetError):
        answered = sent
    # the gateway answered and closed within the first MiB or so, not after the whole bomb
    assert answered is not None and answered <= 16 << 20, f"still accepting after {sent} bytes"
    assert gateway.post().status_code == 200


def test_a_complete_head_over_the_limit_is_a_431_in_the_openai_shape(gateway: Gateway) -> None:
    sock = gateway.connect()
    sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * (64 << 10) + b"\r\n\r\n")
    status, body = _raw_answer(sock)
    assert status == 431 and body is not None and body["error"]["code"] == "request_header_too_large"
    # a head under the limit, with a body in the same write, is served
    resp = gateway.post(headers={"x-small": "a" * 8000})
    assert resp.status_code == 200, resp.text


def test_slow_heads_are_closed_and_the_gateway_keeps_serving(gateway: Gateway) -> None:
    socks = []
    for i in range(2000):  # over the soft descriptor limit the gateway was started under
        s = gateway.connect()
        if i % 2:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")  # a head that never ends
        socks.append(s)
    assert gateway.post().status_code == 200  # served while 2,000 heads are pending
    partial = socks[1]
    status, body = _raw_answer(partial)  # within head_timeout_s: a 408, then the close
    assert status == 408 and body is not None and body["error"]["code"] == "head_timeout"
    assert socks[0].recv(1) == b""  # a silent connection is closed without an answer
    for s in socks:
        s.close()


def test_an_idle_keep_alive_connection_outlives_the_head_timeout(gateway: Gateway) -> None:
    """The head timeout bounds a head in progress, not the quiet between a connection's requests."""
    body = json.dumps(BODY).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer %s\r\ncontent-type: application/json\r\n"
               b"content-length: %d\r\n\r\n%s" % (KEY.encode(), len(body), body))
    sock = gateway.connect()
    for pause in (0.0, 2.5):  # head_timeout_s is 1 s here
        time.sleep(pause)
        sock.sendall(request)
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(65536)
            assert chunk, f"the connection was closed after {pause} s idle"
            head += chunk
        assert head.startswith(b"HTTP/1.1 200"), head[:100]
        size = int(next(v for k, v in (line.split(b": ", 1) for line in head.split(b"\r\n\r\n")[0].split(b"\r\n")[1:])
                        if k.lower() == b"content-length"))
        rest = head.split(b"\r\n\r\n", 1)[1]
        while len(rest) < size:
            rest += sock.recv(65536)
    sock.close()


def test_deep_json_is_a_400_without_a_traceback(gateway: Gateway) -> None:
    headers = {**AUTH, "content-type": "application/json"}
    for depth in (200, 900, 5000):
        nested = "[" * depth + "]" * depth
        bodies = {"/v1/completions": '{"model":"m","prompt":"x","logit_bias":' + nested + "}",
                  "/v1/chat/completions": '{"model":"m","messages":[{"role":"user","content":' + nested + "}]}"}
        for path, raw in bodies.items():
            resp = httpx.post(gateway.url + path, content=raw, headers=headers)
            # what the gateway can read goes on (the worker judges logit_bias); never a 500
            assert resp.status_code < 500, (depth, path, resp.text)
            if depth > 1000:  # past what a JSON parser walks: the gateway's own 400
                _error(resp, 400, "too_deeply_nested")
    assert "Traceback" not in gateway.log.read_text()


def test_an_upgrade_is_answered_not_left_hanging(gateway: Gateway) -> None:
    sock = gateway.connect()
    body = json.dumps(BODY).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: websocket\r\n"
                 b"authorization: Bearer %s\r\ncontent-length: %d\r\n\r\n%s" % (KEY.encode(), len(body), body))
    status, answer = _raw_answer(sock)
    assert status == 400 and answer is not None and answer["error"]["code"] == "upgrade_not_supported"


def test_a_half_closed_client_has_left(gateway: Gateway) -> None:
    """A FIN cannot be told from a close (nginx and hyper take it as one): the request is answered
    whole or not started (a fast worker may answer before the FIN is read), the connection closes
    either way, and the gateway serves on."""
    for _ in range(5):
        sock = gateway.connect()
        body = json.dumps(BODY).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer %s\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (KEY.encode(), len(body), body))
        sock.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := sock.recv(65536):  # until the gateway closes (the socket's 10 s timeout bounds it)
            reply += chunk
        assert reply == b"" or (reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"}")), reply[:200]
    assert gateway.post().status_code == 200


def test_no_redirect_carries_the_clients_host(gateway: Gateway) -> None:
    for path in ("/v1/completions/", "/v1/models/", "/health/"):
        resp = httpx.post(gateway.url + path, json=BODY, headers={**AUTH, "host": "evil.example"})
        assert "evil.example" not in resp.headers.get("location", ""), (path, resp.headers)
        assert resp.status_code in (200, 404, 405), (path, resp.status_code)
        assert "error" in resp.json() or resp.status_code == 200


def test_only_allowed_client_headers_reach_the_worker(gateway: Gateway) -> None:
    resp = gateway.post(headers={"cookie": "sid=secret", "x-forwarded-for": "6.6.6.6", "x-request-id": "r1",
                                 "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                                 "x-session-id": "s1", "user-agent": "t/1"})
    seen = resp.json()["headers"]
    assert "cookie" not in seen and "x-forwarded-for" not in seen and "authorization" not in seen
    assert seen["x-request-id"] == "r1" and seen["traceparent"].startswith("00-") and seen["x-session-id"] == "s1"


def test_docs_and_schema_need_the_key_and_list_the_error_statuses(gateway: Gateway) -> None:
    for path in ("/docs", "/openapi.json"):
        _error(httpx.get(gateway.url + path), 401, "invalid_api_key")
    schema = httpx.get(gateway.url + "/openapi.json", headers=AUTH).json()
    responses = schema["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"400", "401", "404", "413", "429", "502", "503", "504"} <= set(responses), sorted(responses)
    assert "Error" in json.dumps(responses["400"])


def test_uploads_share_a_bounded_buffer(gateway: Gateway) -> None:
    # three uploads of 1 MiB each stall just before their end: 3 MiB buffered, the budget's whole
    stalled = []
    for _ in range(3):
        s = gateway.connect()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer %s\r\ncontent-type: application/json\r\n"
                  b"content-length: %d\r\n\r\n" % (KEY.encode(), 1 << 20) + b" " * ((1 << 20) - 10))
        stalled.append(s)
    time.sleep(0.5)
    resp = gateway.post(json={**BODY, "prompt": "x" * 4000})
    _error(resp, 503, "body_buffer_full")
    assert resp.headers.get("retry-after")
    for s in stalled:  # each ends in a 408 after body_idle_timeout_s: their bytes are released
        status, _ = _raw_answer(s)
        assert status == 408
    wait_until(lambda: gateway.post().status_code == 200, timeout_s=5, what="the buffer released")


def test_the_gateway_survives_all_of_it(gateway: Gateway) -> None:
    results: list[int] = []

    def client() -> None:
        for _ in range(20):
            results.append(gateway.post().status_code)

    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [200] * 80
