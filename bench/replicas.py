"""Several gateway replicas: does sharing in-flight load through Redis balance the workers?

All real processes on loopback: one ``redis-server`` (no persistence), ``--workers`` echo workers
(``mesh.echo_worker``) whose answer takes ``--first-token-delay`` + ``--token-delay`` per output
token (``max_tokens`` drawn uniformly from 1..``--max-tokens``, so requests have different
lengths and stay in flight), and ``--replicas`` gateways (``mesh serve``, ``state.backend:
redis``) per policy, run twice with the same everything else:

- ``shared``: ``state.load_sync_s: 0.1``: every replica adds the others' in-flight load;
- ``local``:  ``state.load_sync_s: 0``: sessions only, each replica sees only its own load.

Loop i's prompt is its own (``user {i}: ...``), so ``kv_aware`` has a per-loop cache affinity to
weigh against load. Both modes replay the same per-loop ``max_tokens`` sequences (same seeds).

A closed-loop client (httpx async) keeps C requests in flight, loop i always through replica
i % R, for ``--duration`` seconds, at each ``--concurrency`` level. Every request's interval and
worker (``x-mesh-worker``) are recorded at the client; per-worker concurrency is then sampled
every ``--sample-ms`` over the steady window (first 0.5 s and the drain after the end left out).
Imbalance per sample = max over workers / mean over workers; reported: its mean and p99, and the
share of samples where some worker had >= 2x the mean. Latency is also given as "added": the
request's latency minus the echo worker's nominal delay for it (the gateway's share). Echo
workers have no capacity limit (a request's time does not grow with the worker's concurrency),
so balance shows in the imbalance columns, not in latency.

    python bench/replicas.py [--replicas 4] [--workers 4] [--concurrency 32 8] [--duration 10]
                             [--policies least_load kv_aware] [--json bench/results/replicas.json]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.procs (real processes), when run as a script from anywhere
sys.path.insert(0, str(ROOT / "bench"))

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import yaml  # noqa: E402
from _table import print_table  # noqa: E402

from tests.procs import ProcessGroup, free_port, wait_until  # noqa: E402

MODEL = "echo"
WORDS = 64  # words in the user message: the echo worker answers min(max_tokens, WORDS) tokens
PROMPT = " ".join(f"w{i}" for i in range(WORDS))
MODES = {"shared": 0.1, "local": 0.0}  # name -> state.load_sync_s
WARMUP_S = 0.5  # samples before this (from the start of a phase) are left out


@dataclass(frozen=True)
class Done:
    """One request as the client saw it (perf_counter seconds)."""

    start: float
    end: float
    worker: str | None  # None: failed
    nominal_s: float  # the echo worker's own delay for it


# -- processes ---------------------------------------------------------------------------------


def start_redis(procs: ProcessGroup) -> str:
    port = free_port()
    cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    procs.start(cmd, name="redis", port=port)
    import redis

    def pings() -> bool:
        try:
            with redis.Redis(port=port, socket_timeout=1) as c:
                return bool(c.ping())
        except redis.RedisError:
            return False

    wait_until(pings, what="redis-server answering PING")
    return f"redis://127.0.0.1:{port}/0"


def start_gateways(procs: ProcessGroup, workers: dict[str, str], redis_url: str, policy: str, mode: str,
                   replicas: int) -> list[str]:
    """``replicas`` gateways sharing one config; started together, then waited for."""
    data = {
        "workers": [{"name": n, "url": u, "models": [MODEL]} for n, u in workers.items()],
        "health": {"interval_s": 0.5, "timeout_s": 1, "unhealthy_threshold": 2},
        "policy": {"name": policy},
        "state": {"backend": "redis", "url": redis_url, "key_prefix": f"bench-{policy}-{mode}:", "timeout_s": 0.2,
                  "load_sync_s": MODES[mode]},
    }
    path = procs.log_dir / f"{policy}-{mode}.yaml"
    path.write_text(yaml.safe_dump(data))
    started = []
    for r in range(replicas):
        port = free_port()
        cmd = [sys.executable, "-m", "mesh.commands.serve", "--config", str(path), "--port", str(port), "--log-level", "warning"]
        started.append(procs.start(cmd, name=f"gw-{policy}-{mode}-{r}", port=port))
    for proc in started:
        def healthy(url: str = proc.url) -> bool:
            try:
                return httpx.get(url + "/health", timeout=2).json().get("healthy_workers") == len(workers)
            except (httpx.HTTPError, ValueError):
                if not proc.alive():
                    raise RuntimeError(f"{proc.name} exited:\n{proc.log_tail()}") from None
                return False

        wait_until(healthy, timeout_s=60, what=f"{proc.name} up with every worker healthy")
    return [p.url for p in started]


def sync_peers(urls: list[str]) -> list[float | None]:
    """Each replica's ``mesh_load_sync_peers`` (other replicas read in its last sync round; None: not syncing)."""
    out: list[float | None] = []
    for url in urls:
        found = re.search(r"^mesh_load_sync_peers (\S+)$", httpx.get(url + "/metrics", timeout=5).text, re.M)
        out.append(float(found.group(1)) if found else None)
    return out


