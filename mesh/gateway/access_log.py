"""The JSON access log (``server.access_log: json``, ``mesh serve --access-log json``): one JSON
object a line per data-plane request, on the ``mesh.access`` logger (stdout unless the operator
gave that logger handlers of their own).

Off the request path: the proxy appends one tuple (``Entry``) to a bounded deque; a daemon
thread turns entries into lines and writes them every ``FLUSH_EVERY_S``. A writer that cannot
keep up (a blocked stdout) loses lines past ``MAX_PENDING``, counted and said in a WARNING on
the gateway's log, never by slowing requests.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # types only: the proxy imports this module
    from mesh.gateway.client_io import Exchange
    from mesh.request.prompt import ParsedRequest

log = logging.getLogger("mesh.gateway.access_log")
ACCESS_LOGGER = "mesh.access"
FLUSH_EVERY_S = 0.05
MAX_PENDING = 10_000

# time (epoch s, at the end), request id, method, path, status, model, worker, target, session id,
# prompt / cached / generation tokens (None: not reported), ttft (s, None: no answer), duration (s), client
Entry = tuple[float, bytes, str, str, int, str | None, str | None, str | None, str | None,
              int | None, int | None, int | None, float | None, float, str | None]
FIELDS = ("time", "request_id", "method", "path", "status", "model", "worker", "target", "session_id",
          "prompt_tokens", "cached_tokens", "generation_tokens", "ttft_s", "duration_s", "client")


def line(entry: Entry) -> str:
    """One entry as its JSON line (the time in RFC 3339, UTC, milliseconds)."""
    values: list[Any] = list(entry)
    t = values[0]
    values[0] = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"
    values[1] = entry[1].decode("ascii", "replace")
    for i in (12, 13):
        if values[i] is not None:
            values[i] = round(values[i], 6)
    return json.dumps(dict(zip(FIELDS, values, strict=True)), ensure_ascii=False, separators=(",", ":"))


class AccessLog:
    """Entries in, lines out on ``logger`` from a thread started with the first entry."""

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self.logger = logger or logging.getLogger(ACCESS_LOGGER)
        self._pending: deque[Entry] = deque()
        self.dropped = 0  # entries lost to a full deque (the writer fell behind)
        self._reported = 0  # drops already warned about
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def record(self, entry: Entry) -> None:
        """Queue one request's entry (the request path: an append, a thread started once)."""
        if len(self._pending) >= MAX_PENDING:
            self.dropped += 1
            return
        self._pending.append(entry)
        if self._thread is None:
            self._start()

    def _start(self) -> None:
        logger = self.logger
        if not logger.handlers:  # the operator's own handlers win; else plain lines on stdout
            handler = logging.StreamHandler(sys.stdout)
            handler.setFormatter(logging.Formatter("%(message)s"))
            logger.addHandler(handler)
            logger.propagate = False
        logger.setLevel(logging.INFO)
        self._thread = threading.Thread(target=self._run, name="mesh-access-log", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(FLUSH_EVERY_S):
            self._drain()
        self._drain()

    def _drain(self) -> None:
        pending = self._pending
        while pending:
            try:
                self.logger.info(line(pending.popleft()))
            except Exception:  # a bad entry must not end the writer
                log.exception("access log: could not write an entry")
        if self.dropped != self._reported:
            log.warning("access log: %d lines dropped (the writer fell behind %d pending lines)",
                        self.dropped - self._reported, MAX_PENDING)
            self._reported = self.dropped

    def close(self, timeout_s: float = 2.0) -> None:
        """Write what is pending and stop the thread (the lifespan's end)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)


def access_entry(scope: MutableMapping[str, Any], state: Exchange, parsed: ParsedRequest | None, took: float) -> Entry:
    """The access log's entry of one request (``server.access_log: json``)."""
    target = state.served_by
    usage = state.usage or (None, None, None)
    client = scope.get("client")
    return (time.time(), state.request_id, scope.get("method", ""), scope.get("path", ""), state.status,
            parsed.info.model if parsed is not None else None, target.worker if target is not None else None,
            target.id if target is not None else None, parsed.info.session_id if parsed is not None else None,
            usage[0], usage[1], usage[2], state.ttft_s, took, f"{client[0]}:{client[1]}" if client else None)
