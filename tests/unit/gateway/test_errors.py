"""mesh.errors: the OpenAI error shape, status -> type, the SSE error event."""

from __future__ import annotations

import json

from mesh.errors import MeshError, bad_request, sse_error_event


def test_shape_and_types() -> None:
    for status, type_ in [(400, "invalid_request_error"), (401, "authentication_error"), (404, "not_found_error"),
                          (413, "invalid_request_error"), (429, "rate_limit_error"), (503, "service_unavailable_error")]:
        err = MeshError(status, "msg", code="c", param="p")
        body = json.loads(err.to_bytes())
        assert body == {"error": {"message": "msg", "type": type_, "param": "p", "code": "c"}}
        resp = err.response()
        assert resp.status_code == status and resp.media_type == "application/json"


def test_headers_travel_with_the_response() -> None:
    resp = MeshError(429, "slow down", headers={"retry-after": "1"}).response()
    assert resp.headers["retry-after"] == "1"


def test_bad_request_defaults() -> None:
    err = bad_request("nope", "model")
    assert (err.status, err.param, err.code, err.type) == (400, "model", "invalid_request", "invalid_request_error")


def test_sse_error_event_then_done() -> None:
    raw = sse_error_event("worker w1 failed mid-stream").decode()
    events = [line[6:] for line in raw.split("\n\n") if line]
    assert json.loads(events[0])["error"]["message"] == "worker w1 failed mid-stream"
    assert events[1] == "[DONE]" and raw.endswith("\n\n")

