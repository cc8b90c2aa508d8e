"""Hostile clients: what a header bomb and a crowd of slow heads do to everyone else's latency.

Mesh and sglang-router in one run, over the same fake workers (``bench.gateway_overhead``'s raw
asyncio ones, instant answers), each measured with an open-loop load of well-behaved clients
(``--rate`` req/s for ``--duration`` s, non-streaming) in three phases:

- ``baseline``: nothing else;
- ``header bomb``: one connection at a time sends a ``--bomb-mib`` MiB header in 1 MiB writes and
  never ends it (a new connection when the gateway closes one);
- ``slow heads``: ``--slow-heads`` connections each send a partial head and trickle a byte a
  second (reopened when closed).

Reported per target and phase, medians over ``--rounds`` interleaved rounds: p50/p99 of the well-behaved requests, errors, and the p99 added
over the target's own baseline (the issue's targets: within 2 ms under the bomb, serving under
2,000 slow heads). Gateways run under a soft limit of 1,024 open files (a default box's), as
the finding was measured.

    python bench/hostile_clients.py [--rate 100] [--duration 5] [--bomb-mib 48] [--slow-heads 2000] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import multiprocessing
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._table import print_table  # noqa: E402
from bench.gateway_overhead import (  # noqa: E402
    PhaseResult,
    _connect,
    _request_bytes,
    free_ports,
    start_fake_workers,
    start_mesh,
    start_sglang,
    stop,
)

TIMEOUT_S = 2.0  # a well-behaved request not answered in this long counts as an error

PHASES = ("baseline", "header bomb", "slow heads")


def header_bomb(port: int, mib: int, stop_flag: Any) -> None:
    """Send ``mib`` MiB of one header, again and again, until ``stop_flag``."""
    chunk = b"a" * (1 << 20)
    while not stop_flag.is_set():
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-big: ")
                for _ in range(mib):
                    if stop_flag.is_set():
                        return
                    s.sendall(chunk)
        except OSError:
            time.sleep(0.01)  # closed by the gateway (431): the next bomb


def slow_heads(port: int, n: int, stop_flag: Any) -> None:
    """Hold ``n`` connections with unfinished heads, a byte per second each, reopening closed ones."""
    socks: list[socket.socket | None] = [None] * n
    while not stop_flag.is_set():
        for i in range(n):
            s = socks[i]
            try:
                if s is None:
                    s = socks[i] = socket.create_connection(("127.0.0.1", port), timeout=0.2)
                    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
                else:
                    s.sendall(b"x")
            except OSError:
                if s is not None:
                    s.close()
                socks[i] = None
            if stop_flag.is_set():
                break
        stop_flag.wait(1.0)
    for s in socks:
        if s is not None:
            s.close()


@contextmanager
def attack(run: Callable[[Any], None] | None) -> Iterator[None]:
    """The attacker in its own process (the measured clients' loop shares no GIL with it)."""
    if run is None:
        yield
        return
    flag = multiprocessing.Event()
    proc = multiprocessing.Process(target=run, args=(flag,), daemon=True)
    proc.start()
    time.sleep(1.0)  # the attack in place before the measured clients start
    try:
        yield
    finally:
        flag.set()
        proc.join(10)
        if proc.is_alive():
            proc.kill()


async def open_loop(port: int, rate: float, duration: float) -> PhaseResult:
    """Non-streaming requests at a fixed rate, each on its own connection (as new clients come,
    and a refused connection shows), bounded by ``TIMEOUT_S``."""
    result = PhaseResult()
    start = time.perf_counter()

    async def one(i: int) -> None:
        sent = time.perf_counter()
        conn = None
        try:
            async with asyncio.timeout(TIMEOUT_S):
                conn = await _connect(port)
                status, _, _ = await conn.request(_request_bytes(port, False, i))
        except (OSError, TimeoutError, ConnectionError):
            result.errors += 1
            return
        finally:
            if conn is not None:
                conn.transport.close()
        result.latencies_ms.append((time.perf_counter() - sent) * 1e3)
        if status == 200:
            result.requests += 1
        else:
            result.errors += 1

    tasks = []
    for i in range(int(rate * duration)):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(i)))
    await asyncio.gather(*tasks)
    result.seconds = time.perf_counter() - start
    return result


