"""A reload that changes a setting read only at startup (the state backend, the index budget, the
gateway's bound KV event endpoint, the upstream connect timeout) is refused with ``restart_required``, naming the
settings, and applies nothing: accepting it would show the new values as the config while the
Redis client, load sync and index keep the old ones (a changed ``state.url`` silently keeping the
old Redis)."""

from __future__ import annotations

from pathlib import Path

import httpx
import yaml

from tests.procs import ProcessGroup, free_port

ADMIN = {"authorization": "Bearer adm"}


def _write(path: Path, workers: list[dict[str, object]], **extra: object) -> None:
    path.write_text(yaml.safe_dump({"server": {"admin_key": "adm"}, "workers": workers, **extra}))


def test_startup_only_settings_refuse_the_reload_and_keep_the_old_config(procs: ProcessGroup, tmp_path: Path) -> None:
    e0, e1 = procs.echo_worker("e0"), procs.echo_worker("e1")
    config = tmp_path / "mesh.yaml"
    one = [{"name": "e0", "url": e0.url, "models": ["echo"]}]
    two = [*one, {"name": "e1", "url": e1.url, "models": ["echo"]}]
    _write(config, one)
    gateway = procs.gateway(config, port=free_port())
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        def names() -> list[str]:
            return sorted(w["name"] for w in http.get("/workers", headers=ADMIN).json()["workers"])

        _write(config, two, state={"key_prefix": "other:"}, index={"max_keys": 1000},
               kv_events={"bind": f"tcp://*:{free_port()}"})
        resp = http.post("/admin/reload", headers=ADMIN)
        assert resp.status_code == 400
        err = resp.json()["error"]
        assert err["code"] == "restart_required"
        assert "state.key_prefix" in err["message"] and "index.max_keys" in err["message"]
        assert "kv_events.bind" in err["message"]  # the bound socket is made at startup
        assert names() == ["e0"]  # nothing applied, not even the new worker
        _write(config, two)  # the same change without the startup-only settings goes through
        assert http.post("/admin/reload", headers=ADMIN).status_code == 200
        assert names() == ["e0", "e1"]
