"""Process helpers the benchmarks share: loopback ports and stopping a child's process group.

Every benchmark starts its children with ``start_new_session=True``, so a child and whatever it
spawns form one process group that ``stop_group`` ends (SIGTERM, then SIGKILL if it lingers).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports free a moment ago (all bound at once, so never repeated)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


def stop_group(popen: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGTERM the child's process group; SIGKILL it if it has not exited after ``timeout_s``."""
    if popen.poll() is not None:
        return
    try:
        os.killpg(popen.pid, signal.SIGTERM)
        popen.wait(timeout_s)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        try:
            os.killpg(popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        popen.wait()
