"""Metrics of a simulated run, and their three renderings: a rich table, JSON, and HTML.

Definitions (all per policy):

- ``hit_rate``: token-weighted prefix reuse, the prompt tokens found cached (GPU or CPU tier) on
  the worker that prefilled the request, at its first admission, over all prompt tokens.
- ``ttft_ms``: arrival (release) to first token. ``e2e_ms``: arrival to last token.
- ``itl_ms``: inter-token latency. ``mean`` is token-weighted (all decode time over all tokens
  after the first); ``p50/p90/p99`` are over requests of their mean inter-token time (TPOT).
- ``throughput_tok_s``: output tokens per second of simulated time (first arrival to last
  completion); ``input_throughput_tok_s`` the same for prompt tokens.
- ``session_moves``: turns of a session routed to a different worker than its previous turn.
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
def render_table(summaries: dict[str, dict[str, Any]], console: Any, title: str = "mesh simulate") -> None:
    from rich.table import Table

    table = Table(title=title, header_style="bold")
    # 'requests' counts the served ones; a policy that left some without a candidate says so
    rejects = any(s["rejected"] for s in summaries.values())
    cols = ("policy", "requests", *(("rejected",) if rejects else ()), "hit rate", "TTFT mean", "TTFT p50",
            "TTFT p99", "ITL mean", "E2E mean", "out tok/s", "in tok/s", "spread", "moves", "wall s")
    rows = []
    for label, s in summaries.items():
        t = s["ttft_ms"]
        rows.append((
            label, f"{s['requests']:,}", *((f"{s['rejected']:,}",) if rejects else ()), f"{s['hit_rate']:.1%}",
            _ms(t["mean"]), _ms(t["p50"]),
            _ms(t["p99"]), _ms(s["itl_ms"]["mean"]), _ms(s["e2e_ms"]["mean"]),
            f"{s['throughput_tok_s']:,.0f}", f"{s['input_throughput_tok_s']:,.0f}",
            f"{s['load_spread']:.2f}", f"{s['session_moves']:,}", f"{s['wall_s']:.2f}",
        ))
    wide = sum(max(len(c), *(len(r[i]) for r in rows)) + 3 for i, c in enumerate(cols)) + 1 if rows else 0
    if wide > console.width:  # an 80-column terminal truncated every cell to 'kv…', '2,…': a policy per column
        table = Table(title=title, header_style="bold")
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


def _series(results: dict[str, RunResult]) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs: dict[str, str] = {}
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, r in results.items():
        served = r.worker >= 0
        ttft = np.sort((r.first_token - r.arrival)[served])
        if ttft.size:
            ax.plot(ttft, np.arange(1, ttft.size + 1) / ttft.size, label=label)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF")
    ax.grid(alpha=0.3)
    ax.legend()
    figs["ttft_cdf"] = _png(fig)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, r in results.items():
        served = r.worker >= 0
        t, hit, prompt = r.arrival[served], r.hit[served], r.prompt[served]
        if t.size < 2:
            continue
        edges = np.linspace(t.min(), t.max(), 61)
        idx = np.clip(np.digitize(t, edges) - 1, 0, 59)
        h = np.bincount(idx, weights=hit, minlength=60)
        p = np.bincount(idx, weights=prompt, minlength=60)
        mid = (edges[:-1] + edges[1:]) / 2
        ok = p > 0
        ax.plot(mid[ok], h[ok] / p[ok], label=label)
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("prefix hit rate (token-weighted)")
    ax.set_ylim(0, 1)
    ax.set_title("Hit rate over time")
    ax.grid(alpha=0.3)
    ax.legend()
    figs["hit_rate"] = _png(fig)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, r in results.items():
        if r.queue_t.size:
            step = max(1, r.queue_t.size // 2000)
            ax.plot(r.queue_t[::step], r.queue_len[::step], label=f"{label} waiting")
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("requests waiting for admission")
    ax.set_title("Queue length over time (sampled at arrivals)")
    ax.grid(alpha=0.3)
    ax.legend()
    figs["queue"] = _png(fig)
    plt.close(fig)

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
    figs["load"] = _png(fig)
    plt.close(fig)
    return figs


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
    head = "".join(f"<th>{h}</th>" for h in (
        "policy", "requests", "hit rate", "TTFT mean ms", "p50", "p90", "p99", "ITL mean ms", "E2E mean ms",
        "out tok/s", "in tok/s", "load spread", "session moves", "wall s"))
    settings = html.escape(json.dumps({k: v for k, v in payload.items() if k != "policies"}, indent=2,
                                      default=_jsonable))
    warnings = payload.get("trace", {}).get("warnings") or []
    warn_html = "".join(f"<li>{html.escape(w)}</li>" for w in warnings)
    imgs = "".join(f'<figure><img src="{src}" alt="{name}"></figure>' for name, src in figs.items())
    doc = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>mesh simulate report</title>
<style>
body{{font-family:system-ui,sans-serif;margin:2em;color:#222}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}} td:first-child{{text-align:left}}
th{{background:#f3f3f3}} figure{{display:inline-block;margin:1em}} pre{{background:#f7f7f7;padding:1em}}
</style></head><body>
<h1>mesh simulate</h1>
<table><tr>{head}</tr>{''.join(rows)}</table>
{f'<h2>Trace warnings</h2><ul>{warn_html}</ul>' if warn_html else ''}
<h2>Plots</h2>{imgs}
<h2>Settings</h2><pre>{settings}</pre>
</body></html>
"""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(doc)
