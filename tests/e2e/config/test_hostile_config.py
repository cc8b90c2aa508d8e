"""Hostile config files: YAML alias bombs, recursive aliases, deep nesting, huge files; through
`mesh config validate` (a real process) and a real gateway's reload (POST /admin/reload and
SIGHUP), which must keep the running config and stay up."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from mesh.config import ConfigError, load_config
from tests.procs import ProcessGroup, free_port, wait_until

ADMIN = {"authorization": "Bearer admin-secret"}


def alias_bomb(levels: int = 7) -> str:
    """A billion-laughs policy: a few hundred bytes that alias-expand to 9**levels strings (7: a
    65 MB error message if expanded; 9 or 10 levels would take all memory)."""
    lines = ["policy:", "  name: round_robin", "  params:", "    junk:",
             "      - &l0 [" + ",".join(["laughlaugh"] * 9) + "]"]
    lines += [f"      - &l{i} [" + ",".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


HOSTILE = {
    "alias_bomb_params": alias_bomb(),
    "alias_bomb_spec": "policy:\n" + "\n".join(alias_bomb().splitlines()[4:]).replace("      -", "  -") + "\n",
    "recursive_alias": "policy: {name: round_robin, params: &a {x: *a}}\n",
    "deep_nesting": "policy: " + "[" * 5000 + "]" * 5000 + "\n",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_yaml_is_a_short_config_error(name: str, tmp_path: Path) -> None:
    path = tmp_path / "mesh.yaml"
    path.write_text(HOSTILE[name])
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert len(str(info.value)) < 1000  # the error message repr-ed the whole expansion


def test_validate_command_on_a_deep_file_is_an_error_not_a_traceback(tmp_path: Path) -> None:
    path = tmp_path / "mesh.yaml"
    path.write_text(HOSTILE["deep_nesting"])
    result = subprocess.run([sys.executable, "-m", "mesh.commands.config", "validate", str(path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr and "RecursionError" not in result.stderr
    assert "nested" in (result.stdout + result.stderr)


def test_a_file_over_the_size_limit_is_refused_without_reading_it_all(tmp_path: Path) -> None:
    from mesh.config import MAX_FILE_BYTES

    huge = tmp_path / "huge.yaml"
    with huge.open("wb") as f:
        f.truncate(MAX_FILE_BYTES + 1)  # sparse: no disk used
    with pytest.raises(ConfigError) as info:
        load_config(huge)  # refused unread (/dev/zero, endless, is refused as not a regular file)
    assert "over the limit" in str(info.value)


def test_a_large_plain_config_still_loads(tmp_path: Path) -> None:
    workers = [{"name": f"w{i}", "url": f"http://10.0.{i // 250}.{i % 250}:8000", "models": ["m"]} for i in range(1000)]
    path = tmp_path / "mesh.yaml"
    path.write_text(yaml.safe_dump({"workers": workers, "policy": "round_robin"}))
    assert len(load_config(path).workers) == 1000


@pytest.fixture
def gateway(procs: ProcessGroup) -> Iterator[tuple[httpx.Client, Path, object]]:
    config = procs.log_dir / "mesh.yaml"
    config.write_text(yaml.safe_dump({"server": {"admin_key": "admin-secret"}, "policy": "round_robin"}))
    proc = procs.gateway(config, port=free_port())
    with httpx.Client(base_url=proc.url, timeout=30) as http:
        yield http, config, proc


def _reload_policy(http: httpx.Client) -> str:
    resp = http.post("/admin/reload", headers=ADMIN)
    assert resp.status_code == 200, resp.text
    return str(resp.json()["policy"]["name"])


def test_reload_and_sighup_with_hostile_files_keep_the_running_config(gateway: tuple) -> None:
    http, config, proc = gateway
    original = config.read_text()
    for name, text in HOSTILE.items():
        config.write_text(text)
        resp = http.post("/admin/reload", headers=ADMIN)
        assert resp.status_code == 400, (name, resp.status_code, resp.text[:300])
        assert resp.json()["error"]["code"] == "invalid_config" and len(resp.text) < 2000
    # A SIGHUP is handled later, on the gateway's loop: each one is awaited (its log line) before
    # the file changes again, and files are replaced whole, as an operator should.
    for count, name in enumerate(["deep_nesting", "alias_bomb_params"], start=1):
        _replace_file(config, HOSTILE[name])
        proc.popen.send_signal(signal.SIGHUP)  # type: ignore[attr-defined]
        wait_until(lambda: proc.log_path.read_text().count("SIGHUP reload failed") >= count,  # type: ignore[attr-defined]
                   what=f"SIGHUP {count} handled")
    assert http.get("/health").status_code == 200
    assert proc.alive()  # type: ignore[attr-defined]
    _replace_file(config, original.replace("round_robin", "power_of_two"))
    assert _reload_policy(http) == "power_of_two"  # reload still works after the hostile ones


def test_a_reload_of_an_empty_file_keeps_the_running_config(gateway: tuple) -> None:
    """An empty file (an editor's truncate-then-write caught halfway) is refused (a 400), not taken
    for "all defaults", which would drop every worker and the admin key, locking the admin API."""
    http, config, _ = gateway
    original = config.read_text()
    config.write_text("")
    resp = http.post("/admin/reload", headers=ADMIN)
    assert resp.status_code == 400 and "empty" in resp.json()["error"]["message"]
    _replace_file(config, original.replace("round_robin", "power_of_two"))
    assert _reload_policy(http) == "power_of_two"


def _replace_file(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)


@pytest.mark.parametrize("endpoint", ["tcp://10.0.0.5", "tcp:/10.0.0.5:5557", "tcp://*:5557", "udp://10.0.0.5:5557",
                                      "tcp://10.0.0.5:99999", "10.0.0.5:5557"])
@pytest.mark.parametrize("field", ["endpoint", "replay_endpoint"])
def test_a_kv_events_endpoint_zmq_cannot_connect_to_is_a_config_error(field: str, endpoint: str, tmp_path: Path) -> None:
    """Refused by the config, not left to the subscriber, whose connect would raise, end its
    stream with a "socket error" log line and leave the worker's prefix index untrusted for good
    (a bad replay endpoint too)."""
    kv = {"endpoint": "tcp://10.0.0.5:5557", field: endpoint}
    path = tmp_path / "mesh.yaml"
    path.write_text(yaml.safe_dump({"workers": [{"name": "a", "url": "http://10.0.0.5:8000", "kv_events": kv}]}))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert any(e.startswith(f"workers[0].kv_events.{field}:") and endpoint in e for e in info.value.errors)


def test_admin_add_with_a_bad_kv_events_endpoint_is_a_400(gateway: tuple) -> None:
    http, _, _ = gateway
    body = {"name": "x", "url": "http://127.0.0.1:9", "kv_events": {"endpoint": "tcp://127.0.0.1"}}
    resp = http.post("/workers", json=body, headers=ADMIN)
    assert resp.status_code in (400, 422), resp.text
    assert "endpoint" in resp.text
    assert "x" not in {w["name"] for w in http.get("/workers", headers=ADMIN).json()["workers"]}


@pytest.mark.parametrize(("param", "value"), [("eviction_interval_s", ".nan"), ("eviction_interval_s", ".inf"),
                                              ("balance_abs_threshold", ".nan"), ("balance_rel_threshold", ".nan"),
                                              ("max_tree_chars", ".inf")])
def test_cache_aware_non_finite_params_are_config_errors(param: str, value: str, tmp_path: Path) -> None:
    """NaN and infinite parameters are config errors: NaN passes a range check written with
    comparisons (never balance, never evict: the prompt trees would grow for good), and an infinite
    max_tree_chars would raise OverflowError (a traceback in `mesh simulate --policy`)."""
    path = tmp_path / "mesh.yaml"
    path.write_text(f"policy: {{name: cache_aware, params: {{{param}: {value}}}}}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert f"{param} must be a finite number" in str(info.value)
    trace = Path(__file__).resolve().parents[3] / "examples" / "traces" / "agent_sessions.jsonl"
    proc = subprocess.run([sys.executable, "-m", "mesh", "simulate", str(trace), "--workers", "2", "--policy",
                           str(path), "--quiet"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr and "finite" in proc.stderr


@pytest.mark.parametrize(("a", "b"), [
    ({"endpoint": "tcp://10.0.0.5:5557"}, {"endpoint": "tcp://10.0.0.5:5557"}),
    ({"endpoint": "tcp://10.0.0.5:5557", "dp_size": 2}, {"endpoint": "tcp://10.0.0.5:5558"}),  # rank 1 = port + 1
    ({"endpoint": "tcp://10.0.0.5:5557", "topic": "kv"}, {"endpoint": "tcp://10.0.0.5:5557", "topic": "kv-b"}),
])
def test_two_workers_on_one_kv_event_stream_is_a_config_error(a: dict, b: dict, tmp_path: Path) -> None:
    """Refused: both workers' streams would read the one engine's events, so the prefix index
    would credit the other worker with blocks it never held and route for hits it does not have."""
    def worker(name: str, port: int, kv: dict) -> dict:
        dp = kv.pop("dp_size", 1)
        return {"name": name, "url": f"http://10.0.0.5:{port}", "dp_size": dp, "kv_events": kv}
    path = tmp_path / "mesh.yaml"
    path.write_text(yaml.safe_dump({"workers": [worker("a", 8000, dict(a)), worker("b", 8001, dict(b))]}))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "workers 'a' and 'b' subscribe to the same KV event stream" in str(info.value)


def test_kv_event_streams_apart_by_endpoint_or_topic_still_load(tmp_path: Path) -> None:
    workers = [{"name": "a", "url": "http://10.0.0.5:8000", "dp_size": 2, "kv_events": {"endpoint": "tcp://10.0.0.5:5557"}},
               {"name": "b", "url": "http://10.0.0.5:8001", "kv_events": {"endpoint": "tcp://10.0.0.5:5559"}},
               {"name": "c", "url": "http://10.0.0.5:8002", "kv_events": {"endpoint": "tcp://10.0.0.5:5559", "topic": "c"}}]
    path = tmp_path / "mesh.yaml"
    path.write_text(yaml.safe_dump({"workers": workers}))
    with pytest.raises(ConfigError):  # b's empty topic matches every topic, c's too
        load_config(path)
    workers[1]["kv_events"]["topic"] = "b"
    path.write_text(yaml.safe_dump({"workers": workers}))
    assert [w.name for w in load_config(path).workers] == ["a", "b", "c"]


def test_two_workers_sharing_a_replay_endpoint_is_a_config_error(tmp_path: Path) -> None:
    """Refused: on connect and on every gap, one worker's replayed batches would be applied to
    the other's index entries."""
    kv = {"replay_endpoint": "tcp://10.0.0.5:5600"}
    workers = [{"name": "a", "url": "http://10.0.0.5:8000", "kv_events": {"endpoint": "tcp://10.0.0.5:5557", **kv}},
               {"name": "b", "url": "http://10.0.0.5:8001", "kv_events": {"endpoint": "tcp://10.0.0.6:5557", **kv}}]
    path = tmp_path / "mesh.yaml"
    path.write_text(yaml.safe_dump({"workers": workers}))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "workers 'a' and 'b' share the KV event replay endpoint" in str(info.value)


def test_admin_add_of_a_worker_on_another_workers_event_stream_is_a_400(gateway: tuple) -> None:
    """The config check covers the file; the admin API adds workers one by one and must refuse
    the same overlap (a second worker on the first's KV event stream)."""
    http, _, _ = gateway
    first = {"name": "ev-a", "url": "http://127.0.0.1:9", "kv_events": {"endpoint": "tcp://127.0.0.1:5999"}}
    second = {"name": "ev-b", "url": "http://127.0.0.1:10", "kv_events": {"endpoint": "tcp://127.0.0.1:5999"}}
    try:
        assert http.post("/workers", json=first, headers=ADMIN).status_code == 201
        resp = http.post("/workers", json=second, headers=ADMIN)
        assert resp.status_code == 400 and "same KV event stream" in resp.json()["error"]["message"], resp.text
        names = {w["name"] for w in http.get("/workers", headers=ADMIN).json()["workers"]}
        assert "ev-a" in names and "ev-b" not in names
    finally:
        http.delete("/workers/ev-a", headers=ADMIN)
