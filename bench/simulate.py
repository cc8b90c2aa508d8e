"""``mesh simulate`` against Dynamo's offline mocker (``run_mocker_trace_replay``), in one run.

Same traces, same worker counts, same simulated hardware: Mesh runs the built-in
``dynamo-mocker`` profile, which copies the mocker's defaults (16,384 KV blocks of 64 tokens per
worker, 8,192-token step budget, 256 sequences, its polynomial prefill and decode timing). Mesh
runs at the engine's 64-token blocks (apples to apples with Dynamo; Mooncake's 512-token ids are
re-blocked) and/or at a coarser block size (Mooncake: its own 512-token ids, which carry all the
trace's reuse information; WEKA: 256 tokens), capacity in tokens unchanged. By default WEKA runs
at 256 only (``--weka-blocks 256 64`` adds the exact granularity, which the index's per-block
cost makes slow), so that the whole run stays within a few minutes on 2 cores. For each scenario and
routing mode (round robin; KV-aware: Dynamo's ``kv_router``, Mesh's best registered KV policy)
the table gives both simulators' wall time (the whole call: trace loading and replay), prefix
hit rate and latencies, and the wall-time ratio.

Scenarios:
- ``mooncake``: the 12,031-request Mooncake conversation trace, 8 workers (open loop).
- ``weka``: the first N WEKA agent sessions (default 100), 4 workers (closed loop per session).
  Dynamo's importer wants plain JSON whose declared models cover every request, so the files are
  decompressed (and the sub-agents' models declared) into a temporary directory first, untimed.

    python bench/simulate.py [--scenarios mooncake weka] [--sessions 100] [--weka-blocks 256 64]
                             [--json bench/results/simulate.json]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import argparse
import gc
import gzip
import json
import os
import tempfile
import time
from typing import Any

os.environ.setdefault("DYN_LOG", "warn")  # the mocker's router logs every decision at INFO

from rich.console import Console
from rich.table import Table

from policies.registry import names
from simulator.engine import SimConfig, Simulator
from simulator.profile import BUILTIN
from simulator.report import summarize
from simulator.traces import LoadOptions, load_traces

TRACES = next((p for p in (Path(__file__).resolve().parents[2] / "shared" / "traces", Path("/work/shared/traces")) if p.is_dir()), Path("/work/shared/traces"))
MOONCAKE = TRACES / "mooncake" / "conversation_trace.jsonl"
WEKA = TRACES / "weka"


def kv_policy() -> tuple[str, Any]:
    """Mesh's KV-aware policy: the precise kv_aware policy when registered, else its pipeline
    equivalent (prefix overlap, prefill work and load, as Dynamo's cost terms)."""
    if "kv_aware" in names("policy"):
        return "kv_aware", "kv_aware"
    return "pipeline(prefix+prefill_load+load)", {"name": "pipeline", "params": {"scorers": [
        {"name": "prefix", "weight": 1.0}, {"name": "prefill_load", "weight": 1.0}, {"name": "load", "weight": 0.5}]}}


def weka_dir(sessions: int, tmp: Path) -> tuple[list[Path], Path]:
    files = sorted(WEKA.glob("*.json.gz"))[:sessions]
    out = tmp / "weka"
    out.mkdir()
    for f in files:
        doc = json.loads(gzip.decompress(f.read_bytes()))
        models = set(doc.get("models") or [])

        def walk(reqs: list[dict[str, Any]]) -> None:
            for r in reqs:
                if r.get("type") == "subagent":
                    walk(r.get("requests") or [])
                elif r.get("model"):
                    models.add(r["model"])

        walk(doc["requests"])
        doc["models"] = sorted(models)
        (out / f.name.removesuffix(".gz")).write_text(json.dumps(doc))
    return files, out


def run_mesh(files: list[Path], workers: int, spec: Any, block_size: int) -> dict[str, Any]:
    gc.collect()
    started = time.perf_counter()
    trace = load_traces(files, LoadOptions(block_size=block_size))
    result = Simulator(trace, spec, SimConfig(workers=workers, profile=BUILTIN["dynamo-mocker"])).run()
    wall = time.perf_counter() - started
    s = summarize(result)
    return {"wall_s": wall, "sim_s": result.wall_s, "requests": s["requests"], "hit_rate": s["hit_rate"],
            "ttft_ms": s["ttft_ms"], "itl_ms": s["itl_ms"]["mean"], "e2e_ms": s["e2e_ms"]["mean"],
            "throughput_tok_s": s["throughput_tok_s"], "preemptions": s["preemptions"]}


def run_dynamo(inputs: list[str], workers: int, mode: str, fmt: str) -> dict[str, Any]:
    from dynamo._core import run_mocker_trace_replay

    kwargs: dict[str, Any] = {"num_workers": workers, "router_mode": mode}
    if fmt == "weka":
        kwargs.update(trace_format="weka", execution_model="claude-opus-4-5-20251101")
    else:
        kwargs.update(trace_block_size=512)
    gc.collect()
    started = time.perf_counter()
    s = run_mocker_trace_replay(inputs, **kwargs).summary
    wall = time.perf_counter() - started
    return {"wall_s": wall, "sim_s": s["wall_time_ms"] / 1e3, "requests": s["completed_requests"],
            "hit_rate": s["prefix_cache_reused_ratio"],
            "ttft_ms": {"mean": s["mean_ttft_ms"], "p50": s["median_ttft_ms"], "p90": s["p90_ttft_ms"],
                        "p99": s["p99_ttft_ms"]},
            "itl_ms": s["mean_itl_ms"], "e2e_ms": s["mean_e2e_latency_ms"],
            "throughput_tok_s": s["output_throughput_tok_s"]}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenarios", nargs="+", default=["mooncake", "weka"], choices=["mooncake", "weka"])
    ap.add_argument("--sessions", type=int, default=100, help="WEKA sessions (files) to replay")
    ap.add_argument("--modes", nargs="+", default=["round_robin", "kv"], choices=["round_robin", "kv"])
    ap.add_argument("--mooncake-blocks", nargs="+", type=int, default=[512, 64],
                    help="Mesh block sizes on Mooncake (512: the trace's ids; 64: Dynamo's engine blocks)")
    ap.add_argument("--weka-blocks", nargs="+", type=int, default=[256],
                    help="Mesh block sizes on WEKA (add 64 for Dynamo's exact granularity: ~1 min more per mode)")
    ap.add_argument("--json", default="bench/results/simulate.json")
    return ap.parse_args()


def plan_scenarios(args: argparse.Namespace, tmp: Path) -> list[tuple[str, list[Path], list[str], int, str, list[int]]]:
    """Per scenario: name, Mesh's trace files, Dynamo's inputs, workers, Dynamo's trace format, Mesh block sizes."""
    plans = []
    if "mooncake" in args.scenarios:
        plans.append(("mooncake", [MOONCAKE], [str(MOONCAKE)], 8, "mooncake", args.mooncake_blocks))
    if "weka" in args.scenarios:
        files, directory = weka_dir(args.sessions, tmp)
        plans.append((f"weka x{len(files)}", files, [str(directory)], 4, "weka", args.weka_blocks))
    return plans


def replay_all(args: argparse.Namespace, plans: list[Any], console: Console, kv_label: str,
               kv_spec: Any) -> list[dict[str, Any]]:
    """Every scenario and mode through Dynamo once and Mesh at each block size: one row each."""
    from rich.progress import Progress

    rows: list[dict[str, Any]] = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("replaying", total=sum(len(args.modes) * (1 + len(p[5])) for p in plans))
        for name, files, dyn_inputs, workers, fmt, blocks in plans:
            for mode in args.modes:
                spec = "round_robin" if mode == "round_robin" else kv_spec
                label = "round_robin" if mode == "round_robin" else kv_label
                progress.update(task, description=f"{name} {mode}: dynamo")
                dyn = run_dynamo(dyn_inputs, workers, "round_robin" if mode == "round_robin" else "kv_router", fmt)
                progress.advance(task)
                meshes = {}
                for bs in blocks:
                    progress.update(task, description=f"{name} {mode}: mesh @{bs}")
                    meshes[bs] = run_mesh(files, workers, spec, bs)
                    progress.advance(task)
                rows.append({"scenario": name, "workers": workers, "mode": mode, "mesh_policy": label,
                             "mesh": meshes, "dynamo": dyn,
                             "speed_ratio": {bs: dyn["wall_s"] / m["wall_s"] for bs, m in meshes.items()}})
    return rows


def results_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="mesh simulate vs Dynamo run_mocker_trace_replay (same traces, workers, timing model)")
    for col in ("scenario", "routing", "sim", "wall s", "ratio", "hit rate", "TTFT mean", "p50", "p99",
                "ITL mean", "E2E mean", "out tok/s"):
        table.add_column(col, justify="left" if col in ("scenario", "routing", "sim") else "right")
    for r in rows:
        entries = [(f"mesh @{bs}", m, f"{r['speed_ratio'][bs]:.2f}x") for bs, m in r["mesh"].items()]
        entries.append(("dynamo @64", r["dynamo"], ""))
        for who, m, ratio in entries:
            table.add_row(
                r["scenario"], r["mesh_policy"] if who.startswith("mesh") else
                ("kv_router" if r["mode"] == "kv" else "round_robin"),
                who, f"{m['wall_s']:.2f}", ratio, f"{m['hit_rate']:.1%}", f"{m['ttft_ms']['mean']:.0f}",
                f"{m['ttft_ms']['p50']:.0f}", f"{m['ttft_ms']['p99']:.0f}", f"{m['itl_ms']:.2f}",
                f"{m['e2e_ms']:.0f}", f"{m['throughput_tok_s']:,.0f}",
            )
    return table


def main() -> int:
    args = parse_args()
    console = Console(width=max(Console().width, 150))
    kv_label, kv_spec = kv_policy()
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        plans = plan_scenarios(args, Path(tmp))
        rows = replay_all(args, plans, console, kv_label, kv_spec)
    console.print(results_table(rows))
    console.print("ratio = Dynamo wall / Mesh wall (> 1: Mesh faster). Latencies in ms. "
                  f"Load average at start {load_start[0]:.2f}, at end {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs).")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"rows": rows, "cpu_count": os.cpu_count(), "loadavg_start": load_start,
                                           "loadavg_end": os.getloadavg()}, indent=2) + "\n")
    console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
