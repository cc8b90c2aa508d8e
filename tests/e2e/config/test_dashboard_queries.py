"""The Grafana dashboard and the Prometheus alert rules in deploy/ read metrics a live gateway
exposes: a real gateway over real echo workers (one with a KV event stream configured, so its
stream gauges have series), real requests (streamed and not), a real scrape; every ``mesh_*``
name in every panel query and alert expression must be a family of that scrape (PromQL parsed
loosely: the metric-name tokens, with the ``_bucket`` / ``_sum`` / ``_count`` suffixes of
histograms)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.procs import ProcessGroup, free_port

REPO = Path(__file__).resolve().parents[3]
DASHBOARD = REPO / "deploy" / "grafana" / "mesh-dashboard.json"
ALERTS = REPO / "deploy" / "prometheus" / "mesh-alerts.yaml"
PROMETHEUS = REPO / "deploy" / "prometheus" / "prometheus.yml"
_NAME = re.compile(r"(?<![\w:$])mesh_[A-Za-z0-9_:]*")
_TYPE = re.compile(r"^# TYPE (mesh_\w+) (\w+)$", re.M)
_SAMPLE = re.compile(r"^(mesh_\w+)[{ ]", re.M)


def dashboard_queries() -> list[str]:
    data = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in data["panels"] for t in p.get("targets", [])]
    for var in data["templating"]["list"]:
        if var["type"] == "query":
            exprs.append(var["definition"])
    return exprs


def alert_expressions() -> list[str]:
    rules = yaml.safe_load(ALERTS.read_text())
    return [r["expr"] for g in rules["groups"] for r in g["rules"]]


def metric_names(expr: str) -> set[str]:
    return set(_NAME.findall(expr))


def families(text: str) -> dict[str, str]:
    """Family name -> type; counters also under their ``_total`` sample name."""
    out = {}
    for name, kind in _TYPE.findall(text):
        out[name] = kind
        if kind == "counter" and not name.endswith("_total"):  # older prometheus_client: no _total in TYPE
            out[name + "_total"] = kind
    return out


def resolves(name: str, fams: dict[str, str]) -> bool:
    if name in fams:
        return True
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix) and fams.get(name[: -len(suffix)]) in ("histogram", "summary"):
            return True
    return False


def test_the_files_are_well_formed() -> None:
    data = json.loads(DASHBOARD.read_text())
    assert data["uid"] and data["title"] and data["panels"]
    ids = [p["id"] for p in data["panels"]]
    assert len(ids) == len(set(ids))
    for p in data["panels"]:
        if p["type"] != "row":
            assert p["targets"], p["title"]
            assert all(t["expr"].count("(") == t["expr"].count(")") for t in p["targets"]), p["title"]
    rules = yaml.safe_load(ALERTS.read_text())
    names = [r["alert"] for g in rules["groups"] for r in g["rules"]]
    assert len(names) == len(set(names))
    assert {"MeshNoHealthyWorkers", "MeshHigh5xxRate", "MeshKvEventStreamUnhealthy", "MeshHighTTFT",
            "MeshPrefixHitRatioCollapse"} <= set(names)
    for g in rules["groups"]:
        for r in g["rules"]:
            assert r["expr"].count("(") == r["expr"].count(")"), r["alert"]
            assert r["labels"]["severity"] in ("warning", "critical") and r["annotations"]["summary"], r["alert"]
    assert yaml.safe_load(PROMETHEUS.read_text())["rule_files"] == ["mesh-alerts.yaml"]


def _scrape_after_traffic(procs: ProcessGroup) -> str:
    workers = [procs.echo_worker(f"echo-{i}", "--cached-tokens", "2") for i in range(2)]
    config: dict[str, Any] = {
        "server": {"admin_key": "adm"},
        "workers": [{"name": "echo-0", "url": workers[0].url, "kv_events": {"endpoint": f"tcp://127.0.0.1:{free_port()}"}},
                    {"name": "echo-1", "url": workers[1].url}],
    }
    path = Path(procs.log_dir) / "dashboard.yaml"
    path.write_text(yaml.safe_dump(config))
    gw = procs.gateway(path, port=free_port(), ready_path="/ready")
    with httpx.Client(base_url=gw.url, timeout=30) as client:
        for i in range(4):
            body: dict[str, Any] = {"model": "echo", "prompt": f"dashboard {i}", "max_tokens": 3}
            if i % 2:
                body.update(stream=True, stream_options={"include_usage": True})
            assert client.post("/v1/completions", json=body, headers={"x-session-id": f"s{i}"}).status_code == 200
        return client.get("/metrics").text


def test_every_dashboard_query_and_alert_names_metrics_a_live_gateway_exposes(procs: ProcessGroup) -> None:
    text = _scrape_after_traffic(procs)
    fams = families(text)
    referenced = {n for e in dashboard_queries() + alert_expressions() for n in metric_names(e)}
    assert len(referenced) > 25, sorted(referenced)  # the parse found the queries' names
    missing = sorted(n for n in referenced if not resolves(n, fams))
    assert not missing, f"named by deploy/ but not on /metrics: {missing}"
    # the request-path and stream series the main panels and alerts read have samples, not only a TYPE line
    sampled = set(_SAMPLE.findall(text))
    for name in ("mesh_time_to_first_token_seconds_bucket", "mesh_inter_token_latency_seconds_bucket",
                 "mesh_e2e_request_latency_seconds_count", "mesh_prompt_tokens_total", "mesh_cached_prompt_tokens_total",
                 "mesh_generation_tokens_total", "mesh_requests_total", "mesh_worker_healthy", "mesh_kv_events_healthy",
                 "mesh_worker_in_flight"):
        assert name in sampled, name
    assert 'mesh_cached_prompt_tokens_total{model="echo"' in text


def test_the_loose_parse_finds_names_and_suffixes() -> None:
    expr = 'histogram_quantile(0.99, sum by (le) (rate(mesh_ttft_bucket{model=~"$model"}[5m]))) / mesh_a_total'
    assert metric_names(expr) == {"mesh_ttft_bucket", "mesh_a_total"}
    assert resolves("mesh_ttft_bucket", {"mesh_ttft": "histogram"})
    assert not resolves("mesh_ttft_bucket", {"mesh_ttft": "counter"})
    assert not resolves("mesh_nope_total", {"mesh_ttft": "histogram"})
