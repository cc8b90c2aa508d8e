"""``mesh simulate`` as the twin of the GPU routing benchmark (``bench/e2e_routing.py``).

For every matrix point of the GPU result files (``bench/results/e2e_*.json``: worker KV and CPU
blocks, concurrent sessions, run length) and every router measured there, it simulates the same
run on a CPU: the same replay plan (``mesh.replay.run.prepare`` with the run's prompt scale,
output tokens, think-time scale and cap: ``mesh.replay.sim_trace``), the same closed loop
(``--concurrency`` sessions in flight, nothing sent after the run's duration), the same workers
(their count, KV capacity and CPU tier; all on one device, time-sharing it as the benchmark's
do: ``simulator.device``) with a profile calibrated on that worker (``bench/data/profiles/``,
written by ``--write-profile`` from an ``e2e_routing.py --calibrate`` run), and each router's
policy:

- ``round_robin``, ``mesh_kv_aware`` (no session ids), ``mesh_default`` (the gateway's default,
  with its retention hint), ``mesh_cache_aware``: the Mesh policy the benchmark configured;
- ``sglang``: Mesh's ``cache_aware``, the parity implementation of sglang-router's algorithm
  (so ``sglang`` and ``mesh_cache_aware`` are one simulated system: the twin cannot order them);
- ``--variant`` routers: their policy and ``config.retention``; variants with worker fields or
  other config sections (late binding's ``max_in_flight``, ``admission``) are not modelled and
  are listed as skipped.

Per point and router it prints GPU vs simulated TTFT mean (error %), hit rate (difference in
points), requests served, and the router's rank by TTFT mean on each side; then one verdict per
target: the ranking at every point (over the pairs the twin can order), every TTFT mean within
``--ttft-tol`` (20%), every hit rate within ``--hit-tol`` points (3). ``--json`` (default
``bench/results/sim_twin.json``) gets all of it.

    python bench/sim_twin.py                                   # every e2e_*.json, the committed profile
    python bench/sim_twin.py bench/results/e2e_high.json       # one run
    python bench/sim_twin.py --write-profile bench/results/e2e_high_cal.json   # the profile, from a calibration
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

import argparse
import json
import time
from dataclasses import dataclass
from typing import Any

PROFILE = ROOT / "bench" / "data" / "profiles" / "h200-llama3-8b-x4.yaml"
SLICE = ROOT / "bench" / "data" / "weka-routing"
RESULTS = ROOT / "bench" / "results"


@dataclass(frozen=True)
class SimSpec:
    """What the twin simulates for one GPU router: a policy, whether session ids are sent, the
    gateway's ``retention`` settings (``config.retention``'s items); ``skip``: why it cannot
    (None: it can)."""

    policy: Any
    session_ids: bool
    retention: tuple[tuple[str, Any], ...] = ()
    skip: str | None = None

    @property
    def spill_hint(self) -> bool:
        return bool(dict(self.retention).get("spill_hint", True))

    def sim_retention(self) -> dict[str, Any]:
        """The ``SimConfig`` fields of ``retention``."""
        return {RETENTION_FIELDS[k]: v for k, v in self.retention}

    def key(self) -> str:
        return json.dumps([self.policy, self.session_ids, self.retention], sort_keys=True)


# config.retention's keys -> the simulator's fields (simulator.sim_config.SimConfig)
RETENTION_FIELDS = {"spill_hint": "spill_hint", "fill": "retention_fill", "active_s": "retention_active_s",
                    "idle_factor": "retention_idle_factor"}


# ============================================================================ routers
def sim_spec(name: str, config: dict[str, Any]) -> SimSpec:
    """The simulated system of GPU router ``name`` in a run of ``config`` (its ``--variant`` list)."""
    from bench.e2e_routing import SPECS, _variant_spec

    specs = dict(SPECS)
    for variant in config.get("variant") or []:
        vname, _, text = variant.partition("=")
        specs[vname] = _variant_spec(vname, json.loads(text))
    spec = specs.get(name)
    if spec is None:
        return SimSpec(None, True, skip=f"router {name!r} unknown to bench/e2e_routing.py")
    return router_sim_spec(spec)


def router_sim_spec(spec: Any) -> SimSpec:
    """What the twin simulates for one of ``bench/e2e_routing.py``'s ``RouterSpec``s."""
    from mesh.commands.simulate import default_policy

    if spec.kind == "sglang":  # sglang-router reads no session header
        return SimSpec("cache_aware", False)
    retention = dict(spec.config.get("retention") or {})
    other = [*sorted(set(spec.config) - {"retention"}), *(f"retention.{k}" for k in sorted(set(retention) - set(RETENTION_FIELDS)))]
    if spec.worker or other:
        what = ", ".join([*(f"worker.{k}" for k in spec.worker), *other])
        return SimSpec(spec.policy, spec.session_ids, skip=f"not modelled: {what}")
    policy = spec.policy if spec.policy is not None else default_policy()
    return SimSpec(policy, spec.session_ids, tuple(sorted(retention.items())))


