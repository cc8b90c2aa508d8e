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

import base64
import html
import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from simulator.engine import RunResult


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
            _ms(t["mean"]), _ms(t["p50"]), _ms(t["p99"]), _ms(itl["p50"]), _ms(itl["p99"]), _ms(s["e2e_ms"]["mean"]),
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


def _ms(v: float) -> str:
    return f"{v / 1000:.2f} s" if v >= 10_000 else f"{v:.1f} ms"


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
def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _panels(plt: Any, n: int) -> tuple[Any, list[Any]]:
    """A grid of ``n`` small panels sharing both axes (the unused ones hidden)."""
    cols = min(n, 3)
    rows = -(-n // cols)
    fig, grid = plt.subplots(rows, cols, figsize=(3.4 * cols + 0.8, 2.4 * rows + 0.8), sharex=True, sharey=True,
                             squeeze=False, constrained_layout=True)
    flat = list(grid.ravel())
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def _bins(t: np.ndarray, lo: float, hi: float, n: int = 60) -> tuple[np.ndarray, np.ndarray]:
    """(bin centres, bin index of each of ``t``) over ``n`` equal bins of [lo, hi]."""
    edges = np.linspace(lo, hi if hi > lo else lo + 1.0, n + 1)
    idx = np.clip(np.digitize(t, edges) - 1, 0, n - 1)
    return (edges[:-1] + edges[1:]) / 2, idx


def _series(results: dict[str, RunResult]) -> dict[str, str]:
    """The report's plots, as inline PNG data URLs by name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return {"ttft_cdf": _ttft_cdf(plt, results), "hit_rate": _hit_rate(plt, results),
            "queue": _queue(plt, results), "load": _load(plt, results)}


def _ttft_cdf(plt: Any, results: dict[str, RunResult]) -> str:
    fig, ax = plt.subplots(figsize=(7, 4))
    styles = ("-", "--", "-.", ":")  # with widths narrowing, equal curves stay visible on each other
    for k, (label, r) in enumerate(results.items()):
        served = r.worker >= 0
        ttft = np.sort((r.first_token - r.arrival)[served])
        if ttft.size:
            ax.plot(ttft, np.arange(1, ttft.size + 1) / ttft.size, label=label, linestyle=styles[k % len(styles)],
                    linewidth=max(0.8, 3.0 - 0.5 * k))
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF")
    ax.grid(alpha=0.3)
    ax.legend()
    return _close(plt, fig)


def _hit_rate(plt: Any, results: dict[str, RunResult]) -> str:
    """Hit rate over time: one small panel per policy (shared axes). Overlaid, several policies'
    lines hide each other and the raw samples become a solid block of colour."""
    fig, axes = _panels(plt, len(results))
    for ax, (label, r) in zip(axes, results.items()):
        served = r.worker >= 0
        t, hit, prompt = r.arrival[served], r.hit[served], r.prompt[served]
        ax.set_title(label, fontsize=9)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        if t.size < 2:
            continue
        mid, idx = _bins(t, r.arrival.min(), r.arrival.max())
        h = np.bincount(idx, weights=hit, minlength=mid.size)
        p = np.bincount(idx, weights=prompt, minlength=mid.size)
        ok = p > 0
        ax.plot(mid[ok], h[ok] / p[ok], color="C0")
    fig.supxlabel("simulated time (s)")
    fig.supylabel("prefix hit rate (token-weighted)")
    fig.suptitle("Hit rate over time")
    return _close(plt, fig)


def _queue(plt: Any, results: dict[str, RunResult]) -> str:
    """Queue length over time, one panel per policy: mean and max per time bin."""
    fig, axes = _panels(plt, len(results))
    for ax, (label, r) in zip(axes, results.items()):
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3)
        if r.queue_t.size < 2:
            continue
        mid, idx = _bins(r.queue_t, r.queue_t.min(), r.queue_t.max())
        n = np.bincount(idx, minlength=mid.size)
        mean = np.bincount(idx, weights=r.queue_len, minlength=mid.size)
        peak = np.zeros(mid.size)
        np.maximum.at(peak, idx, r.queue_len)
        ok = n > 0
        ax.fill_between(mid[ok], 0, peak[ok], color="C1", alpha=0.3, linewidth=0, label="max")
        ax.plot(mid[ok], mean[ok] / n[ok], color="C1", label="mean")
    axes[0].legend(fontsize=8, loc="upper right")
    fig.supxlabel("simulated time (s)")
    fig.supylabel("requests waiting for admission")
    fig.suptitle("Queue length over time (sampled at arrivals; mean and max per time bin)")
    return _close(plt, fig)


def _load(plt: Any, results: dict[str, RunResult]) -> str:
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(results))
    for k, (label, r) in enumerate(results.items()):
        served = r.worker >= 0
        counts = np.bincount(r.worker[served], minlength=len(r.workers))
        ax.bar(np.arange(len(r.workers)) + k * width, counts, width=width, label=label)
    first = next(iter(results.values()))
    ax.set_xticks(np.arange(len(first.workers)) + 0.4 - width / 2)
    ax.set_xticklabels(first.workers, rotation=90 if len(first.workers) > 16 else 0)
    ax.set_ylabel("requests prefilled")
    ax.set_title("Per-worker load")
    ax.legend()
    return _close(plt, fig)


def _close(plt: Any, fig: Any) -> str:
    """The figure as a PNG data URL; the figure is closed."""
    png = _png(fig)
    plt.close(fig)
    return png


def write_html(path: str | Path, payload: dict[str, Any], results: dict[str, RunResult]) -> None:
    """A self-contained report: summary table, run settings, and inline PNG plots."""
    figs = _series(results)
    rows = []
    for label, s in payload["policies"].items():
        t = s["ttft_ms"]
        rows.append(
            "<tr>" + "".join(f"<td>{html.escape(str(x))}</td>" for x in (
                label, f"{s['requests']:,}", f"{s['hit_rate']:.1%}", f"{t['mean']:.1f}", f"{t['p50']:.1f}",
                f"{t['p90']:.1f}", f"{t['p99']:.1f}", f"{s['itl_ms']['mean']:.2f}", f"{s['e2e_ms']['mean']:.1f}",
                f"{s['throughput_tok_s']:,.0f}", f"{s['input_throughput_tok_s']:,.0f}", f"{s['load_spread']:.2f}",
                f"{s['session_moves']:,}", f"{s['wall_s']:.2f}",
            )) + "</tr>"
        )
    ref = _reference_row(payload.get("trace", {}), ("policy", "requests", "hit rate", *("",) * 11))
    if any(ref[1:]):
        rows.append("<tr>" + "".join(f"<td>{html.escape(x)}</td>" for x in ref) + "</tr>")
    head = "".join(f"<th>{h}</th>" for h in (
        "policy", "requests", "hit rate", "TTFT mean ms", "p50", "p90", "p99", "ITL mean ms", "E2E mean ms",
        "out tok/s", "in tok/s", "load spread", "session moves", "wall s"))
    settings = html.escape(json.dumps({k: v for k, v in payload.items() if k != "policies"}, indent=2,
                                      default=_jsonable))
    warnings = list(payload.get("trace", {}).get("warnings") or [])
    runs = payload.get("runs")
    if runs and runs["pending"]:  # rewritten as each run ends: say which are still to come
        warnings.insert(0, f"partial report: {runs['done']} of {runs['total']} runs finished; still running or "
                           f"not run: {', '.join(runs['pending'])}")
    default = payload.get("gateway_default_policy")
    if default:
        warnings.append(f"{default}: the gateway's default policy (mesh serve without a policy)")
    write_page(path, "mesh simulate", head, rows, "Notes", warnings, figs, settings)


def write_page(path: str | Path, title: str, head: str, rows: list[str], warnings_title: str, warnings: list[str],
               figs: dict[str, str], settings: str) -> None:
    """The self-contained HTML report of ``mesh simulate`` and ``mesh replay``: the summary table
    (``head``: its header cells; ``rows``: its ``<tr>`` rows), warnings, plots, settings."""
    warn_html = "".join(f"<li>{html.escape(w)}</li>" for w in warnings)
    imgs = "".join(f'<figure><img src="{src}" alt="{name}"></figure>' for name, src in figs.items())
    doc = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{title} report</title>
<style>
body{{font-family:system-ui,sans-serif;margin:2em;color:#222}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}} td:first-child{{text-align:left}}
th{{background:#f3f3f3}} figure{{display:inline-block;margin:1em}} pre{{background:#f7f7f7;padding:1em}}
</style></head><body>
<h1>{title}</h1>
<table><tr>{head}</tr>{''.join(rows)}</table>
{f'<h2>{warnings_title}</h2><ul>{warn_html}</ul>' if warn_html else ''}
<h2>Plots</h2>{imgs}
<h2>Settings</h2><pre>{settings}</pre>
</body></html>
"""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(doc)
