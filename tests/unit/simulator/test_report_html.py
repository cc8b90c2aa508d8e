"""The HTML report of ``mesh simulate`` and ``mesh replay`` (``simulator.report_page`` and
``simulator.report_plots``), asserted on the page it writes: what a reader deciding between
policies finds there."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest

from simulator.engine import RunResult
from simulator.report import TABLE_NOTE, summarize, write_html
from simulator.report_page import baseline_run, best_run, fmt_num
from simulator.report_plots import time_unit
from tests.support.run_results import HOUR, result


def payload_of(results: dict[str, RunResult], **extra: Any) -> dict[str, Any]:
    return {
        "mesh_simulate": 1, "complete": True,
        "runs": {"done": len(results), "total": len(results), "pending": [],
                 "workers": {k: 2 for k in results}, "policy": {k: k for k in results}},
        "trace": {"files": [f"/traces/weka/trace_{i:04d}.json.gz" for i in range(142)], "formats": ["weka"] * 142,
                  "requests": 400, "sessions": 40, "warnings": ["a trace warning"], "ideal_hit_rate": 0.9,
                  "ideal_hit_rate_global": 0.95},
        "workers": 2, "prefill_workers": 0, "workers_per_device": 1,
        "profile": {"name": "h200-8b", "estimate": True, "kv_blocks": 3444, "block_size": 16},
        "gateway_default_policy": "session_sticky", "baseline": None,
        "command": "mesh simulate /traces/weka --policy round_robin --max-sessions 40",
        "policies": {k: summarize(r) for k, r in results.items()}, "warnings": [], **extra,
    }


def page(tmp_path: Path, results: dict[str, RunResult], **extra: Any) -> str:
    out = tmp_path / "report.html"
    write_html(out, payload_of(results, **extra), results)
    return out.read_text()


RUNS = {"round_robin": result("round_robin", 0.8), "kv_aware": result("kv_aware", 0.2),
        "session_sticky": result("session_sticky", 0.3)}


def test_the_header_says_what_was_run(tmp_path: Path) -> None:
    html = page(tmp_path, RUNS)
    header = html[html.index('<dl class="run">'):html.index("</dl>")]
    for field, value in (("traces", "/traces/weka/ (142 files, weka)"), ("requests", "400 requests, 40 sessions, 41.0 h"),
                         ("workers", "2"), ("profile", "h200-8b (an estimate, not calibrated), 3,444 KV blocks"),
                         ("policies", "round_robin, kv_aware, session_sticky (the gateway&#x27;s default)"),
                         ("command", "mesh simulate /traces/weka --policy round_robin --max-sessions 40")):
        assert f"<dt>{field}</dt><dd>" in header and value in header, (field, value)


def test_the_warnings_and_the_column_footnotes_are_on_the_page(tmp_path: Path) -> None:
    html = page(tmp_path, RUNS, complete=False,
                runs={"done": 3, "total": 4, "pending": ["random"], "workers": {}, "policy": {}},
                warnings=["kv_aware: 3 of 403 requests rejected"])
    warnings = html[html.index('<ul class="warnings">'):]
    assert "profile h200-8b is an estimate (not calibrated)" in warnings
    assert "partial report: 3 of 4 runs finished; still running or not run: random" in warnings
    assert "a trace warning" in warnings and "kv_aware: 3 of 403 requests rejected" in warnings
    assert TABLE_NOTE.replace("'", "&#x27;") in html  # the terminal table's caption
    assert "session_sticky: the gateway&#x27;s default policy (mesh serve without a policy)" in html
    assert "<td>ideal (trace)</td><td></td><td>90.0% (95.0% any)</td>" in html


def test_the_latency_table_has_ttft_itl_and_e2e_percentiles_in_ms(tmp_path: Path) -> None:
    html = page(tmp_path, RUNS)
    table = html[html.index('<table class="latency">'):]
    table = table[:table.index("</table>")]
    for name in ("TTFT (ms)", "ITL (ms)", "E2E (ms)"):
        assert f'<th colspan="4">{name}</th>' in table
    assert table.count("<th>p90</th>") == 3 and table.count("<th>p99</th>") == 3
    itl = summarize(RUNS["kv_aware"])["itl_ms"]  # (2.0 - 0.2) s over 50 tokens: 36 ms each
    row = table[table.index("<td class=\"run\">kv_aware</td>"):].split("</tr>")[0]
    assert f"<td>{fmt_num(itl['p50'])}</td><td>{fmt_num(itl['p90'])}</td><td>{fmt_num(itl['p99'])}</td>" in row
    assert "ITL: mean: all decode time over all tokens after the first" in html


def test_numbers_carry_thousands_separators_and_sensible_precision(tmp_path: Path) -> None:
    slow = {"round_robin": result("round_robin", 600.0, e2e_s=859.3544), "kv_aware": result("kv_aware", 0.2)}
    html = page(tmp_path, slow)
    assert "859,354" in html and "859354" not in html
    assert (fmt_num(859354.4), fmt_num(123.456), fmt_num(3.14159), fmt_num(None)) == ("859,354", "123.5", "3.14", "-")


def test_the_best_policy_is_marked_and_the_others_read_against_the_baseline(tmp_path: Path) -> None:
    html = page(tmp_path, RUNS)
    summary = html[html.index('<table class="summary">'):html.index("</table>")]
    best_row = summary[summary.index("<tr class=best>"):].split("</tr>")[0]
    assert 'kv_aware <span class="tag">&#9733; best</span>' in best_row
    assert 'round_robin <span class="tag">baseline</span>' in summary
    assert "-75.0%" in best_row  # TTFT mean 200 ms against the baseline's 800 ms, lower: better
    assert '<span class="d good">-75.0%</span>' in best_row
    assert "the lowest TTFT mean among the runs that served every request" in html
    assert "the change against the baseline round_robin" in html
    chosen = page(tmp_path, RUNS, baseline="session_sticky")
    assert 'session_sticky <span class="tag">baseline</span>' in chosen and "+166.7%" in chosen  # 800 vs 300 ms


def test_best_and_baseline_need_two_runs_and_skip_runs_that_rejected_requests() -> None:
    summaries = {k: summarize(r) for k, r in RUNS.items()}
    assert best_run({"kv_aware": summaries["kv_aware"]}) is None
    assert baseline_run({"kv_aware": summaries["kv_aware"]}, None) is None
    summaries["kv_aware"]["rejected"] = 5
    assert best_run(summaries) == "session_sticky"
    assert baseline_run(summaries, "kv_aware") == "kv_aware" and baseline_run(summaries, None) == "round_robin"


def test_a_long_trace_reads_in_hours_and_its_burst_gets_its_own_panels(tmp_path: Path) -> None:
    html = page(tmp_path, RUNS)
    alts = dict(re.findall(r'alt="([^;"]+);([^"]*)"', html))
    queue = next(v for k, v in alts.items() if k.startswith("Queue length"))
    ticks = re.search(r"x: simulated time \(h\), ticks ([^;]+)", queue)
    assert ticks is not None, queue
    assert ticks.group(1) == "0, 10, 20, 30, 40"  # 41 h: at most six ticks, in hours
    assert re.search(r"x: simulated time \((s|min)\), ticks", queue)  # the burst of the first seconds, zoomed
    assert "x: simulated time (h)" in alts["Hit rate over time"]


def test_a_short_run_reads_in_seconds_or_minutes() -> None:
    assert time_unit(90.0) == ("s", 1.0) and time_unit(600.0) == ("min", 60.0) and time_unit(41 * HOUR)[0] == "h"


def test_without_matplotlib_the_page_is_written_without_plots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    html = page(tmp_path, RUNS)
    assert "data:image/png" not in html and "matplotlib is not installed" in html
    assert '<table class="latency">' in html
