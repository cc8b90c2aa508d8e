"""Request ids: the client's ``x-request-id`` when it is a sane one, else one the gateway makes.

The id goes to the worker (``x-request-id``, replacing the client's), back to the client (the
response's ``x-request-id``), into the gateway's log lines about the request and its access log
line. A client's id is kept when it is 1 to ``MAX_LENGTH`` printable ASCII characters (no space:
it is written unquoted in log lines); anything else is replaced, never refused.

A made-up id is a random per-process prefix and a counter (``<16 hex>-<hex count>``): unique
across restarts and replicas for any practical purpose, and ~0.2 us (``uuid4`` reads the OS's
random source on every call).
"""

from __future__ import annotations

import itertools
import re
import secrets

HEADER = b"x-request-id"
MAX_LENGTH = 128
_SANE = re.compile(rb"[!-~]{1,%d}" % MAX_LENGTH)


class RequestIds:
    """Makes the ids of one gateway process's requests."""

    __slots__ = ("_prefix", "_count")

    def __init__(self) -> None:
        self._prefix = secrets.token_hex(8).encode()
        self._count = itertools.count(1)

    def of(self, headers: list[tuple[bytes, bytes]]) -> bytes:
        """The request's id: its ``x-request-id`` if sane (the first one), else a new one."""
        for key, value in headers:
            if key == HEADER:
                if _SANE.fullmatch(value) is not None:
                    return value
                break
        return b"%s-%x" % (self._prefix, next(self._count))
