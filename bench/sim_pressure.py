"""Policies across cache pressures, in the GPU routing benchmark's twin.

``bench/e2e_routing.py`` measures a few matrix points on the GPU; a policy tuned on those can lose
between them. This runs the twin (``bench/sim_twin.py``'s workload, profile and closed loop) over
a grid of worker KV capacities and concurrent sessions, every router at every point, and prints
each router's TTFT mean as a ratio to sglang-router's algorithm (``cache_aware`` without session
ids) at the same point, its hit rate, and the geometric mean of its ratios over the grid.

    python bench/sim_pressure.py                       # the default grid: 14 points, ~1 min
    python bench/sim_pressure.py --workers-per-device 1   # the same cluster with a GPU per worker
    python bench/sim_pressure.py --seeds 5                # each point over 5 jittered runs
    python bench/sim_pressure.py --points 2000/24,3000/24 \\
        --variant 'prev={"name":"session_sticky","params":{"rehome_below":0,"spread_by":"sessions"}}'

Routers: ``sglang`` (the reference), ``mesh_default`` (the gateway's default, session ids and
its retention hint), ``mesh_kv_aware`` (no session ids), and each ``--variant NAME=POLICY_SPEC``
(session ids sent). The simulator is deterministic, and small changes move single points by
+-10% or more (which session a miss hits first cascades): read the grid, not a point, and with
``--seeds N`` each point is N runs, seed k > 0 with the think times jittered (``--jitter``), each
ratio the geometric mean over them (the JSON keeps their range).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

import argparse
import json
import math
import random
import statistics
import time
from dataclasses import replace
from typing import Any

from bench._table import print_table
from bench.sim_twin import PROFILE, RESULTS, SimSpec, prepare_workload, router_sim_spec

GRID = "2000/24,1800/24,2400/24,2000/20,2000/28,4000/16,3000/16,2200/22,2600/24,2200/26,1600/20,3000/24,2000/16,5000/24"
BASE_RUN = RESULTS / "e2e_high_s7.json"  # the GPU run whose workload settings the grid reuses
ROUTERS: dict[str, SimSpec] = {
    "sglang": SimSpec("cache_aware", False),
    "mesh_default": SimSpec("session_sticky", True),
    "mesh_kv_aware": SimSpec("kv_aware", False),
}


def variant_router(name: str, spec: Any) -> SimSpec:
    """A ``--variant`` as ``bench/e2e_routing.py`` takes it (a policy spec, or ``{"policy": SPEC,
    "config": {"retention": {...}}}``), simulated as ``bench/sim_twin.py`` does; a
    ValueError for what the twin does not model."""
    from bench.e2e_routing import _variant_spec

    sim = router_sim_spec(_variant_spec(name, spec))
    if sim.skip:
        raise ValueError(sim.skip)
    return sim


def parse_points(text: str) -> list[tuple[int, int]]:
    """``KV/SESSIONS,...`` -> [(kv blocks per worker, concurrent sessions), ...]."""
    out = []
    for part in text.split(","):
        kv, _, conc = part.strip().partition("/")
        out.append((int(kv), int(conc)))
    return out


class Twin:
    """The benchmark's workload prepared once; ``run`` simulates one router at one point."""

    def __init__(self, base_run: Path, profile_path: str, run_s: float, workers_per_device: int = 0) -> None:
        from mesh.replay.sim_trace import plan_trace
        from simulator.profile import load_profile

        config = json.loads(base_run.read_text())["config"]
        prep = prepare_workload(config)
        self.block = int(config.get("block_size", 16))
        self.workers = int(config.get("workers", 4))
        self.traces = {s: plan_trace(prep.trace, prep.plan, prep.builder, self.block, session_ids=s)
                       for s in (True, False)}
        self.profile = load_profile(profile_path)
        self.run_s = run_s
        # as on the GPU benchmark's one H200 unless told (1: a device per worker)
        self.workers_per_device = workers_per_device or self.workers

    def trace(self, session_ids: bool, seed: int, jitter: float) -> Any:
        """The workload; for ``seed`` > 0 with every think time (a dependency's delay) scaled by
        a lognormal factor of sigma ``jitter`` drawn from ``seed``: the GPU's own step-time noise
        moves which session a miss hits first, and the twin is deterministic, so a grid read over
        several such seeds is a distribution rather than one draw of it."""
        base = self.traces[session_ids]
        if seed == 0 or jitter <= 0:
            return base
        rng = random.Random(seed)
        requests = [replace(r, deps=tuple((i, kind, delay * rng.lognormvariate(0.0, jitter))
                                          for i, kind, delay in r.deps)) for r in base.requests]
        return replace(base, requests=requests)

    def run(self, policy: Any, session_ids: bool, kv: int, conc: int, seed: int,
            retention: dict[str, Any] | None = None, jitter: float = 0.0) -> dict[str, Any]:
        """One simulated run; ``retention``: ``SimConfig`` fields (``SimSpec.sim_retention``)."""
        from simulator.engine import SimConfig, Simulator
        from simulator.profile import with_overrides
        from simulator.report import summarize

        prof = with_overrides(self.profile, kv_blocks=kv, **{"cpu.blocks": 0})
        config = SimConfig(workers=self.workers, profile=prof, concurrency=conc, horizon_s=self.run_s,
                           workers_per_device=self.workers_per_device, seed=seed,
                           **(retention or {}))
        return summarize(Simulator(self.trace(session_ids, seed, jitter), policy, config).run())


