"""``mesh config validate | show | reference`` through the CLI's ``main`` (the printed lines):
every error at once with its YAML path and the nearest key on a typo, the warnings of a valid
config that cannot work as it seems, the effective config with secrets redacted, and the
generated reference page equal to docs/config.md."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mesh.cli import main
from mesh.config import MeshConfig, parse_config
from mesh.yaml_document import model_in
from tests.procs import REPO

PD_POLICY = yaml.safe_load((REPO / "examples" / "pipeline_pd.yaml").read_text())["policy"]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def write(tmp_path: Path, data: object, name: str = "mesh.yaml") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return str(path)


def test_validate_reports_every_error_with_its_path_and_the_nearest_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, {
        "server": {"port": 99999},
        "helth": {"interval_s": 1},
        "workers": [{"name": "a", "ulr": "http://h:1"}],
        "policy": {"name": "pipeline", "params": {"profiles": {
            "prefill": {"scorers": [{"name": "prefx", "weight": 2}]},
            "decode": {"scorers": [{"name": "load", "wieght": 1}], "picker": {"name": "softmax", "params": {"temprature": 1}}},
        }}},
    })
    code, _, err = run(capsys, "config", "validate", path)
    assert code == 1
    lines = [line.strip() for line in err.splitlines()[1:]]
    assert err.splitlines()[0] == f"{path}: {len(lines)} error(s)"
    paths = [line.split(": ", 1)[0] for line in lines]
    assert set(paths) == {
        "server.port", "helth", "workers[0].url", "workers[0].ulr",
        "policy.params.profiles.prefill.scorers[0].name", "policy.params.profiles.decode.scorers[0].wieght",
        "policy.params.profiles.decode.picker.params.temprature",
    }, lines
    by_path = dict(line.split(": ", 1) for line in lines)
    assert "did you mean 'health'?" in by_path["helth"]
    assert "did you mean 'url'?" in by_path["workers[0].ulr"]
    assert "did you mean 'prefix'?" in by_path["policy.params.profiles.prefill.scorers[0].name"]
    assert "did you mean 'weight'?" in by_path["policy.params.profiles.decode.scorers[0].wieght"]
    assert "picker 'softmax' has no parameter 'temprature' (did you mean 'temperature'?)" in \
        by_path["policy.params.profiles.decode.picker.params.temprature"]
    assert "__init__()" not in err and "unexpected keyword argument" not in err


def test_a_policy_parameter_typo_names_the_parameter_it_meant(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, {"workers": [{"name": "a", "url": "http://h:1"}],
                            "policy": {"name": "session_sticky", "params": {"inner": {"name": "kv_aware", "params": {
                                "temprature": 0.1, "cpu_weight": 5}}, "load_factr": 2}}})
    code, _, err = run(capsys, "config", "validate", path)
    assert code == 1
    assert "policy.params.load_factr: policy 'session_sticky' has no parameter 'load_factr' (did you mean 'load_factor'?)" in err
    assert "policy.params.inner.params.temprature: policy 'kv_aware' has no parameter 'temprature' (did you mean 'temperature'?)" in err
    value_error = write(tmp_path, {"policy": {"name": "session_sticky", "params": {"inner": {
        "name": "kv_aware", "params": {"cpu_weight": 5}}}}}, "values.yaml")
    code, _, err = run(capsys, "config", "validate", value_error)
    assert code == 1 and "policy.params.inner: policy 'kv_aware': cpu_weight must be a finite number in [0.0, 1.0], got 5" in err


def test_validate_warns_about_an_empty_file_and_a_gateway_without_workers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = write(tmp_path, "# nothing yet\n", "empty.yaml")
    code, out, err = run(capsys, "config", "validate", empty)
    assert code == 0 and out.startswith("OK:")
    assert f"warning: {empty}: the file is empty" in err
    assert "warning: workers: 0 workers and no admin key: this gateway can never get a worker" in err
    keyed = write(tmp_path, {"server": {"admin_key": "k"}}, "keyed.yaml")
    code, out, err = run(capsys, "config", "validate", keyed)
    assert code == 0 and "warning:" not in err
    assert "note: workers: 0 static workers: add them with POST /workers" in err


def test_validate_warns_about_profiles_naming_roles_no_worker_has(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mixed = [{"name": "a", "url": "http://h:1"}, {"name": "b", "url": "http://h:2"}]
    code, _, err = run(capsys, "config", "validate", write(tmp_path, {"workers": mixed, "policy": PD_POLICY}))
    assert code == 0
    assert "warning: policy.params.profiles.prefill: no worker has role prefill" in err
    assert "warning: policy.params.profiles.decode: no worker has role decode" in err
    assert "no prefill/decode pair can form" in err
    code, _, err = run(capsys, "config", "validate", str(REPO / "examples" / "pipeline_pd.yaml"))  # P/D workers
    assert code == 0 and "warning" not in err, err
    only_decode = [{"name": "p", "url": "http://h:1", "role": "prefill"}, {"name": "m", "url": "http://h:2"}]
    code, _, err = run(capsys, "config", "validate", write(tmp_path, {"workers": only_decode, "policy": PD_POLICY}, "p.yaml"))
    assert "policy.params.profiles.decode: no worker has role decode" in err and "profiles.prefill:" not in err


def test_show_prints_the_effective_config_with_secrets_redacted(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, {"server": {"api_keys": ["data-secret"], "port": 9100},
                            "workers": [{"name": "a", "url": "http://h:1", "api_key": "worker-secret"}],
                            "state": {"backend": "redis", "url": "redis://user:redis-secret@h:6379/0"}})
    monkeypatch.setenv("MESH_ADMIN_KEY", "admin-secret")
    code, out, err = run(capsys, "config", "show", "--config", path)
    assert code == 0, err
    for secret in ("data-secret", "worker-secret", "redis-secret", "admin-secret"):
        assert secret not in out
    shown = yaml.safe_load(out)
    assert shown["server"]["port"] == 9100 and shown["server"]["api_keys"] == ["***"]
    assert shown["server"]["admin_key"] == "***"  # from the environment, as mesh serve takes it
    assert shown["workers"][0]["api_key"] == "***" and shown["state"]["url"] == "redis://user:***@h:6379/0"
    assert shown["health"]["interval_s"] == 2.0 and shown["policy"] == "session_sticky"  # defaults filled in
    assert parse_config(shown) is not None  # what it prints is a config again
    monkeypatch.delenv("MESH_ADMIN_KEY")
    code, out, _ = run(capsys, "config", "show")
    assert code == 0 and yaml.safe_load(out) == MeshConfig().model_dump(mode="json")


def test_the_reference_page_is_generated_from_the_models(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "config", "reference")
    assert code == 0
    checked_in = (REPO / "docs" / "config.md").read_text()
    assert out == checked_in, "docs/config.md is stale: python -m mesh.commands.config reference > docs/config.md"
    rows = {line.split("|")[1].strip().strip("`"): line for line in out.splitlines() if line.startswith("| `")}
    for path in _paths(MeshConfig, ""):
        assert path in rows, f"{path} missing from the reference"
        assert rows[path].rstrip().rsplit("|", 2)[-2].strip(), f"{path} has no description"
    assert "| `server.request_timeout_s` | float (> 0) | `3600.0` |" in out


def _paths(model: type, prefix: str) -> list[str]:
    out = []
    for name, field in model.model_fields.items():  # type: ignore[attr-defined]
        sub = model_in(field.annotation)
        path = f"{prefix}{name}"
        if sub is None or model is not MeshConfig:
            out.append(path)
        if sub is not None and sub is not model:
            is_list = "list[" in str(field.annotation)
            out += _paths(sub, f"{path}[]." if is_list else f"{path}.")
    return out
