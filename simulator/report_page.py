"""The HTML report of ``mesh simulate`` and ``mesh replay``: one page shape, two callers.

A reader deciding between policies reads, top to bottom:

1. the header: what was run (traces, requests and sessions, workers, profile, policies, the
   command line);
2. the warnings (an estimated profile, a partial report, rejected requests, the trace's own);
3. the summary table, a row per run: the best run marked, every other run's change against the
   baseline under each compared value, the column footnotes below it;
4. the latency table: TTFT, ITL and end-to-end mean/p50/p90/p99 in ms;
5. the plots (``simulator.report_plots``) and the settings as JSON.

Best: the lowest TTFT mean among the runs that served every request they were sent (no
rejections, no errors; when none did, among all runs that served any), ties to the first listed.
Baseline: the run named by ``Page.baseline`` (``--baseline``), else the first. A report of one
run has neither mark. Numbers carry thousands separators; milliseconds keep two decimals below
10, one below 1,000, none above.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Summary = dict[str, Any]


def fmt_num(v: float | None) -> str:
    """Two decimals below 10, one below 1,000, none above; thousands separated."""
    if v is None:
        return "-"
    if abs(v) < 10:
        return f"{v:,.2f}"
    return f"{v:,.1f}" if abs(v) < 1000 else f"{v:,.0f}"


def fmt_latency(v: float | None) -> str:
    """A latency in ms for the terminal tables: seconds from 10 s on ('2,285.1 ms', '12.93 s')."""
    if v is None:
        return "-"
    return f"{v / 1000:,.2f} s" if v >= 10_000 else f"{v:,.1f} ms"


def fmt_int(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def fmt_pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def get(s: Summary, path: tuple[str, ...]) -> float | None:
    """The number at ``path`` in a summary (None: absent or not a number)."""
    v: Any = s
    for k in path:
        if not isinstance(v, dict) or k not in v:
            return None
        v = v[k]
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


@dataclass(frozen=True, slots=True)
class Column:
    """A summary-table column: ``title`` (with its unit), the value's text, and, for a compared
    column, the number's ``path``, which way is better, and how the change reads."""

    title: str
    text: Callable[[Summary], str]
    path: tuple[str, ...] = ()  # () = not compared against the baseline
    better: str = "lower"  # or "higher"
    delta: str = "rel"  # "rel": relative change; "pp": percentage points (a rate)


def num_column(title: str, path: tuple[str, ...], better: str = "lower") -> Column:
    return Column(title, lambda s: fmt_num(get(s, path)), path, better)


def int_column(title: str, path: tuple[str, ...], better: str = "", compared: bool = False) -> Column:
    return Column(title, lambda s: fmt_int(get(s, path)), path if compared else (), better)


HIT_RATE = Column("hit rate", lambda s: fmt_pct(get(s, ("hit_rate",))), ("hit_rate",), "higher", "pp")


@dataclass(frozen=True, slots=True)
class Page:
    title: str  # "mesh simulate" / "mesh replay"
    header: list[tuple[str, str]]  # (field, value): what was run
    summaries: dict[str, Summary]  # run label -> summary (``simulator.report.summarize``'s shape)
    columns: tuple[Column, ...]  # after the run's label
    notes: list[str]  # the summary table's footnotes
    warnings: list[str]
    figs: dict[str, tuple[str, str]]  # name -> (PNG data URL, alt text)
    settings: str  # the payload as JSON, escaped
    extra_rows: list[tuple[str, ...]] = field(default_factory=list)  # e.g. the trace's ideal hit rate
    baseline: str | None = None  # None: the first run


def best_run(summaries: dict[str, Summary]) -> str | None:
    """The run with the lowest TTFT mean (module doc); None for fewer than two runs."""
    served = {k: s for k, s in summaries.items() if s.get("requests")}
    if len(summaries) < 2 or not served:
        return None
    whole = {k: s for k, s in served.items() if not s.get("rejected") and not s.get("errors")}
    pool = whole or served
    return min(pool, key=lambda k: pool[k]["ttft_ms"]["mean"])


