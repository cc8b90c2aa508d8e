"""Real processes for end-to-end tests: free ports, start, wait until an HTTP endpoint answers, stop.

Generic on purpose (gateway, echo workers, bundled engine workers, peers): every process runs in
its own process group, with stdout and stderr in a log file whose tail is shown when it fails.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
# The shared traces lie beside the checkout (CI lays a copy of shared/ there); /work/shared is
# where a developer's session has them.
SHARED_TRACES = next(
    (p for p in (REPO.parent / "shared" / "traces", Path("/work/shared/traces")) if p.is_dir()),
    REPO.parent / "shared" / "traces",
)
PYTHON = sys.executable


# Test ports come from below the kernel's ephemeral range, which outbound connections draw from:
# a port found free here cannot be taken by some client's connect() before its server binds it
# (an OS-picked port 0 can). Each test process walks its own stride of the range (by pid), and
# never hands out a port twice (processes started back to back before any binds).
_PORTS_LO, _PORTS_HI = 20_000, 32_000
_HANDED_OUT: set[int] = set()
_cursor = _PORTS_LO + (os.getpid() * 97) % (_PORTS_HI - _PORTS_LO)


def free_port(host: str = "127.0.0.1") -> int:
    """A port outside the ephemeral range, free now, not handed out before in this process."""
    global _cursor
    for _ in range(_PORTS_HI - _PORTS_LO):
        port, _cursor = _cursor, _PORTS_LO + (_cursor + 1 - _PORTS_LO) % (_PORTS_HI - _PORTS_LO)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free port in [{_PORTS_LO}, {_PORTS_HI})")


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    port: int | None = None
    meta: dict[str, object] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def start_process(
    cmd: list[str],
    *,
    name: str,
    log_dir: Path,
    port: int | None = None,
    env: dict[str, str] | None = None,
    cwd: Path = REPO,
) -> Proc:
    log_path = log_dir / f"{name}.log"
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=cwd, start_new_session=True
        )
    return Proc(name, popen, log_path, port)


def wait_http(url: str, *, proc: Proc | None = None, timeout_s: float = 30.0, status: int = 200) -> None:
    """Poll ``url`` until it answers ``status``; fail fast (with the log tail) if ``proc`` exits."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive():
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode} before {url} was up:\n{proc.log_tail()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == status:
                    return
                last = f"status {resp.status}"
        except urllib.error.HTTPError as exc:
            if exc.code == status:
                return
            last = f"status {exc.code}"
        except OSError as exc:
            last = str(exc)
        time.sleep(0.05)
    tail = f"\n{proc.log_tail()}" if proc is not None else ""
    raise TimeoutError(f"{url} did not answer {status} within {timeout_s} s (last: {last}){tail}")


def stop_process(proc: Proc, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> int | None:
    """Signal the whole process group; SIGKILL it if it lingers. Returns the exit code."""
    if proc.alive():
        try:
            os.killpg(proc.pid, sig)
            proc.popen.wait(timeout_s)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            kill_process(proc)
    return proc.popen.returncode


def kill_process(proc: Proc) -> None:
    """SIGKILL the process group (a crash, as far as its peers can tell)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.popen.wait()


class ProcessGroup:
    """Starts processes for one test (or module) and stops all of them at teardown."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[Proc] = []

    def start(self, cmd: list[str], *, name: str, port: int | None = None, env: dict[str, str] | None = None) -> Proc:
        proc = start_process(cmd, name=name, log_dir=self.log_dir, port=port, env=env)
        self.procs.append(proc)
        return proc

    def start_http(
        self,
        cmd: list[str],
        *,
        name: str,
        port: int,
        ready_path: str = "/health",
        timeout_s: float = 30.0,
        env: dict[str, str] | None = None,
    ) -> Proc:
        proc = self.start(cmd, name=name, port=port, env=env)
        wait_http(f"http://127.0.0.1:{port}{ready_path}", proc=proc, timeout_s=timeout_s)
        return proc

    def echo_worker(self, name: str, *extra: str, port: int | None = None, timeout_s: float = 30.0) -> Proc:
        port = port or free_port()
        cmd = [PYTHON, "-m", "mesh.echo_worker", "--port", str(port), "--name", name, *extra]
        return self.start_http(cmd, name=name, port=port, timeout_s=timeout_s)

    def gateway(self, config_path: Path, *, port: int, name: str = "gateway", ready_path: str = "/health") -> Proc:
        cmd = [PYTHON, "-m", "mesh.commands.serve", "--config", str(config_path), "--port", str(port), "--log-level", "warning"]
        return self.start_http(cmd, name=name, port=port, ready_path=ready_path)

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            stop_process(proc)
        self.procs.clear()


def wait_until(check: Callable[[], Any], timeout_s: float = 20.0, what: str = "condition") -> Any:
    """Poll ``check`` until it returns something truthy (returned); AssertionError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s} s")
        time.sleep(0.05)


def stalled_client(port: int, body: dict[str, Any], path: str = "/v1/completions") -> socket.socket:
    """A client that sends its request, keeps its socket open and never reads (a 4 KiB receive
    buffer, so the gateway's writes to it soon block)."""
    import json

    data = json.dumps(body).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%s" % (path.encode(), len(data), data))
    return sock
