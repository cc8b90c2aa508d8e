"""A gateway with ``server.client_write_timeout_s`` set, for the tests of clients that stop reading:
its load, health and write-timeout count as a test reads them, and a check that it dropped a
client's connection."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import yaml

from tests.procs import Proc, ProcessGroup, free_port

ADMIN = {"authorization": "Bearer adm"}
WRITE_TIMEOUT_S = 1.0  # the request timeout is a minute: only the write timeout can end these requests
WORD = "w" * 1024


@dataclass
class Gateway:
    proc: Proc
    http: httpx.Client

    def workers(self) -> dict[str, dict[str, Any]]:
        return {w["name"]: w for w in self.http.get("/workers", headers=ADMIN).json()["workers"]}

    def load(self) -> dict[str, tuple[int, int, int]]:
        return {t["id"]: (t["in_flight"], t["prefill_tokens"], t["decode_tokens"])
                for w in self.workers().values() for t in w["targets"]}

    def idle(self) -> bool:
        return all(v == (0, 0, 0) for v in self.load().values())

    def write_timeouts(self) -> float:
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith("mesh_client_write_timeouts_total "):
                return float(line.split()[-1])
        raise AssertionError("mesh_client_write_timeouts_total is not exported")

    def healthy(self, name: str) -> None:
        worker = self.workers()[name]
        assert worker["healthy"] and worker["circuit"] == "closed" and worker["last_error"] is None, worker


def write_timeout_gateway(procs: ProcessGroup, name: str, workers: list[dict[str, Any]], **extra: Any) -> Iterator[Gateway]:
    """A gateway process over ``workers`` whose client write timeout is ``WRITE_TIMEOUT_S`` (and a
    minute's request timeout), with a client of its own; ``extra``: more config sections."""
    path = procs.log_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "server": {"admin_key": "adm", "request_timeout_s": 60, "client_write_timeout_s": WRITE_TIMEOUT_S},
        # one failure would open a circuit: a client's stall counted against its worker shows at once
        "circuit_breaker": {"failure_threshold": 1, "open_s": 60},
        "health": {"interval_s": 60},
        "workers": workers, **extra,
    }))
    proc = procs.gateway(path, port=free_port(), name=name, ready_path="/ready")
    with httpx.Client(base_url=proc.url, timeout=30) as http:
        yield Gateway(proc, http)


def dropped(sock: socket.socket) -> bool:
    """The gateway closed the client's connection: what is buffered reads out, then EOF or a reset."""
    sock.settimeout(10)
    try:
        while sock.recv(1 << 16):
            pass
    except ConnectionResetError:
        pass
    return True
