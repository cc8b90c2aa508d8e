"""A config path that names a FIFO (or a device) is refused at once, never waited on: opening a
FIFO for reading blocks until a writer comes, and a reload runs on the gateway's event loop, so a
config swapped for a FIFO would hang the whole gateway (``/health`` included) at the next SIGHUP.
Real gateway process, real FIFO."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest
import yaml

from mesh.config import ConfigError, load_config
from tests.procs import ProcessGroup, free_port, wait_until

ADMIN = {"authorization": "Bearer adm"}


def test_a_reload_from_a_fifo_is_refused_and_the_gateway_keeps_answering(procs: ProcessGroup, tmp_path: Path) -> None:
    echo = procs.echo_worker("e0")
    config = tmp_path / "mesh.yaml"
    config.write_text(yaml.safe_dump({"server": {"admin_key": "adm"},
                                      "workers": [{"name": "e0", "url": echo.url, "models": ["echo"]}]}))
    gateway = procs.gateway(config, port=free_port())
    config.unlink()
    os.mkfifo(config)
    with httpx.Client(base_url=gateway.url, timeout=10) as http:
        resp = http.post("/admin/reload", headers=ADMIN)  # answered: the loop never blocks in open()
        assert resp.status_code == 400 and "regular file" in resp.json()["error"]["message"]
        os.kill(gateway.pid, signal.SIGHUP)
        wait_until(lambda: http.get("/health").status_code == 200, what="the gateway answering after SIGHUP")
        body = {"model": "echo", "prompt": "still serving", "max_tokens": 2}
        assert http.post("/v1/completions", json=body).status_code == 200


@pytest.mark.parametrize("path", ["/dev/zero", "/dev/null"])
def test_a_device_is_not_a_config(path: str) -> None:
    with pytest.raises(ConfigError, match="regular file"):
        load_config(path)
