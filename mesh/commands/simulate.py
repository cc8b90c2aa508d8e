"""``mesh simulate`` and ``mesh calibrate``: the simulator's command line.

``mesh simulate TRACE [TRACE ...] --workers N --policy NAME_OR_YAML [--policy ...]`` replays the
traces (format detected per file) once per policy on a fresh simulated cluster and prints a
table; ``--json`` and ``--html`` write the full report. A YAML policy file is a file whose
``policy:`` key holds a policy spec (a name, or ``{name, params}``), as in ``mesh.yaml``.

``mesh calibrate --url URL [--out profile.yaml]`` measures a running OpenAI-compatible endpoint
and writes a timing profile for ``mesh simulate --profile``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from mesh.commands.sim_workload import add_workload_args


def add_parser(subparsers: Any) -> None:
    _add_simulate_parser(subparsers)
    _add_calibrate_parser(subparsers)


def _add_simulate_parser(subparsers: Any) -> None:
    sim = subparsers.add_parser(
        "simulate",
        help="replay request traces on a simulated cluster with the production policies",
        description=__doc__.split("\n\n")[1],
    )
    sim.add_argument("traces", nargs="+", metavar="TRACE", help="trace files or directories (format auto-detected)")
    sim.add_argument("--workers", type=int, default=4, help="simulated workers (default 4)")
    sim.add_argument("--policy", action="append", metavar="NAME_OR_YAML",
                     help="built-in policy name, module:Class, or a YAML file with a 'policy:' key; repeat to compare")
    sim.add_argument("--profile", default=None, metavar="FILE_OR_NAME",
                     help="timing profile: YAML/JSON file or built-in name (h200-8b, dynamo-mocker, unit)")
    sim.add_argument("--json", dest="json_out", metavar="OUT", help="write the report as JSON")
    sim.add_argument("--html", dest="html_out", metavar="OUT", help="write a self-contained HTML report")
    sim.add_argument("--max-sessions", type=int, metavar="N", help="replay only the first N sessions")
    sim.add_argument("--max-requests", type=int, metavar="N", help="replay only the first N requests")
    sim.add_argument("--time-scale", type=float, default=1.0, metavar="F",
                     help="multiply arrival and think times (0.5 = twice the request rate)")
    sim.add_argument("--session-start-spread", type=float, default=0.0, metavar="S",
                     help="shift each session's start by a uniform offset in [0, S) seconds, drawn with --seed "
                          "(WEKA/AgentX sessions all start at t=0: without it their first turns arrive as one "
                          "burst that dominates TTFT p99; requests without a session keep their times)")
    sim.add_argument("--seed", type=int, default=0, help="seed of the policies' random choices")
    sim.add_argument("--block-size", type=int, metavar="TOKENS", help="simulation block size (default: the trace's)")
    sim.add_argument("--trace-block-size", type=int, metavar="TOKENS", help="tokens per trace block id (override)")
    sim.add_argument("--kv-blocks", type=int, metavar="N", help="override the profile's GPU KV blocks per worker")
    sim.add_argument("--cpu-blocks", type=int, metavar="N", help="override the profile's CPU-tier blocks per worker")
    sim.add_argument("--event-lag-ms", type=float, metavar="MS", help="override the KV event lag")
    sim.add_argument("--prefill-workers", type=int, default=0, metavar="P",
                     help="give the first P workers the prefill role and the rest the decode role (needs a "
                          "policy with prefill/decode profiles, e.g. examples/pipeline_pd.yaml; with any other "
                          "a warning says the run was a mixed cluster's)")
    sim.add_argument("--speculative-ttl", type=float, default=2.0, metavar="S",
                     help="router's speculative index entries live S seconds (0 = off; default 2, as the gateway)")
    sim.add_argument("--session-ttl", type=float, default=600.0, metavar="S", help="idle expiry of session bindings")
    sim.add_argument("--quiet", action="store_true", help="no progress bar and no table")
    add_workload_args(sim)
    sim.set_defaults(func=run_simulate)


def _add_calibrate_parser(subparsers: Any) -> None:
    cal = subparsers.add_parser(
        "calibrate",
        help="measure prefill/decode timing of a running OpenAI-compatible endpoint into a profile",
        description="Measures TTFT over prompt lengths and cached contexts, and inter-token latency over "
                    "batch sizes and contexts, from any OpenAI-compatible endpoint with streaming, and fits "
                    "a simulator timing profile.",
    )
    cal.add_argument("--url", required=True, help="base URL of the endpoint (e.g. http://127.0.0.1:8000)")
    cal.add_argument("--out", default="profile.yaml", help="profile file to write (default profile.yaml)")
    cal.add_argument("--model", help="model name (default: the first of /v1/models)")
    cal.add_argument("--api-key", help="bearer token, if the endpoint needs one")
    cal.add_argument("--base", default="h200-8b", help="built-in profile whose capacity fields are kept")
    cal.add_argument("--kv-blocks", type=int, help="GPU KV capacity in blocks to record")
    cal.add_argument("--block-size", type=int, help="the engine's block size to record")
    cal.add_argument("--max-prompt", type=int, default=8192, help="longest prompt to measure, in tokens")
    cal.add_argument("--max-batch", type=int, default=32, help="largest decode batch to measure")
    cal.add_argument("--repeats", type=int, default=3, help="measurements per point (median kept)")
    cal.add_argument("--quick", action="store_true", help="few, small points (smoke test)")
    cal.add_argument("--timeout", type=float, default=300.0, help="per-request timeout, seconds")
    cal.add_argument("--session", metavar="ID",
                     help="send this session id with every request: behind a session-aware gateway all "
                          "measurements then land on one worker (calibrate through the gateway)")
    cal.add_argument("--session-header", default="x-session-id", help="header carrying --session")
    cal.add_argument("--ttft-max-tokens", type=int, default=1, metavar="N",
                     help="max_tokens of the TTFT measurements (default 1: prefill alone; more: requests that go "
                          "on decoding after their first token)")
    cal.add_argument("--token-ids", type=int, metavar="VOCAB",
                     help="send prompts as random token ids below VOCAB instead of text (as a replay of token-id "
                          "traffic does: what parsing id lists costs is then measured too)")
    cal.set_defaults(func=run_calibrate)


def _fail(cmd: str, message: str) -> int:
    print(f"mesh {cmd}: error: {message}", file=sys.stderr)
    return 2


def _load_policy_arg(arg: str) -> tuple[str, Any]:
    """(label, spec) for a --policy value: a YAML file with 'policy:' or a policy name."""
    from mesh.commands.policy_arg import load_policy_arg

    return load_policy_arg(arg)


def default_policy() -> str:
    """The gateway's default policy (``mesh serve`` and ``mesh up`` without a policy)."""
    from mesh.config import DEFAULT_POLICY

    return str(DEFAULT_POLICY)


