"""``mesh replay --html``: the page of ``mesh simulate``'s report (``simulator.report_page``) for
a replay, with the target in the header and no queue plot (a live endpoint reports none)."""

from __future__ import annotations

from pathlib import Path

from mesh.replay.report import write_html
from simulator.report import summarize
from tests.support.run_results import result


def test_a_replay_page_has_the_header_warnings_latency_table_and_plots(tmp_path: Path) -> None:
    r = result("replay", 0.25, span_s=300.0, n=200)
    s = {**summarize(r), "errors": 0, "throughput_req_s": 0.67, "requests_per_worker": {"w0": 100, "w1": 100},
         "ideal_hit_rate": 0.8}
    payload = {"mesh_replay": 1, "command": "mesh replay http://gw:8000 /traces/weka --concurrency 4",
               "trace": {"files": ["/traces/weka/trace_0001.json.gz"], "formats": ["weka"], "requests": 200,
                         "sessions": 4},
               "target": {"url": "http://gw:8000", "model": "llama", "concurrency": 4},
               "policies": {"replay": s}, "warnings": ["the endpoint reported no cached_tokens"], "requests": []}
    out = tmp_path / "replay.html"
    write_html(out, payload, {"replay": r})
    html = out.read_text()
    assert "<h1>mesh replay</h1>" in html
    for field, value in (("target", "http://gw:8000, model llama"), ("traces", "/traces/weka/trace_0001.json.gz (weka)"),
                         ("requests", "200 requests, 4 sessions, 5.0 min of replay"),
                         ("concurrency", "4 sessions at once"), ("command", "mesh replay http://gw:8000")):
        assert f"<dt>{field}</dt><dd>{value}" in html, field
    assert "the endpoint reported no cached_tokens" in html and "ITL p50/p99: over requests" in html
    assert '<th colspan="4">ITL (ms)</th>' in html and "&#9733; best" not in html  # one run: nothing to rank
    assert html.count("data:image/png") == 3 and "Queue length" not in html
    assert "x: replay time (min)" in html
