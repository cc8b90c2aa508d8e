"""The replay's report: the metrics of ``mesh simulate`` over real measurements, and renderings.

A replay's requests become a ``simulator.engine.RunResult`` (send time as arrival, the first token
chunk, the end of the stream, the reported usage, the serving worker) and go through
``simulator.report.summarize``: a real run's JSON has exactly the fields, names and definitions
of a simulated run's (``policies.<label>``), so ``--compare sim.json`` lines them up. Added per
run:

- ``hit_rate``: reported ``cached_tokens`` over reported prompt tokens (the built prompt's length
  where a server reports no usage); ``cached_reported``: whether any response reported cached
  tokens at all (an endpoint without it reads 0%, not a measurement);
- ``errors`` (and ``errors_by_status``, ``error_samples``), ``not_sent`` (the duration ran out);
- ``throughput_req_s``; ``itl_gaps_ms``: the raw gaps between token chunks, over all of them;
- ``requests_per_worker`` (from the worker header; ``unknown`` where none came back) and
  ``session_moves``: later turns of a session served by another worker than its previous turn
  (None when no response named its worker);
- ``ideal_hit_rate``: the trace's reference at the replay's token scale (``prompts.ideal_hit_rate``).
"""

from __future__ import annotations

import html
import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from mesh.replay.client import PlayResult
from mesh.replay.prompts import IdealHitRate
from mesh.replay.schedule import Plan
from simulator.engine import RunResult
from simulator.report import dist, summarize, write_json
from simulator.report_page import (
    HIT_RATE,
    Column,
    Page,
    fmt_latency,
    fmt_pct,
    get,
    int_column,
    num_column,
    requests_text,
    traces_text,
    write_page,
)
from simulator.report_plots import plots

UNKNOWN_WORKER = "unknown"
__all__ = ["compare_rows", "render_compare", "render_table", "requests_table", "run_result", "summarize_replay",
           "write_html", "write_json"]


def run_result(plan: Plan, play: PlayResult, label: str, spec: Any = None, sessions: bool = True) -> RunResult:
    """The sent requests as a ``RunResult`` (errors: worker -1, outside the served metrics)."""
    sent = [i for i, o in enumerate(play.outcomes) if o.sent]
    names = sorted({o.worker or UNKNOWN_WORKER for o in play.outcomes if o.ok})
    index = {w: k for k, w in enumerate(names)}
    arrival = np.array([play.outcomes[i].send for i in sent], dtype=np.float64)
    finish = np.array([play.outcomes[i].end for i in sent], dtype=np.float64)
    first = np.array([o.end if math.isnan(o.first) else o.first for o in (play.outcomes[i] for i in sent)],
                     dtype=np.float64)
    prompt = np.array([_prompt_tokens(plan, i, play.outcomes[i]) for i in sent], dtype=np.int64)
    hit = np.array([play.outcomes[i].cached_tokens or 0 for i in sent], dtype=np.int64)
    output = np.array([o.completion_tokens if o.completion_tokens is not None else o.tokens
                       for o in (play.outcomes[i] for i in sent)], dtype=np.int64)
    worker = np.array([index[o.worker or UNKNOWN_WORKER] if o.ok else -1 for o in (play.outcomes[i] for i in sent)],
                      dtype=np.int64)
    moves = session_moves(plan, play)
    return RunResult(
        policy=label, policy_spec=spec, workers=names, block_size=0, arrival=arrival, first_token=first,
        finish=finish, prompt=prompt, output=output, hit=hit, cpu_hit=np.zeros_like(hit), worker=worker,
        preemptions=0, rejected=0, session_moves=moves or 0, router_session_moves=0,
        busy_s=[0.0] * len(names), steps=[0] * len(names), queue_t=np.zeros(0), queue_len=np.zeros(0),
        running=np.zeros(0), wall_s=play.wall_s, sessions_enabled=sessions,
    )


def _prompt_tokens(plan: Plan, i: int, o: Any) -> int:
    return int(o.prompt_tokens) if o.prompt_tokens is not None else plan.turns[i].units


