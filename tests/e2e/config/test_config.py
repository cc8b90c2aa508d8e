"""mesh.config: defaults, YAML loading, errors that name their YAML path, `mesh config validate`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mesh.config import DEFAULT_POLICY, ConfigError, MeshConfig, load_config, parse_config
from policies.base import Role

GOOD = """
server:
  port: 9000
  admin_key: secret
  api_keys: [k1, k2]
  allowed_worker_hosts: [10.0.0.5, gpu-1]
workers:
  - name: gpu-1
    url: http://gpu-1:8000/
    role: prefill
    dp_size: 2
    block_size: 64
    kv_events: {endpoint: "tcp://gpu-1:5557", replay_endpoint: "tcp://gpu-1:5558"}
  - {name: b, url: "http://10.0.0.5:8001", models: [m1], max_in_flight: 8}
policy: {name: kv_aware, params: {decode_weight: 0.1}}
seed: 3
sessions: {header: X-Session-ID, idle_ttl_s: 30}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "mesh.yaml"
    path.write_text(text)
    return path


def errors_of(text: str, tmp_path: Path) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    return info.value.errors


def test_defaults_need_no_file() -> None:
    config = load_config(None)
    assert config == MeshConfig()
    assert config.policy == DEFAULT_POLICY
    assert config.workers == []
    assert config.server.max_body_bytes == 8 * 1024 * 1024
    assert config.sessions.header == "x-session-id" and config.sessions.body_field == "user"
    assert config.index.speculative_ttl_s == 2.0
    assert config.build_policy().name == DEFAULT_POLICY


def test_empty_file_means_defaults(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "")) == MeshConfig()


def test_full_file_is_parsed(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, GOOD))
    a, b = config.workers
    assert a.url == "http://gpu-1:8000"  # trailing slash normalized away
    assert a.role is Role.PREFILL and a.dp_size == 2 and a.block_size == 64 and a.models is None
    assert a.kv_events is not None and a.kv_events.replay_endpoint == "tcp://gpu-1:5558"
    assert b.models == ["m1"] and b.max_in_flight == 8
    assert config.sessions.header == "x-session-id"  # lower-cased
    assert config.build_policy().name == "kv_aware" and config.seed == 3


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("workers:\n  - {name: a, url: 'http://h:1', colour: red}\n", "workers[0].colour: unknown key"),
        ("server: {port: many}\n", "server.port: Input should be a valid integer"),
        ("server: {port: 70000}\n", "server.port: Input should be less than or equal to 65535"),
        ("workers:\n  - {name: a, url: 'http://h:1', role: chef}\n", "workers[0].role: Input should be 'mixed', 'prefill' or 'decode'"),
        ("workers:\n  - {name: 'bad name', url: 'http://h:1'}\n", "workers[0].name: worker name must be"),
        ("workers:\n  - {name: a, url: 'h:1'}\n", "workers[0].url: worker url 'h:1' needs a scheme and a host"),
        ("workers:\n  - {name: a, url: 'http://u:p@h:1'}\n", "workers[0].url: worker url 'http://u:***@h:1' must not carry credentials"),
        ("workers:\n  - {name: a, url: 'ftp://h:1'}\n", "scheme 'ftp' not in allowed_schemes"),
        ("retries: {max_attempts: 0}\n", "retries.max_attempts: Input should be greater than or equal to 1"),
        ("frobnicate: 1\n", "frobnicate: unknown key"),
        ("policy: no_such_policy\n", "policy: unknown policy 'no_such_policy'"),
        ("- a\n- b\n", "(top level): expected a mapping of sections, got list"),
        ("server: [\n", "invalid YAML"),
        # YAML's .inf passed ge=0: speculation never confirmed would never expire
        ("index: {speculative_ttl_s: .inf}\n", "index.speculative_ttl_s: Input should be a finite number"),
        ("sessions: {idle_ttl_s: .nan}\n", "sessions.idle_ttl_s: Input should be a finite number"),
    ],
)
def test_errors_name_the_yaml_path(tmp_path: Path, text: str, expected: str) -> None:
    errors = errors_of(text, tmp_path)
    assert any(expected in e for e in errors), errors


