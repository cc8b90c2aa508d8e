"""The serving metrics a dashboard reads, request ids and the JSON access log, end to end: a real
gateway (``mesh serve --access-log json``) over a real echo worker that waits before its first
token, between tokens, and reports cached prompt tokens; real requests, real scrapes.

The echo worker's usage is exact: prompt tokens are the prompt's bytes (byte tokenizer), the
completion tokens the words echoed, cached tokens ``--cached-tokens`` (at most the prompt's)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.procs import PYTHON, Proc, ProcessGroup, free_port, wait_http, wait_until

FIRST_TOKEN_DELAY_S = 0.3
TOKEN_DELAY_S = 0.05
CACHED = 3
PROMPT = "one two three four five six"  # 6 words, 27 bytes
LABELS = {"model": "echo", "target": "w0"}
GENERATED_ID = re.compile(r"^[0-9a-f]{16}-[0-9a-f]+$")


@pytest.fixture(scope="module")
def gateway(module_procs: ProcessGroup) -> Iterator[Proc]:
    module_procs.echo_worker("w0", "--first-token-delay-s", str(FIRST_TOKEN_DELAY_S), "--token-delay-s",
                             str(TOKEN_DELAY_S), "--cached-tokens", str(CACHED))
    worker_url = module_procs.procs[-1].url
    config = Path(module_procs.log_dir) / "serving-metrics.yaml"
    config.write_text(yaml.safe_dump({"server": {"admin_key": "adm"}, "workers": [{"name": "w0", "url": worker_url}]}))
    port = free_port()
    gw = module_procs.start([PYTHON, "-m", "mesh.commands.serve", "--config", str(config), "--port", str(port),
                             "--log-level", "warning", "--access-log", "json"], name="gateway", port=port)
    wait_http(f"{gw.url}/ready", proc=gw, timeout_s=30)
    yield gw


def scrape(gw: Proc) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = httpx.get(f"{gw.url}/metrics", timeout=10).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return samples.get((name, frozenset({**LABELS, **labels}.items())), 0.0)


def moved(before: dict[Any, float], after: dict[Any, float], name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def completion(gw: Proc, stream: bool, headers: dict[str, str] | None = None, max_tokens: int = 6) -> httpx.Response:
    body: dict[str, Any] = {"model": "echo", "prompt": PROMPT, "max_tokens": max_tokens, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    resp = httpx.post(f"{gw.url}/v1/completions", json=body, headers=headers or {}, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp


def test_a_non_streamed_answer_counts_its_ttft_latency_and_reported_tokens(gateway: Proc) -> None:
    before = scrape(gateway)
    resp = completion(gateway, stream=False, max_tokens=4)
    usage = resp.json()["usage"]
    assert usage == {"prompt_tokens": 27, "completion_tokens": 4, "total_tokens": 31,
                     "prompt_tokens_details": {"cached_tokens": CACHED}}
    after = scrape(gateway)
    assert moved(before, after, "mesh_prompt_tokens_total") == 27
    assert moved(before, after, "mesh_generation_tokens_total") == 4
    assert moved(before, after, "mesh_cached_prompt_tokens_total") == CACHED
    # the older per-target counter of reported reuse reads the same parse
    key = ("mesh_prefix_reported_tokens_total", frozenset({("target", "w0")}))
    assert after.get(key, 0) - before.get(key, 0) == CACHED
    # a non-streamed answer's first token comes with its whole body: after every token's delay
    assert moved(before, after, "mesh_time_to_first_token_seconds_count") == 1
    ttft = moved(before, after, "mesh_time_to_first_token_seconds_sum")
    assert ttft >= FIRST_TOKEN_DELAY_S + 4 * TOKEN_DELAY_S - 0.01, ttft
    assert moved(before, after, "mesh_time_to_first_token_seconds_bucket", le="0.25") == 0
    assert moved(before, after, "mesh_e2e_request_latency_seconds_count") == 1
    assert moved(before, after, "mesh_e2e_request_latency_seconds_sum") >= ttft
    assert moved(before, after, "mesh_inter_token_latency_seconds_count") == 0  # no stream, no gaps


def test_a_streamed_answer_counts_its_ttft_token_gaps_and_reported_tokens(gateway: Proc) -> None:
    before = scrape(gateway)
    resp = completion(gateway, stream=True, max_tokens=6)
    events = [line[5:].strip() for line in resp.text.splitlines() if line.startswith("data:")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 6
    after = scrape(gateway)
    assert moved(before, after, "mesh_prompt_tokens_total") == 27
    assert moved(before, after, "mesh_generation_tokens_total") == 6
    assert moved(before, after, "mesh_cached_prompt_tokens_total") == CACHED
    # TTFT: the first chunk, after the first-token delay and one token's, well before the rest
    assert moved(before, after, "mesh_time_to_first_token_seconds_count") == 1
    ttft = moved(before, after, "mesh_time_to_first_token_seconds_sum")
    e2e = moved(before, after, "mesh_e2e_request_latency_seconds_sum")
    assert FIRST_TOKEN_DELAY_S <= ttft < e2e, (ttft, e2e)
    assert moved(before, after, "mesh_e2e_request_latency_seconds_count") == 1
    # ITL: one gap per chunk after the first (6 words 50 ms apart, then finish, usage and [DONE]
    # chunks, which a read may join): at least the 5 word gaps' worth of time, in 1 to 8 gaps
    gaps = moved(before, after, "mesh_inter_token_latency_seconds_count")
    assert 1 <= gaps <= 8, gaps
    assert moved(before, after, "mesh_inter_token_latency_seconds_sum") >= 0.5 * 5 * TOKEN_DELAY_S
    assert moved(before, after, "mesh_inter_token_latency_seconds_bucket", le="+Inf") == gaps


def test_the_clients_request_id_is_echoed_and_reaches_the_worker(gateway: Proc) -> None:
    for stream in (False, True):
        resp = completion(gateway, stream=stream, headers={"x-request-id": "client-id-42"}, max_tokens=1)
        assert resp.headers["x-request-id"] == "client-id-42"
        assert resp.headers["x-echo-request-id"] == "client-id-42"  # what the worker was sent
        assert resp.headers.get_list("x-request-id") == ["client-id-42"]  # once, not the worker's again


def test_a_request_id_is_made_when_the_client_sent_none_or_an_unusable_one(gateway: Proc) -> None:
    ids = []
    for headers in ({}, {"x-request-id": "has a space"}, {"x-request-id": "x" * 129}, {"x-request-id": ""}):
        resp = completion(gateway, stream=False, headers=headers, max_tokens=1)
        rid = resp.headers["x-request-id"]
        assert GENERATED_ID.match(rid), (headers, rid)
        assert resp.headers["x-echo-request-id"] == rid
        ids.append(rid)
    assert len(set(ids)) == len(ids)
    # an answer the gateway gives itself has one too
    bad = httpx.post(f"{gateway.url}/v1/completions", content=b"{not json", timeout=10,
                     headers={"content-type": "application/json", "x-request-id": "bad-body-1"})
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "bad-body-1"


def access_lines(gw: Proc) -> list[dict[str, Any]]:
    out = []
    for line in gw.log_path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def test_the_json_access_log_has_one_line_per_request(gateway: Proc) -> None:
    completion(gateway, stream=True, headers={"x-request-id": "log-me-1", "x-session-id": "sess-7"}, max_tokens=3)
    bad = httpx.post(f"{gateway.url}/v1/completions", content=b"[1]", timeout=10,
                     headers={"content-type": "application/json", "x-request-id": "log-me-2"})
    assert bad.status_code == 400

    def logged() -> list[dict[str, Any]] | None:
        found = [x for x in access_lines(gateway) if x.get("request_id") in ("log-me-1", "log-me-2")]
        return found if len(found) == 2 else None

    lines = wait_until(logged, timeout_s=10, what="two access log lines")
    ok = next(x for x in lines if x["request_id"] == "log-me-1")
    assert re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$", ok["time"]), ok
    assert (ok["method"], ok["path"], ok["status"], ok["model"], ok["worker"], ok["target"]) == (
        "POST", "/v1/completions", 200, "echo", "w0", "w0")
    assert ok["session_id"]  # the gateway's key of the session header
    assert (ok["prompt_tokens"], ok["cached_tokens"], ok["generation_tokens"]) == (27, CACHED, 3)
    assert FIRST_TOKEN_DELAY_S <= ok["ttft_s"] < ok["duration_s"] < 30
    assert re.match(r"^127\.0\.0\.1:\d+$", ok["client"]), ok
    failed = next(x for x in lines if x["request_id"] == "log-me-2")
    assert failed["status"] == 400 and failed["worker"] is None and failed["prompt_tokens"] is None
    assert failed["ttft_s"] is None and failed["duration_s"] >= 0


def test_mesh_up_writes_the_json_access_log_too(procs: ProcessGroup) -> None:
    port = free_port()
    up = procs.start([PYTHON, "-m", "mesh", "up", "--engine", "echo", "--workers", "1", "--port", str(port),
                      "--access-log", "json"], name="up", port=port)
    wait_http(f"{up.url}/ready", proc=up, timeout_s=90)
    resp = httpx.post(f"{up.url}/v1/completions", json={"model": "echo", "prompt": "hi up", "max_tokens": 2},
                      headers={"x-request-id": "from-up-1"}, timeout=30)
    assert resp.status_code == 200 and resp.headers["x-request-id"] == "from-up-1"
    line = wait_until(lambda: next((x for x in access_lines(up) if x.get("request_id") == "from-up-1"), None),
                      timeout_s=10, what="the access log line")
    assert line["status"] == 200 and line["model"] == "echo" and line["generation_tokens"] == 2