def session_moves(plan: Plan, play: PlayResult) -> int | None:
    """Later turns (trace order) of a session served by another worker than its previous served
    turn; None when no response named its worker."""
    last: dict[str, str] = {}
    moves = 0
    named = False
    for t in plan.turns:
        o = play.outcomes[t.pos]
        if t.session is None or not o.ok or not o.worker:
            continue
        named = True
        prev = last.get(t.session)
        if prev is not None and prev != o.worker:
            moves += 1
        last[t.session] = o.worker
    return moves if named else None


def summarize_replay(plan: Plan, play: PlayResult, label: str, ideal: IdealHitRate | None = None,
                     spec: Any = None, sessions: bool = True) -> dict[str, Any]:
    """``simulator.report.summarize`` of the run, plus the replay's own fields (module doc)."""
    outs = play.outcomes
    sent = [o for o in outs if o.sent]
    if any(o.ok for o in sent):
        s = summarize(run_result(plan, play, label, spec, sessions))
    else:  # nothing served: summarize's maxima have no values
        s = _empty_summary(label, spec, play.wall_s)
    errors = [o for o in sent if o.error is not None]
    s["session_moves"] = session_moves(plan, play)
    s["sent"] = len(sent)
    s["errors"] = len(errors)
    s["errors_by_status"] = dict(sorted(Counter(str(o.status) if o.status else "transport" for o in errors).items()))
    s["error_samples"] = [f"{n} x {msg}" for msg, n in Counter(o.error for o in errors).most_common(5)]
    s["not_sent"] = len(outs) - len(sent)
    s["truncated"] = play.truncated
    s["throughput_req_s"] = s["requests"] / s["makespan_s"] if s["makespan_s"] else 0.0
    gaps = np.array([g for o in sent if o.ok for g in o.gaps], dtype=np.float64)
    s["itl_gaps_ms"] = dist(gaps)
    s["cached_reported"] = any(o.cached_tokens is not None for o in sent)
    s["requests_per_worker"] = {w["id"]: w["requests"] for w in s["per_worker"]}
    s["ideal_hit_rate"] = ideal.session if ideal is not None else None
    s["ideal_hit_rate_global"] = ideal.global_ if ideal is not None else None
    return s