def baseline_run(summaries: dict[str, Summary], name: str | None) -> str | None:
    """The baseline's label: ``name`` (a run label, or a policy whose first run it is), else the
    first run; None for fewer than two runs."""
    if len(summaries) < 2:
        return None
    if name is None or name in summaries:
        return name or next(iter(summaries))
    return next((k for k, s in summaries.items() if s.get("policy") == name), next(iter(summaries)))


def delta(col: Column, value: float | None, base: float | None) -> str:
    """The change of ``value`` against ``base``, as a small coloured span ('' when not defined)."""
    if value is None or base is None:
        return ""
    if col.delta == "pp":
        change, text = value - base, f"{(value - base) * 100:+.1f} pp"
    elif base == 0:
        return ""
    else:
        change, text = value / base - 1, f"{value / base - 1:+.1%}"
    if abs(change) < 0.0005:
        return '<span class="d">=</span>'
    good = (change < 0) == (col.better == "lower") if col.better else None
    cls = "d" if good is None else "d good" if good else "d bad"
    return f'<span class="{cls}">{text}</span>'


def summary_table(page: Page) -> str:
    best = best_run(page.summaries)
    base = baseline_run(page.summaries, page.baseline)
    head = "".join(f"<th>{html.escape(t)}</th>" for t in ("run", *(c.title for c in page.columns)))
    rows = []
    for label, s in page.summaries.items():
        tags = ("".join(f' <span class="tag">{t}</span>' for t in
                        (("&#9733; best",) if label == best else ()) + (("baseline",) if label == base else ())))
        cells = [f'<td class="run">{html.escape(label)}{tags}</td>']
        for col in page.columns:
            mark = ""
            if col.path and base is not None and label != base:
                mark = delta(col, get(s, col.path), get(page.summaries[base], col.path))
            cells.append(f"<td>{html.escape(col.text(s))}{'<br>' + mark if mark else ''}</td>")
        rows.append(f'<tr{" class=best" if label == best else ""}>{"".join(cells)}</tr>')
    rows += ["<tr>" + "".join(f"<td>{html.escape(x)}</td>" for x in row) + "</tr>" for row in page.extra_rows]
    notes = list(page.notes)
    if best is not None:
        notes.insert(0, f"\u2605 best: {best}, the lowest TTFT mean among the runs that served every request "
                        "(no rejections or errors); ties go to the first listed.")
    if base is not None:
        notes.insert(1 if best else 0, f"Under each compared value: the change against the baseline {base} "
                                        "(relative; hit rate in percentage points), green where better.")
    foot = "".join(f"<li>{html.escape(n)}</li>" for n in notes)
    return f'<table class="summary"><tr>{head}</tr>{"".join(rows)}</table><ul class="notes">{foot}</ul>'


LATENCY = (("TTFT", "ttft_ms", "arrival to first token"),
           ("ITL", "itl_ms", "mean: all decode time over all tokens after the first; p50/p90/p99: over requests, "
                             "of each one's mean time per output token after the first"),
           ("E2E", "e2e_ms", "arrival to last token"))
STATS = ("mean", "p50", "p90", "p99")


def latency_table(summaries: dict[str, Summary]) -> str:
    """TTFT, ITL and end-to-end: mean/p50/p90/p99 in ms, a row per run."""
    top = "".join(f'<th colspan="{len(STATS)}">{name} (ms)</th>' for name, _, _ in LATENCY)
    sub = "".join(f"<th>{stat}</th>" for _ in LATENCY for stat in STATS)
    rows = []
    for label, s in summaries.items():
        cells = "".join(f"<td>{fmt_num(get(s, (key, stat)))}</td>" for _, key, _ in LATENCY for stat in STATS)
        rows.append(f'<tr><td class="run">{html.escape(label)}</td>{cells}</tr>')
    foot = "".join(f"<li>{name}: {html.escape(what)}.</li>" for name, _, what in LATENCY)
    return (f'<table class="latency"><tr><th rowspan="2">run</th>{top}</tr><tr>{sub}</tr>{"".join(rows)}</table>'
            f'<ul class="notes">{foot}</ul>')