def stop_gateways(procs: ProcessGroup, prefix: str) -> None:
    from tests.procs import stop_process

    for proc in [p for p in procs.procs if p.name.startswith(prefix)]:
        stop_process(proc)
        procs.procs.remove(proc)


# -- load --------------------------------------------------------------------------------------


async def closed_loop(urls: list[str], concurrency: int, duration: float, args: argparse.Namespace,
                      seed: int) -> tuple[list[Done], float, float]:
    """C loops, loop i through replica i % R; returns (requests, phase start, phase end)."""
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    clients = [httpx.AsyncClient(base_url=u, timeout=60, limits=limits) for u in urls]
    done: list[Done] = []
    t0 = time.perf_counter()
    stop = t0 + duration

    async def loop(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        client = clients[i % len(clients)]
        while time.perf_counter() < stop:
            n = rng.randint(1, args.max_tokens)
            nominal = args.first_token_delay + args.token_delay * min(n, WORDS)
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"user {i}: {PROMPT}"}], "max_tokens": n}
            start = time.perf_counter()
            try:
                resp = await client.post("/v1/chat/completions", json=body)
                worker = resp.headers.get("x-mesh-worker") if resp.status_code == 200 else None
            except httpx.HTTPError:
                worker = None
            done.append(Done(start, time.perf_counter(), worker, nominal))

    try:
        await asyncio.gather(*(loop(i) for i in range(concurrency)))
    finally:
        for c in clients:
            await c.aclose()
    return done, t0, stop


# -- analysis ----------------------------------------------------------------------------------


def imbalance(done: list[Done], workers: list[str], t0: float, stop: float, sample_s: float) -> dict[str, Any]:
    """Per-worker concurrency sampled every ``sample_s`` in [t0 + WARMUP_S, stop)."""
    times = np.arange(t0 + WARMUP_S, stop, sample_s)
    counts = np.zeros((len(times), len(workers)))
    for j, w in enumerate(workers):
        starts = np.sort([d.start for d in done if d.worker == w])
        ends = np.sort([d.end for d in done if d.worker == w])
        counts[:, j] = np.searchsorted(starts, times, "right") - np.searchsorted(ends, times, "right")
    mean = counts.mean(axis=1)
    ok = mean > 0
    ratio = counts.max(axis=1)[ok] / mean[ok]
    spread = counts.max(axis=1) - counts.min(axis=1)
    return {
        "samples": int(ok.sum()),
        "max_over_mean": round(float(ratio.mean()), 3) if ratio.size else None,
        "max_over_mean_p99": round(float(np.percentile(ratio, 99)), 3) if ratio.size else None,
        "share_ge_2x_pct": round(100 * float((ratio >= 2).mean()), 2) if ratio.size else None,
        "max_minus_min": round(float(spread.mean()), 3),
        "mean_concurrency_per_worker": [round(float(x), 3) for x in counts.mean(axis=0)],
    }