def run_grid(twin: Twin, routers: dict[str, SimSpec], points: list[tuple[int, int]],
             seeds: list[int], jitter: float, progress: Any) -> dict[str, list[dict[str, Any]]]:
    """Per router, per point, over ``seeds``: TTFT mean, p99, hit rate and moves (means), and the
    ratio to ``sglang`` (the geometric mean of each seed's ratio to sglang's run of that seed,
    with their range)."""
    runs: dict[str, list[list[dict[str, Any]]]] = {}
    for name, spec in routers.items():
        runs[name] = []
        for kv, conc in points:
            ms = []
            for seed in seeds:
                ms.append(twin.run(spec.policy, spec.session_ids, kv, conc, seed, spec.sim_retention(), jitter))
                progress()
            runs[name].append(ms)
    out: dict[str, list[dict[str, Any]]] = {}
    for name, per_point in runs.items():
        rows = []
        for (kv, conc), ms, refs in zip(points, per_point, runs["sglang"], strict=True):
            ratios = [m["ttft_ms"]["mean"] / r["ttft_ms"]["mean"] for m, r in zip(ms, refs, strict=True)]
            rows.append({"kv_blocks": kv, "concurrency": conc, "ratio": geo_mean(ratios),
                         "ratio_range": [min(ratios), max(ratios)],
                         "ttft_mean_ms": statistics.fmean(m["ttft_ms"]["mean"] for m in ms),
                         "ttft_p99_ms": statistics.fmean(m["ttft_ms"]["p99"] for m in ms),
                         "hit_rate": statistics.fmean(m["hit_rate"] for m in ms),
                         "requests": sum(m["requests"] for m in ms),
                         "session_moves": sum(m["router_session_moves"] for m in ms)})
        out[name] = rows
    return out


def geo_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def print_grid(grid: dict[str, list[dict[str, Any]]], points: list[tuple[int, int]], width: int) -> None:
    headers = ["router", *(f"{kv}/{c}" for kv, c in points), "geo mean"]
    rows = []
    for name, cells in grid.items():
        if name == "sglang":
            rows.append([f"{name} (ms, hit)", *(f"{c['ttft_mean_ms']:,.0f} {c['hit_rate']:.0%}" for c in cells), ""])
            continue
        ratios = [c["ratio"] for c in cells]
        rows.append([name, *(f"{c['ratio']:.2f}x {c['hit_rate']:.0%}" for c in cells), f"{geo_mean(ratios):.3f}x"])
    print_table("TTFT mean / sglang-router's algorithm, hit rate (columns: KV blocks per worker / sessions)",
                headers, rows, width=width, left=["router"])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", default=GRID, help="KV/SESSIONS,... (default: 14 points around the GPU matrix)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=POLICY_JSON",
                    help="one more router: a policy spec, session ids sent (repeatable)")
    ap.add_argument("--base-run", type=Path, default=BASE_RUN, help="GPU result whose workload settings to use")
    ap.add_argument("--profile", default=str(PROFILE), help="simulator profile")
    ap.add_argument("--run-s", type=float, default=30.0, help="seconds of closed-loop traffic per run (default 30)")
    ap.add_argument("--workers-per-device", type=int, default=0,
                    help="workers sharing one device (default 0: all of them, as the GPU benchmark's one H200; "
                         "1: one GPU per worker, the profile's timings alone)")
    ap.add_argument("--seeds", type=int, default=1,
                    help="runs per router and point (default 1: the unperturbed workload; seed k > 0 "
                         "jitters the think times by --jitter); ratios are geometric means over them")
    ap.add_argument("--jitter", type=float, default=0.2, help="sigma of the lognormal think-time factor (default 0.2)")
    ap.add_argument("--json", dest="json_out", default=str(RESULTS / "sim_pressure.json"))
    ap.add_argument("--width", type=int, default=240)
    args = ap.parse_args(argv)
    args.routers = dict(ROUTERS)
    for v in args.variant:
        name, _, spec = v.partition("=")
        try:
            args.routers[name] = variant_router(name, json.loads(spec))
        except ValueError as exc:  # json.JSONDecodeError is one too
            ap.error(f"--variant takes NAME=POLICY_JSON or NAME={{policy, config: {{retention}}}}, got {v!r} ({exc})")
    try:
        args.point_list = parse_points(args.points)
    except ValueError:
        ap.error(f"--points takes KV/SESSIONS,..., got {args.points!r}")
    return args


def main(argv: list[str] | None = None) -> int:
    from rich.progress import Progress

    from simulator.report import write_json

    args = parse_args(argv)
    started = time.perf_counter()
    twin = Twin(args.base_run, args.profile, args.run_s, args.workers_per_device)
    with Progress(transient=False) as bar:
        task = bar.add_task("simulating", total=len(args.routers) * len(args.point_list) * args.seeds)
        grid = run_grid(twin, args.routers, args.point_list, list(range(args.seeds)), args.jitter,
                        lambda: bar.advance(task))
    print_grid(grid, args.point_list, args.width)
    write_json(args.json_out, {
        "bench": "sim_pressure", "points": args.point_list,
        "routers": {k: {"policy": v.policy, "session_ids": v.session_ids, "spill_hint": v.spill_hint,
                        "retention": dict(v.retention)}
                    for k, v in args.routers.items()},
        "grid": grid, "geo_mean": {k: geo_mean([c["ratio"] for c in v]) for k, v in grid.items()},
        "base_run": str(args.base_run), "profile": args.profile, "seeds": args.seeds, "jitter": args.jitter,
        "workers_per_device": twin.workers_per_device,
        "wall_s": time.perf_counter() - started})
    print(f"wrote {args.json_out} ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
