"""Header rules of the data plane: what is forwarded each way, and the bearer-key check.

Requests go upstream with the request's id (``mesh.gateway.request_id``) and the client headers
named by an allowlist (``forwarded_names``: tracing, the session header, ``server.forward_headers``, Authorization with
``server.forward_authorization``), never a hop-by-hop one (RFC 9110: the fixed set and any named
in ``Connection``) nor what the proxy sets itself; a header holding CR, LF or NUL is refused
(injection). Cookies, ``X-Forwarded-For`` and the like are not a worker's business.
Answers come back minus hop-by-hop headers, ``server`` and ``date``. Header names are the
lower-case bytes ASGI servers give.
"""

from __future__ import annotations

import hmac
import re

from mesh.errors import MeshError

# Never forwarded in either direction (RFC 9110 hop-by-hop, plus what the proxy recomputes).
HOP_BY_HOP = frozenset(
    b"connection keep-alive proxy-authenticate proxy-authorization proxy-connection te trailer trailers "
    b"transfer-encoding upgrade host content-length expect".split()
)
# x-request-id: the gateway sends its own (``mesh.gateway.request_id``), one of the worker's would repeat it
RESPONSE_DROP = HOP_BY_HOP | {b"server", b"date", b"x-request-id"}
# Set by the proxy, never taken from the client: a client's data-parallel rank would come first
# and a vLLM worker would follow it over the router's choice; the request id is the gateway's
# (the client's when sane, ``mesh.gateway.request_id``).
ROUTER_SET = frozenset({b"content-type", b"x-data-parallel-rank", b"x-request-id"})
JSON_HEADERS = [(b"content-type", b"application/json")]
# Client headers a worker sees by default: what clients send and engines read (the W3C trace
# context), nothing that identifies the client's network or browser. vLLM also reads x-request-id:
# every request carries one (the client's when sane), set by the proxy (ROUTER_SET).
FORWARDED = frozenset(b"accept user-agent traceparent tracestate baggage".split())
_BAD_HEADER_BYTES = re.compile(rb"[\r\n\0]")


def header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    """The first value of ``name`` (lower-case, as ASGI servers give names), or None."""
    for key, value in headers:
        if key == name:
            return value
    return None


def check_bearer(headers: list[tuple[bytes, bytes]], keys: list[str], what: str) -> None:
    """Raise 401 unless ``Authorization: Bearer <one of keys>`` is present (constant-time compare)."""
    value = header(headers, b"authorization")
    token = value[7:].strip() if value is not None and value[:7].lower() == b"bearer " else b""
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(token, key.encode())
    if not token or not ok:
        raise MeshError(401, f"missing or invalid {what} (send 'Authorization: Bearer <key>')", code="invalid_api_key",
                        headers={"www-authenticate": "Bearer"})


def forwarded_names(forward_headers: list[str], session_header: str, forward_authorization: bool) -> frozenset[bytes]:
    """The client header names forwarded to workers (lower-case bytes)."""
    names = FORWARDED | {h.lower().encode() for h in forward_headers} | {session_header.lower().encode()}
    if forward_authorization:
        names |= {b"authorization"}
    return names - HOP_BY_HOP - ROUTER_SET


def forwarded(client: list[tuple[bytes, bytes]], allowed: frozenset[bytes]) -> list[tuple[bytes, bytes]]:
    """The client headers in ``allowed`` and not named in ``Connection``; rejects CR/LF/NUL (injection)."""
    named: frozenset[bytes] = frozenset()
    for key, value in client:
        if key == b"connection":
            named = named | {t.strip().lower() for t in value.split(b",")}
    out = []
    for key, value in client:
        if key not in allowed or (named and key in named):
            continue
        if _BAD_HEADER_BYTES.search(value):
            raise MeshError(400, "header contains a control character", code="invalid_header")
        out.append((key, value))
    return out


def upstream_headers(client: list[tuple[bytes, bytes]], allowed: frozenset[bytes], request_id: bytes) -> list[bytes]:
    """``forwarded`` headers as request lines, after the proxy's own content type and the request's id."""
    return [b"content-type: application/json\r\nx-request-id: %s\r\n" % request_id,
            *(b"%s: %s\r\n" % kv for kv in forwarded(client, allowed))]


def response_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """A worker's answer headers for the client: hop-by-hop ones, ``server`` and ``date`` dropped."""
    return [(k, v) for k, v in headers if k not in RESPONSE_DROP]