def summarize(done: list[Done], workers: list[str], t0: float, stop: float, args: argparse.Namespace) -> dict[str, Any]:
    good = [d for d in done if d.worker is not None]
    lat = np.array([d.end - d.start for d in good]) * 1e3
    added = np.array([d.end - d.start - d.nominal_s for d in good]) * 1e3
    pct = lambda xs, q: round(float(np.percentile(xs, q)), 2) if xs.size else None  # noqa: E731
    per_worker = {w: sum(1 for d in good if d.worker == w) for w in workers}
    return {
        "requests": len(good),
        "errors": len(done) - len(good),
        "rate": round(len(good) / (max(d.end for d in done) - t0), 1) if done else 0.0,
        "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99),
        "added_p50_ms": pct(added, 50), "added_p99_ms": pct(added, 99),
        "requests_per_worker": per_worker,
        **imbalance(done, workers, t0, stop, args.sample_ms / 1000),
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def build_report(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    ratios: dict[str, Any] = {}
    for policy, by_c in results.items():
        for c, modes in by_c.items():
            s, loc = modes["shared"], modes["local"]
            ratios[f"{policy}/C={c}"] = {k: ratio(s[k], loc[k]) for k in
                                          ("requests", "p50_ms", "p99_ms", "max_over_mean", "max_over_mean_p99",
                                           "share_ge_2x_pct", "max_minus_min")}
    return {
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "machine": {"cpus": os.cpu_count(), "load_avg": os.getloadavg()},
        "results": results,
        "ratios_shared_over_local": ratios,
    }


def peers(values: list[float | None] | None) -> str:
    """Fewest other replicas any replica read in its last load sync round ("-": none syncing)."""
    known = [v for v in values or [] if v is not None]
    return f"{min(known):.0f}" if known else "-"


def print_report(report: dict[str, Any]) -> None:
    cfg = report["config"]
    rows = []
    for policy, by_c in report["results"].items():
        for c, modes in by_c.items():
            for mode, r in modes.items():
                rows.append([policy, str(c), mode, str(r["requests"]), str(r["errors"]), f"{r['p50_ms']:.0f}",
                             f"{r['p99_ms']:.0f}", f"{r['added_p50_ms']:.1f}", f"{r['added_p99_ms']:.1f}",
                             f"{r['max_over_mean']:.2f}", f"{r['max_over_mean_p99']:.2f}", f"{r['share_ge_2x_pct']:.1f}",
                             f"{r['max_minus_min']:.2f}", peers(r.get("sync_peers"))])
            q = report["ratios_shared_over_local"][f"{policy}/C={c}"]
            fmt = lambda v: "-" if v is None else ">99" if v > 99 else f"{v:.2f}"  # noqa: E731  (x / ~0)
            rows.append([policy, str(c), "shared/local", fmt(q["requests"]), "", fmt(q["p50_ms"]), fmt(q["p99_ms"]), "", "",
                         fmt(q["max_over_mean"]), fmt(q["max_over_mean_p99"]), fmt(q["share_ge_2x_pct"]),
                         fmt(q["max_minus_min"]), ""])
    title = (f"{cfg['replicas']} gateway replicas, {cfg['workers']} echo workers, {cfg['duration']:g} s per phase: "
             "shared load (load_sync_s 0.1) vs local only (0)")
    headers = ["policy", "C", "load", "requests", "err", "p50 ms", "p99 ms", "added p50", "added p99",
               "max/mean", "max/mean p99", ">=2x mean %", "max-min", "peers"]
    print_table(title, headers, rows, left=("policy", "load"))


# -- driver ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.progress import Progress

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--concurrency", type=int, nargs="+", default=[32, 8], help="closed-loop streams, one phase each")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per phase")
    p.add_argument("--policies", nargs="+", default=["least_load", "kv_aware"])
    p.add_argument("--first-token-delay", type=float, default=0.1, help="echo worker delay before any token (s)")
    p.add_argument("--token-delay", type=float, default=0.02, help="echo worker delay per output token (s)")
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens drawn from 1..this per request")
    p.add_argument("--sample-ms", type=float, default=50.0)
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "replicas.json"))
    args = p.parse_args(argv)
    if min(args.replicas, args.workers, min(args.concurrency), args.max_tokens) < 1 or args.duration <= WARMUP_S:
        p.error(f"counts must be >= 1 and --duration > {WARMUP_S}")

    console = Console()
    procs = ProcessGroup(Path(tempfile.mkdtemp(prefix="mesh-bench-replicas-")))
    results: dict[str, Any] = {}
    began = time.monotonic()
    try:
        redis_url = start_redis(procs)
        delays = ["--first-token-delay-s", str(args.first_token_delay), "--token-delay-s", str(args.token_delay)]
        workers = {f"w{i}": procs.echo_worker(f"w{i}", *delays).url for i in range(args.workers)}
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("starting", total=len(args.policies) * len(MODES) * len(args.concurrency))
            for policy in args.policies:
                results[policy] = {c: {} for c in args.concurrency}
                for mode in MODES:
                    progress.update(task, description=f"{policy}/{mode}: starting {args.replicas} gateways")
                    urls = start_gateways(procs, workers, redis_url, policy, mode, args.replicas)
                    for k, c in enumerate(args.concurrency):
                        progress.update(task, description=f"{policy}/{mode}: C={c}")
                        done, t0, stop = asyncio.run(closed_loop(urls, c, args.duration, args, seed=k))
                        results[policy][c][mode] = summarize(done, list(workers), t0, stop, args)
                        results[policy][c][mode]["sync_peers"] = sync_peers(urls)
                        progress.advance(task)
                    stop_gateways(procs, f"gw-{policy}-{mode}-")
    finally:
        procs.stop_all()
    report = build_report(results, args)
    report["wall_s"] = round(time.monotonic() - began, 1)
    print_report(report)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    console.print(f"{report['wall_s']} s in all; load average: {report['machine']['load_avg']}; logs in {procs.log_dir}; JSON written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
