"""Metrics of a simulated run, and their three renderings: a rich table, JSON, and HTML.

Definitions (all per policy):

- ``hit_rate``: token-weighted prefix reuse, the prompt tokens found cached (GPU or CPU tier) on
  the worker that prefilled the request, at its first admission, over all prompt tokens.
- ``ttft_ms``: arrival (release) to first token (a pair's: the decode worker's, after the
  transfer). ``e2e_ms``: arrival to last token.
- ``itl_ms``: inter-token latency. ``mean`` is token-weighted (all decode time over all tokens
  after the first); ``p50/p90/p99`` are over requests of their mean inter-token time (TPOT).
- ``throughput_tok_s``: output tokens per second of simulated time (first arrival to last
  completion); ``input_throughput_tok_s`` the same for prompt tokens.
- ``session_moves``: turns of a session routed to a different worker than its previous turn (for
  a prefill/decode pair: its decode worker, the one that answers).
- ``pd_pairs``: requests served through a prefill/decode pair (the rest ran on one worker).
- ``not_sent``: requests a closed-loop run never released (``--run-s`` ran out; outside every
  other metric).
- per worker: requests, prompt tokens, hit rate and busy fraction; ``load_spread`` is the most
  loaded worker's requests over the mean (1.0 = perfectly even).
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

import numpy as np

from simulator.engine import RunResult
from simulator.report_page import (
    HIT_RATE,
    Column,
    Page,
    fmt_latency,
    fmt_num,
    int_column,
    num_column,
    requests_text,
    traces_text,
    write_page,
)
from simulator.report_plots import plots


def dist(values: np.ndarray, scale: float = 1000.0) -> dict[str, float]:
    if values.size == 0:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    v = values * scale
    p50, p90, p99 = np.percentile(v, [50, 90, 99])
    return {"mean": float(v.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def summarize(r: RunResult) -> dict[str, Any]:
    """The metrics of one run (JSON-ready)."""
    served = r.worker >= 0
    ttft = (r.first_token - r.arrival)[served]
    e2e = (r.finish - r.arrival)[served]
    out = r.output[served]
    decode_time = (r.finish - r.first_token)[served]
    multi = out > 1
    tpot = decode_time[multi] / (out[multi] - 1)
    itl = dist(tpot)
    decode_tokens = int((out[multi] - 1).sum())
    itl["mean"] = float(decode_time[multi].sum() / decode_tokens * 1000) if decode_tokens else 0.0
    prompt = int(r.prompt[served].sum())
    hit = int(r.hit[served].sum())
    span = float(r.finish.max() - r.arrival.min()) if r.arrival.size else 0.0
    n_workers = len(r.workers)
    per_worker = []
    counts = np.bincount(r.worker[served], minlength=n_workers)
    ptok = np.bincount(r.worker[served], weights=r.prompt[served], minlength=n_workers)
    htok = np.bincount(r.worker[served], weights=r.hit[served], minlength=n_workers)
    for i, wid in enumerate(r.workers):
        per_worker.append({
            "id": wid,
            "requests": int(counts[i]),
            "prompt_tokens": int(ptok[i]),
            "hit_rate": float(htok[i] / ptok[i]) if ptok[i] else 0.0,
            "busy_frac": float(r.busy_s[i] / span) if span else 0.0,
            "steps": int(r.steps[i]),
        })
    mean_req = counts.mean() if n_workers else 0.0
    worker_hits = [w["hit_rate"] for w in per_worker if w["requests"]]
    return {
        "policy": r.policy,
        "spec": r.policy_spec,
        "requests": int(served.sum()),
        "rejected": r.rejected,
        "not_sent": r.not_sent,
        "pd_pairs": r.pairs,
        "hit_rate": hit / prompt if prompt else 0.0,
        "cpu_hit_rate": float(r.cpu_hit[served].sum() / prompt) if prompt else 0.0,
        "prompt_tokens": prompt,
        "output_tokens": int(out.sum()),
        "ttft_ms": dist(ttft),
        "itl_ms": itl,
        "e2e_ms": dist(e2e),
        "throughput_tok_s": float(out.sum() / span) if span else 0.0,
        "input_throughput_tok_s": float(prompt / span) if span else 0.0,
        "makespan_s": span,
        "session_moves": r.session_moves,
        "router_session_moves": r.router_session_moves,
        "preemptions": r.preemptions,
        "load_spread": float(counts.max() / mean_req) if mean_req else 0.0,
        "hit_rate_spread": [min(worker_hits), max(worker_hits)] if worker_hits else [0.0, 0.0],
        "per_worker": per_worker,
        "wall_s": r.wall_s,
        "notes": list(r.notes),
    }


# ------------------------------------------------------------------------------ terminal
def render_table(summaries: dict[str, dict[str, Any]], console: Any, title: str = "mesh simulate",
                 reference: dict[str, float | None] | None = None) -> None:
    """One row per run; ``reference`` (the trace's ``ideal_hit_rate``, same session, and
    ``ideal_hit_rate_global``) adds a last row with that hit rate alone."""
    from rich.table import Table

    table = Table(title=title, header_style="bold", caption=TABLE_NOTE, caption_justify="left")
    # 'requests' counts the served ones; a policy that left some without a candidate says so
    rejects = any(s["rejected"] for s in summaries.values())
    pairs = any(s.get("pd_pairs") for s in summaries.values())
    cols = ("policy", "requests", *(("rejected",) if rejects else ()), *(("PD pairs",) if pairs else ()),
            "hit rate", "TTFT mean", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "E2E mean", "out tok/s",
            "in tok/s", "spread", "moves", "wall s")
    rows = []
    for label, s in summaries.items():
        t, itl = s["ttft_ms"], s["itl_ms"]
        rows.append((
            label, f"{s['requests']:,}", *((f"{s['rejected']:,}",) if rejects else ()),
            *((f"{s.get('pd_pairs', 0):,}",) if pairs else ()), f"{s['hit_rate']:.1%}",
            *(fmt_latency(v) for v in (t["mean"], t["p50"], t["p99"], itl["p50"], itl["p99"], s["e2e_ms"]["mean"])),
            f"{s['throughput_tok_s']:,.0f}", f"{s['input_throughput_tok_s']:,.0f}",
            f"{s['load_spread']:.2f}", f"{s['session_moves']:,}", f"{s['wall_s']:.2f}",
        ))
    if reference and (reference.get("ideal_hit_rate") is not None or reference.get("ideal_hit_rate_global") is not None):
        rows.append(_reference_row(reference, cols))
    wide = sum(max(len(c), *(len(r[i]) for r in rows)) + 3 for i, c in enumerate(cols)) + 1 if rows else 0
    if wide > console.width:  # an 80-column terminal truncated every cell to 'kv…', '2,…': a policy per column
        table = Table(title=title, header_style="bold", caption=TABLE_NOTE, caption_justify="left")
        table.add_column("metric", no_wrap=True)
        for row in rows:
            table.add_column(row[0], justify="right", no_wrap=True)
        for i, col in enumerate(cols[1:], start=1):
            table.add_row(col, *(row[i] for row in rows))
    else:
        for col in cols:
            table.add_column(col, justify="left" if col == "policy" else "right", no_wrap=True)
        for row in rows:
            table.add_row(*row)
    console.print(table)


def _reference_row(reference: dict[str, Any], cols: tuple[str, ...]) -> tuple[str, ...]:
    """The trace's ideal hit rate in the hit-rate column, the other cells empty (all empty but
    the label when ``reference`` has none)."""
    session, glob = reference.get("ideal_hit_rate"), reference.get("ideal_hit_rate_global")
    hit = " ".join(x for x in (f"{session:.1%}" if session is not None else "",
                                f"({glob:.1%} any)" if glob is not None else "") if x)
    return tuple("ideal (trace)" if c == "policy" else hit if c == "hit rate" else "" for c in cols)


# The table's footnote: what the columns that are not self-explanatory count.
TABLE_NOTE = ("ideal (trace): the hit rate of an unbounded cache reusing every prefix seen before in the same "
              "session (in brackets: seen before at all; a trace without sessions: only that). ITL p50/p99: over requests, of each one's mean time per output token after the first. "
              "spread: busiest worker's requests / mean. moves: session turns sent to another worker "
              "than the session's previous turn.")


# ------------------------------------------------------------------------------ JSON
def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2, default=_jsonable) + "\n")


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    return str(obj)


# ------------------------------------------------------------------------------ HTML
COLUMNS = (
    int_column("requests", ("requests",)), int_column("rejected", ("rejected",)),
    int_column("PD pairs", ("pd_pairs",)), HIT_RATE, num_column("TTFT mean (ms)", ("ttft_ms", "mean")),
    num_column("TTFT p99 (ms)", ("ttft_ms", "p99")), num_column("ITL p99 (ms)", ("itl_ms", "p99")),
    num_column("E2E mean (ms)", ("e2e_ms", "mean")),
    num_column("out tok/s", ("throughput_tok_s",), "higher"),
    Column("in tok/s", lambda s: fmt_num(s["input_throughput_tok_s"])),
    Column("spread", lambda s: f"{s['load_spread']:.2f}"), int_column("moves", ("session_moves",)),
    Column("wall s", lambda s: f"{s['wall_s']:,.2f}"),
)


def write_html(path: str | Path, payload: dict[str, Any], results: dict[str, RunResult]) -> None:
    """The self-contained report (``simulator.report_page``): what was run, warnings, the tables
    with the best run and the changes against the baseline, plots, settings."""
    trace = payload.get("trace", {})
    runs = payload["policies"].values()
    shown = tuple(c for c in COLUMNS if c.title not in ("rejected", "PD pairs")
                  or any(s.get("rejected" if c.title == "rejected" else "pd_pairs") for s in runs))
    ref = _reference_row(trace, ("policy", *(c.title for c in shown)))
    default = payload.get("gateway_default_policy")
    notes = [TABLE_NOTE, "Times in ms; throughput in tokens per second of simulated time.",
             *([f"{default}: the gateway's default policy (mesh serve without a policy)"] if default else [])]
    page = Page(
        title="mesh simulate", header=run_header(payload), summaries=payload["policies"], columns=shown, notes=notes,
        warnings=html_warnings(payload), figs=plots(results), extra_rows=[ref] if any(ref[1:]) else [],
        settings=html.escape(json.dumps({k: v for k, v in payload.items() if k != "policies"}, indent=2,
                                        default=_jsonable)),
        baseline=payload.get("baseline"))
    write_page(path, page)


def run_header(payload: dict[str, Any]) -> list[tuple[str, str]]:
    """(field, value) of what was run, for the report's header."""
    trace, profile, runs = payload.get("trace", {}), payload.get("profile", {}), payload.get("runs", {})
    workers = payload.get("workers")
    counts = ", ".join(str(n) for n in workers) if isinstance(workers, list) else str(workers)
    if payload.get("prefill_workers"):
        counts += f" ({payload['prefill_workers']} of them prefill)"
    if payload.get("workers_per_device", 1) > 1:
        counts += f", {payload['workers_per_device']} per device"
    policies = list(dict.fromkeys(runs.get("policy", {}).values())) or list(payload["policies"])
    default = payload.get("gateway_default_policy")
    return [
        ("traces", traces_text(trace.get("files", []), trace.get("formats", []))),
        ("requests", requests_text(trace, payload["policies"], "simulated")),
        ("workers", counts),
        ("profile", f"{profile.get('name', '?')}" + (" (an estimate, not calibrated)" if profile.get("estimate") else "")
                    + (f", {profile['kv_blocks']:,} KV blocks of {profile.get('block_size')} tokens a worker"
                       if profile.get("kv_blocks") else "")),
        ("policies", ", ".join(f"{p} (the gateway's default)" if p == default else p for p in policies)),
        ("command", str(payload.get("command", ""))),
        ("status", "complete" if payload.get("complete", True) else
                   f"partial: {runs.get('done')} of {runs.get('total')} runs finished"),
    ]


def html_warnings(payload: dict[str, Any]) -> list[str]:
    """The terminal's warnings: a partial report, an estimated profile, the trace's and the runs'."""
    warnings = []
    runs = payload.get("runs")
    if runs and runs["pending"]:  # rewritten as each run ends: say which are still to come
        warnings.append(f"partial report: {runs['done']} of {runs['total']} runs finished; still running or "
                        f"not run: {', '.join(runs['pending'])}")
    profile = payload.get("profile", {})
    if profile.get("estimate"):
        warnings.append(f"profile {profile.get('name')} is an estimate (not calibrated): absolute times are "
                        "estimates, compare policies by their ratios (mesh calibrate measures a profile)")
    return [*warnings, *(payload.get("trace", {}).get("warnings") or []), *(payload.get("warnings") or [])]