# ============================================================================ workload
def trace_paths(config: dict[str, Any]) -> list[str]:
    """The run's trace paths, mapped into this checkout where they were the GPU machine's."""
    out = []
    for p in config.get("trace") or [str(SLICE)]:
        path = Path(p)
        if not path.exists() and "bench/data/" in p:
            path = ROOT / "bench" / "data" / p.split("bench/data/", 1)[1]
        out.append(str(path))
    return out


def workload_key(config: dict[str, Any]) -> str:
    keys = ("sessions", "max_turns", "time_scale", "max_think_s", "prompt_scale", "output_tokens", "max_model_len",
            "block_size")
    return json.dumps([trace_paths(config), *(config.get(k) for k in keys)])


def prepare_workload(config: dict[str, Any]) -> Any:
    """The replay's preparation of the run's trace, as ``e2e_routing._prepare`` does it."""
    from mesh.replay.run import ReplaySetup, prepare

    out_tokens = config.get("output_tokens", 32)
    return prepare(ReplaySetup(
        traces=trace_paths(config), sessions=config.get("sessions"), max_turns=config.get("max_turns"),
        time_scale=config.get("time_scale", 0.01), max_think_s=config.get("max_think_s", 2.0),
        prompt_scale=config.get("prompt_scale", 16.0), output_tokens=out_tokens,
        max_prompt_tokens=config.get("max_model_len", 32768) - out_tokens - 1,
        engine_block_size=config.get("block_size", 16)))


# ============================================================================ simulation
@dataclass(frozen=True)
class Point:
    file: str
    config: dict[str, Any]
    point: dict[str, Any]

    @property
    def label(self) -> str:
        p = self.point
        return f"{Path(self.file).stem}: kv {p['kv_blocks']} cpu {p['cpu_blocks']} conc {p['concurrency']}"


