"""``mesh replay URL TRACE...``: replay agent traces live against an OpenAI-compatible endpoint.

Any endpoint that serves streamed ``/v1/completions``: a Mesh gateway, sglang-router, vLLM, one
bare worker. Sessions run closed loop (a turn is sent when its predecessor finished plus the
trace's think time times ``--time-scale``, capped by ``--max-think-s``), open-loop arrivals at
their time times ``--time-scale``, at most ``--concurrency`` sessions in flight. Prompts are
built from the trace's block ids, so equal prefixes are byte-identical prompts. The report has
``mesh simulate``'s metrics and JSON shape (``--compare sim.json`` lines them up).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mesh.replay.client import PlayResult
    from mesh.replay.run import Prepared


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "replay",
        help="replay agent traces live against an OpenAI-compatible endpoint and report TTFT, ITL, hit rate",
        description=__doc__.split("\n\n")[1],
    )
    p.add_argument("url", metavar="URL", help="base URL of the endpoint (e.g. http://127.0.0.1:8000)")
    p.add_argument("traces", nargs="+", metavar="TRACE", help="trace files or directories (WEKA, Mooncake, Mesh, Bailian)")
    p.add_argument("--model", help="model name (default: the first of GET /v1/models; sglang-router lists "
                                   "'unknown' there: pass the workers' model)")
    p.add_argument("--api-key", help="bearer token, if the endpoint needs one")
    g = p.add_argument_group("what is replayed")
    g.add_argument("--sessions", type=int, metavar="N", help="the first N sessions (a WEKA file is one, with its sub-agents)")
    g.add_argument("--max-requests", type=int, metavar="N", help="the first N requests of the trace")
    g.add_argument("--max-turns", type=int, metavar="N", help="at most N requests per session")
    g.add_argument("--max-prompt-tokens", type=int, metavar="N",
                   help="drop requests whose prompt is over N tokens (and the turns that follow them)")
    g.add_argument("--block-size", type=int, metavar="TOKENS", help="re-block the traces' ids (needed to mix block sizes)")
    g.add_argument("--trace-block-size", type=int, metavar="TOKENS", help="tokens per trace block id (override)")
    t = p.add_argument_group("timing")
    t.add_argument("--time-scale", type=float, default=0.01, metavar="F",
                   help="multiply think times and arrival times (default 0.01)")
    t.add_argument("--max-think-s", type=float, default=2.0, metavar="S", help="cap of a scaled think time (default 2)")
    t.add_argument("--concurrency", type=int, default=16, metavar="N",
                   help="at most N sessions in flight, started as slots free up (default 16; 0 = no limit)")
    t.add_argument("--session-start-spread", type=float, default=0.0, metavar="S",
                   help="shift each session's start by a seeded uniform offset in [0, S) s (after the time scale)")
    t.add_argument("--seed", type=int, default=0, help="seed of --session-start-spread")
    t.add_argument("--duration-s", type=float, metavar="S",
                   help="release no request after S seconds (requests in flight finish); the rest count as not sent")
    t.add_argument("--timeout", type=float, default=600.0, metavar="S", help="per-request timeout (default 600)")
    r = p.add_argument_group("requests")
    r.add_argument("--prompt-scale", type=float, default=16.0, metavar="F",
                   help="trace tokens per prompt token: a 64-token WEKA block becomes 64/F units (default 16)")
    r.add_argument("--prompt-format", choices=("text", "tokens"), default="text",
                   help="text: one lowercase letter per unit (one token with a byte-level tokenizer); "
                        "tokens: token ids (prompt: [ids]) below --token-vocab")
    r.add_argument("--token-vocab", type=int, default=256, metavar="N", help="token ids of --prompt-format tokens are < N")
    r.add_argument("--output-tokens", default="32", metavar="N|trace",
                   help="max_tokens of every request (default 32), or 'trace': the trace's output / --prompt-scale")
    r.add_argument("--max-output-tokens", type=int, default=256, metavar="N", help="cap of --output-tokens trace")
    r.add_argument("--session-header", default="x-session-id", metavar="NAME", help="header carrying the session id")
    r.add_argument("--no-session-ids", action="store_true", help="send no session id")
    r.add_argument("--worker-header", default="x-mesh-worker", metavar="NAME",
                   help="response header naming the worker that served (default x-mesh-worker)")
    r.add_argument("--engine-block-size", type=int, default=16, metavar="TOKENS",
                   help="the engines' KV block size, for the trace's ideal hit rate (default 16)")
    o = p.add_argument_group("report")
    o.add_argument("--label", default="replay", help="name of this run in the table and the JSON (default replay)")
    o.add_argument("--json", dest="json_out", metavar="PATH", help="write the report (and every request) as JSON")
    o.add_argument("--html", dest="html_out", metavar="PATH", help="write a self-contained HTML report")
    o.add_argument("--compare", metavar="REPORT.json",
                   help="a mesh simulate (or mesh replay) JSON report: print both side by side with ratios")
    o.add_argument("--compare-run", metavar="NAME", help="the run of --compare to use (default its first policy)")
    o.add_argument("--quiet", action="store_true", help="no progress line and no table")
    p.set_defaults(func=run_replay)


def _fail(message: str, code: int = 2) -> int:
    print(f"mesh replay: error: {message}", file=sys.stderr)
    return code


def _write_problem(path: str) -> str | None:
    target = Path(path)
    if target.is_dir():
        return "it is a directory"
    if not target.parent.is_dir():
        return f"no such directory {str(target.parent)!r}"
    if not os.access(target.parent, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        return "permission denied"
    return None


def _flags_problem(args: argparse.Namespace) -> str | None:
    at_least = {"--sessions": (args.sessions, 1), "--max-requests": (args.max_requests, 1),
                "--max-turns": (args.max_turns, 1), "--max-prompt-tokens": (args.max_prompt_tokens, 1),
                "--concurrency": (args.concurrency, 0), "--token-vocab": (args.token_vocab, 2),
                "--max-output-tokens": (args.max_output_tokens, 1), "--engine-block-size": (args.engine_block_size, 1)}
    for flag, (value, low) in at_least.items():
        if value is not None and value < low:
            return f"{flag} must be >= {low}, got {value}"
    for flag, value, positive in (("--time-scale", args.time_scale, True), ("--max-think-s", args.max_think_s, False),
                                  ("--prompt-scale", args.prompt_scale, True), ("--timeout", args.timeout, True),
                                  ("--duration-s", args.duration_s, True),
                                  ("--session-start-spread", args.session_start_spread, False)):
        if value is not None and not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
            return f"{flag} must be a finite number {'> 0' if positive else '>= 0'}, got {value}"
    if args.output_tokens != "trace":
        try:
            if int(args.output_tokens) < 1:
                raise ValueError
        except ValueError:
            return f"--output-tokens must be an integer >= 1 or 'trace', got {args.output_tokens!r}"
    for flag, path in (("--json", args.json_out), ("--html", args.html_out)):
        why = path and _write_problem(path)
        if why:
            return f"cannot write the {flag[2:]} report to {path}: {why}"
    if args.compare and not Path(args.compare).is_file():
        return f"--compare {args.compare}: no such file"
    return None


def run_replay(args: argparse.Namespace) -> int:
    """The command: check the flags, load and plan the traces, play them, report. Exit 0 when
    every request was served, 1 when some failed (or none was served), 2 on bad input."""
    from mesh.replay.client import ReplayError

    started = time.perf_counter()
    problem = _flags_problem(args)
    if problem:
        return _fail(problem)
    other = None
    if args.compare:
        try:
            other = _load_compare(args.compare, args.compare_run)
        except (OSError, ValueError, TypeError) as exc:
            return _fail(f"--compare {args.compare}: {exc}")
    prep = _prepare(args)
    if isinstance(prep, str):
        return _fail(prep)
    for w in prep.warnings:
        print(f"mesh replay: warning: {w}", file=sys.stderr)
    try:
        model, summary, result = asyncio.run(_play(args, prep))
    except ReplayError as exc:
        return _fail(str(exc))
    warnings = _run_warnings(args, prep, summary)
    payload = _payload(args, prep, model, summary, result, warnings, started)
    _show(args, prep, summary, other, payload)
    try:
        _write_reports(args, prep, summary, result, payload)
    except OSError as exc:
        return _fail(f"cannot write the report: {exc}")
    if summary["requests"] == 0:
        return _fail(f"no request was served ({'; '.join(summary['error_samples'][:2]) or 'none sent'})", 1)
    return 1 if summary["errors"] else 0


def _prepare(args: argparse.Namespace) -> Prepared | str:
    """The loaded and planned traces, or the one-line reason they cannot be replayed."""
    from mesh.replay.run import ReplaySetup, prepare
    from simulator.traces import TraceError

    setup = ReplaySetup(
        traces=args.traces, sessions=args.sessions, max_requests=args.max_requests, max_turns=args.max_turns,
        time_scale=args.time_scale, max_think_s=args.max_think_s, session_start_spread_s=args.session_start_spread,
        seed=args.seed, prompt_scale=args.prompt_scale, prompt_format=args.prompt_format, token_vocab=args.token_vocab,
        output_tokens=None if args.output_tokens == "trace" else int(args.output_tokens),
        max_output_tokens=args.max_output_tokens, max_prompt_tokens=args.max_prompt_tokens,
        block_size=args.block_size, trace_block_size=args.trace_block_size, engine_block_size=args.engine_block_size,
    )
    try:
        return prepare(setup)
    except (TraceError, ValueError) as exc:
        return str(exc)
    except OSError as exc:
        return f"{getattr(exc, 'filename', '') or ''}: {exc.strerror or exc}"


def _session_header(args: argparse.Namespace) -> str | None:
    return None if args.no_session_ids else args.session_header


async def _play(args: argparse.Namespace, prep: Prepared) -> tuple[str, dict[str, Any], PlayResult]:
    """(model, summary, outcomes) of one replay; ``ReplayError`` when the endpoint is unreachable
    or names no model. The progress line is closed whatever happens."""
    from mesh.replay.client import ClientOptions, check_reachable, discover_model
    from mesh.replay.progress import ProgressLine
    from mesh.replay.run import replay

    if args.model:
        model = args.model
        await check_reachable(args.url, args.api_key)
    else:
        model = await discover_model(args.url, args.api_key)
    opts = ClientOptions(url=args.url, model=model, api_key=args.api_key, session_header=_session_header(args),
                         worker_header=args.worker_header, concurrency=args.concurrency,
                         duration_s=args.duration_s, timeout_s=args.timeout)
    progress = ProgressLine(len(prep.plan.turns), enabled=not args.quiet)
    try:
        summary, result = await replay(prep, opts, args.label, progress)
    finally:
        progress.close()
    return model, summary, result


def _run_warnings(args: argparse.Namespace, prep: Prepared, summary: dict[str, Any]) -> list[str]:
    """The preparation's warnings plus the run's (failures, requests not sent, no cached_tokens);
    the run's are printed here, the preparation's were printed before the run."""
    warnings = list(prep.warnings)
    if summary["errors"]:
        warnings.append(f"{summary['errors']:,} of {summary['sent']:,} requests failed: "
                        + "; ".join(summary["error_samples"][:3]))
    if summary["not_sent"]:
        warnings.append(f"{summary['not_sent']:,} requests not sent (--duration-s {args.duration_s:g} ran out)")
    if summary["requests"] and not summary["cached_reported"]:
        warnings.append("the endpoint reported no cached_tokens: the hit rate is not measured")
    for w in warnings[len(prep.warnings):]:
        print(f"mesh replay: warning: {w}", file=sys.stderr)
    return warnings


def _payload(args: argparse.Namespace, prep: Prepared, model: str, summary: dict[str, Any], result: PlayResult,
             warnings: list[str], started: float) -> dict[str, Any]:
    """The JSON report (``mesh simulate``'s shape: one run under ``policies``), every request included."""
    from mesh.commands.command_line import command_line
    from mesh.replay.report import requests_table

    return {
        "mesh_replay": 1,
        "command": command_line(args),
        "trace": prep.trace_info(),
        "target": {"url": args.url, "model": model, "session_header": _session_header(args),
                   "worker_header": args.worker_header, "concurrency": args.concurrency,
                   "duration_s": args.duration_s, "started_unix": result.started_unix},
        "workers": len(summary["per_worker"]),
        "policies": {args.label: summary},
        "reference": prep.reference(),
        "warnings": warnings,
        "wall_s": time.perf_counter() - started,
        "requests": requests_table(prep.plan, result),
    }


def _show(args: argparse.Namespace, prep: Prepared, summary: dict[str, Any],
          other: tuple[str, dict[str, Any]] | None, payload: dict[str, Any]) -> None:
    """Print the table (unless ``--quiet``) and, with ``--compare``, the comparison, which is also
    added to ``payload`` as ``compare`` (quiet or not)."""
    from mesh.replay.report import compare_rows

    if args.quiet:
        if other is not None:
            payload["compare"] = {"file": args.compare, "run": other[0], "rows": compare_rows(summary, other[1])}
        return
    from rich.console import Console

    from mesh.replay.report import render_compare, render_table

    out = Console()
    if not out.is_terminal:
        out = Console(width=160)
    render_table({args.label: summary}, out, reference=prep.reference(),
                 title=f"mesh replay: {len(prep.plan.turns):,} requests, {prep.plan.sessions} sessions -> {args.url}")
    if other is not None:
        label, theirs = other
        rows = compare_rows(summary, theirs)
        payload["compare"] = {"file": args.compare, "run": label, "rows": rows}
        render_compare(rows, args.label, label, out, f"{args.label} vs {label} ({args.compare})")


def _write_reports(args: argparse.Namespace, prep: Prepared, summary: dict[str, Any], result: PlayResult,
                   payload: dict[str, Any]) -> None:
    """Write ``--json`` and ``--html`` when asked (``OSError`` when a file cannot be written)."""
    from mesh.replay.report import run_result, write_html, write_json

    if args.json_out:
        write_json(args.json_out, payload)
    if args.html_out:
        results = {args.label: run_result(prep.plan, result, args.label)} if summary["requests"] else {}
        write_html(args.html_out, payload, results)


def _load_compare(path: str, run: str | None) -> tuple[str, dict[str, Any]]:
    from mesh.replay.report import pick_summary

    try:
        payload = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(payload, dict):
        raise TypeError("not a mesh simulate / mesh replay report")
    return pick_summary(payload, run)
