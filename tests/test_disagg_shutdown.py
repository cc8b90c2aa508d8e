"""The disaggregated relay (``mesh.disagg``, ``mesh.disagg_gateway``) under the gateway's own
shutdown and its other failure paths, over real processes: a ``mesh serve`` gateway with echo
workers in prefill/decode roles (an echo prefill answers without ``kv_transfer_params``: the
relay's fallback, whose leases and failure paths are the disaggregated ones).

Charging is read from the gateway's log with ``circuit_breaker: {failure_threshold: 1}``: any
failure recorded against a worker opens its circuit and logs "circuit opened for worker X".
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.procs import PYTHON, Proc, ProcessGroup, free_port, wait_until
from tests.test_load_accounting import PD_POLICY
from tests.test_shutdown_signals import LONG, StreamReader, refused

SHUTDOWN = "gateway is shutting down"


class PlainRequest:
    """One non-streamed request in a thread: its status and JSON body, or what ended it."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        self.status = 0
        self.body: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self.thread.start()

    def _run(self, url: str, body: dict[str, Any]) -> None:
        try:
            resp = httpx.post(url, json=body, timeout=60)
            self.status, self.body = resp.status_code, resp.json()
        except Exception as exc:  # noqa: BLE001  (what the client saw is the result)
            self.error = exc

    def join(self) -> None:
        self.thread.join(30)
        assert not self.thread.is_alive(), "the request never ended"


def served(worker: Proc) -> int:
    return int(httpx.post(worker.url + "/admin/faults", json={}, timeout=10).json()["served"])


def set_faults(worker: Proc, **faults: Any) -> None:
    httpx.post(worker.url + "/admin/faults", json=faults, timeout=10).raise_for_status()


def pd_gateway(procs: ProcessGroup, tmp_path: Path, workers: dict[str, tuple[Proc, str]], *extra: str,
               server: dict[str, Any] | None = None) -> tuple[Proc, int]:
    """``mesh serve`` over ``workers`` (name -> (process, role)); every failure opens a circuit."""
    port = free_port()
    config = {"server": {"port": port, "admin_key": "adm", **(server or {})}, "health": {"interval_s": 60},
              "circuit_breaker": {"failure_threshold": 1}, "policy": PD_POLICY,
              "workers": [{"name": n, "url": p.url, "role": r} for n, (p, r) in workers.items()]}
    path = tmp_path / "pd.yaml"
    path.write_text(yaml.safe_dump(config))
    cmd = [PYTHON, "-m", "mesh", "serve", "--config", str(path), "--log-level", "warning", *extra]
    return procs.start_http(cmd, name="gateway", port=port, ready_path="/ready"), port


def error_of(body: Any) -> dict[str, Any]:
    """The OpenAI error object of an answer (asserts its shape)."""
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), body
    err = body["error"]
    assert isinstance(err.get("message"), str) and "type" in err and "code" in err, err
    return dict(err)


def test_a_relay_cut_by_the_shutdown_timeout_blames_the_gateway_not_its_workers(
        procs: ProcessGroup, tmp_path: Path) -> None:
    """At the shutdown timeout the relay's streams (and its requests waiting on a worker) were not
    ended by the gateway (only the ordinary proxy's pool was closed): uvicorn cancelled them and
    the client's connection was cut, or, once they broke, each was charged to its worker."""
    p0 = procs.echo_worker("p0")
    d0 = procs.echo_worker("d0", "--token-delay-s", "0.2", "--repeat", "200")
    gateway, port = pd_gateway(procs, tmp_path, {"p0": (p0, "prefill"), "d0": (d0, "decode")}, "--shutdown-timeout", "1")
    url = f"{gateway.url}/v1/completions"
    stream = StreamReader(url, LONG)  # decoding on d0 at the timeout, streamed
    plain = PlainRequest(url, {**LONG, "stream": False})  # decoding on d0 at the timeout, not streamed
    assert stream.started.wait(20)
    wait_until(lambda: served(d0) == 2, what="both decodes running on d0")
    set_faults(p0, first_token_delay_s=30.0)
    prefilling = PlainRequest(url, {**LONG, "stream": False})  # its prefill on p0 at the timeout
    wait_until(lambda: served(p0) == 3, what="the third prefill running on p0")
    os.kill(gateway.pid, signal.SIGTERM)
    wait_until(lambda: refused(port), what="new connections refused")
    assert gateway.popen.wait(30) == 0, gateway.log_tail()

    stream.join()
    assert stream.error is None, f"the stream was cut off: {stream.error!r}"
    assert stream.status == 200 and stream.lines[-1] == "data: [DONE]", stream.lines[-3:]
    events = stream.events()
    assert any(e.get("choices") for e in events)  # it was mid-answer
    errors = [error_of(e)["message"] for e in events if "error" in e]
    assert len(errors) == 1 and SHUTDOWN in errors[0] and "d0" not in errors[0], errors
    for req in (plain, prefilling):
        req.join()
        assert req.error is None, f"the request was cut off: {req.error!r}"
        err = error_of(req.body)
        assert req.status == 503 and err["code"] == "shutting_down" and SHUTDOWN in err["message"], req.body
    log = gateway.log_tail(20000)
    assert "ending 3 request(s) with an error" in log, log
    assert "circuit opened" not in log, log  # neither p0 nor d0 did anything wrong
    assert "Traceback" not in log, log
    kill_now(p0, d0)


def kill_now(*workers: Proc) -> None:
    """Echo workers sleep through a request their client left (a SIGTERM would wait for it)."""
    for w in workers:
        w.popen.kill()
        w.popen.wait(10)
