"""Nothing listens beyond loopback unless told to (real processes, the kernel's socket table read):
``mesh up`` on its default host runs its workers, their KV event publishers and replay sockets on
127.0.0.1, on the ports ``--base-port`` pins; ``mesh worker`` without ``--host`` listens on
127.0.0.1, and so do its wildcard ``tcp://*:P`` KV event and replay endpoints."""

from __future__ import annotations

import httpx

from tests.procs import PYTHON, ProcessGroup, free_port, wait_http, wait_until


def listening(port: int) -> set[str]:
    """The local addresses a TCP socket listens on at ``port`` (IPv4 and IPv6), from /proc/net."""
    found = set()
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(_address(addr, v6))
    return found


def _address(hex_addr: str, v6: bool) -> str:
    raw = bytes.fromhex(hex_addr)
    if not v6:
        return ".".join(str(b) for b in raw[::-1])
    words = [raw[i:i + 4][::-1].hex() for i in range(0, 16, 4)]
    return ":".join(w[j:j + 4] for w in words for j in (0, 4))


LOOPBACK = {"127.0.0.1"}


def test_mesh_up_pins_worker_ports_and_keeps_everything_on_loopback(procs: ProcessGroup) -> None:
    base, port = free_port(), free_port()
    while base + 3 > 32_000 or port in range(base, base + 3):
        base = free_port()
    up = procs.start([PYTHON, "-m", "mesh", "up", "--workers", "1", "--base-port", str(base), "--port", str(port)],
                     name="up", port=port)
    wait_http(f"http://127.0.0.1:{port}/ready", proc=up, timeout_s=240)
    # worker-0's API on base, its KV event publisher on base+1 and replay socket on base+2
    for pinned in (base, base + 1, base + 2):
        wait_until(lambda p=pinned: listening(p), 30, f"a listener on {pinned}")
        assert listening(pinned) == LOOPBACK, (pinned, listening(pinned))
    assert listening(port) == LOOPBACK
    # mesh up's summary line (printed once the gateway is up, after /ready may already answer)
    wait_until(lambda: f"worker-0:{base}" in up.log_tail(20_000), 30, f"mesh up naming worker-0:{base}")
    resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": "demo", "prompt": "hi", "max_tokens": 2},
                      timeout=60)
    assert resp.status_code == 200, resp.text  # the gateway reaches the worker on its pinned port


def test_mesh_worker_listens_on_loopback_unless_told_otherwise(procs: ProcessGroup) -> None:
    http, events, replay = free_port(), free_port(), free_port()
    worker = procs.start([PYTHON, "-m", "mesh", "worker", "--preset", "tiny", "--port", str(http),
                          "--kv-events-endpoint", f"tcp://*:{events}", "--kv-events-replay-endpoint", f"tcp://*:{replay}"],
                         name="worker", port=http)
    wait_http(f"http://127.0.0.1:{http}/health", proc=worker, timeout_s=240)
    for port in (events, replay):
        wait_until(lambda p=port: listening(p), 30, f"the KV event socket on {port}")
    assert [listening(p) for p in (http, events, replay)] == [LOOPBACK] * 3


def test_mesh_up_refuses_pinned_ports_it_cannot_use(procs: ProcessGroup) -> None:
    port = free_port()
    for base, message in ((65535, "must lie in 1-65535"), (port - 1, f"include the gateway's --port {port}")):
        proc = procs.start([PYTHON, "-m", "mesh", "up", "--engine", "echo", "--workers", "2", "--base-port", str(base),
                            "--port", str(port)], name=f"up-{base}")
        assert proc.popen.wait(60) == 2
        assert message in proc.log_tail(), proc.log_tail()
