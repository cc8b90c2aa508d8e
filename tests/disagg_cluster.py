"""A disaggregated test cluster: bundled tiny-preset workers with roles as real processes (on
loopback, or each in its own network namespace), a ``Router`` over them with a prefill/decode
pipeline, and the gateway relay (``mesh.gateway.disagg_relay``) driven from the test process.

Shared by ``test_disagg.py`` (loopback, fault injection) and ``test_disagg_netns.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from mesh.core.keys import block_keys, namespace_seed
from mesh.core.router import Router
from mesh.gateway.disagg_relay import DecodeQueue, RelayConfig, RelayError, RelayStats, relay_disaggregated
from policies import create_policy
from policies.base import Decision, RequestInfo, Role, TargetState
from tests.procs import REPO, Proc, ProcessGroup, free_port
from workers.transfer.auth import SECRET_ENV

MODEL = "tiny"
SECRET = "test-deployment-secret"  # shared by a cluster's workers: kv_transfer_params are signed
BS = 16
PD_POLICY = {
    "name": "pipeline",
    "params": {
        "profiles": {
            "prefill": {"scorers": [{"name": "prefix", "weight": 2}, {"name": "prefill_load", "weight": 1}]},
            "decode": {"filters": ["healthy", "model_match", "admission_headroom"],
                       "scorers": [{"name": "load", "weight": 1}]},
        },
    },
}
LEAK_KEYS = ("leaked_blocks", "pinned_blocks", "pinned_states", "transfers_active", "admission_pending",
             "admission_pending_bytes")


@dataclass
class Worker:
    name: str
    role: Role
    url: str
    proc: Proc
    host: str


def worker_command(port: int, role: str, host: str = "127.0.0.1", *extra: str, model: str = MODEL) -> list[str]:
    return [sys.executable, "-m", "workers.server.cli", "--preset", model, "--host", host, "--port", str(port),
            "--num-kv-blocks", "256", "--cpu-threads", "1", "--log-level", "warning", "--role", role, *extra]


def wait_healthy(url: str, proc: Proc, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.log_tail()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{proc.name} not healthy within {timeout_s} s:\n{proc.log_tail()}")


@dataclass
class Cluster:
    group: ProcessGroup
    workers: dict[str, Worker] = field(default_factory=dict)
    model: str = MODEL  # the preset its workers start with (``extra`` may name another) and serve

    def start(self, name: str, role: str, *extra: str, host: str = "127.0.0.1", prefix: list[str] | None = None,
              faults: bool = True, secret: str | None = SECRET) -> Worker:
        """Start a worker (not waiting for it: call ``wait`` after starting several). Workers of
        a cluster share ``secret`` (signed kv_transfer_params); None starts one without."""
        port = free_port() if host == "127.0.0.1" else 8000
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               **({"MESH_KV_TRANSFER_FAULTS": "1"} if faults else {}),
               SECRET_ENV: secret or ""}
        command = worker_command(port, role, host, *extra, model=self.model)
        proc = self.group.start((prefix or []) + command, name=name, port=port, env=env)
        w = Worker(name, Role(role), f"http://{host}:{port}", proc, host)
        self.workers[name] = w
        return w

    def wait(self) -> None:
        for w in self.workers.values():
            if w.proc.alive() or w.proc.popen.returncode is None:
                wait_healthy(w.url, w.proc)

    def alive(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.proc.alive()]

    def router(self, names: list[str] | None = None) -> Router:
        targets = {
            w.name: TargetState(id=w.name, worker=w.name, url=w.url, role=w.role, models=frozenset({self.model}),
                                block_size=BS)
            for w in self.workers.values() if (names is None or w.name in names) and w.role is not Role.MIXED
        }
        return Router(create_policy(PD_POLICY), targets)


def request_info(prompt: list[int], max_tokens: int, model: str = MODEL) -> RequestInfo:
    keys = block_keys(prompt, BS, namespace_seed(model))
    return RequestInfo(model=model, block_keys=keys, block_size=BS, prompt_tokens=len(prompt), max_tokens=max_tokens)


def completion(prompt: list[int], max_tokens: int = 16, stream: bool = False, model: str = MODEL) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def prompt_tokens(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(1, 256) for _ in range(n)]


@dataclass
class Answer:
    status: int
    text: str
    usage: dict[str, Any] | None
    prefill: str
    decode: str
    prefill_usage: dict[str, Any] | None
    raw: bytes


async def relay(router: Router, body: dict[str, Any], *, path: str = "/v1/completions",
                decision: Decision | None = None, stats: RelayStats | None = None, queue: DecodeQueue | None = None,
                config: RelayConfig | None = None, info: RequestInfo | None = None) -> Answer:
    """One request through ``relay_disaggregated``; the whole body read and parsed."""
    if info is None:
        prompt = body["prompt"] if isinstance(body.get("prompt"), list) else [1] * 64
        info = request_info(prompt, body.get("max_tokens", 16), body.get("model", MODEL))
    decision = decision or router.decide(info, time.monotonic())
    async with httpx.AsyncClient() as client:
        resp = await relay_disaggregated(client, router, info, body, decision, path=path, stats=stats, queue=queue,
                                         config=config)
        try:
            raw = b"".join([chunk async for chunk in resp.body()])
        finally:
            await resp.aclose()
    text, usage = parse_answer(raw, bool(body.get("stream")), path)
    return Answer(resp.status, text, usage, resp.prefill, resp.decode, resp.prefill_usage, raw)


def parse_answer(raw: bytes, stream: bool, path: str) -> tuple[str, dict[str, Any] | None]:
    chat = "chat" in path
    if not stream:
        obj = json.loads(raw)
        choice = obj["choices"][0]
        return (choice["message"]["content"] if chat else choice["text"]), obj.get("usage")
    text, usage = "", None
    for line in raw.decode().splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        obj = json.loads(line[6:])
        if "error" in obj:
            raise RuntimeError(f"stream error: {obj}")
        usage = obj.get("usage") or usage
        for c in obj.get("choices", []):
            text += (c.get("delta", {}).get("content") or "") if chat else c.get("text", "")
    return text, usage


def direct(url: str, body: dict[str, Any], path: str = "/v1/completions") -> tuple[str, dict[str, Any] | None]:
    """The same request answered by one worker (the mixed reference)."""
    r = httpx.post(url + path, json=body, timeout=120)
    r.raise_for_status()
    return parse_answer(r.content, bool(body.get("stream")), path)


def status(url: str) -> dict[str, Any]:
    return dict(httpx.get(f"{url}/kv_transfer/status", timeout=30).json())


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(mesh_worker_\w+) (\S+)$", text, re.M)}


def assert_no_leaks(workers: list[Worker], timeout_s: float = 10.0) -> None:
    """Every worker idle: no leaked, pinned or in-use block, no live transfer or pending
    admission (read from /metrics, waiting for background releases to land)."""
    deadline = time.monotonic() + timeout_s
    bad: dict[str, dict[str, float]] = {}
    while True:
        bad = {}
        for w in workers:
            s = status(w.url)  # a fresh leak check (/metrics reuses one for up to 30 s)
            values = {k: float(s[k]) for k in LEAK_KEYS}
            values["kv_blocks_used"] = metrics(w.url)["mesh_worker_kv_blocks_used"]
            if any(values.values()):
                bad[w.name] = values
        if not bad or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not bad, f"blocks or transfers left over: {bad}"


def set_faults(url: str, **faults: Any) -> None:
    httpx.post(f"{url}/kv_transfer/faults", json=faults, timeout=10).raise_for_status()


async def wait_for(predicate: Any, timeout_s: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def astatus(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient() as client:
        return dict((await client.get(f"{url}/kv_transfer/status", timeout=30)).json())


def assert_leases_settled(router: Router) -> None:
    """Remote request accounting is exact: every lease the relay took was finished once."""
    for t in router.targets.values():
        assert (t.in_flight, t.prefill_tokens, t.decode_tokens) == (0, 0, 0), f"{t.id} load left over: {t}"


__all__ = ["Answer", "Cluster", "RelayError", "Worker", "assert_leases_settled", "assert_no_leaks", "astatus",
           "completion", "direct", "metrics", "prompt_tokens", "relay", "request_info", "set_faults", "status",
           "wait_for"]