def measure(port: int, args: argparse.Namespace, phase: str) -> dict[str, Any]:
    attacks: dict[str, Callable[[Any], None] | None] = {
        "baseline": None,
        "header bomb": functools.partial(header_bomb, port, args.bomb_mib),
        "slow heads": functools.partial(slow_heads, port, args.slow_heads),
    }
    with attack(attacks[phase]):
        result = asyncio.run(open_loop(port, args.rate, args.duration))
    time.sleep(1.5)  # closed attackers' sockets drain before the next phase
    return result.summary()


def set_open_files(soft: int) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


def median_summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per field, the median over rounds (a burst of other load hits one round of each target)."""
    return {k: sorted(r[k] for r in rounds)[len(rounds) // 2] for k in ("requests", "errors", "p50_ms", "p99_ms")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, default=100.0)
    p.add_argument("--duration", type=float, default=5.0, help="seconds per phase")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; numbers are medians over rounds")
    p.add_argument("--bomb-mib", type=int, default=48)
    p.add_argument("--slow-heads", type=int, default=2000)
    p.add_argument("--skip-sglang", action="store_true")
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "hostile_clients.json"))
    args = p.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="mesh-hostile-"))
    worker_ports = free_ports(2)
    mesh_port, sglang_port = free_ports(2)
    procs = [start_fake_workers(worker_ports)]
    rounds: dict[str, dict[str, list[dict[str, Any]]]] = {}
    try:
        set_open_files(1024)  # the gateways start under a default box's soft limit
        targets = {"mesh": (start_mesh(worker_ports, mesh_port, "round_robin", tmp), mesh_port)}
        sglang = None if args.skip_sglang else start_sglang(worker_ports, sglang_port, tmp)
        if sglang is not None:
            targets["sglang-router"] = (sglang, sglang_port)
        set_open_files(8192)  # the attackers' own
        procs += [proc for proc, _ in targets.values()]
        for r in range(args.rounds):
            for name, (_, port) in targets.items():
                for phase in PHASES:
                    s = measure(port, args, phase)
                    rounds.setdefault(name, {}).setdefault(phase, []).append(s)
                    print(f"round {r + 1}/{args.rounds} {name} {phase}: p99 {s['p99_ms']:.2f} ms, errors {s['errors']}",
                          flush=True)
    finally:
        for proc in reversed(procs):
            stop(proc)
    results = {name: {phase: median_summary(rs) for phase, rs in phases.items()} for name, phases in rounds.items()}
    report = build_report(results, args)
    print_report(report)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"JSON written to {path}")
    return 0


def build_report(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    added = {name: {phase: round(r[phase]["p99_ms"] - r["baseline"]["p99_ms"], 3) for phase in PHASES[1:]}
             for name, r in results.items()}
    return {"args": vars(args), "results": results, "added_p99_ms": added,
            "targets": {"header bomb added p99 <= 2 ms": added.get("mesh", {}).get("header bomb", float("inf")) <= 2.0,
                        "slow heads: no errors": results.get("mesh", {}).get("slow heads", {}).get("errors", 1) == 0}}


def print_report(report: dict[str, Any]) -> None:
    rows = []
    for name, r in report["results"].items():
        for phase in PHASES:
            s = r[phase]
            added = "-" if phase == "baseline" else f"{report['added_p99_ms'][name][phase]:+.2f}"
            rows.append([name, phase, f"{s['p50_ms']:.2f}", f"{s['p99_ms']:.2f}", added, str(s["requests"]), str(s["errors"])])
    print_table("Well-behaved clients beside hostile ones (open loop, non-streaming)",
                ["target", "phase", "p50 ms", "p99 ms", "added p99 ms", "ok", "errors"], rows, left=("target", "phase"))
    for what, met in report["targets"].items():
        print(f"{what}: {'met' if met else 'NOT met'}")


if __name__ == "__main__":
    sys.exit(main())
