"""KV event ingestion capacity: request latency under a KV event flood, and the gateway's memory.

A real gateway (``mesh serve``) fronts fake workers (``bench.gateway_overhead``'s instant HTTP
workers) whose configs name KV event endpoints; a flood publisher (raw pyzmq PUB sockets, one per
stream, bound as vLLM's publisher binds: the gateway connects to a concrete host) sends frames in
vLLM's wire format (``[topic, seq, msgpack [ts, [BlockStored]]]``, one event of one 16-token block
per frame: the costliest shape per event, and every block new, never removed: the index grows
unless bounded). Per phase the flood runs at a paced rate (events/s over all streams, sent every
millisecond) or unpaced (as fast as one publisher process sends), over 1 or several streams,
while an open-loop request load (``--rate`` req/s, non-streaming chat completions) measures
request p50/p99, against a no-event baseline measured just before it (the machine's other load
drifts); every phase runs ``--rounds`` times and the medians are reported. Between phases the
gateway drains its backlog. Reported: the table, the JSON
(``bench/results/kv_ingest_capacity.json`` unless ``--json``), the gateway's RSS and index size,
and the ingestion capacity: the events/s at which request p99 rises 1 ms over the no-events
baseline (interpolated between the paced rates measured on one stream).

    python bench/kv_ingest_capacity.py [--quick] [--rounds 2] [--duration 8] [--rate 100] [--streams 4] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

from bench._table import print_table  # noqa: E402
from bench.gateway_overhead import (  # noqa: E402
    MODEL,
    PhaseResult,
    _connect,
    _request_bytes,
    fake_worker_main,
    free_ports,
    start,
    stop,
    wait_ok,
)

BLOCK = 16
RATES = [2_000, 10_000, 30_000]


# -- the flood publisher (its own process) ------------------------------------------------------


class Frames:
    """vLLM batches of one BlockStored each: a new 16-token block (no parent) on the GPU, every
    block distinct (its hash and first tokens count up), so a flood only ever adds to the index."""

    def __init__(self, rng: random.Random) -> None:
        import msgspec

        self.encode = msgspec.msgpack.encode
        self.tokens = [rng.randrange(1, 32_000) for _ in range(BLOCK)]
        self.base = rng.getrandbits(40) << 20

    def payload(self, n: int) -> bytes:
        tokens = self.tokens
        tokens[0], tokens[1] = 32_000 + (n & 0xFFFF), 32_000 + (n >> 16)
        return self.encode([0.0, [["BlockStored", [self.base + n], None, tokens, BLOCK, None, "GPU"]]])


def publish_main(ports: list[int], rate: float, seconds: float, sent_out: Any) -> None:
    """Bind one PUB per port and send ``rate`` events/s in all (0: unpaced) for ``seconds``."""
    import zmq

    ctx = zmq.Context()
    socks = []
    for p in ports:
        s = ctx.socket(zmq.PUB)
        s.setsockopt(zmq.SNDHWM, 100_000)
        s.bind(f"tcp://127.0.0.1:{p}")
        socks.append(s)
    time.sleep(0.6)  # the gateway's SUB sockets reconnect (ZMQ's slow joiner)
    frames = Frames(random.Random(time.time_ns()))
    seqs = [0] * len(socks)
    sent = 0
    start_t = time.perf_counter()
    end_t = start_t + seconds
    while True:
        now = time.perf_counter()
        if now >= end_t:
            break
        due = int((now - start_t) * rate) if rate else sent + 256
        while sent < due:
            i = sent % len(socks)
            try:
                socks[i].send_multipart([b"", seqs[i].to_bytes(8, "big"), frames.payload(sent)], zmq.NOBLOCK)
            except zmq.Again:
                pass  # over the PUB's high-water mark: ZMQ drops it (the subscriber sees a gap)
            seqs[i] += 1
            sent += 1
        if rate:
            time.sleep(0.001)
    sent_out.value = sent
    for s in socks:
        s.close(linger=0)
    ctx.term()


# -- the request load ---------------------------------------------------------------------------


async def open_loop(ports: list[int], stream: bool, rate: float, duration: float, timeout_s: float = 10.0) -> PhaseResult:
    """``bench.gateway_overhead.open_loop`` with a deadline per request: a request whose answer
    never comes (a pooled connection closed under it) is an error, not a hung benchmark."""
    port = ports[0]
    idle = [await _connect(port) for _ in range(8)]
    result = PhaseResult()
    start_t = time.perf_counter()

    async def one(i: int, at: float) -> None:
        conn = idle.pop() if idle else await _connect(port)
        try:
            status, _, _ = await asyncio.wait_for(conn.request(_request_bytes(port, stream, i)), timeout_s)
        except Exception:  # noqa: BLE001  (a timeout or a lost connection: an error)
            result.errors += 1
            conn.transport.close()
            return
        result.latencies_ms.append((time.perf_counter() - at) * 1e3)
        if status == 200:
            result.requests += 1
        else:
            result.errors += 1
        if not conn.closed:
            idle.append(conn)

    tasks = []
    for i in range(int(rate * duration)):
        delay = start_t + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(i, time.perf_counter())))
    await asyncio.gather(*tasks)
    result.seconds = time.perf_counter() - start_t
    for c in idle:
        c.transport.close()
    return result


# -- the gateway -------------------------------------------------------------------------------


def start_gateway(worker_ports: list[int], kv_ports: list[int], port: int, tmp: Path,
                  extra: dict[str, Any]) -> Any:
    import yaml

    workers = []
    for i, (wp, kp) in enumerate(zip(worker_ports, kv_ports)):
        workers.append({"name": f"w{i}", "url": f"http://127.0.0.1:{wp}", "models": [MODEL], "block_size": BLOCK,
                        "kv_events": {"endpoint": f"tcp://127.0.0.1:{kp}"}})
    cfg: dict[str, Any] = {"server": {"host": "127.0.0.1", "port": port}, "workers": workers, **extra}
    path = tmp / "mesh.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = start([sys.executable, "-m", "mesh.commands.serve", "--config", str(path), "--log-level", "warning"],
                 tmp / "mesh.log")
    wait_ok(f"http://127.0.0.1:{port}/ready", 30, proc)
    return proc


def rss_mb(pid: int) -> float:
    m = re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text())
    return int(m.group(1)) / 1024 if m else float("nan")


def scrape(port: int) -> dict[str, float]:
    """Sums of the ``mesh_kv_events_*`` and ``mesh_index_*`` series (every label set added up)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("mesh_kv_events_", "mesh_index_")):
            name, _, value = line.rpartition(" ")
            base = name.split("{", 1)[0]
            if "resets" in base:
                reason = re.search(r'reason="([^"]*)"', name)
                base = f"{base}:{reason.group(1) if reason else ''}"
            try:
                out[base] = out.get(base, 0.0) + float(value)
            except ValueError:
                pass
    return out


