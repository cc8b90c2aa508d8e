"""mesh.gateway.proxy helpers: header hygiene, bearer checks (the proxy itself runs in the e2e tests)."""

from __future__ import annotations

import pytest

from mesh.errors import MeshError
from mesh.gateway.headers import check_bearer, forwarded_names, upstream_headers


def test_upstream_headers_hygiene() -> None:
    client = [
        (b"host", b"gw"), (b"connection", b"keep-alive, x-request-id"), (b"x-request-id", b"1"), (b"te", b"trailers"),
        (b"authorization", b"Bearer client-key"), (b"content-length", b"5"), (b"x-session-id", b"s1"),
        (b"content-type", b"text/plain"), (b"cookie", b"sid=1"), (b"x-forwarded-for", b"6.6.6.6"), (b"traceparent", b"00-a"),
        (b"x-tenant", b"t1"),
    ]  # fmt: skip
    allowed = forwarded_names([], "x-session-id", forward_authorization=False)
    # the client's x-request-id is replaced by the request's (mesh.gateway.request_id), never repeated
    assert upstream_headers(client, allowed, b"rid-1") == [b"content-type: application/json\r\nx-request-id: rid-1\r\n",
                                                           b"x-session-id: s1\r\n", b"traceparent: 00-a\r\n"]
    with_auth = forwarded_names(["X-Tenant", "Host"], "x-session-id", forward_authorization=True)
    lines = upstream_headers(client, with_auth, b"rid-1")
    assert b"authorization: Bearer client-key\r\n" in lines and b"x-tenant: t1\r\n" in lines
    assert not any(line.startswith((b"host:", b"cookie:")) for line in lines)  # hop-by-hop never, named or not
    with pytest.raises(MeshError) as info:
        upstream_headers([(b"traceparent", b"v\r\nx-injected: 1")], allowed, b"rid-1")
    assert info.value.status == 400


@pytest.mark.parametrize(
    ("value", "ok"),
    [(b"Bearer k2", True), (b"bearer k1", True), (b"Bearer k3", False), (b"k1", False), (b"Bearer ", False), (None, False)],
)
def test_check_bearer(value: bytes | None, ok: bool) -> None:
    headers = [] if value is None else [(b"authorization", value)]
    if ok:
        check_bearer(headers, ["k1", "k2"], "API key")
        return
    with pytest.raises(MeshError) as info:
        check_bearer(headers, ["k1", "k2"], "API key")
    assert info.value.status == 401 and info.value.headers == {"www-authenticate": "Bearer"}
