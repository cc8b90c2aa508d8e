"""``mesh serve`` from flags and environment (real processes): workers and policy without a config
file, API and admin keys from flags, environment variables and key files (401 without, 200 with),
flags over the YAML and kept across a reload, and the loud warning for a gateway that can never get
a worker."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import httpx

from tests.procs import PYTHON, ProcessGroup, free_port, wait_until

BODY = {"model": "echo", "prompt": "hello mesh", "max_tokens": 4}


def serve(procs: ProcessGroup, *args: str, env: dict[str, str] | None = None) -> str:
    port = free_port()
    procs.start_http([PYTHON, "-m", "mesh", "serve", "--port", str(port), "--log-level", "warning", *args],
                     name=f"serve-{port}", port=port, env=env)
    return f"http://127.0.0.1:{port}"


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_worker_urls_and_policy_serve_completions_without_a_config_file(procs: ProcessGroup) -> None:
    a, b = procs.echo_worker("a"), procs.echo_worker("b")
    url = serve(procs, "--worker-urls", a.url, b.url, "--policy", "kv_aware")
    def candidates() -> set[str]:
        route = httpx.post(f"{url}/debug/route", json=BODY, timeout=30).json()
        assert route["policy"]["name"] == "kv_aware"
        return set(route["decision"]["candidates"])

    wait_until(lambda: candidates() == {"worker-0", "worker-1"}, 30, "both flag workers candidates")
    for _ in range(4):
        resp = httpx.post(f"{url}/v1/completions", json=BODY, timeout=30)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"]


def test_keys_from_environment_and_files(procs: ProcessGroup, tmp_path: Path) -> None:
    worker = procs.echo_worker("w")
    admin_file = tmp_path / "admin.key"
    admin_file.write_text("# the admin key\nadmin-from-file\n")
    url = serve(procs, "--worker-urls", worker.url,
                env={"MESH_API_KEYS": "env-one, env-two", "MESH_ADMIN_KEY_FILE": str(admin_file)})
    assert httpx.post(f"{url}/v1/completions", json=BODY, timeout=30).status_code == 401
    assert httpx.post(f"{url}/v1/completions", json=BODY, headers=auth("wrong"), timeout=30).status_code == 401
    assert httpx.post(f"{url}/v1/completions", json=BODY, headers=auth("env-two"), timeout=30).status_code == 200
    assert httpx.get(f"{url}/workers", timeout=10).status_code == 401
    workers = httpx.get(f"{url}/workers", headers=auth("admin-from-file"), timeout=10)
    assert workers.status_code == 200, workers.text


def test_flags_override_the_yaml_and_survive_a_reload(procs: ProcessGroup, tmp_path: Path) -> None:
    worker = procs.echo_worker("w")
    keys = tmp_path / "keys.txt"
    keys.write_text("file-key-1\n\nfile-key-2\n")
    config = tmp_path / "mesh.yaml"
    config.write_text("server: {api_keys: [yaml-key], admin_key: yaml-admin}\n"
                      "workers:\n  - {name: yaml-worker, url: 'http://127.0.0.1:1'}\n")
    url = serve(procs, "--config", str(config), "--worker-urls", worker.url, "--api-key", "flag-key",
                "--api-key-file", str(keys), "--admin-key", "flag-admin",
                env={"MESH_API_KEYS": "env-key"})  # a flag wins over the environment too
    for key, status in (("yaml-key", 401), ("env-key", 401), ("flag-key", 200), ("file-key-2", 200)):
        resp = httpx.post(f"{url}/v1/completions", json=BODY, headers=auth(key), timeout=30)
        assert resp.status_code == status, (key, resp.text)
    assert httpx.get(f"{url}/workers", headers=auth("yaml-admin"), timeout=10).status_code == 401
    keys.write_text("rotated-key\n")  # a key file is read again at a reload
    reload = httpx.post(f"{url}/admin/reload", headers=auth("flag-admin"), timeout=30)
    assert reload.status_code == 200, reload.text
    assert reload.json()["workers"] == ["worker-0"]  # the flag's worker, not the file's
    for key, status in (("flag-key", 200), ("rotated-key", 200), ("file-key-1", 401), ("yaml-key", 401)):
        resp = httpx.post(f"{url}/v1/completions", json=BODY, headers=auth(key), timeout=30)
        assert resp.status_code == status, (key, resp.text)


def test_a_gateway_that_can_never_get_a_worker_warns_how_to_fix_it(tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESH_")}
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([PYTHON, "-m", "mesh", "serve", "--port", str(port)], stdout=out,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while "Uvicorn running" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        text = log.read_text()
    finally:
        proc.terminate()
        proc.wait(20)
    assert "WARNING" in text and "0 workers and no admin key: this gateway can never get a worker" in text, text
    assert "--worker-urls" in text and "--admin-key" in text


def test_a_reload_that_moves_the_listener_is_refused_unless_a_flag_pins_it(procs: ProcessGroup, tmp_path: Path) -> None:
    worker = procs.echo_worker("w")
    port, other = free_port(), free_port()
    config = tmp_path / "mesh.yaml"
    text = "server: {{port: {port}, admin_key: adm}}\nworkers:\n  - {{name: w, url: '{url}'}}\n"
    config.write_text(text.format(port=port, url=worker.url))
    procs.start_http([PYTHON, "-m", "mesh", "serve", "--config", str(config)], name="serve", port=port)
    config.write_text(text.format(port=other, url=worker.url))
    resp = httpx.post(f"http://127.0.0.1:{port}/admin/reload", headers=auth("adm"), timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "restart_required", resp.text
    assert "server.port" in resp.json()["error"]["message"]
    pinned = serve(procs, "--config", str(config))  # --port given: the file's port is not the listener's
    assert httpx.post(f"{pinned}/admin/reload", headers=auth("adm"), timeout=30).status_code == 200