def header_list(fields: list[tuple[str, str]]) -> str:
    items = "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(v)}</dd>" for k, v in fields if v)
    return f'<dl class="run">{items}</dl>'


def traces_text(files: list[str], formats: list[str]) -> str:
    """The trace files, a directory's many files as the directory and their count."""
    kinds = ", ".join(sorted(set(formats)))
    if len(files) <= 3:
        return f"{', '.join(files)} ({kinds})" if files else ""
    parents = {str(Path(f).parent) for f in files}
    where = parents.pop() + "/" if len(parents) == 1 else f"{', '.join(files[:2])}, ..."
    return f"{where} ({len(files):,} files, {kinds})"


def requests_text(trace: dict[str, Any], summaries: dict[str, Summary], clock: str) -> str:
    """'2,000 requests, 40 sessions, 3.7 h simulated': the trace's size and the longest run's span."""
    makespan = max((s.get("makespan_s", 0.0) for s in summaries.values()), default=0.0)
    sessions = trace.get("sessions") or 0
    return (f"{trace.get('requests', 0):,} requests, " + (f"{sessions:,} sessions" if sessions else "no sessions")
            + (f", {span_text(makespan)} {clock}" if makespan else ""))


def span_text(seconds: float) -> str:
    if seconds >= 2 * 3600:
        return f"{seconds / 3600:,.1f} h"
    return f"{seconds / 60:,.1f} min" if seconds >= 120 else f"{seconds:,.1f} s"


STYLE = """
body{font-family:system-ui,sans-serif;margin:2em;color:#222;max-width:1500px}
table{border-collapse:collapse;margin:.5em 0}
td,th{border:1px solid #ccc;padding:4px 8px;white-space:nowrap;text-align:right;vertical-align:top;font-variant-numeric:tabular-nums}
td:first-child,th:first-child{text-align:left} th{background:#f3f3f3;white-space:normal}
tr.best td{background:#eef8ee} .tag{font-size:75%;background:#ddd;border-radius:3px;padding:0 4px}
tr.best .tag:first-child{background:#2e7d32;color:#fff}
.d{font-size:75%;color:#666} .d.good{color:#2e7d32} .d.bad{color:#c62828}
ul.notes{font-size:85%;color:#444;max-width:1100px} ul.warnings li{color:#8a5300}
dl.run{display:grid;grid-template-columns:max-content auto;gap:2px 1em;margin:0 0 1em}
dl.run dt{font-weight:600} dl.run dd{margin:0;font-family:ui-monospace,monospace;font-size:90%;overflow-wrap:break-word}
figure{margin:1em 0} figure img{max-width:100%} pre{background:#f7f7f7;padding:1em;overflow-x:auto}
"""


def render(page: Page) -> str:
    """The page as one self-contained HTML document."""
    warn = "".join(f"<li>{html.escape(w)}</li>" for w in page.warnings)
    imgs = "".join(f'<figure><img src="{src}" alt="{html.escape(alt)}"></figure>' for src, alt in page.figs.values())
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{page.title} report</title>
<style>{STYLE}</style></head><body>
<h1>{page.title}</h1>
{header_list(page.header)}
{f'<h2>Warnings</h2><ul class="warnings">{warn}</ul>' if warn else ''}
<h2>Summary</h2>
{summary_table(page)}
<h2>Latency</h2>
{latency_table(page.summaries)}
<h2>Plots</h2>{imgs or '<p>No plots: nothing was served, or matplotlib is not installed.</p>'}
<details><summary>Settings (JSON)</summary><pre>{page.settings}</pre></details>
</body></html>
"""


def write_page(path: str | Path, page: Page) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(render(page))
