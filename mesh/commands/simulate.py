"""``mesh simulate`` and ``mesh calibrate``: the simulator's command line.

``mesh simulate TRACE [TRACE ...] --workers N[,N...] --policy NAME_OR_YAML [--policy ...]`` replays
the traces (format detected per file) once per policy and worker count on a fresh simulated
cluster, the gateway's default policy among them, and prints a table with the trace's ideal hit
rate beside; ``--json`` and ``--html`` write the full report, rewritten as each run ends
(``mesh.commands.sim_run``), and ``--ttft-p99-target`` names the smallest count meeting it. A YAML policy file is a file whose
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
    sim.add_argument("--workers", type=worker_counts, default=[4], metavar="N[,N...]",
                     help="simulated workers (default 4); a comma-separated list (4,8,12) sweeps them: a run per "
                          "count per policy")
    sim.add_argument("--ttft-p99-target", type=float, metavar="SECONDS",
                     help="report per policy the smallest --workers count whose TTFT p99 is at most SECONDS")
    sim.add_argument("--policy", action="append", metavar="NAME_OR_YAML",
                     help="built-in policy name, module:Class, or a YAML file with a 'policy:' key; repeat to "
                          "compare (default: the gateway's default policy, which is also added as its own row "
                          "unless --no-default-policy or --prefill-workers)")
    sim.add_argument("--baseline", metavar="NAME",
                     help="the run (or policy: its first run) the HTML report compares every other run against "
                          "(default: the first)")
    sim.add_argument("--no-default-policy", action="store_true",
                     help="run only the --policy values, without the gateway's default policy beside them")
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
    sim.add_argument("--hybrid-checkpoints", type=int, default=0, metavar="N",
                     help="hybrid workers (recurrent layers beside attention, docs/hybrid.md): N recurrent-state "
                          "checkpoints each (LRU); hits and the router's matches end at a checkpoint (0: not hybrid)")
    sim.add_argument("--hybrid-interval-blocks", type=int, default=32, metavar="B",
                     help="with --hybrid-checkpoints: a checkpoint every B prompt blocks besides each request's end "
                          "(0: request ends only; default 32: the engine's 512 tokens at block size 16)")
    sim.add_argument("--quiet", action="store_true",
                     help="no progress and no table (a terminal gets a bar; a log or pipe a line every --progress-s)")
    sim.add_argument("--progress-s", type=_positive_seconds, default=5.0, metavar="S",
                     help="seconds between progress lines when stderr is not a terminal (default 5; the first "
                          "comes 2 s into each run, or S if shorter)")
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
    cal.add_argument("--base", default="h200-8b",
                     help="built-in profile whose other fields (batch limits, CPU tier, P/D transfer) are kept")
    cal.add_argument("--kv-blocks", type=int,
                     help="GPU KV capacity in blocks to record (default: the worker's, from its /metrics or "
                          "/health; the base profile's, with a warning, when it reports none)")
    cal.add_argument("--block-size", type=int, help="the engine's block size to record (default: the worker's, "
                                                    "else the base profile's)")
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


def worker_counts(value: str) -> list[int]:
    """``--workers``: one count or a comma-separated list (each checked by the plan, named after
    the flag)."""
    try:
        counts = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count or a comma-separated list of counts, got {value!r}") from None
    if not counts:
        raise argparse.ArgumentTypeError(f"expected a count or a comma-separated list of counts, got {value!r}")
    return counts


def _positive_seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not (seconds > 0 and seconds < float("inf")):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {value!r}")
    return seconds


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

    from mesh.commands.sim_progress import SimProgress
    from mesh.commands.sim_run import plan, run_all
    from policies.registry import PluginError
    from simulator.engine import SimulationError
    from simulator.profile import ProfileError
    from simulator.traces import TraceError
    from simulator.worker_model import CapacityError

    console = Console(stderr=True)
    started = time.perf_counter()
    progress = SimProgress(0, stream=sys.stderr, enabled=not args.quiet, console=console, tty=console.is_terminal,
                           interval_s=args.progress_s)
    try:
        policies, default_label = _policies(args)
        progress.runs = len(policies) * len(set(args.workers))
        p = plan(args, policies, default_label, progress)
        for w in p.trace.warnings:
            console.print(f"[yellow]warning:[/] {w}")
        results, payload = run_all(args, p, progress, started)
    except (TraceError, ProfileError, PluginError, SimulationError, CapacityError) as exc:
        return _fail("simulate", str(exc))
    except KeyboardInterrupt:
        progress.close()
        where = " and ".join(x for x in (args.json_out, args.html_out) if x)
        print(f"mesh simulate: interrupted{f'; the runs finished are in {where}' if where else ''}", file=sys.stderr)
        return 130
    except OSError as exc:
        return _fail("simulate", f"{exc.filename or ''}: {exc.strerror or exc}")
    finally:
        progress.close()
    _show(args, p, payload, console)
    return 0


def _policies(args: argparse.Namespace) -> tuple[list[tuple[str, Any]], str | None]:
    """((label, spec) per run's policy, the label of the gateway's default among them): the
    ``--policy`` values, then the gateway's default as its own row (named as the gateway names
    it) unless one of them is it, ``--no-default-policy``, or a prefill/decode cluster
    (``--prefill-workers``: the default has no prefill/decode profiles, its row would be a mixed
    cluster's)."""
    default = default_policy()
    given = [_load_policy_arg(p) for p in (args.policy or [])]
    specs = [spec for _, spec in given]
    with_default = not given or (not args.no_default_policy and not args.prefill_workers and default not in specs)
    if with_default:
        given.append((default, default))
    labels = _unique([label for label, _ in given])
    default_label = next((lab for lab, (_, spec) in zip(labels, given) if spec == default), None)
    return [(lab, spec) for lab, (_, spec) in zip(labels, given)], default_label


def _show(args: argparse.Namespace, p: Any, payload: dict[str, Any], console: Any) -> None:
    """The report's warnings on stderr, one line each, and its table (and sizing) on stdout
    unless ``--quiet``."""
    from rich.console import Console
    from rich.text import Text

    from mesh.commands.sim_run import sizing_lines
    from simulator.report import render_table

    for w in payload["warnings"]:
        console.print(Text.assemble(("warning:", "yellow"), f" {w}"), highlight=False, soft_wrap=True)  # one line
    if args.quiet:
        return
    out = Console()
    if not out.is_terminal:
        out = Console(width=200)
    workers = ", ".join(str(n) for n in p.counts)
    render_table(payload["policies"], out, title=f"mesh simulate: {len(p.trace.requests):,} requests, "
                                                 f"{workers} workers, profile {p.profile.name}",
                 reference=p.reference)
    if p.default_label is not None:
        out.print(f"{p.default_label}: the gateway's default policy (mesh serve without a policy)", highlight=False)
    if "sizing" in payload:
        for line in sizing_lines(payload["sizing"], p.counts):
            out.print(line, highlight=False, soft_wrap=True)
    if p.profile.estimate:
        console.print(f"[dim]profile {p.profile.name} is an estimate (not calibrated)[/]")


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


def run_calibrate(args: argparse.Namespace) -> int:
    from simulator.calibrate import CalibrationError, calibrate

    problem = calibrate_args_problem(args)
    if problem is not None:
        return _fail("calibrate", problem)
    from mesh.commands.calibrate_capacity import read_capacity

    try:
        calibrate(args, None if args.kv_blocks is not None else read_capacity(args.url, args.api_key, args.timeout))
    except CalibrationError as exc:
        return _fail("calibrate", str(exc))
    return 0
