"""What the reliability tests of hung, garbage and killed workers share: a gateway started on a
config of theirs, its /workers view, and requests that record how they ended."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.procs import Proc, ProcessGroup, free_port

ADMIN = {"authorization": "Bearer adm"}


def start_gateway(procs: ProcessGroup, workers: list[dict[str, Any]], **sections: Any) -> Proc:
    """A gateway over ``workers``; ``sections`` override whole config sections (``server`` is merged)."""
    server = {"admin_key": "adm", **sections.pop("server", {})}
    config = {"server": server, "workers": workers, **sections}
    path = Path(procs.log_dir) / f"gateway-{free_port()}.yaml"
    path.write_text(yaml.safe_dump(config))
    return procs.gateway(path, port=free_port(), ready_path="/ready")


def worker_view(gateway: Proc, name: str) -> dict[str, Any]:
    workers = httpx.get(f"{gateway.url}/workers", headers=ADMIN, timeout=10).json()["workers"]
    return next(w for w in workers if w["name"] == name)


@dataclass
class Outcome:
    """How one request ended, as its client saw it."""

    stream: bool
    status: int
    worker: str | None
    seconds: float
    events: list[str]  # a stream's data payloads ([] for a non-stream answer)
    body: bytes

    @property
    def whole(self) -> bool:
        """A 200 that is a complete answer: a JSON object, or a stream ending ``[DONE]`` with no error."""
        if self.status != 200:
            return False
        if not self.stream:
            try:
                return isinstance(json.loads(self.body), dict)
            except ValueError:
                return False
        return bool(self.events) and self.events[-1] == "[DONE]" and not any('"error"' in e for e in self.events)

    @property
    def cut_cleanly(self) -> bool:
        """A 200 stream that broke after its first byte: an OpenAI error event, then ``[DONE]``."""
        return (self.stream and self.status == 200 and len(self.events) >= 2 and self.events[-1] == "[DONE]"
                and "error" in json.loads(self.events[-2]))


def sse_data(raw: bytes) -> list[str]:
    return [line[5:].strip() for line in raw.decode().splitlines() if line.startswith("data:")]


def request(client: httpx.Client, stream: bool, prompt: str = "hello there world", max_tokens: int = 4,
            model: str = "m") -> Outcome:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    start = time.monotonic()
    with client.stream("POST", "/v1/completions", json=body) as resp:
        raw = resp.read()
    seconds = time.monotonic() - start
    events = sse_data(raw) if stream and resp.headers.get("content-type", "").startswith("text/event-stream") else []
    return Outcome(stream, resp.status_code, resp.headers.get("x-mesh-worker"), seconds, events, raw)