def run_simulate(args: argparse.Namespace) -> int:
    from rich.console import Console

    from policies.registry import PluginError
    from simulator.engine import SimulationError
    from simulator.profile import ProfileError
    from simulator.report import write_html, write_json
    from simulator.traces import TraceError
    from simulator.worker_model import CapacityError

    console = Console(stderr=True)
    started = time.perf_counter()
    try:
        trace, profile, results, workload = _simulate(args, console)
    except (TraceError, ProfileError, PluginError, SimulationError, CapacityError) as exc:
        return _fail("simulate", str(exc))
    except OSError as exc:
        return _fail("simulate", f"{exc.filename or ''}: {exc.strerror or exc}")
    payload = _report(args, trace, profile, results, workload, console, started)
    try:
        if args.json_out:
            write_json(args.json_out, payload)
        if args.html_out:
            write_html(args.html_out, payload, results)
    except OSError as exc:
        return _fail("simulate", f"cannot write report: {exc}")
    return 0


def _simulate(args: argparse.Namespace, console: Any) -> tuple[Any, Any, dict[str, Any], dict[str, Any]]:
    """(trace, profile, result per policy label, the workload's report fields): every flag checked
    before the (possibly long) trace load, then one run per policy."""
    from mesh.commands.sim_workload import load_workload, workload_problem
    from simulator.engine import SimConfig, SimulationError, check_config
    from simulator.profile import load_profile
    from simulator.traces import TraceError

    problem = workload_problem(args)
    if problem is not None:
        raise SimulationError(problem)
    policies = [_load_policy_arg(p) for p in (args.policy or [default_policy()])]
    labels = _unique([label for label, _ in policies])
    overrides = {"kv_blocks": args.kv_blocks, "cpu.blocks": args.cpu_blocks, "event_lag_ms": args.event_lag_ms}
    profile = load_profile(args.profile, **overrides)
    config = SimConfig(workers=args.workers, profile=profile, seed=args.seed,
                       prefill_workers=args.prefill_workers, session_ttl_s=args.session_ttl,
                       speculative_ttl_s=args.speculative_ttl, concurrency=args.concurrency or 0,
                       horizon_s=args.run_s, workers_per_device=args.workers_per_device,
                       spill_hint=not args.no_spill_hint)
    check_config(config)  # every flag is checked before the (possibly long) trace load and run
    for flag, path in (("json", args.json_out), ("html", args.html_out)):
        if path:
            check_report_path(flag, path)
    try:
        trace, workload = load_workload(args, args.block_size or profile.block_size)
    except ValueError as exc:  # the replay's planning: no request left (a TraceError is one too)
        if isinstance(exc, TraceError):
            raise
        raise SimulationError(str(exc)) from None
    for w in trace.warnings:
        console.print(f"[yellow]warning:[/] {w}")
    results = {}
    for label, (_, spec) in zip(labels, policies):
        results[label] = _run_one(trace, spec, config, label, console, args.quiet)
    return trace, profile, results, workload


