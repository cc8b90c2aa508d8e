"""``mesh simulate``'s runs: one per policy per ``--workers`` count, each result kept as it lands.

The plan (``plan``) checks every flag and builds every policy before the (possibly long) trace
load. The runs then go one at a time (``run_all``); after each one the JSON and HTML reports are
rewritten with every run finished so far (``complete: false`` and the runs still pending until
the last), each written to a temporary file renamed over the report, so a run cut short (Ctrl-C,
a killed job, a full disk on the last write) leaves the finished runs readable, never a torn file.

Sizing: with several ``--workers`` counts and ``--ttft-p99-target S``, ``sizing`` names per
policy the smallest count whose TTFT p99 is at most ``S`` seconds (None: none of them). The
table's reference row is the trace's ideal hit rate (``simulator.ideal``; in the replay's plan,
the replay's own at its token scale).
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mesh.commands.sim_progress import SimProgress, duration


@dataclass(frozen=True, slots=True)
class Run:
    label: str  # the report's key: the policy's label, with the worker count in a sweep
    policy: str  # the policy's label
    spec: Any
    workers: int
    config: Any  # simulator.sim_config.SimConfig


@dataclass(slots=True)
class Plan:
    trace: Any
    profile: Any
    workload: dict[str, Any]
    runs: list[Run]
    counts: list[int]
    default_label: str | None  # the row of the gateway's default policy (None: not run)
    reference: dict[str, float | None] = field(default_factory=dict)
    command: str = ""  # the command line, as the report's header shows it


def run_label(policy: str, workers: int, sweep: bool) -> str:
    return f"{policy} ({workers} workers)" if sweep else policy


def plan(args: argparse.Namespace, policies: list[tuple[str, Any]], default_label: str | None,
         progress: SimProgress) -> Plan:
    """Every flag checked and every policy built, then the trace loaded; raises the errors that
    ``run_simulate`` turns into messages."""
    from mesh.commands.command_line import command_line
    from mesh.commands.sim_workload import load_workload, workload_problem
    from mesh.commands.simulate import check_report_path
    from policies import create_policy
    from simulator.engine import SimConfig, SimulationError, check_config
    from simulator.ideal import ideal_hit_rate
    from simulator.profile import load_profile
    from simulator.traces import TraceError

    problem = workload_problem(args)
    if problem is not None:
        raise SimulationError(problem)
    if args.ttft_p99_target is not None and not args.ttft_p99_target > 0:
        raise SimulationError(f"--ttft-p99-target must be a number of seconds > 0, got {args.ttft_p99_target}")
    overrides = {"kv_blocks": args.kv_blocks, "cpu.blocks": args.cpu_blocks, "event_lag_ms": args.event_lag_ms}
    profile = load_profile(args.profile, **overrides)
    base = SimConfig(workers=1, profile=profile, seed=args.seed, prefill_workers=args.prefill_workers,
                     session_ttl_s=args.session_ttl, speculative_ttl_s=args.speculative_ttl,
                     concurrency=args.concurrency or 0, horizon_s=args.run_s,
                     workers_per_device=args.workers_per_device, spill_hint=not args.no_spill_hint,
                     hybrid_checkpoints=args.hybrid_checkpoints,
                     hybrid_interval_blocks=args.hybrid_interval_blocks if args.hybrid_checkpoints else 0)
    counts = sorted(set(args.workers))
    configs = {n: replace(base, workers=n) for n in counts}
    for config in configs.values():
        check_config(config)
    for flag, path in (("json", args.json_out), ("html", args.html_out)):
        if path:
            check_report_path(flag, path)
    for _, spec in policies:  # a plugin error now, not after hours of the runs before it
        create_policy(spec, strict=True)
    sweep = len(counts) > 1
    runs = [Run(run_label(label, n, sweep), label, spec, n, configs[n]) for label, spec in policies for n in counts]
    check_baseline(args.baseline, runs)
    progress.phase(f"loading {', '.join(args.traces)}")
    loaded = time.perf_counter()
    try:
        trace, workload = load_workload(args, args.block_size or profile.block_size)
    except ValueError as exc:  # the replay's planning: no request left (a TraceError is one too)
        if isinstance(exc, TraceError):
            raise
        raise SimulationError(str(exc)) from None
    finally:
        progress.close()
    if "ideal_hit_rate" in workload:
        reference = {"ideal_hit_rate": workload["ideal_hit_rate"],
                     "ideal_hit_rate_global": workload.get("ideal_hit_rate_global")}
    else:
        ideal = ideal_hit_rate(trace)
        reference = {"ideal_hit_rate": ideal.session if trace.sessions else None,  # no session: only the global
                     "ideal_hit_rate_global": ideal.global_}
    progress.say(f"loaded {len(trace.requests):,} requests, {trace.sessions:,} sessions in "
                 f"{duration(time.perf_counter() - loaded)}; {len(runs)} run(s) to go")
    return Plan(trace, profile, workload, runs, counts, default_label, reference, command_line(args))


def check_baseline(name: str | None, runs: list[Run]) -> None:
    """``--baseline`` names a run or a policy (its first run, ``simulator.report_page``)."""
    from simulator.engine import SimulationError

    if name is not None and not any(name in (r.label, r.policy) for r in runs):
        raise SimulationError(f"--baseline {name!r} names no run (the runs: {', '.join(r.label for r in runs)})")


def run_all(args: argparse.Namespace, p: Plan, progress: SimProgress, started: float
            ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(result per run label, the final payload): each run's reports written as it ends."""
    from simulator.engine import Simulator
    from simulator.report import summarize

    results: dict[str, Any] = {}
    summaries: dict[str, dict[str, Any]] = {}
    payload: dict[str, Any] = {}
    for run in p.runs:
        sim = Simulator(p.trace, run.spec, run.config, progress=progress.update if progress.tty else None)
        progress.start(run.label, len(p.trace.requests), _done_of(sim))
        result = sim.run()
        results[run.label] = result
        summaries[run.label] = summarize(result)  # the shape mesh replay's summaries share
        progress.close()  # the run's display ends with it, before the reports are written
        payload = build_payload(args, p, summaries, started)
        written = write_reports(args, payload, results, final=run is p.runs[-1])
        progress.finished(result_line(run.label, summaries[run.label], result.wall_s, written))
    return results, payload


