"""Policy plugins named in YAML that misbehave, against a real gateway and real echo workers: a
plugin that raises, returns None or a non-Decision, or names a target that is not a candidate must
not turn every request into a 500 (or a 503, or a request sent to a worker that cannot serve it):
the gateway falls back to a built-in policy, answers, and counts it."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.procs import REPO, ProcessGroup, free_port

PLUGIN = "tests.plugins.hostile_policies:Misbehaving"


@pytest.fixture(scope="module")
def gateway(module_procs: ProcessGroup) -> Iterator[httpx.Client]:
    e0 = module_procs.echo_worker("e0")
    e1 = module_procs.echo_worker("e1", "--model", "other")
    config = module_procs.log_dir / "mesh.yaml"
    config.write_text(yaml.safe_dump({
        "server": {"admin_key": "admin-secret", "request_timeout_s": 30},
        "workers": [{"name": "e0", "url": e0.url}, {"name": "e1", "url": e1.url}],
        "policy": {"name": PLUGIN},
    }))
    proc = module_procs.gateway(config, port=free_port())
    with httpx.Client(base_url=proc.url, timeout=30) as http:
        yield http


def ask(http: httpx.Client, mode: str) -> httpx.Response:
    return http.post("/v1/completions", json={"model": "echo", "prompt": f"hello mode:{mode}", "max_tokens": 2})


@pytest.mark.parametrize("mode", ["raise", "exit", "none", "string", "foreign", "unavailable", "hook"])
def test_a_misbehaving_plugin_falls_back_and_answers(gateway: httpx.Client, mode: str) -> None:
    for _ in range(3):  # not a one-off: every request, not only the first
        resp = ask(gateway, mode)
        assert resp.status_code == 200, (mode, resp.status_code, resp.text[:300])
    assert ask(gateway, "good").status_code == 200
    metrics = gateway.get("/metrics").text
    counted = [line for line in metrics.splitlines() if line.startswith("mesh_policy_fallbacks_total")]
    assert any(float(line.rsplit(" ", 1)[1]) >= 3 for line in counted), counted


def test_the_fallback_shows_in_debug_route(gateway: httpx.Client) -> None:
    resp = gateway.post("/debug/route", json={"model": "echo", "prompt": "hello mode:raise"})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["decision"]["target"] == "e0" and "fallback" in str(body).lower() and "RuntimeError" in str(body)


@pytest.mark.parametrize("spec, message", [
    ({"name": "tests.plugins.hostile_policies:NotAPolicy"}, "has no decide"),
    ({"name": "tests.plugins.hostile_policies:not_a_class"}, "has no class"),
    ({"name": "tests.plugins.broken_plugin:Anything"}, "cannot import"),
    ({"name": PLUGIN, "params": {"nope": 1}}, "has no parameter 'nope'"),
    ({"name": PLUGIN, "params": [1, 2]}, "params must be a mapping"),
    ({"name": 5}, "spec must be a name"),
])
def test_config_validate_names_a_bad_plugin_in_one_line(spec: dict, message: str, tmp_path: Path) -> None:
    path = tmp_path / "mesh.yaml"
    path.write_text(yaml.safe_dump({"policy": spec}))
    proc = subprocess.run([sys.executable, "-m", "mesh", "config", "validate", str(path)],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert message in proc.stderr + proc.stdout, proc.stderr + proc.stdout


@pytest.mark.parametrize("kind_key", ["scorers", "filters", "picker", "policy"])
def test_a_config_cannot_make_the_gateway_instantiate_an_arbitrary_class(kind_key: str, tmp_path: Path) -> None:
    # `module:Class` imports any module on the path; a class that is not a plugin of that kind is
    # refused before it is instantiated with the YAML params: otherwise `mesh config validate` (and
    # the gateway's start and reload) of this file would run `touch` (any command).
    marker = tmp_path / "pwned"
    gadget = {"name": "subprocess:Popen", "params": {"args": ["touch", str(marker)]}}
    if kind_key == "policy":
        policy: dict = {"name": "session_sticky", "params": {"inner": gadget}}
    else:
        policy = {"name": "pipeline", "params": {kind_key: [gadget] if kind_key != "picker" else gadget}}
    path = tmp_path / "mesh.yaml"
    path.write_text(yaml.safe_dump({"policy": policy}))
    proc = subprocess.run([sys.executable, "-m", "mesh", "config", "validate", str(path)],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert "Popen" in proc.stdout + proc.stderr and "has no" in proc.stdout + proc.stderr
    time.sleep(0.2)  # a spawned `touch` would have run by now
    assert not marker.exists(), "the config ran a command"


def test_a_plugin_module_that_exits_at_import_is_an_error_not_an_exit(procs: ProcessGroup, tmp_path: Path) -> None:
    # SystemExit is not an Exception: `mesh config validate` exited 3 without a word, and a reload
    # naming such a module ended the gateway.
    spec = {"name": "tests.plugins.exiting_plugin:Anything"}
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"policy": spec}))
    proc = subprocess.run([sys.executable, "-m", "mesh", "config", "validate", str(bad)],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 1 and "exiting_plugin" in proc.stderr and "exited" in proc.stderr, proc.stderr
    config = tmp_path / "mesh.yaml"
    config.write_text(yaml.safe_dump({"server": {"admin_key": "admin-secret"}, "policy": "round_robin"}))
    gw = procs.gateway(config, port=free_port())
    config.write_text(yaml.safe_dump({"server": {"admin_key": "admin-secret"}, "policy": spec}))
    with httpx.Client(base_url=gw.url, timeout=30) as http:
        resp = http.post("/admin/reload", headers={"authorization": "Bearer admin-secret"})
        assert resp.status_code == 400 and "exiting_plugin" in resp.text, resp.text
        assert http.get("/health").status_code == 200 and gw.alive


def test_debug_route_dry_runs_a_wrapped_plugin_behind_the_guard(procs: ProcessGroup, tmp_path: Path) -> None:
    """session_sticky around a plugin: /debug/route shows the inner policy's dry run for a session
    kept on its target, behind the guard: neither hidden (no dry run shown) nor called bare (its
    bug would be a 500): the guarded dry run shows the fallback, with a 200."""
    e0, e1 = procs.echo_worker("e0"), procs.echo_worker("e1")
    config = tmp_path / "mesh.yaml"
    config.write_text(yaml.safe_dump({
        "workers": [{"name": "e0", "url": e0.url}, {"name": "e1", "url": e1.url}],
        "policy": {"name": "session_sticky", "params": {"inner": {"name": PLUGIN}}},
    }))
    gw = procs.gateway(config, port=free_port())
    session = {"x-session-id": "s1"}
    with httpx.Client(base_url=gw.url, timeout=30) as http:
        first = http.post("/v1/completions", headers=session, json={"model": "echo", "prompt": "hello", "max_tokens": 2})
        assert first.status_code == 200, first.text
        resp = http.post("/debug/route", headers=session, json={"model": "echo", "prompt": "hello mode:raise"})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["session"]["bound_target"] == body["decision"]["target"]
        assert "fallback" in str(body["inner_decision"]).lower() and "RuntimeError" in str(body["inner_decision"])
