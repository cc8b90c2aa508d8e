"""Hostile requests against a real gateway process: never a 5xx, always the OpenAI error shape.

A property suite (hypothesis) throws arbitrary bytes, arbitrary JSON and mutated valid bodies at
both completion routes; fixed cases pin the status of each known kind of bad input. After every
batch the gateway must still serve a valid request.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.procs import ProcessGroup, free_port

KEY = "data-key"
AUTH = {"authorization": f"Bearer {KEY}"}
ROUTES = ("/v1/chat/completions", "/v1/completions")
VALID = {
    "/v1/chat/completions": {"model": "echo", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 4},
    "/v1/completions": {"model": "echo", "prompt": "hi there", "max_tokens": 4},
}
MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
def gateway(module_procs: ProcessGroup) -> Iterator[httpx.Client]:
    worker = module_procs.echo_worker("bad-input-echo")
    config = module_procs.log_dir / "mesh.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "server": {"api_keys": [KEY], "admin_key": "adm", "max_body_bytes": MAX_BODY, "max_tokens_limit": 100_000},
                "workers": [{"name": "w", "url": worker.url}],
            }
        )
    )
    gw = module_procs.gateway(config, port=free_port(), ready_path="/ready")
    with httpx.Client(base_url=gw.url, timeout=30, headers=AUTH) as client:
        yield client


def assert_error_shape(resp: httpx.Response) -> None:
    assert resp.status_code < 500, (resp.status_code, resp.text[:500])
    if resp.status_code >= 400:
        body = resp.json()
        assert set(body) == {"error"}, body
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]


def assert_still_serving(client: httpx.Client) -> None:
    resp = client.post("/v1/chat/completions", json=VALID["/v1/chat/completions"])
    assert resp.status_code == 200, resp.text


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)
field_values = json_values | st.integers(min_value=-(2**70), max_value=2**70) | st.just(10**12) | st.text(max_size=300)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(ROUTES), body=st.binary(max_size=300))
def test_arbitrary_bytes(gateway: httpx.Client, route: str, body: bytes) -> None:
    assert_error_shape(gateway.post(route, content=body, headers={"content-type": "application/json"}))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(ROUTES), body=json_values)
def test_arbitrary_json(gateway: httpx.Client, route: str, body: Any) -> None:
    assert_error_shape(gateway.post(route, content=json.dumps(body)))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    route=st.sampled_from(ROUTES),
    field=st.sampled_from(["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "stream", "user", "n", "cache_salt"]),
    value=field_values,
    drop=st.booleans(),
)
def test_mutated_valid_bodies(gateway: httpx.Client, route: str, field: str, value: Any, drop: bool) -> None:
    body = dict(VALID[route])
    if drop:
        body.pop(field, None)
    else:
        body[field] = value
    resp = gateway.post(route, content=json.dumps(body))
    assert_error_shape(resp)


def test_gateway_survives_the_property_suite(gateway: httpx.Client) -> None:
    assert_still_serving(gateway)


@pytest.mark.parametrize(
    ("route", "content", "status", "code"),
    [
        ("/v1/chat/completions", b"{not json", 400, "invalid_json"),
        ("/v1/chat/completions", b'{"model": "echo", "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, "invalid_utf8"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}]}', 400, "missing_model"),
        ("/v1/chat/completions", b'{"model": ["echo"], "messages": []}', 400, "missing_model"),
        ("/v1/chat/completions", b'{"model": "echo"}', 400, "missing_messages"),
        ("/v1/completions", b'{"model": "echo"}', 400, "invalid_prompt"),
        ("/v1/completions", b'{"model": "echo", "prompt": {"a": 1}}', 400, "invalid_prompt"),
        ("/v1/completions", b'{"model": "nope", "prompt": "x"}', 404, "model_not_found"),
        ("/v1/completions", b'{"model": "echo", "prompt": "x", "max_tokens": 100000000000}', 400, "invalid_max_tokens"),
        ("/v1/completions", b'{"model": "echo", "prompt": "x", "max_tokens": -5}', 400, "invalid_max_tokens"),
        ("/v1/completions", b'{"model": "echo", "prompt": "x", "max_tokens": 1.5}', 400, "invalid_request"),
        ("/v1/completions", b"[]", 400, "invalid_json"),
        ("/v1/completions", b"", 400, "empty_body"),
        # the gateway's relay alone sets these: a client's would steer a worker's KV transfer
        ("/v1/completions", b'{"model": "echo", "prompt": "x", "kv_transfer_params": {"do_remote_prefill": true}}',
         400, "invalid_request"),
    ],
)
def test_known_bad_bodies(gateway: httpx.Client, route: str, content: bytes, status: int, code: str) -> None:
    resp = gateway.post(route, content=content)
    assert_error_shape(resp)
    assert (resp.status_code, resp.json()["error"]["code"]) == (status, code)


def test_body_over_the_limit_is_413(gateway: httpx.Client) -> None:
    big = json.dumps({"model": "echo", "prompt": "x" * MAX_BODY}).encode()
    resp = gateway.post("/v1/completions", content=big)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "body_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit holds while streaming in
        for _ in range(8):
            yield b" " * (MAX_BODY // 4)

    resp = gateway.post("/v1/completions", content=chunks())
    assert resp.status_code == 413
    assert_still_serving(gateway)


def test_api_keys_are_required(gateway: httpx.Client) -> None:
    for headers in ({"authorization": ""}, {"authorization": "Bearer wrong"}, {"authorization": f"Basic {KEY}"}):
        resp = gateway.post("/v1/chat/completions", json=VALID["/v1/chat/completions"], headers=headers)
        assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error"
    assert gateway.get("/v1/models", headers={"authorization": ""}).status_code == 401
    assert gateway.get("/v1/models").status_code == 200


def test_a_long_session_id_is_served_not_refused(gateway: httpx.Client) -> None:
    """A session id of any length (a long OpenAI ``user`` value, here 4,000 bytes) is served, not a
    400: only the id's 128-bit hash is kept, so its length costs nothing."""
    resp = gateway.post("/v1/chat/completions", json=VALID["/v1/chat/completions"], headers={"x-session-id": "s" * 4000})
    assert resp.status_code == 200, resp.text
    body = {**VALID["/v1/completions"], "user": "u" * 4000}
    assert gateway.post("/v1/completions", json=body).status_code == 200


