"""Helpers for end-to-end tests over bundled-engine workers (real processes, real ZMQ, real HTTP).

``tests/e2e/routing/test_e2e_cache_routing.py`` and ``tests/e2e/sessions/test_e2e_sessions.py`` use them: tiny-preset
workers publishing KV events, gateway processes from a YAML config, multi-turn chat sessions
whose every turn extends the previous prompt with the assistant's reply, and small readers of
``/metrics``, ``/debug/route`` and ``/workers``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.procs import PYTHON, Proc, ProcessGroup, free_port, wait_http, wait_until

ADMIN_KEY = "admin-secret"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
BLOCK = 16  # the workers' and the gateway's block size
MODEL = "tiny"
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


@dataclass
class BundledWorker:
    name: str
    proc: Proc
    kv_port: int
    replay_port: int
    hybrid: bool = False  # a hybrid preset (recurrent layers): the gateway's workers[].hybrid

    def config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "url": self.proc.url,
            "block_size": BLOCK,
            "kv_events": {"endpoint": f"tcp://127.0.0.1:{self.kv_port}",
                          "replay_endpoint": f"tcp://127.0.0.1:{self.replay_port}"},
            **({"hybrid": True} if self.hybrid else {}),
        }


def start_workers(procs: ProcessGroup, names: list[str], *, num_kv_blocks: int = 4096,
                  wait: bool = True, preset: str = "tiny", extra: tuple[str, ...] = ()) -> dict[str, BundledWorker]:
    """Start every worker, then (``wait``) wait for all: start-up runs in parallel. A preset other
    than tiny is served under tiny's name (the helpers' requests name model "tiny")."""
    out = {}
    for name in names:
        port, kv, replay = free_port(), free_port(), free_port()
        cmd = [PYTHON, "-m", "workers.server.cli", "--preset", preset, "--served-model-name", MODEL,
               "--host", "127.0.0.1", "--port", str(port),
               "--block-size", str(BLOCK), "--num-kv-blocks", str(num_kv_blocks), "--cpu-threads", "1",
               "--max-model-len", "8192", "--log-level", "warning",
               # vLLM's convention: the publisher binds a wildcard address, the gateway connects
               "--kv-events-endpoint", f"tcp://*:{kv}", "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}"]
        cmd += list(extra)
        out[name] = BundledWorker(name, procs.start(cmd, name=name, port=port), kv, replay, hybrid="hybrid" in preset)
    if wait:
        wait_workers(out)
    return out


def wait_workers(workers: dict[str, BundledWorker]) -> None:
    for w in workers.values():
        wait_http(w.proc.url + "/health", proc=w.proc, timeout_s=180)


def write_config(path: Path, workers: list[BundledWorker], **extra: Any) -> Path:
    """A gateway config over ``workers``; no ``policy`` key unless given (the default policy)."""
    data: dict[str, Any] = {
        "server": {"admin_key": ADMIN_KEY, "request_timeout_s": 60},
        "workers": [w.config() for w in workers],
        "health": {"interval_s": 0.3, "timeout_s": 1, "unhealthy_threshold": 1},
        "retries": {"max_attempts": 3, "backoff_base_s": 0.01},
        **extra,
    }
    path.write_text(yaml.safe_dump(data))
    return path


def start_gateway(procs: ProcessGroup, config: Path, name: str, env: dict[str, str] | None = None) -> Proc:
    """A ``mesh serve`` process (not waited for: see ``Gateway.wait_ready``)."""
    port = free_port()
    cmd = [PYTHON, "-m", "mesh.commands.serve", "--config", str(config), "--port", str(port), "--log-level", "warning"]
    return procs.start(cmd, name=name, port=port, env=env)


@dataclass
class Turn:
    worker: str
    prompt_tokens: int
    cached_tokens: int
    reply: str


class Gateway:
    """An HTTP client of one gateway process, with readers for its debug and admin endpoints."""

    def __init__(self, proc: Proc) -> None:
        self.proc = proc
        self.http = httpx.Client(base_url=proc.url, timeout=60)

    def wait_ready(self, workers: int) -> None:
        """Every worker healthy and its KV event stream subscribed and trusted."""
        wait_http(self.proc.url + "/health", proc=self.proc, timeout_s=60)

        def ready() -> bool:
            ws = self.workers()
            healthy = len(ws) == workers and all(w["healthy"] for w in ws.values())
            streams = self.metric_values("mesh_kv_events_healthy")
            return healthy and len(streams) == workers and all(v == 1.0 for v in streams.values())

        wait_until(ready, 60, f"{self.proc.name}: {workers} healthy workers with live KV event streams")

    def workers(self) -> dict[str, dict[str, Any]]:
        resp = self.http.get("/workers", headers=ADMIN)
        assert resp.status_code == 200, resp.text
        return {w["name"]: w for w in resp.json()["workers"]}

    def in_flight(self, worker: str) -> int:
        return sum(t["in_flight"] for t in self.workers()[worker]["targets"])

    def chat(self, body: dict[str, Any], session: str | None = None) -> Turn:
        resp = self.http.post("/v1/chat/completions", json=body, headers=_session(session))
        assert resp.status_code == 200, resp.text
        data = resp.json()
        usage = data["usage"]
        return Turn(resp.headers["x-mesh-worker"], usage["prompt_tokens"],
                    usage["prompt_tokens_details"]["cached_tokens"], data["choices"][0]["message"]["content"])

    def chat_stream(self, body: dict[str, Any], session: str | None = None) -> Turn:
        """A streamed turn asking for the final usage chunk."""
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        text, usage, worker = [], None, ""
        with self.http.stream("POST", "/v1/chat/completions", json=body, headers=_session(session)) as resp:
            assert resp.status_code == 200, resp.read()
            worker = resp.headers["x-mesh-worker"]
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                assert "error" not in event, event
                if event.get("usage"):
                    usage = event["usage"]
                text.extend(c["delta"].get("content") or "" for c in event.get("choices", []))
        assert usage is not None, "no usage chunk"
        return Turn(worker, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], "".join(text))

    def route(self, body: dict[str, Any], session: str | None = None) -> dict[str, Any]:
        resp = self.http.post("/debug/route", json=body, headers=_session(session))
        assert resp.status_code == 200, resp.text
        return dict(resp.json())

    def metric_values(self, name: str) -> dict[str, float]:
        """Every sample of ``name``: label text (``target="w0"``, or "" without labels) -> value."""
        out = {}
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                head, value = line.rsplit(" ", 1)
                out[head[len(name):].strip("{}")] = float(value)
        return out

    def metric(self, name: str) -> float:
        return sum(self.metric_values(name).values())

    def close(self) -> None:
        self.http.close()


def _session(session: str | None) -> dict[str, str]:
    return {"x-session-id": session} if session else {}


def overlaps(explained: dict[str, Any]) -> dict[str, int]:
    """GPU overlap (blocks) per candidate of an explained decision."""
    return {tid: c["overlap"]["gpu_blocks"] for tid, c in explained["candidates"].items()}


@dataclass
class Conversation:
    """A chat session: every turn sends all previous messages, the replies and a new user message."""

    seed: int
    system: str = ""
    messages: list[dict[str, str]] = field(default_factory=list)
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        if self.system:
            self.messages.append({"role": "system", "content": self.system})

    def next_body(self, words: int = 14, **params: Any) -> dict[str, Any]:
        """The next turn's body (the user message is appended; call ``answered`` with the reply)."""
        text = f"session {self.seed}: " + " ".join(self.rng.choice(WORDS) for _ in range(words))
        self.messages.append({"role": "user", "content": text})
        return self.body(**params)

    def body(self, **params: Any) -> dict[str, Any]:
        return {"model": MODEL, "messages": list(self.messages), "max_tokens": 8, "temperature": 0, **params}

    def answered(self, reply: str) -> None:
        self.messages.append({"role": "assistant", "content": reply})


def shared_prefix(words: int, seed: int = 7) -> str:
    rng = random.Random(seed)
    return "You are a careful agent. " + " ".join(rng.choice(WORDS) for _ in range(words))
