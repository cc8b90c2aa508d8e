"""The disaggregated relay (``mesh.gateway.disagg_relay``, ``mesh.gateway.disagg_proxy``) under the gateway's own
shutdown and its other failure paths, over real processes: a ``mesh serve`` gateway with echo
workers in prefill/decode roles (an echo prefill answers without ``kv_transfer_params``: the
relay's fallback, whose leases and failure paths are the disaggregated ones).

Charging is read from the gateway's log with ``circuit_breaker: {failure_threshold: 1}``: any
failure recorded against a worker opens its circuit and logs "circuit opened for worker X".
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fakes.http_worker import start_fake
from tests.procs import Proc, ProcessGroup, wait_until
from tests.support.pd_gateway import error_of, kill_now, pd_gateway, served
from tests.support.shutdown import LONG, PlainRequest, StreamReader, refused

SHUTDOWN = "gateway is shutting down"


def set_faults(worker: Proc, **faults: Any) -> None:
    httpx.post(worker.url + "/admin/faults", json=faults, timeout=10).raise_for_status()


def test_a_relay_cut_by_the_shutdown_timeout_blames_the_gateway_not_its_workers(
        procs: ProcessGroup, tmp_path: Path) -> None:
    """At the shutdown timeout the gateway ends the relay's streams (and its requests waiting on a
    worker) itself, as the ordinary proxy's: each client gets the shutdown error (an error event and
    [DONE], or a 503), its connection is not cut by uvicorn, and no worker is charged."""
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



# A worker misbehaving on purpose (raw sockets: the echo worker cannot): argv name, mode, port.
# Every mode answers a non-streamed request (a prefill) with a completion; a streamed one:
#   break-sse / break-json: its first bytes (an event; part of a JSON body), then the connection
#   closes mid-body, the worker still alive; vllm-400: vLLM's flat error; html-503: an HTML page.
FAKE_WORKER = r'''
async def on_request(method, path, body, reader, writer):
    if method == "GET":
        out = {"object": "list", "data": [{"id": "echo", "object": "model"}]} if path == "/v1/models" else {}
        writer.write(answer(b"200 OK", b"application/json", json.dumps(out).encode()))
    elif mode == "vllm-400":
        out = {"object": "error", "message": "This model's maximum context length is 16 tokens",
               "type": "BadRequestError", "param": None, "code": 400}
        writer.write(answer(b"400 Bad Request", b"application/json", json.dumps(out).encode()))
    elif mode == "html-503":
        writer.write(answer(b"503 Service Unavailable", b"text/html", b"<html><body>upstream overloaded</body></html>"))
    elif not body.get("stream"):
        out = {"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": "a"}]}
        writer.write(answer(b"200 OK", b"application/json", json.dumps(out).encode()))
    else:
        sse = mode == "break-sse"
        part = b'data: {"id": "x", "choices": [{"index": 0, "text": "a"}]}\n\n' if sse else b'{"id": "x", "choices": ['
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ntransfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n"
                     % (b"text/event-stream" if sse else b"application/json", len(part), part))
        await writer.drain()
        await asyncio.sleep(0.1)
        return False  # mid-body: the connection closes, the worker lives on


serve(on_request)
'''


def fake_worker(procs: ProcessGroup, name: str, mode: str) -> Proc:
    return start_fake(procs, "fake_pd_worker", FAKE_WORKER, name, mode, "/health")


@pytest.mark.parametrize("mode", ["break-sse", "break-json"])
def test_a_decode_worker_that_breaks_every_stream_opens_its_circuit(procs: ProcessGroup, tmp_path: Path,
                                                                    mode: str) -> None:
    """The relay counts a decode stream as its worker's success once it ended whole, as the proxy
    does, not at its first bytes (which would reset the failures the breaks counted), so a worker
    breaking every stream reaches the threshold. A streamed answer that is not an event stream is
    charged too when it breaks."""
    p0 = procs.echo_worker("p0")
    d0 = fake_worker(procs, "d0", mode)
    gateway, _ = pd_gateway(procs, tmp_path, {"p0": (p0, "prefill"), "d0": (d0, "decode")}, threshold=2)
    for _ in range(2):
        reader = StreamReader(f"{gateway.url}/v1/completions", LONG)
        reader.join()
        assert reader.error is None and reader.status == 200, reader.error
        assert reader.lines[-1] == "data: [DONE]", reader.lines
        errors = [error_of(e)["message"] for e in reader.events() if "error" in e]
        assert errors == ["worker d0 failed mid-stream"], reader.lines
    log = gateway.log_tail(20000)
    assert "circuit opened for worker d0 after 2 failures" in log, log
    assert "worker p0" not in log, log



@pytest.mark.parametrize(("role", "mode", "status"), [("prefill", "vllm-400", 400), ("prefill", "html-503", 503),
                                                      ("decode", "vllm-400", 400)])
def test_a_workers_non_openai_error_reaches_the_client_in_the_openai_shape(
        procs: ProcessGroup, tmp_path: Path, role: str, mode: str, status: int) -> None:
    """The relay rewraps a worker's non-OpenAI error body in the OpenAI shape, as the ordinary
    proxy does: vLLM's flat ``{"object": "error"}``, an HTML page under ``content-type:
    application/json``."""
    fake = fake_worker(procs, "fake", mode)
    other = procs.echo_worker("echo")
    workers = {"fake": (fake, role), "echo": (other, "decode" if role == "prefill" else "prefill")}
    gateway, _ = pd_gateway(procs, tmp_path, workers, threshold=3)  # a 503 is charged: both requests reach it
    for stream in (False, True):
        resp = httpx.post(f"{gateway.url}/v1/completions", json={**LONG, "max_tokens": 4, "stream": stream}, timeout=30)
        assert resp.status_code == status, resp.text
        assert resp.headers["content-type"] == "application/json"
        err = error_of(resp.json())
        detail = "maximum context length" if mode == "vllm-400" else "upstream overloaded"
        assert f"{role} worker fake answered {status}" in err["message"] and detail in err["message"], err


def test_a_relay_cut_at_the_request_timeout_counts_as_a_stream_error(procs: ProcessGroup, tmp_path: Path) -> None:
    """``mesh_stream_errors_total`` counts streams ended with an error event after the first byte:
    the relay's request-timeout event is counted, as the proxy counts its own."""
    p0 = procs.echo_worker("p0")
    d0 = procs.echo_worker("d0", "--token-delay-s", "0.2", "--repeat", "200")
    gateway, _ = pd_gateway(procs, tmp_path, {"p0": (p0, "prefill"), "d0": (d0, "decode")},
                            server={"request_timeout_s": 1.0})
    reader = StreamReader(f"{gateway.url}/v1/completions", LONG)
    reader.join()
    assert reader.error is None and reader.lines[-1] == "data: [DONE]", reader.lines[-3:]
    assert any(e.get("choices") for e in reader.events())  # it was mid-answer
    errors = [error_of(e)["message"] for e in reader.events() if "error" in e]
    assert errors == ["request timed out after 1 s"], errors
    metrics = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    assert "\nmesh_stream_errors_total 1.0\n" in metrics, [l for l in metrics.splitlines() if "stream_errors" in l]
    kill_now(d0)