def _done_of(sim: Any) -> Any:
    """What the progress ticker reads: the simulator's finished-request count."""
    return lambda: sim.done


def result_line(label: str, s: dict[str, Any], wall_s: float, written: list[str]) -> str:
    t = s["ttft_ms"]
    where = f"; written to {', '.join(written)}" if written else ""
    return (f"{label} done in {duration(wall_s)}: {s['requests']:,} requests, hit rate {s['hit_rate']:.1%}, "
            f"TTFT p50 {t['p50'] / 1e3:,.3f} s, p99 {t['p99'] / 1e3:,.3f} s{where}")


def sizing(p: Plan, summaries: dict[str, dict[str, Any]], target_s: float) -> dict[str, Any]:
    """Per policy, the smallest worker count whose TTFT p99 meets ``target_s`` (None: none did,
    among the counts finished), with every finished count's p99."""
    out: dict[str, Any] = {}
    for run in p.runs:
        s = summaries.get(run.label)
        if s is None:
            continue
        entry = out.setdefault(run.policy, {"workers": None, "ttft_p99_ms": {}})
        entry["ttft_p99_ms"][run.workers] = s["ttft_ms"]["p99"]
        if entry["workers"] is None and s["ttft_ms"]["p99"] <= target_s * 1e3 and not s["rejected"]:
            entry["workers"] = run.workers
    return {"ttft_p99_target_s": target_s, "policies": out}


def sizing_lines(report: dict[str, Any], counts: list[int]) -> list[str]:
    target = report["ttft_p99_target_s"]
    lines = []
    for policy, entry in report["policies"].items():
        p99 = entry["ttft_p99_ms"]
        if entry["workers"] is not None:
            n = entry["workers"]
            lines.append(f"TTFT p99 <= {target:g} s: {policy} needs {n} worker{'s' if n > 1 else ''} "
                         f"(p99 {p99[n] / 1e3:,.3f} s)")
        else:
            best = min(p99, key=lambda k: p99[k])
            tried = ", ".join(str(n) for n in counts if n in p99)
            lines.append(f"TTFT p99 <= {target:g} s: {policy} meets it with none of {tried} workers "
                         f"(best: {best} workers, p99 {p99[best] / 1e3:,.3f} s)")
    return lines


