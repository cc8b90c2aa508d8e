"""Header rules of the data plane: what is forwarded each way, and the bearer-key check.

Requests go upstream with the client's headers minus the hop-by-hop ones (RFC 9110: the fixed
set and any named in ``Connection``), minus what the proxy sets itself, minus Authorization
unless ``server.forward_authorization``; a header holding CR, LF or NUL is refused (injection).
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
RESPONSE_DROP = HOP_BY_HOP | {b"server", b"date"}
# Set by the proxy, never taken from the client: a client's data-parallel rank would come first
# and a vLLM worker would follow it over the router's choice.
ROUTER_SET = frozenset({b"content-type", b"x-data-parallel-rank"})
JSON_HEADERS = [(b"content-type", b"application/json")]
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


def upstream_headers(client: list[tuple[bytes, bytes]], forward_authorization: bool) -> list[bytes]:
    """Client headers as request lines, minus hop-by-hop ones (RFC 9110: the fixed set and any
    named in ``Connection``) and Authorization unless configured; rejects CR/LF/NUL (injection)."""
    out = [b"content-type: application/json\r\n"]
    named: frozenset[bytes] = frozenset()
    for key, value in client:
        if key == b"connection":
            named = named | {t.strip().lower() for t in value.split(b",")}
    for key, value in client:
        if key in HOP_BY_HOP or key in ROUTER_SET or (key == b"authorization" and not forward_authorization):
            continue
        if named and key in named:
            continue
        if _BAD_HEADER_BYTES.search(value) or _BAD_HEADER_BYTES.search(key):
            raise MeshError(400, "header contains a control character", code="invalid_header")
        out.append(b"%s: %s\r\n" % (key, value))
    return out


def response_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """A worker's answer headers for the client: hop-by-hop ones, ``server`` and ``date`` dropped."""
    return [(k, v) for k, v in headers if k not in RESPONSE_DROP]
