"""A short soak: steady load on three workers while one at a time is killed (-9) and restarted.

Nothing is lost that had not started streaming: every non-streamed request gets a whole 200
(retried past the dead worker), every stream is whole or, cut after its first byte, ends with an
error event and ``[DONE]``; the gateway's memory stays flat within a generous bound.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx

from tests.e2e.reliability.gateway_helpers import Outcome, request, start_gateway
from tests.procs import ProcessGroup, kill_process

RUN_S = 16.0
KILL_EVERY_S = 3.0
RSS_GROWTH_MB = 40  # generous: the 5-minute soak moved 80 -> 83 MB


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_kill_and_restart_workers_under_load_loses_nothing_and_memory_stays_flat(procs: ProcessGroup) -> None:
    names = ("s0", "s1", "s2")
    workers = {n: procs.echo_worker(n, "--model", "m", "--token-delay-s", "0.02") for n in names}
    gateway = start_gateway(
        procs, [{"name": n, "url": w.url, "models": ["m"]} for n, w in workers.items()],
        server={"first_byte_timeout_s": 2, "idle_timeout_s": 2},
        health={"interval_s": 0.3, "timeout_s": 0.5, "unhealthy_threshold": 1},
        circuit_breaker={"failure_threshold": 3, "open_s": 1},
    )
    outcomes: list[Outcome] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def load(i: int) -> None:
        try:
            with httpx.Client(base_url=gateway.url, timeout=30) as client:
                n = 0
                while not stop.is_set():
                    n += 1
                    outcomes.append(request(client, stream=(i + n) % 2 == 0, prompt=f"soak {i} {n} a b c d e",
                                            max_tokens=8))
        except BaseException as exc:  # a transport error is a lost request
            errors.append(exc)

    threads = [threading.Thread(target=load, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    try:
        time.sleep(2.0)
        rss_before = rss_mb(gateway.pid)
        end = time.monotonic() + RUN_S
        kills = 0
        while time.monotonic() < end - KILL_EVERY_S:
            time.sleep(KILL_EVERY_S / 2)
            name = names[kills % len(names)]
            kill_process(workers[name])
            time.sleep(KILL_EVERY_S / 4)
            workers[name] = procs.echo_worker(name, "--model", "m", "--token-delay-s", "0.02", port=workers[name].port)
            kills += 1
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    rss_after = rss_mb(gateway.pid)
    assert not errors, errors[:3]
    assert kills >= 3 and len(outcomes) > 200, (kills, len(outcomes))
    lost = [o for o in outcomes if not (o.whole or o.cut_cleanly)]
    assert not lost, lost[:5]
    assert all(o.whole for o in outcomes if not o.stream)  # a buffered answer is never cut: retried instead
    print(f"{len(outcomes)} requests, {kills} kills, {sum(o.cut_cleanly for o in outcomes)} streams cut, "
          f"RSS {rss_before:.0f} -> {rss_after:.0f} MB")
    assert rss_after - rss_before < RSS_GROWTH_MB, (rss_before, rss_after)
