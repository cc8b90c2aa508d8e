"""A Redis outage is one warning when it starts and one when Redis answers again (not debug lines
only, which left an operator mesh_state_backend_errors_total alone); a refused command names
another app's keys only when Redis said WRONGTYPE (not for an out-of-memory refusal).
Real redis-server processes, killed and restarted."""

from __future__ import annotations

import asyncio
import logging

import pytest

from mesh.state.redis_state import RedisStateBackend
from tests.procs import ProcessGroup
from tests.support.redis_server import RedisServer


def test_an_outage_is_logged_once_when_it_starts_and_once_when_it_ends(
        procs: ProcessGroup, caplog: pytest.LogCaptureFixture) -> None:
    srv = RedisServer(procs)
    srv.start()

    async def go() -> None:
        backend = RedisStateBackend(srv.url, 60.0, timeout_s=0.2, retry_after_s=0.0)
        assert await backend.set_session("s", "w0", 0.0) is False
        srv.kill()
        for _ in range(5):
            assert await backend.get_session("s", 0.0) is None  # local answers, no raise
        srv.start()
        assert await backend.get_session("s", 0.0) is None  # a fresh server: nothing shared yet
        await backend.aclose()

    with caplog.at_level(logging.WARNING, logger="mesh.state.redis_state"):
        asyncio.run(go())
    lines = [r.getMessage() for r in caplog.records]
    assert sum("unreachable" in m for m in lines) == 1, lines
    # The cause (redis-py 8's repr is only "network:ConnectionError") and the node that failed.
    down = next(m for m in lines if "unreachable" in m)
    assert f"127.0.0.1:{srv.port}" in down and "ConnectionError: Conn" in down and "network:" not in down, down
    assert sum("answers again" in m for m in lines) == 1, lines
    assert all("pass" not in m for m in lines)


def test_an_out_of_memory_refusal_does_not_blame_another_apps_keys(
        procs: ProcessGroup, caplog: pytest.LogCaptureFixture) -> None:
    srv = RedisServer(procs)
    srv.start()
    with srv.client() as c:
        c.config_set("maxmemory", 1)
        c.config_set("maxmemory-policy", "noeviction")

    async def go() -> None:
        backend = RedisStateBackend(srv.url, 60.0, timeout_s=0.5)
        await backend.set_session("s", "w0", 0.0)
        await backend.aclose()

    with caplog.at_level(logging.WARNING, logger="mesh.state.redis_state"):
        asyncio.run(go())
    refused = [r.getMessage() for r in caplog.records if "refused a command" in r.getMessage()]
    assert refused and "maxmemory" in refused[0] and "another app" not in refused[0], refused
    srv.kill()
