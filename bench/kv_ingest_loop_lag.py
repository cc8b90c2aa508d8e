"""The event loop's lag under a KV event flood, in one process: no HTTP, no gateway around it.

A ``KvEventSubscriber`` (the gateway's, with its receiver thread, inboxes and pacer) over a
``PrefixIndex`` bounded as the gateway's default, fed by ``bench/kv_ingest_capacity.py``'s flood
publisher (its own process); a probe on the loop sleeps 1 ms again and again and records how late
it wakes (what every callback of a request waits behind event work), with the garbage collector's
pauses. Isolates the loop from the HTTP benchmark's other processes.

    python bench/kv_ingest_loop_lag.py [--rate 30000] [--streams 1] [--seconds 5] [--receiver process]   # --rate 0: unpaced

``--receiver process``: the receiver process (``mesh.events.child``) receives, decodes and keys;
the loop only applies (``index.ingest_process``). Also reported: the CPU seconds this process and
the receiver process used.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from bench._procs import free_ports  # noqa: E402
from bench.kv_ingest_capacity import publish_main  # noqa: E402
from mesh.config import DEFAULT_MAX_KEYS  # noqa: E402
from mesh.core.index import PrefixIndex  # noqa: E402
from mesh.events.subscriber import KvEventSubscriber, WorkerEvents  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def _cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of ``pid`` so far (0 when it is gone)."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run(rate: float, streams: int, seconds: float, process: bool = False) -> dict[str, float]:
    ports = free_ports(streams)
    index = PrefixIndex(max_keys=DEFAULT_MAX_KEYS)
    sub = KvEventSubscriber(index, process=process)
    await sub.start()
    for i, p in enumerate(ports):
        sub.add_worker(WorkerEvents(f"w{i}", f"tcp://127.0.0.1:{p}", model="m", block_size=16))
    ctx = mp.get_context("spawn")
    sent = ctx.Value("q", 0)  # held here: the child opens it after this function moves on
    pub = ctx.Process(target=publish_main, args=(ports, rate, seconds + 1.2, sent)) if streams else None
    if pub is not None:
        pub.start()
    await asyncio.sleep(1.2)
    gc.freeze()  # as the gateway does after startup
    marks: list[tuple[str, float]] = []
    gc.callbacks.append(lambda phase, info: marks.append((phase, time.perf_counter())))
    lags: list[float] = []
    child = sub.receiver_pid
    cpu0, child0 = time.process_time(), _cpu_s(child)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        await asyncio.sleep(0.001)
        lags.append((time.perf_counter() - t - 0.001) * 1e3)
    gc.callbacks.clear()
    cpu, child_cpu = time.process_time() - cpu0, _cpu_s(child) - child0
    pauses = [(b[1] - a[1]) * 1e3 for a, b in zip(marks, marks[1:]) if a[0] == "start" and b[0] == "stop"]
    applied = sum(h.batches for h in sub.health().values())
    resets = sum(sum(h.resets.values()) for h in sub.health().values())
    if pub is not None:
        pub.join(30)
    await sub.stop()
    return {"lag_p50_ms": pct(lags, 0.5), "lag_p99_ms": pct(lags, 0.99), "lag_max_ms": max(lags),
            "gc_max_ms": max(pauses or [0.0]), "applied": applied, "resets": resets, "keys": len(index),
            "cpu_s": cpu, "child_cpu_s": child_cpu}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=30_000, help="events/s over all streams (0: unpaced)")
    ap.add_argument("--streams", type=int, default=1, help="streams (0: no flood, the baseline)")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--receiver", choices=["thread", "process"], default="thread")
    args = ap.parse_args()
    out = asyncio.run(run(args.rate, args.streams, args.seconds, args.receiver == "process"))
    flood = "none" if not args.streams else ("unpaced" if not args.rate else f"{args.rate:,.0f}/s")
    print(f"flood {flood} x{args.streams}: loop lag p50 {out['lag_p50_ms']:.2f} p99 {out['lag_p99_ms']:.2f} "
          f"max {out['lag_max_ms']:.2f} ms; gc pause max {out['gc_max_ms']:.1f} ms; applied {out['applied']:,.0f} "
          f"batches, {out['resets']:.0f} resets, {out['keys']:,.0f} keys; cpu {out['cpu_s']:.2f} s here, "
          f"{out['child_cpu_s']:.2f} s in the receiver process ({args.receiver})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