def drain(port: int, timeout_s: float) -> float:
    """Wait until the gateway applies no more batches (its backlog is done); the seconds it took."""
    t0 = time.monotonic()
    last = -1.0
    while time.monotonic() - t0 < timeout_s:
        try:
            now = scrape(port).get("mesh_kv_events_batches_total", 0.0)
        except OSError:
            now = last
        if now == last:
            break
        last = now
        time.sleep(0.5)
    return time.monotonic() - t0


# -- one phase ---------------------------------------------------------------------------------


def run_phase(port: int, pid: int, kv_ports: list[int], rate: float, streams: int, duration: float,
              req_rate: float, flood: bool) -> dict[str, Any]:
    before = scrape(port)
    ctx = mp.get_context("spawn")
    sent = ctx.Value("q", 0)
    pub = None
    if flood:
        pub = ctx.Process(target=publish_main, args=(kv_ports[:streams], rate, duration + 1.2, sent))
        pub.start()
        time.sleep(1.0)  # connected and flooding before the first request
    res = asyncio.run(open_loop([port], False, req_rate, duration))
    rss = rss_mb(pid)
    if pub is not None:
        pub.join(30)
    drained = drain(port, 30.0)
    after = scrape(port)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    resets = {k.split(":", 1)[1]: v for k, v in delta.items() if k.startswith("mesh_kv_events_resets_total:") and v}
    return {
        "flood": "none" if not flood else ("unpaced" if not rate else f"{int(rate)}/s"),
        "rate": rate, "streams": streams if flood else 0,
        "events_sent": int(sent.value), "batches_applied": int(delta.get("mesh_kv_events_batches_total", 0)),
        "gaps": int(delta.get("mesh_kv_events_gaps_total", 0)), "resets": resets,
        "requests": res.requests, "errors": res.errors,
        "p50_ms": round(res.pct(0.50), 2), "p99_ms": round(res.pct(0.99), 2), "max_ms": round(max(res.latencies_ms or [0]), 1),
        "rss_mb": round(rss, 1), "index_keys": int(after.get("mesh_index_keys", -1)),
        "drain_s": round(drained, 1),
    }