def test_every_error_is_reported(tmp_path: Path) -> None:
    errors = errors_of("server: {port: x, max_body_bytes: -1}\nhealth: {interval_s: 0}\n", tmp_path)
    paths = sorted(e.split(":")[0] for e in errors)
    assert paths == ["health.interval_s", "server.max_body_bytes", "server.port"]


def test_duplicate_worker_names_rejected(tmp_path: Path) -> None:
    errors = errors_of("workers:\n  - {name: a, url: 'http://h:1'}\n  - {name: a, url: 'http://h:2'}\n", tmp_path)
    assert any("duplicate worker name 'a'" in e for e in errors)


def test_host_allowlist_applies_to_static_workers(tmp_path: Path) -> None:
    text = "server: {allowed_worker_hosts: [good]}\nworkers:\n  - {name: a, url: 'http://evil:1'}\n"
    assert any("host 'evil' not in allowed_worker_hosts" in e for e in errors_of(text, tmp_path))


def test_policy_spec_passes_through_untouched() -> None:
    spec = {"name": "kv_aware", "params": {"decode_weight": 0.5}}
    config = parse_config({"policy": spec})
    assert config.policy == spec
    assert config.build_policy().name == "kv_aware"
    with pytest.raises(ConfigError, match="policy.params.nope: policy 'random' has no parameter 'nope'"):
        parse_config({"policy": {"name": "random", "params": {"nope": 1}}})
    with pytest.raises(ConfigError, match="policy.params.seed: policy 'random' has no parameter 'seed'"):
        parse_config({"policy": {"name": "random", "params": {"seed": 7}}})  # the router's: top-level seed


def run_validate(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mesh.commands.config", "validate", str(path)], capture_output=True, text=True, timeout=60
    )


def test_validate_command_ok_and_errors(tmp_path: Path) -> None:
    good = run_validate(write(tmp_path, GOOD))
    assert good.returncode == 0 and good.stdout.startswith("OK:"), good.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("server: {port: x}\nworkers:\n  - {name: a, url: 'http://h:1', extra: 1}\n")
    result = run_validate(bad)
    assert result.returncode == 1
    assert "2 error(s)" in result.stderr
    assert "server.port:" in result.stderr and "workers[0].extra:" in result.stderr


CLUSTER = {"backend": "redis", "url": "rediss://user:pw@10.0.0.2:6379/0", "cluster": True}


def test_a_redis_cluster_state_backend_is_parsed() -> None:
    state = parse_config({"state": {**CLUSTER, "cluster_seeds": ["10.0.0.3:6379", "[fd00::4]:6380"]}}).state
    assert state.cluster and state.cluster_seeds == ["10.0.0.3:6379", "[fd00::4]:6380"]
    assert parse_config({"state": {"backend": "redis", "url": "redis://h:1"}}).state.cluster is False  # one server


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        ({"backend": "memory", "cluster": True}, "state: cluster: true needs backend: redis"),
        ({**CLUSTER, "url": "unix:///run/redis.sock"}, "state: cluster: true needs a redis:// or rediss:// url"),
        ({**CLUSTER, "url": "redis://h:6379/3"}, "a Redis Cluster has only database 0"),
        ({**CLUSTER, "url": "redis://h:6379?db=2"}, "a Redis Cluster has only database 0"),
        ({**CLUSTER, "key_prefix": "{mesh}:"}, "key_prefix '{mesh}:' must not contain '{' or '}' with cluster: true"),
        ({**CLUSTER, "cluster_seeds": ["10.0.0.3"]}, "state.cluster_seeds: cluster_seeds[0] '10.0.0.3' must be host:port"),
        ({**CLUSTER, "cluster_seeds": ["h:1", "redis://h:2"]}, "cluster_seeds[1] 'redis://h:2' must be host:port"),
        ({**CLUSTER, "cluster_seeds": ["u:p@h:1"]}, "cluster_seeds[0] 'u:p@h:1' must be host:port"),
        ({"backend": "redis", "url": "redis://h:1", "cluster_seeds": ["h:2"]}, "state: cluster_seeds needs cluster: true"),
        ({**CLUSTER, "cluster": "maybe"}, "state.cluster: Input should be a valid boolean"),
    ],
)
def test_redis_cluster_mistakes_are_named(state: dict[str, object], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"state": state})
    assert any(expected in e for e in info.value.errors), info.value.errors
    assert all("pw" not in e for e in info.value.errors)  # the url's password is never shown
