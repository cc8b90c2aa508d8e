"""``mesh simulate`` and ``mesh calibrate`` as a user runs them: real subprocesses, real files."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.procs import SHARED_TRACES, free_port

ROOT = Path(__file__).resolve().parents[3]
MOONCAKE = SHARED_TRACES / "mooncake" / "conversation_trace.jsonl"
EXAMPLE = ROOT / "examples" / "traces" / "agent_sessions.jsonl"


def mesh(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "mesh", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def test_simulate_compares_policies_and_writes_reports(tmp_path: Path) -> None:
    policy_file = tmp_path / "sticky.yaml"
    policy_file.write_text("policy:\n  name: session_sticky\n  params: {max_in_flight: 8}\n")
    out, page = tmp_path / "report.json", tmp_path / "report.html"
    proc = mesh("simulate", str(MOONCAKE), "--workers", "3", "--policy", "round_robin", "--policy",
                str(policy_file), "--profile", "dynamo-mocker", "--max-requests", "400", "--seed", "5",
                "--json", str(out), "--html", str(page), "--baseline", "sticky")
    assert proc.returncode == 0, proc.stderr
    assert "round_robin" in proc.stdout and "sticky" in proc.stdout  # the table
    report = json.loads(out.read_text())
    assert report["trace"]["requests"] == 400 and report["trace"]["formats"] == ["mooncake"]
    assert report["workers"] == 3 and report["wall_s"] > 0
    # the gateway's default policy is its own row beside the ones asked for, named as the gateway names it
    assert set(report["policies"]) == {"round_robin", "sticky", "session_sticky"}
    assert report["gateway_default_policy"] == "session_sticky" and report["complete"] is True
    assert report["runs"]["policy"]["session_sticky"] == "session_sticky"
    for s in report["policies"].values():
        assert s["requests"] == 400
        assert 0.0 < s["hit_rate"] < 1.0
        t = s["ttft_ms"]
        assert 0 < t["p50"] <= t["p90"] <= t["p99"] and t["mean"] > 0
        assert set(s["itl_ms"]) == {"mean", "p50", "p90", "p99"} and s["itl_ms"]["mean"] > 0
        assert s["throughput_tok_s"] > 0 and s["input_throughput_tok_s"] > s["throughput_tok_s"]
        assert s["wall_s"] > 0
        assert [w["id"] for w in s["per_worker"]] == ["w0", "w1", "w2"]
        assert sum(w["requests"] for w in s["per_worker"]) == 400
    assert report["policies"]["sticky"]["spec"] == {"name": "session_sticky", "params": {"max_in_flight": 8}}
    html = page.read_text()
    assert html.startswith("<!doctype html>") and html.count("data:image/png;base64,") == 4
    # the header says what was run, the baseline is the one asked for, the best run is marked
    assert f"<dt>traces</dt><dd>{MOONCAKE} (mooncake)</dd>" in html and "<dd>400 requests, no sessions" in html
    assert "<dd>dynamo-mocker" in html and "--baseline sticky" in html and "--max-requests 400" in html
    def label_cell(run: str) -> str:
        return html.split(f'<td class="run">{run} ')[1].split("</td>")[0]

    assert report["baseline"] == "sticky" and '<span class="tag">baseline</span>' in label_cell("sticky")
    best = min(report["policies"], key=lambda k: report["policies"][k]["ttft_ms"]["mean"])  # ties: the first
    assert '<span class="tag">&#9733; best</span>' in label_cell(best) and html.count("&#9733; best</span>") == 1
    bad = mesh("simulate", str(MOONCAKE), "--policy", "round_robin", "--baseline", "nope", "--max-requests", "10")
    assert bad.returncode == 2 and "--baseline 'nope' names no run" in bad.stderr


def test_simulate_session_trace_counts_session_moves(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    proc = mesh("simulate", str(EXAMPLE), "--workers", "2", "--policy", "random", "--policy", "session_sticky",
                "--profile", "h200-8b", "--json", str(out), "--quiet", "--seed", "1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""  # --quiet
    report = json.loads(out.read_text())
    assert report["trace"]["sessions"] == 2
    assert report["policies"]["session_sticky"]["session_moves"] == 0
    assert report["policies"]["random"]["session_moves"] >= 1


@pytest.mark.parametrize("args, message", [
    (["/nonexistent/trace.jsonl"], "no such file"),
    ([str(EXAMPLE), "--workers", "0"], "--workers must be >= 1"),
    ([str(EXAMPLE), "--policy", "no_such_policy"], "unknown policy 'no_such_policy'"),
    ([str(EXAMPLE), "--profile", "nope"], "no such profile file"),
    ([str(EXAMPLE), "--kv-blocks", "2", "--profile", "unit"], "KV blocks"),
])
def test_simulate_errors_are_messages_not_tracebacks(args: list[str], message: str) -> None:
    proc = mesh("simulate", *args, "--quiet")
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_simulate_reports_a_malformed_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(MOONCAKE.read_text().split("\n", 3)[0] + "\n{\"timestamp\": 3,\n")
    proc = mesh("simulate", str(bad), "--quiet")
    assert proc.returncode == 2 and f"{bad}:2:" in proc.stderr and "Traceback" not in proc.stderr


FAKE_SERVER = textwrap.dedent('''
    import asyncio, json, sys
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()
    active = 0

    @app.get("/v1/models")
    async def models():
        return {"data": [{"id": "fake-model"}]}

    @app.get("/metrics")
    async def metrics():  # as vLLM reports its KV capacity
        from fastapi.responses import PlainTextResponse
        return PlainTextResponse('vllm:cache_config_info{block_size="16",num_gpu_blocks="16384"} 1.0\\n')

    @app.post("/v1/completions")
    async def completions(req: Request):
        global active
        body = await req.json()
        n_prompt = len(body["prompt"].split())
        if not body.get("stream"):
            return JSONResponse({"choices": [{"text": "x"}], "usage": {"prompt_tokens": n_prompt}})
        async def gen():
            global active
            active += 1
            try:
                await asyncio.sleep(0.002 + 2e-6 * n_prompt)  # prefill
                for i in range(body["max_tokens"]):
                    if i:
                        await asyncio.sleep(0.001 + 0.0002 * active)  # decode step
                    yield "data: " + json.dumps({"choices": [{"text": " t", "finish_reason": None}]}) + "\\n\\n"
                yield "data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": n_prompt}}) + "\\n\\n"
                yield "data: [DONE]\\n\\n"
            finally:
                active -= 1
        return StreamingResponse(gen(), media_type="text/event-stream")

    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
''')


def test_calibrate_writes_a_loadable_profile(tmp_path: Path) -> None:
    script = tmp_path / "fake_openai.py"
    script.write_text(FAKE_SERVER)
    port = free_port()
    server = subprocess.Popen([sys.executable, str(script), str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        out = tmp_path / "calibrated.yaml"
        proc = mesh("calibrate", "--url", f"http://127.0.0.1:{port}", "--out", str(out), "--quick", timeout=180)
        assert proc.returncode == 0, proc.stderr
        from simulator.profile import load_profile

        profile = load_profile(out)
        # the worker's capacity (its /metrics), not the base profile's 52,000 blocks
        assert profile.estimate is False and profile.kv_blocks == 16384 and profile.block_size == 16
        assert "KV capacity: 16,384 blocks of 16 tokens (the worker's /metrics" in proc.stderr
        import yaml

        unfitted = yaml.safe_load(out.read_text())["calibration"]["unfitted"]
        # its TTFT grows by ~1 ms over the sweep, within a loaded machine's noise: fitted or said why not
        assert profile.prefill.per_token_ms > 0 or "non-positive slope" in unfitted["prefill.per_token"]
        assert profile.name == "calibrated-fake-model"
        points = yaml.safe_load(out.read_text())["calibration"]["points"]
        assert len(points["prefill"]) >= 3 and len(points["decode"]) >= 2
        # the profile drives a simulation
        sim = mesh("simulate", str(EXAMPLE), "--profile", str(out), "--quiet", "--json", str(tmp_path / "r.json"))
        assert sim.returncode == 0, sim.stderr
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_calibrate_unreachable_endpoint_is_a_message(tmp_path: Path) -> None:
    proc = mesh("calibrate", "--url", f"http://127.0.0.1:{free_port()}", "--out", str(tmp_path / "p.yaml"),
                "--quick", "--timeout", "2")
    assert proc.returncode == 2 and "mesh calibrate: error:" in proc.stderr and "Traceback" not in proc.stderr


def test_simulate_runs_the_benchmarks_workload_as_mesh_replay_plans_it(tmp_path: Path) -> None:
    from mesh.replay.run import ReplaySetup, prepare

    slice_dir = ROOT / "bench" / "data" / "weka-routing"
    out = tmp_path / "twin.json"
    proc = mesh("simulate", str(slice_dir), "--max-sessions", "4", "--workers", "2", "--workers-per-device", "2",
                "--profile", "h200-8b", "--kv-blocks", "2000", "--prompt-scale", "16", "--output-tokens", "32",
                "--time-scale", "0.01", "--max-think-s", "2", "--concurrency", "2", "--policy", "session_sticky",
                "--policy", "kv_aware", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    plan = prepare(ReplaySetup(traces=[str(slice_dir)], sessions=4, prompt_scale=16.0, output_tokens=32,
                               time_scale=0.01, max_think_s=2.0)).plan
    assert report["trace"]["requests"] == len(plan.turns)
    assert report["trace"]["replay_plan"]["prompt_units"] == sum(t.units for t in plan.turns)
    assert report["closed_loop"] == {"concurrency": 2, "run_s": None, "session_ids": True}
    for s in report["policies"].values():
        assert s["requests"] == len(plan.turns) and s["not_sent"] == 0
        assert s["prompt_tokens"] == sum(t.units for t in plan.turns)
        assert s["output_tokens"] == 32 * len(plan.turns)
    cut = mesh("simulate", str(slice_dir), "--max-sessions", "4", "--workers", "2", "--prompt-scale", "16",
               "--run-s", "5", "--json", str(out), "--quiet")
    assert cut.returncode == 0, cut.stderr
    s = next(iter(json.loads(out.read_text())["policies"].values()))
    assert s["not_sent"] > 0 and s["requests"] + s["not_sent"] == len(plan.turns)
    bad = mesh("simulate", str(slice_dir), "--prompt-scale", "0")
    assert bad.returncode == 2 and "--prompt-scale must be a number > 0" in bad.stderr