def test_unknown_routes_and_methods_keep_the_shape(gateway: httpx.Client) -> None:
    resp = gateway.get("/v1/nothing-here")
    assert_error_shape(resp)
    assert resp.status_code == 404
    resp = gateway.get("/v1/chat/completions")
    assert_error_shape(resp)
    assert resp.status_code == 405
    resp = gateway.post("/workers", json={"name": "x"}, headers={"authorization": "Bearer adm"})
    assert resp.status_code == 422
    assert_error_shape(resp)


def _complete_response(data: bytes) -> bool:
    head, sep, rest = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.lower().split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return len(rest) >= int(line.split(b":")[1])
    return True


@pytest.mark.parametrize("value", [b"abc\x00def", b"abc\rdef", b"a\r\n\r\nGET / HTTP/1.1"])
def test_header_injection_is_rejected(gateway: httpx.Client, value: bytes) -> None:
    port = int(str(gateway.base_url).rsplit(":", 1)[1].rstrip("/"))
    body = json.dumps(VALID["/v1/chat/completions"]).encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer " + KEY.encode()
        + b"\r\nx-session-id: " + value + b"\r\ncontent-length: %d\r\n\r\n" % len(body) + body
    )  # fmt: skip
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while not _complete_response(data):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), data[:300]
    assert b"application/json" in head and b'"error"' in rest
    assert_still_serving(gateway)