def _report(args: argparse.Namespace, trace: Any, profile: Any, results: dict[str, Any], workload: dict[str, Any],
            console: Any, started: float) -> dict[str, Any]:
    """The report's payload (``wall_s``: since ``started``); its warnings on stderr, one line
    each, and its table on stdout unless ``--quiet``."""
    from rich.console import Console
    from rich.text import Text

    from simulator.report import render_table, summarize

    summaries = {label: summarize(r) for label, r in results.items()}
    warnings = []  # one line each, on stderr and in the JSON
    for label, s in summaries.items():
        if s["rejected"]:  # not in the latency and hit-rate numbers: they cover served requests only
            warnings.append(f"{label}: {s['rejected']:,} of {s['requests'] + s['rejected']:,} "
                            "requests rejected (the policy found no candidate for them)")
        warnings.extend(f"{label}: {note}" for note in s["notes"])
    for w in warnings:
        console.print(Text.assemble(("warning:", "yellow"), f" {w}"), highlight=False, soft_wrap=True)  # one line
    payload = {
        "mesh_simulate": 1,
        "trace": {
            "files": trace.files, "formats": trace.formats, "requests": len(trace.requests),
            "sessions": trace.sessions, "block_size": trace.block_size, "warnings": trace.warnings,
            "time_scale": args.time_scale, "session_start_spread_s": args.session_start_spread,
            **workload,
        },
        "closed_loop": {"concurrency": args.concurrency, "run_s": args.run_s,
                        "session_ids": not args.no_session_ids},
        "workers_per_device": args.workers_per_device,
        "spill_hint": not args.no_spill_hint,
        "workers": args.workers,
        "prefill_workers": args.prefill_workers,
        "profile": profile.to_dict(),
        "seed": args.seed,
        "policies": summaries,
        "warnings": warnings,
        "wall_s": time.perf_counter() - started,
    }
    if not args.quiet:
        out = Console()
        if not out.is_terminal:
            out = Console(width=200)
        render_table(summaries, out, title=f"mesh simulate: {len(trace.requests):,} requests, "
                                                  f"{args.workers} workers, profile {profile.name}")
        if profile.estimate:
            console.print(f"[dim]profile {profile.name} is an estimate (not calibrated)[/]")
    return payload


def check_report_path(flag: str, path: str) -> None:
    """Raise ``SimulationError`` unless a report could be written to ``path`` (checked before the run,
    which can take hours: a typo'd path fails before it, not after). Creates nothing."""
    from simulator.engine import SimulationError

    why = write_problem(path)
    if why is not None:
        raise SimulationError(f"cannot write {flag} report to {path}: {why}")


def write_problem(path: str) -> str | None:
    """Why a file could not be written at ``path`` (None: it could); creates nothing."""
    target = Path(path)
    parent = target.parent
    if target.is_dir():
        return "it is a directory"
    if not parent.is_dir():
        return f"no such directory {str(parent)!r}"
    if not os.access(parent, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        return "permission denied"
    return None


def calibrate_args_problem(args: argparse.Namespace) -> str | None:
    """The first bad ``mesh calibrate`` flag, found before any measurement (they take minutes on a
    GPU endpoint): an unwritable ``--out``, a count below its least value (never clamped)."""
    import math

    at_least = {"--repeats": (args.repeats, 1), "--max-prompt": (args.max_prompt, 16), "--max-batch": (args.max_batch, 1),
                "--ttft-max-tokens": (args.ttft_max_tokens, 1), "--token-ids": (args.token_ids, 2),
                "--kv-blocks": (args.kv_blocks, 0), "--block-size": (args.block_size, 1)}
    for flag, (value, low) in at_least.items():
        if value is not None and value < low:
            return f"{flag} must be >= {low}, got {value}"
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        return f"--timeout must be a finite number of seconds > 0, got {args.timeout}"
    why = write_problem(args.out)
    return None if why is None else f"cannot write the profile to {args.out}: {why}"


def _unique(labels: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        out.append(label if seen[label] == 1 else f"{label}#{seen[label]}")
    return out


def _run_one(trace: Any, spec: Any, config: Any, label: str, console: Any, quiet: bool) -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from simulator.engine import Simulator

    if quiet:
        return Simulator(trace, spec, config).run()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True, disable=not console.is_terminal) as progress:  # a log: no blank line
        task = progress.add_task(f"simulating {label}", total=len(trace.requests))
        sim = Simulator(trace, spec, config, progress=lambda done: progress.update(task, completed=done))
        return sim.run()


def run_calibrate(args: argparse.Namespace) -> int:
    from simulator.calibrate import CalibrationError, calibrate

    problem = calibrate_args_problem(args)
    if problem is not None:
        return _fail("calibrate", problem)
    try:
        calibrate(args)
    except CalibrationError as exc:
        return _fail("calibrate", str(exc))
    return 0