def build_payload(args: argparse.Namespace, p: Plan, summaries: dict[str, dict[str, Any]], started: float
                  ) -> dict[str, Any]:
    """The report with every run finished so far (``complete``: all of them)."""
    trace = p.trace
    warnings = report_warnings(summaries)
    pending = [r.label for r in p.runs if r.label not in summaries]
    payload: dict[str, Any] = {
        "mesh_simulate": 1,
        "complete": not pending,
        "runs": {"done": len(summaries), "total": len(p.runs), "pending": pending,
                 "workers": {r.label: r.workers for r in p.runs}, "policy": {r.label: r.policy for r in p.runs}},
        "trace": {
            "files": trace.files, "formats": trace.formats, "requests": len(trace.requests),
            "sessions": trace.sessions, "block_size": trace.block_size, "warnings": trace.warnings,
            "time_scale": args.time_scale, "session_start_spread_s": args.session_start_spread,
            **p.workload, **p.reference,
        },
        "closed_loop": {"concurrency": args.concurrency, "run_s": args.run_s,
                        "session_ids": not args.no_session_ids},
        "workers_per_device": args.workers_per_device,
        "spill_hint": not args.no_spill_hint,
        "hybrid_checkpoints": args.hybrid_checkpoints,
        "hybrid_interval_blocks": args.hybrid_interval_blocks if args.hybrid_checkpoints else 0,
        "workers": p.counts[0] if len(p.counts) == 1 else p.counts,
        "prefill_workers": args.prefill_workers,
        "profile": p.profile.to_dict(),
        "seed": args.seed,
        "gateway_default_policy": p.default_label,
        "baseline": args.baseline,
        "command": p.command,
        "policies": summaries,
        "warnings": warnings,
        "wall_s": time.perf_counter() - started,
    }
    if args.ttft_p99_target is not None:
        payload["sizing"] = sizing(p, summaries, args.ttft_p99_target)
    return payload


def report_warnings(summaries: dict[str, dict[str, Any]]) -> list[str]:
    warnings = []
    for label, s in summaries.items():
        if s["rejected"]:  # not in the latency and hit-rate numbers: they cover served requests only
            warnings.append(f"{label}: {s['rejected']:,} of {s['requests'] + s['rejected']:,} "
                            "requests rejected (the policy found no candidate for them)")
        warnings.extend(f"{label}: {note}" for note in s["notes"])
    return warnings


def write_reports(args: argparse.Namespace, payload: dict[str, Any], results: dict[str, Any], final: bool) -> list[str]:
    """The JSON and HTML reports, each replaced atomically; the paths written. A report that is
    not a regular file (``--json /dev/stdout``, a FIFO) is written once, whole, at the end."""
    from simulator.report import write_html, write_json

    written = []
    for path, write in ((args.json_out, lambda tmp: write_json(tmp, payload)),
                        (args.html_out, lambda tmp: write_html(tmp, payload, results))):
        if path and (final or not _special(path)):
            atomic_write(path, write)
            written.append(path)
    return written


def _special(path: str) -> bool:
    """An existing path that is not a regular file (following links): a device, a pipe."""
    return os.path.exists(path) and not os.path.isfile(path)


def atomic_write(path: str, write: Any) -> None:
    """``write(tmp)`` to a temporary file beside ``path`` (beside the file a link names), then
    renamed over it: a reader sees the old report or the new one, whole. A path that is not a
    regular file is written in place (renaming over ``/dev/stdout`` would replace the device link)."""
    from simulator.engine import SimulationError

    target = Path(path)
    try:
        if _special(path):
            write(target)
            return
        target = target.resolve() if target.is_symlink() else target
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            write(tmp)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    except OSError as exc:
        raise SimulationError(f"cannot write report {path}: {exc.strerror or exc}") from None