def simulate_router(prep: Any, spec: SimSpec, pt: Point, profile: Any) -> dict[str, Any]:
    """The simulated run of ``spec`` at ``pt`` (``simulator.report.summarize``'s metrics)."""
    from mesh.replay.sim_trace import plan_trace
    from simulator.engine import SimConfig, Simulator
    from simulator.profile import with_overrides
    from simulator.report import summarize

    p, c = pt.point, pt.config
    workers = int(c.get("workers", 4))
    devices = max(1, len([d for d in str(c.get("device", "cuda")).split(",") if d.strip()]))
    trace = plan_trace(prep.trace, prep.plan, prep.builder, int(c.get("block_size", 16)), session_ids=spec.session_ids)
    prof = with_overrides(profile, kv_blocks=p["kv_blocks"], **{"cpu.blocks": p["cpu_blocks"]})
    config = SimConfig(workers=workers, profile=prof, concurrency=p["concurrency"], horizon_s=p["run_s"] or None,
                       workers_per_device=-(-workers // devices), **spec.sim_retention())
    return summarize(Simulator(trace, spec.policy, config).run())


def run_points(points: list[Point], profile: Any, progress: Any) -> list[dict[str, Any]]:
    """Every point's rows (GPU next to simulated), simulating each distinct system once."""
    preps: dict[str, Any] = {}
    sims: dict[tuple[str, str, str], dict[str, Any]] = {}
    out = []
    for pt in points:
        prep = preps.get(workload_key(pt.config))
        if prep is None:
            prep = preps[workload_key(pt.config)] = prepare_workload(pt.config)
        rows = []
        for name, gpu in pt.point["routers"].items():
            spec = sim_spec(name, pt.config)
            sim = None
            if spec.skip is None and gpu.get("ok"):
                key = (workload_key(pt.config), json.dumps(_point_key(pt.point)), spec.key())
                if key not in sims:
                    sims[key] = simulate_router(prep, spec, pt, profile)
                sim = sims[key]
            rows.append(compare_row(name, spec, gpu, sim))
            progress()
        out.append({"file": pt.file, "label": pt.label, "point": _point_key(pt.point), "rows": rank(rows)})
    return out


def _point_key(p: dict[str, Any]) -> dict[str, Any]:
    return {k: p[k] for k in ("kv_blocks", "cpu_blocks", "concurrency", "run_s")}


# ============================================================================ comparison
def compare_row(name: str, spec: SimSpec, gpu: dict[str, Any], sim: dict[str, Any] | None) -> dict[str, Any]:
    row: dict[str, Any] = {"router": name, "sim_policy": spec.policy, "sim_system": spec.key(), "skip": spec.skip,
                           "gpu_ttft_ms": gpu["ttft_ms"]["mean"] if gpu.get("ok") else None,
                           "gpu_hit": gpu.get("hit_rate"), "gpu_requests": gpu.get("requests")}
    if sim is None:
        row["skip"] = row["skip"] or "GPU run failed"
        return row
    row.update(sim_ttft_ms=sim["ttft_ms"]["mean"], sim_hit=sim["hit_rate"], sim_requests=sim["requests"],
               sim_ttft_p50_ms=sim["ttft_ms"]["p50"], sim_ttft_p99_ms=sim["ttft_ms"]["p99"],
               gpu_ttft_p50_ms=gpu["ttft_ms"]["p50"], gpu_ttft_p99_ms=gpu["ttft_ms"]["p99"])
    row["ttft_err"] = sim["ttft_ms"]["mean"] / gpu["ttft_ms"]["mean"] - 1 if gpu["ttft_ms"]["mean"] else None
    row["hit_diff_pts"] = (sim["hit_rate"] - gpu["hit_rate"]) * 100
    return row


def rank(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ranks by TTFT mean (1 = fastest) on the GPU and in the twin, over the simulated rows."""
    live = [r for r in rows if r.get("sim_ttft_ms") is not None]
    for side in ("gpu", "sim"):
        for i, r in enumerate(sorted(live, key=lambda r: r[f"{side}_ttft_ms"])):
            r[f"{side}_rank"] = i + 1
    return rows


def pairs(rows: list[dict[str, Any]]) -> tuple[int, list[str]]:
    """(pairs the twin can order, those it orders unlike the GPU): two rows of one simulated
    system (sglang and mesh_cache_aware) have no order in the twin."""
    live = [r for r in rows if r.get("sim_ttft_ms") is not None]
    n, wrong = 0, []
    for i, a in enumerate(live):
        for b in live[i + 1:]:
            if a["sim_system"] == b["sim_system"]:
                continue
            n += 1
            if (a["gpu_ttft_ms"] < b["gpu_ttft_ms"]) != (a["sim_ttft_ms"] < b["sim_ttft_ms"]):
                wrong.append(f"{a['router']}/{b['router']}")
    return n, wrong


def repeats(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The GPU's own spread: per matrix point and router measured in several runs, the range of
    its TTFT mean and hit rate over the runs, and whether the twin's value lies inside it."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for p in points:
        q = p["point"]
        key = f"kv {q['kv_blocks']} cpu {q['cpu_blocks']} conc {q['concurrency']}"
        for r in p["rows"]:
            if r.get("sim_ttft_ms") is not None:
                groups.setdefault((key, r["router"]), []).append(r)
    out = []
    for (key, router), rows in sorted(groups.items()):
        if len(rows) < 2:
            continue
        ttft = [r["gpu_ttft_ms"] for r in rows]
        hit = [r["gpu_hit"] for r in rows]
        sim_t, sim_h = rows[0]["sim_ttft_ms"], rows[0]["sim_hit"]
        out.append({"point": key, "router": router, "runs": len(rows), "gpu_ttft_ms": [min(ttft), max(ttft)],
                    "gpu_ttft_range": (max(ttft) - min(ttft)) / (sum(ttft) / len(ttft)),
                    "gpu_hit": [min(hit), max(hit)], "sim_ttft_ms": sim_t, "sim_hit": sim_h,
                    "sim_ttft_inside": min(ttft) <= sim_t <= max(ttft), "sim_hit_inside": min(hit) <= sim_h <= max(hit),
                    "same_sim": len({r["sim_system"] for r in rows}) == 1})
    return out


def noise(spread: list[dict[str, Any]]) -> float:
    """The GPU's repeat noise in TTFT mean: the median relative range of the repeated rows."""
    ranges = sorted(r["gpu_ttft_range"] for r in spread)
    return ranges[len(ranges) // 2] if ranges else 0.0


def verdicts(points: list[dict[str, Any]], ttft_tol: float, hit_tol: float) -> dict[str, Any]:
    rows = [r for p in points for r in p["rows"] if r.get("sim_ttft_ms") is not None]
    spread = repeats(points)
    tie = noise(spread)
    ranking = []
    for p in points:
        n, wrong = pairs(p["rows"])
        beyond = [x for x in wrong if _gpu_gap(p["rows"], x) >= tie]
        ranking.append({"label": p["label"], "pairs": n, "misordered": wrong, "misordered_beyond_noise": beyond})
    ttft_bad = [f"{_where(points, r)} {r['ttft_err']:+.0%}" for r in rows if abs(r["ttft_err"]) > ttft_tol]
    hit_bad = [f"{_where(points, r)} {r['hit_diff_pts']:+.1f}" for r in rows if abs(r["hit_diff_pts"]) > hit_tol]
    return {
        "ranking": {"met": all(not x["misordered"] for x in ranking), "points": ranking, "gpu_noise": tie,
                    "met_beyond_noise": all(not x["misordered_beyond_noise"] for x in ranking)},
        "repeats": {"rows": spread, "ttft_inside": sum(r["sim_ttft_inside"] for r in spread),
                    "hit_inside": sum(r["sim_hit_inside"] for r in spread), "of": len(spread)},
        "ttft": {"met": not ttft_bad, "within": len(rows) - len(ttft_bad), "of": len(rows), "tol": ttft_tol,
                 "outside": ttft_bad},
        "hit": {"met": not hit_bad, "within": len(rows) - len(hit_bad), "of": len(rows), "tol_pts": hit_tol,
                "outside": hit_bad},
    }


def _gpu_gap(rows: list[dict[str, Any]], pair: str) -> float:
    """How far apart the GPU's TTFT means of a pair ``a/b`` are, relative to their mean."""
    a, b = pair.split("/")
    ta, tb = (next(r["gpu_ttft_ms"] for r in rows if r["router"] == name) for name in (a, b))
    return abs(ta - tb) / ((ta + tb) / 2)


def _where(points: list[dict[str, Any]], row: dict[str, Any]) -> str:
    label = next(p["label"] for p in points if any(r is row for r in p["rows"]))
    return f"{label} {row['router']}"


# ============================================================================ output
def print_points(points: list[dict[str, Any]], width: int) -> None:
    from bench._table import print_table

    headers = ("router", "sim policy", "GPU TTFT", "sim TTFT", "err", "GPU hit", "sim hit", "diff pts",
               "GPU req", "sim req", "rank GPU", "rank sim")
    for p in points:
        out = []
        for r in p["rows"]:
            if r.get("sim_ttft_ms") is None:
                out.append([r["router"], "-", _ms(r["gpu_ttft_ms"]), "-", "-", _pct(r["gpu_hit"]), "-", "-",
                            str(r["gpu_requests"]), "-", "-", f"skipped: {r['skip']}"])
                continue
            out.append([r["router"], _policy(r["sim_policy"]), _ms(r["gpu_ttft_ms"]), _ms(r["sim_ttft_ms"]),
                        f"{r['ttft_err']:+.0%}", _pct(r["gpu_hit"]), _pct(r["sim_hit"]), f"{r['hit_diff_pts']:+.1f}",
                        str(r["gpu_requests"]), str(r["sim_requests"]), str(r["gpu_rank"]), str(r["sim_rank"])])
        print_table(p["label"] + f" ({p['point']['run_s']:.0f} s)", headers, out, width=width,
                    left=("router", "sim policy", "rank sim"))


def print_repeats(v: dict[str, Any], width: int) -> None:
    from bench._table import print_table

    rows = [[r["point"], r["router"], str(r["runs"]), f"{_ms(r['gpu_ttft_ms'][0])} - {_ms(r['gpu_ttft_ms'][1])}",
             f"{r['gpu_ttft_range']:.0%}", _ms(r["sim_ttft_ms"]) + ("" if r["sim_ttft_inside"] else " (out)"),
             f"{_pct(r['gpu_hit'][0])} - {_pct(r['gpu_hit'][1])}", _pct(r["sim_hit"]) + ("" if r["sim_hit_inside"] else " (out)")]
            for r in v["repeats"]["rows"]]
    print_table("the GPU's repeats of one point (runs of several dates) against the twin", (
        "point", "router", "runs", "GPU TTFT range", "range/mean", "sim TTFT", "GPU hit range", "sim hit"), rows,
        width=width, left=("point", "router"))


def print_verdicts(v: dict[str, Any]) -> None:
    rk = v["ranking"]
    bad = [f"{p['label']}: {', '.join(p['misordered'])}" for p in rk["points"] if p["misordered"]]
    print(f"ranking per point: {'MET' if rk['met'] else 'NOT MET'} "
          f"({sum(not p['misordered'] for p in rk['points'])}/{len(rk['points'])} points ordered as on the GPU"
          + (f"; misordered: {'; '.join(bad)}" if bad else "") + ")")
    beyond = [f"{p['label']}: {', '.join(p['misordered_beyond_noise'])}" for p in rk["points"]
              if p["misordered_beyond_noise"]]
    print(f"  ignoring pairs the GPU separates by less than its repeat noise ({rk['gpu_noise']:.0%}): "
          f"{'MET' if rk['met_beyond_noise'] else 'NOT MET'}" + (f" (misordered: {'; '.join(beyond)})" if beyond else ""))
    rp = v["repeats"]
    print(f"inside the GPU's repeat range: TTFT {rp['ttft_inside']}/{rp['of']}, hit rate {rp['hit_inside']}/{rp['of']}")
    t, h = v["ttft"], v["hit"]
    print(f"TTFT mean within {t['tol']:.0%}: {'MET' if t['met'] else 'NOT MET'} ({t['within']}/{t['of']}"
          + (f"; outside: {'; '.join(t['outside'])}" if t["outside"] else "") + ")")
    print(f"hit rate within {h['tol_pts']:g} points: {'MET' if h['met'] else 'NOT MET'} ({h['within']}/{h['of']}"
          + (f"; outside: {'; '.join(h['outside'])}" if h["outside"] else "") + ")")


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f} ms"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def _policy(spec: Any) -> str:
    return spec if isinstance(spec, str) else json.dumps(spec, separators=(",", ":"))


# ============================================================================ main
def gpu_points(paths: list[Path]) -> list[Point]:
    points = []
    for path in paths:
        doc = json.loads(path.read_text())
        if doc.get("bench") != "e2e_routing":
            continue
        points += [Point(str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path), doc["config"], p)
                   for p in doc.get("points") or []]
    return points


def write_profile(calibration_json: Path, out: Path) -> None:
    """The twin's profile from an ``e2e_routing.py --calibrate`` run: worker 0 alone, plus the
    mean of every worker measured at once (``simulator.profile.with_shared``); each profile's
    prefill terms fitted again from its recorded points, in the engine's steps
    (``simulator.calibrate_fit.refit_prefill``: the profiles of that run predate the step-wise fit)."""
    from dataclasses import replace

    import yaml

    from simulator.calibrate_fit import refit_prefill
    from simulator.profile import Profile, dump_profile, from_dict, with_shared

    def load(text: str, what: str) -> Profile:
        doc = yaml.safe_load(text)
        profile = from_dict(doc["profile"], source=f"{calibration_json}: {what}")
        return refit_prefill(profile, (doc.get("calibration") or {}).get("points") or {})

    cal = json.loads(calibration_json.read_text())["calibration"][0]
    alone = load(cal["alone"], "alone")
    shared = [load(t, f"shared[{i}]") for i, t in enumerate(cal["shared"])]
    profile = replace(with_shared(alone, shared), name="h200-llama3-8b-x4", estimate=False, description=(
        f"bundled llama3-8b worker on one H200 (bench/e2e_routing.py --calibrate, {calibration_json.name}): "
        f"prefill/decode alone, shared_* with all {len(shared)} workers of the GPU busy"))
    out.parent.mkdir(parents=True, exist_ok=True)
    dump_profile(profile, out)
    print(f"wrote {out}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="*", type=Path, help="GPU result files (default bench/results/e2e_*.json)")
    ap.add_argument("--profile", default=str(PROFILE), help=f"simulator profile (default {PROFILE.relative_to(ROOT)})")
    ap.add_argument("--json", dest="json_out", default=str(RESULTS / "sim_twin.json"), help="write the comparison here")
    ap.add_argument("--ttft-tol", type=float, default=0.20, help="target: |sim/GPU - 1| of TTFT mean (default 0.20)")
    ap.add_argument("--hit-tol", type=float, default=3.0, help="target: |sim - GPU| hit rate, points (default 3)")
    ap.add_argument("--width", type=int, default=170)
    ap.add_argument("--write-profile", type=Path, metavar="CAL_JSON",
                    help="write --profile from this e2e_routing --calibrate result and exit")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from rich.progress import Progress

    from simulator.profile import load_profile
    from simulator.report import write_json

    args = parse_args(argv)
    if args.write_profile:
        write_profile(args.write_profile, Path(args.profile))
        return 0
    paths = args.results or sorted(RESULTS.glob("e2e_*.json"))
    points = gpu_points(paths)
    profile = load_profile(args.profile)
    started = time.perf_counter()
    total = sum(len(p.point["routers"]) for p in points)
    with Progress(transient=True) as bar:
        task = bar.add_task("simulating", total=total)
        compared = run_points(points, profile, lambda: bar.advance(task))
    print_points(compared, args.width)
    v = verdicts(compared, args.ttft_tol, args.hit_tol)
    print_repeats(v, args.width)
    print_verdicts(v)
    write_json(args.json_out, {"bench": "sim_twin", "profile": profile.to_dict(), "profile_file": args.profile,
                               "files": [str(p) for p in paths], "points": compared, "verdicts": v,
                               "wall_s": time.perf_counter() - started})
    print(f"wrote {args.json_out} ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
