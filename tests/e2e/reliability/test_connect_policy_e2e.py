"""Every address the gateway connects to passes one connect policy (``mesh.connect_policy``), on
the admin API and on a reload as at startup: a metadata-host worker URL, a KV event endpoint on a
unix socket outside ``server.allowed_ipc_paths`` or on a metadata host in another spelling are
400s in the OpenAI shape, and the gateway never opens a connection to them (a real listening
unix socket sees none). The same socket listed in ``allowed_ipc_paths`` is connected to: the
listener does see a gateway that connects."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.procs import Proc, ProcessGroup, free_port, wait_until

ADMIN = {"authorization": "Bearer adm"}


class UnixListener:
    """A unix socket that counts the connections made to it (each is accepted and closed)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.accepted = 0
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(16)
        self.sock.settimeout(0.1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


@pytest.fixture
def listeners(tmp_path: Path) -> Iterator[tuple[UnixListener, UnixListener]]:
    # short paths: a unix socket path has at most 107 bytes
    base = Path(f"/tmp/mesh-cp-{free_port()}")
    outside, allowed = UnixListener(base / "outside" / "kv.sock"), UnixListener(base / "allowed" / "kv.sock")
    try:
        yield outside, allowed
    finally:
        outside.close()
        allowed.close()
        for p in (outside.path, allowed.path):
            p.unlink(missing_ok=True)
            p.parent.rmdir()
        base.rmdir()


def start_gateway(procs: ProcessGroup, allowed_dir: Path, workers: list[dict[str, object]]) -> tuple[Proc, Path]:
    path = procs.log_dir / "gateway.yaml"
    server = {"admin_key": "adm", "allowed_ipc_paths": [str(allowed_dir)]}
    path.write_text(yaml.safe_dump({"server": server, "workers": workers}))
    return procs.gateway(path, port=free_port()), path


def refused(gateway: Proc, worker: dict[str, object]) -> dict[str, object]:
    resp = httpx.post(f"{gateway.url}/workers", json=worker, headers=ADMIN, timeout=10)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) >= {"message", "type", "code"} and error["type"] == "invalid_request_error", error
    return error  # type: ignore[no-any-return]


def test_the_admin_api_and_a_reload_refuse_addresses_outside_the_policy_and_never_connect(
        procs: ProcessGroup, listeners: tuple[UnixListener, UnixListener]) -> None:
    outside, allowed = listeners
    echo = procs.echo_worker("e0")
    gateway, config = start_gateway(procs, allowed.path.parent, [{"name": "e0", "url": echo.url}])

    meta = refused(gateway, {"name": "meta", "url": "http://169.254.169.254"})
    assert "metadata" in str(meta["message"]) and "allowed_worker_hosts" in str(meta["message"])
    assert "metadata" in str(refused(gateway, {"name": "meta6", "url": "http://[::ffff:a9fe:a9fe]:80"})["message"])
    sock = refused(gateway, {"name": "sock", "url": echo.url, "kv_events": {"endpoint": f"ipc://{outside.path}"}})
    assert "allowed_ipc_paths" in str(sock["message"])
    replay = refused(gateway, {"name": "replay", "url": echo.url, "kv_events": {
        "endpoint": "tcp://127.0.0.1:1", "replay_endpoint": f"ipc://{allowed.path.parent}/../outside/kv.sock"}})
    assert "replay_endpoint" in str(replay["message"])
    assert "metadata" in str(refused(gateway, {"name": "tcp", "url": echo.url,
                                               "kv_events": {"endpoint": "tcp://0xa9fea9fe:5557"}})["message"])

    # A reload naming the outside socket keeps the running config and says why.
    config.write_text(yaml.safe_dump({"server": {"admin_key": "adm", "allowed_ipc_paths": [str(allowed.path.parent)]},
                                      "workers": [{"name": "e0", "url": echo.url,
                                                   "kv_events": {"endpoint": f"ipc://{outside.path}"}}]}))
    resp = httpx.post(f"{gateway.url}/admin/reload", headers=ADMIN, timeout=10)
    assert resp.status_code == 400 and "allowed_ipc_paths" in resp.text, resp.text

    names = [w["name"] for w in httpx.get(f"{gateway.url}/workers", headers=ADMIN, timeout=10).json()["workers"]]
    assert names == ["e0"]
    time.sleep(1.5)  # a subscriber of it would have connected by now (the control below connects at once)
    assert outside.accepted == 0

    # The control: the same kind of endpoint, under the allowed directory, is connected to.
    ok = httpx.post(f"{gateway.url}/workers", headers=ADMIN, timeout=10,
                    json={"name": "ok", "url": echo.url, "kv_events": {"endpoint": f"ipc://{allowed.path}"}})
    assert ok.status_code == 201, ok.text
    wait_until(lambda: allowed.accepted > 0, timeout_s=15, what="the gateway connecting to the allowed socket")
    assert outside.accepted == 0


def test_a_config_with_a_metadata_worker_does_not_start(procs: ProcessGroup, tmp_path: Path) -> None:
    path = tmp_path / "meta.yaml"
    path.write_text(yaml.safe_dump({"workers": [{"name": "m", "url": "http://metadata.google.internal"}]}))
    proc = procs.start([*procs_cmd(path)], name="gateway-meta")
    assert proc.popen.wait(30) != 0
    assert "workers[0]: worker url 'http://metadata.google.internal'" in proc.log_tail() and "metadata service" in proc.log_tail()


def procs_cmd(path: Path) -> list[str]:
    from tests.procs import PYTHON

    return [PYTHON, "-m", "mesh.commands.serve", "--config", str(path), "--port", str(free_port())]
