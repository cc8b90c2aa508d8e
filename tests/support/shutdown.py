"""Requests in flight across a gateway's or a worker's shutdown: each runs in a thread and keeps
what its client saw (a stream's data lines, a status and body, or the exception that ended it),
and a probe for a listener that no longer serves new connections."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx

LONG = {"model": "echo", "prompt": "a b c d", "max_tokens": 1000, "stream": True}


class StreamReader:
    """Reads one streamed request in a thread: its SSE data lines, or the exception that ended it."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        self.lines: list[str] = []
        self.error: BaseException | None = None
        self.status = 0
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self.thread.start()

    def _run(self, url: str, body: dict[str, Any]) -> None:
        try:
            with httpx.stream("POST", url, json=body, timeout=60) as resp:
                self.status = resp.status_code
                for line in resp.iter_lines():
                    if line:
                        self.lines.append(line)
                        self.started.set()
        except Exception as exc:  # noqa: BLE001  (what the client saw is the result)
            self.error = exc
        self.started.set()

    def join(self) -> None:
        self.thread.join(30)
        assert not self.thread.is_alive(), "the stream never ended"

    def events(self) -> list[Any]:
        return [json.loads(line[6:]) for line in self.lines if line.startswith("data: {")]


class PlainRequest:
    """One non-streamed request in a thread: its status and JSON body, or what ended it."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        self.status = 0
        self.body: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self.thread.start()

    def _run(self, url: str, body: dict[str, Any]) -> None:
        try:
            resp = httpx.post(url, json=body, timeout=60)
            self.status, self.body = resp.status_code, resp.json()
        except Exception as exc:  # noqa: BLE001  (what the client saw is the result)
            self.error = exc

    def join(self) -> None:
        self.thread.join(30)
        assert not self.thread.is_alive(), "the request never ended"


def refused(port: int) -> bool:
    """No new connection is served: refused, or reset (a probe that reached the backlog as the
    listener closed is reset by the kernel, not answered)."""
    try:
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
        return True
    return False
