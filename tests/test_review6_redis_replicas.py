"""Review 6: gateway replicas sharing one real redis-server (``state.backend: redis``).

- Bindings queued during a long outage are all written once Redis is back: one pipeline of every
  queued binding took longer than the call's time bound past ~10k sessions, failed, was queued
  again with the newer ones, and so never got through again (sharing stopped for good).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import yaml

from mesh.state_redis import RedisStateBackend, SharedSessionTable
from tests.procs import PYTHON, ProcessGroup, free_port, kill_process, wait_until
from tests.test_state_redis import RedisServer, server  # noqa: F401 (server: the redis-server fixture)

CHAT = {"model": "echo", "messages": [{"role": "user", "content": "hello review six"}], "max_tokens": 2}
SKEW_S = 120  # replica B's wall clock is two minutes behind A's (and Redis's)
# A gateway process whose time.time() is SKEW_S behind: the host clock of a replica without NTP.
SKEWED = ("import runpy, sys, time; _t = time.time; time.time = lambda: _t() - %d; "
          "sys.argv = ['serve', *sys.argv[1:]]; runpy.run_module('mesh.commands.serve', run_name='__main__')")


def metric(http: httpx.Client, name: str, labels: str = "") -> float:
    text = http.get("/metrics").text
    labels_re = re.escape(labels) if labels else r"(?:\{[^}]*\})?"
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}{labels_re} (\S+)$", text, re.M))


def write_config(procs: ProcessGroup, name: str, workers: dict[str, str], url: str, prefix: str) -> str:
    data = {
        "workers": [{"name": n, "url": u} for n, u in workers.items()],
        "health": {"interval_s": 0.3, "timeout_s": 1, "unhealthy_threshold": 1},
        "sessions": {"idle_ttl_s": 30},
        "policy": {"name": "least_load"},
        "state": {"backend": "redis", "url": url, "key_prefix": prefix, "timeout_s": 0.5, "load_sync_s": 0.1},
    }
    path = procs.log_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def start_gateway(procs: ProcessGroup, config: str, name: str, skew_s: int = 0) -> httpx.Client:
    port = free_port()
    args = ["--config", config, "--port", str(port), "--log-level", "warning"]
    cmd = [PYTHON, "-c", SKEWED % skew_s, *args] if skew_s else [PYTHON, "-m", "mesh.commands.serve", *args]
    proc = procs.start_http(cmd, name=name, port=port)
    http = httpx.Client(base_url=proc.url, timeout=30)
    wait_until(lambda: http.get("/health").json()["healthy_workers"] >= 1, what=f"{name}'s workers healthy")
    return http


def test_bindings_queued_through_a_long_outage_are_all_written_once_redis_is_back(server: RedisServer) -> None:  # noqa: F811
    # 60k sessions bound locally while Redis was unreachable: one pipeline of all of them took
    # longer than 2 x timeout_s, failed, and was queued again whole, forever.
    n = 60_000
    prefix = "outage6:"

    async def go() -> int:
        backend = RedisStateBackend(server.url, 600, key_prefix=prefix, timeout_s=0.1, retry_after_s=0.05)
        table = SharedSessionTable(backend, 600)
        now = time.monotonic()
        for i in range(n):
            table.bind(f"out-{i}", "e0" if i % 2 else "e1", now)
        flusher = asyncio.create_task(table.run_flusher())
        try:
            deadline = time.monotonic() + 20
            while (table._pending or table._flushing) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        finally:
            flusher.cancel()
            with pytest.raises(asyncio.CancelledError):
                await flusher
            await backend.aclose()
        with server.client() as c:
            return sum(1 for _ in c.scan_iter(prefix + "s:*", count=10_000))

    assert asyncio.run(go()) == n