def capacity(rows: list[dict[str, Any]]) -> float | None:
    """Events/s at which p99 first exceeds its baseline by 1 ms (one stream, paced), interpolated."""
    pts = [(0.0, 0.0)] + sorted((r["rate"], r["delta_ms"]) for r in rows if r["streams"] == 1 and r["rate"])
    for (r0, d0), (r1, d1) in zip(pts, pts[1:]):
        if d1 > 1.0:
            return r1 if d1 == d0 else r0 + (r1 - r0) * max(0.0, 1.0 - d0) / (d1 - d0)
    return None  # never reached within the rates measured


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One phase over its rounds: medians of latency, sums of counts, the last RSS and index size."""
    out = dict(runs[-1])
    for k in ("p50_ms", "p99_ms", "base_p99_ms", "delta_ms"):
        out[k] = round(median([r[k] for r in runs]), 2)
    out["deltas_ms"] = [r["delta_ms"] for r in runs]
    out["max_ms"] = max(r["max_ms"] for r in runs)
    for k in ("events_sent", "batches_applied", "gaps", "requests", "errors"):
        out[k] = sum(r[k] for r in runs)
    resets: dict[str, float] = {}
    for r in runs:
        for k, v in r["resets"].items():
            resets[k] = resets.get(k, 0) + v
    out["resets"] = resets
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="about a minute: short phases, fewer of them")
    ap.add_argument("--duration", type=float, default=8.0, help="seconds of requests per phase")
    ap.add_argument("--rate", type=float, default=100.0, help="requests/s (open loop)")
    ap.add_argument("--streams", type=int, default=4, help="streams (workers) of the multi-stream phases")
    ap.add_argument("--rounds", type=int, default=0, help="rounds of every phase (default 2, 1 with --quick)")
    ap.add_argument("--config", default="{}", help="JSON merged into the gateway config (e.g. an index section)")
    ap.add_argument("--label", default="", help="a name for this run in the JSON")
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "kv_ingest_capacity.json"))
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    duration = 4.0 if args.quick else args.duration
    rounds = args.rounds or (1 if args.quick else 2)
    rows = measure(args, duration, rounds, phase_plan(args))
    base = rows[0]
    cap = capacity(rows[1:-1])
    report = {"label": args.label, "quick": args.quick, "duration_s": duration, "rounds": rounds,
              "request_rate": args.rate, "cpus": os.cpu_count(), "loadavg": os.getloadavg(),
              "config": json.loads(args.config), "baseline_p99_ms": base["p99_ms"], "capacity_events_per_s": cap,
              "phases": rows}
    print_report(rows, cap)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


def phase_plan(args: argparse.Namespace) -> list[tuple[float, int]]:
    """The flood phases as (events/s, streams), 0 events/s unpaced: every rate and unpaced on one
    stream, then on ``--streams`` streams (only 30,000/s and unpaced with ``--quick``)."""
    phases: list[tuple[float, int]] = [(r, 1) for r in RATES] + [(0.0, 1)]
    phases += [(30_000, args.streams), (0.0, args.streams)] if args.quick else \
        [(r, args.streams) for r in RATES] + [(0.0, args.streams)]
    return phases


def measure(args: argparse.Namespace, duration: float, rounds: int, phases: list[tuple[float, int]]) -> list[dict[str, Any]]:
    """Fake workers and a gateway for the run; the rows: the no-event baseline and every phase,
    each combined over its rounds, then a no-event phase measured at the end."""
    n = max(args.streams, 1)
    worker_ports, kv_ports, (port,) = free_ports(n), free_ports(n), free_ports(1)
    runs: dict[tuple[float, int], list[dict[str, Any]]] = {}  # (-1.0, 0): the round's baseline
    with tempfile.TemporaryDirectory(prefix="mesh-kv-bench-") as d:
        tmp = Path(d)
        fake = mp.get_context("spawn").Process(target=fake_worker_main, args=(worker_ports,), daemon=True)
        fake.start()
        gw = start_gateway(worker_ports, kv_ports, port, tmp, json.loads(args.config))
        try:
            asyncio.run(open_loop([port], False, args.rate, 1.0))  # warm up the pools
            for _ in range(rounds):
                run_round(port, gw.pid, kv_ports, args.rate, duration, phases, runs)
            end = run_phase(port, gw.pid, kv_ports, 0, 0, duration, args.rate, flood=False)
            end["base_p99_ms"], end["delta_ms"] = runs[(-1.0, 0)][0]["p99_ms"], 0.0
        finally:
            stop(gw)
            fake.terminate()
    return [combine(v) for v in runs.values()] + [end]


def run_round(port: int, pid: int, kv_ports: list[int], req_rate: float, duration: float,
              phases: list[tuple[float, int]], runs: dict[tuple[float, int], list[dict[str, Any]]]) -> None:
    """One round of every phase, its rows appended to ``runs`` by (rate, streams)."""
    # each flood against a baseline measured just before it: the machine's other load
    # drifts, and a baseline minutes old measures that drift too
    base = run_phase(port, pid, kv_ports, 0, 0, duration, req_rate, flood=False)
    base["base_p99_ms"], base["delta_ms"] = base["p99_ms"], 0.0
    runs.setdefault((-1.0, 0), []).append(base)
    for rate, streams in phases:
        own = base if (rate, streams) == phases[0] else \
            run_phase(port, pid, kv_ports, 0, 0, duration / 2, req_rate, flood=False)
        row = run_phase(port, pid, kv_ports, rate, streams, duration, req_rate, flood=True)
        row["base_p99_ms"], row["delta_ms"] = own["p99_ms"], round(row["p99_ms"] - own["p99_ms"], 2)
        runs.setdefault((rate, streams), []).append(row)
        print(f"  {row['flood']:>8} x{streams}: p99 {row['p99_ms']} ms (baseline {own['p99_ms']})",
              file=sys.stderr)


def print_report(rows: list[dict[str, Any]], cap: float | None) -> None:
    headers = ["flood", "streams", "sent", "applied", "gaps", "resets", "req", "err", "p50 ms", "p99 ms",
               "max ms", "its base p99", "p99 - base", "RSS MB", "index keys", "drain s"]
    print_table("KV event ingestion: request latency under a flood", headers, [
        [r["flood"], str(r["streams"]), str(r["events_sent"]), str(r["batches_applied"]), str(r["gaps"]),
         ",".join(f"{k}:{int(v)}" for k, v in r["resets"].items()) or "-", str(r["requests"]), str(r["errors"]),
         f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}", f"{r['max_ms']:.1f}", f"{r['base_p99_ms']:.2f}", f"{r['delta_ms']:+.2f}",
         f"{r['rss_mb']:.0f}", str(r["index_keys"]), f"{r['drain_s']:.1f}"] for r in rows], left=["flood"])
    print("ingestion capacity (p99 +1 ms over its baseline, one stream, median of rounds): "
          + (f"{cap:,.0f} events/s" if cap is not None else f"above {max(RATES):,} events/s (never reached)"))
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    raise SystemExit(main())