def _empty_summary(label: str, spec: Any, wall_s: float) -> dict[str, Any]:
    zero = {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    return {"policy": label, "spec": spec, "requests": 0, "rejected": 0, "pd_pairs": 0, "hit_rate": 0.0,
            "cpu_hit_rate": 0.0, "prompt_tokens": 0, "output_tokens": 0, "ttft_ms": dict(zero), "itl_ms": dict(zero),
            "e2e_ms": dict(zero), "throughput_tok_s": 0.0, "input_throughput_tok_s": 0.0, "makespan_s": 0.0,
            "session_moves": 0, "router_session_moves": 0, "preemptions": 0, "load_spread": 0.0,
            "hit_rate_spread": [0.0, 0.0], "per_worker": [], "wall_s": wall_s, "notes": []}


def requests_table(plan: Plan, play: PlayResult) -> list[dict[str, Any]]:
    """One record per planned request (JSON-ready): times in s from the start, usage, worker."""
    rows = []
    for t in plan.turns:
        o = play.outcomes[t.pos]
        rows.append({
            "i": t.pos, "trace_idx": t.request.idx, "source": t.request.source, "session": t.session,
            "group": t.group, "deps": [[p, "start" if trig == 0 else "done", round(d, 6)] for p, trig, d in t.deps],
            "sent": o.sent, "send_s": _r(o.send), "first_s": _r(o.first), "end_s": _r(o.end),
            "ttft_ms": _r((o.first - o.send) * 1000), "units": t.units, "max_tokens": t.max_tokens,
            "prompt_tokens": o.prompt_tokens, "cached_tokens": o.cached_tokens,
            "completion_tokens": o.completion_tokens, "worker": o.worker, "status": o.status, "error": o.error,
        })
    return rows


def _r(x: float) -> float | None:
    return None if math.isnan(x) else round(float(x), 6)


# ------------------------------------------------------------------------------ terminal
def _workers(s: dict[str, Any]) -> str:
    return " ".join(f"{w}:{n}" for w, n in s.get("requests_per_worker", {}).items()) or "-"


def render_table(summaries: dict[str, dict[str, Any]], console: Any, title: str = "mesh replay",
                 reference: dict[str, Any] | None = None) -> None:
    """One column per run (metric rows: fits any terminal), the trace's ideal hit rate beside."""
    from rich.table import Table

    table = Table(title=title, header_style="bold", caption=TABLE_NOTE, caption_justify="left")
    table.add_column("metric", no_wrap=True)
    for label in summaries:
        table.add_column(label, justify="right", no_wrap=True)
    if reference is not None:
        table.add_column("ideal (trace)", justify="right", no_wrap=True, style="dim")
    rows: list[tuple[str, Any]] = [
        ("requests", lambda s: f"{s['requests']:,}"),
        ("errors", lambda s: f"{s.get('errors', 0):,}"),
        ("not sent", lambda s: f"{s.get('not_sent', 0):,}"),
        ("hit rate", lambda s: fmt_pct(s["hit_rate"]) + ("" if s.get("cached_reported", True) else " (n/a)")),
        ("TTFT mean", lambda s: fmt_latency(s["ttft_ms"]["mean"])),
        ("TTFT p50", lambda s: fmt_latency(s["ttft_ms"]["p50"])),
        ("TTFT p90", lambda s: fmt_latency(s["ttft_ms"]["p90"])),
        ("TTFT p99", lambda s: fmt_latency(s["ttft_ms"]["p99"])),
        ("ITL mean", lambda s: fmt_latency(s["itl_ms"]["mean"])),
        ("ITL p50", lambda s: fmt_latency(s["itl_ms"]["p50"])),
        ("ITL p99", lambda s: fmt_latency(s["itl_ms"]["p99"])),
        ("E2E mean", lambda s: fmt_latency(s["e2e_ms"]["mean"])),
        ("E2E p50", lambda s: fmt_latency(s["e2e_ms"]["p50"])),
        ("E2E p99", lambda s: fmt_latency(s["e2e_ms"]["p99"])),
        ("req/s", lambda s: f"{s.get('throughput_req_s', 0.0):,.2f}"),
        ("out tok/s", lambda s: f"{s['throughput_tok_s']:,.0f}"),
        ("prompt tokens", lambda s: f"{s['prompt_tokens']:,}"),
        ("session moves", lambda s: "-" if s.get("session_moves") is None else f"{s['session_moves']:,}"),
        ("per worker", _workers),
    ]
    for name, fmt in rows:
        ref = ""
        if reference is not None and name == "hit rate":
            ref = f"{fmt_pct(reference.get('ideal_hit_rate'))} (any session: {fmt_pct(reference.get('ideal_hit_rate_global'))})"
        table.add_row(name, *(fmt(s) for s in summaries.values()), *((ref,) if reference is not None else ()))
    console.print(table)


TABLE_NOTE = ("hit rate: reported cached_tokens / prompt tokens; ideal: every prefix seen before in the same session "
              "reused, at the replay's token scale. ITL p50/p99: over requests, of each one's mean time per output "
              "token after the first. session moves: later turns served by another worker than the previous turn.")

# (label, path into a summary, kind) of the comparison's rows
_COMPARE = (
    ("requests", ("requests",), "n"), ("hit rate", ("hit_rate",), "pct"),
    ("TTFT mean", ("ttft_ms", "mean"), "ms"), ("TTFT p50", ("ttft_ms", "p50"), "ms"),
    ("TTFT p90", ("ttft_ms", "p90"), "ms"), ("TTFT p99", ("ttft_ms", "p99"), "ms"),
    ("ITL mean", ("itl_ms", "mean"), "ms"), ("ITL p50", ("itl_ms", "p50"), "ms"), ("ITL p99", ("itl_ms", "p99"), "ms"),
    ("E2E mean", ("e2e_ms", "mean"), "ms"), ("E2E p50", ("e2e_ms", "p50"), "ms"), ("E2E p99", ("e2e_ms", "p99"), "ms"),
    ("out tok/s", ("throughput_tok_s",), "n"), ("in tok/s", ("input_throughput_tok_s",), "n"),
    ("load spread", ("load_spread",), "f"), ("session moves", ("session_moves",), "n"),
)


def compare_rows(mine: dict[str, Any], other: dict[str, Any]) -> list[dict[str, Any]]:
    """Metric by metric: this run's value, the other's, and the ratio mine / other."""
    rows = []
    for label, path, kind in _COMPARE:
        a, b = get(mine, path), get(other, path)
        ratio = a / b if a is not None and b not in (None, 0.0) else None
        rows.append({"metric": label, "kind": kind, "value": a, "other": b, "ratio": ratio})
    return rows


def pick_summary(payload: dict[str, Any], name: str | None = None) -> tuple[str, dict[str, Any]]:
    """(label, summary) of a ``mesh simulate`` or ``mesh replay`` JSON: ``name``, or its first."""
    runs = payload.get("policies")
    if not isinstance(runs, dict) or not runs:
        raise ValueError("not a mesh simulate / mesh replay report (no 'policies')")
    if name is None:
        label = next(iter(runs))
    elif name in runs:
        label = name
    else:
        raise ValueError(f"no run {name!r} in the report (it has: {', '.join(runs)})")
    return label, runs[label]


def _fmt(kind: str, v: float | None) -> str:
    if v is None:
        return "-"
    return {"pct": lambda: f"{v:.1%}", "ms": lambda: fmt_latency(v), "f": lambda: f"{v:.2f}"}.get(kind, lambda: f"{v:,.0f}")()


def render_compare(rows: list[dict[str, Any]], mine: str, other: str, console: Any, title: str) -> None:
    from rich.table import Table

    table = Table(title=title, header_style="bold")
    for col, justify in (("metric", "left"), (mine, "right"), (other, "right"), ("ratio", "right")):
        table.add_column(col, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for r in rows:
        table.add_row(r["metric"], _fmt(r["kind"], r["value"]), _fmt(r["kind"], r["other"]),
                      "-" if r["ratio"] is None else f"{r['ratio']:.2f}x")
    console.print(table)


# ------------------------------------------------------------------------------ HTML
COLUMNS = (
    int_column("requests", ("requests",)), int_column("errors", ("errors",), "lower", compared=True), HIT_RATE,
    Column("ideal", lambda s: fmt_pct(s.get("ideal_hit_rate"))), num_column("TTFT mean (ms)", ("ttft_ms", "mean")),
    num_column("TTFT p99 (ms)", ("ttft_ms", "p99")), num_column("ITL p99 (ms)", ("itl_ms", "p99")),
    num_column("E2E mean (ms)", ("e2e_ms", "mean")),
    Column("req/s", lambda s: f"{s.get('throughput_req_s', 0.0):,.2f}", ("throughput_req_s",), "higher"),
    num_column("out tok/s", ("throughput_tok_s",), "higher"),
    int_column("session moves", ("session_moves",)), Column("per worker", _workers),
    Column("wall s", lambda s: f"{s['wall_s']:,.2f}"),
)


def write_html(path: str | Path, payload: dict[str, Any], results: dict[str, RunResult]) -> None:
    """The page of ``mesh simulate``'s HTML (``simulator.report_page``) for a replay."""
    trace, target = payload.get("trace", {}), payload.get("target", {})
    header = [
        ("target", f"{target.get('url', '?')}" + (f", model {target['model']}" if target.get("model") else "")),
        ("traces", traces_text(trace.get("files", []), trace.get("formats", []))),
        ("requests", requests_text(trace, payload["policies"], "of replay")),
        ("concurrency", "" if target.get("concurrency") is None else f"{target['concurrency']:,} sessions at once"),
        ("runs", ", ".join(payload["policies"])),
        ("command", str(payload.get("command", ""))),
    ]
    page = Page(
        title="mesh replay", header=header, summaries=payload["policies"], columns=COLUMNS,
        notes=[TABLE_NOTE, "Times in ms, as the client measured them; throughput per second of replay."],
        warnings=list(payload.get("warnings") or []), figs=plots(results, clock="replay", queue=False),
        settings=html.escape(json.dumps({k: v for k, v in payload.items() if k not in ("policies", "requests")},
                                        indent=2, default=str)))
    write_page(path, page)
