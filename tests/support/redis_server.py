"""A real ``redis-server`` for the tests of shared session state: a process on a free port, without
persistence, restartable on that port, and the module-scoped ``server`` fixture that runs one.
Importing this module fails at once where redis-server is not installed."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator

import pytest
import redis

from tests.procs import Proc, ProcessGroup, free_port, kill_process, wait_until

if shutil.which("redis-server") is None:  # .ci/run installs it; so does `apt-get install redis-server`
    raise RuntimeError("redis-server is not installed: apt-get install -y redis-server")


class RedisServer:
    """A real redis-server on a fixed free port, without persistence; restartable on that port."""

    def __init__(self, procs: ProcessGroup) -> None:
        self.procs = procs
        self.port = free_port()
        self.proc: Proc | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        cmd = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.proc = self.procs.start(cmd, name=f"redis-{self.port}-{time.monotonic_ns()}", port=self.port)
        wait_until(self.pings, what="redis-server answering PING")

    def kill(self) -> None:
        if self.proc is not None:
            kill_process(self.proc)

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, decode_responses=True, socket_timeout=2)

    def pings(self) -> bool:
        try:
            with self.client() as c:
                return bool(c.ping())
        except redis.RedisError:
            return False


@pytest.fixture(scope="module")
def server(module_procs: ProcessGroup) -> Iterator[RedisServer]:
    srv = RedisServer(module_procs)
    srv.start()
    yield srv
    srv.kill()
