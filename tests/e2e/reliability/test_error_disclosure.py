"""Data-plane errors name the worker, never its address or a server file path (those stay in
the gateway's log and ``/workers``)."""

from __future__ import annotations

import re

import httpx

from tests.e2e.reliability.gateway_helpers import start_gateway, worker_view
from tests.procs import ProcessGroup, kill_process

ADDRESS = re.compile(r"\d+\.\d+\.\d+\.\d+|localhost|:\d{2,5}\b")


def test_an_attempt_on_a_dead_worker_names_it_but_not_its_address(procs: ProcessGroup) -> None:
    worker = procs.echo_worker("w1", "--model", "m")
    gateway = start_gateway(procs, [{"name": "w1", "url": worker.url, "models": ["m"]}],
                            health={"interval_s": 3600})  # still healthy when the request comes
    kill_process(worker)
    for stream in (False, True):
        resp = httpx.post(f"{gateway.url}/v1/completions", timeout=30,
                          json={"model": "m", "prompt": "hi", "max_tokens": 2, "stream": stream})
        assert resp.status_code == 502, resp.text
        message = resp.json()["error"]["message"]
        assert "w1" in message and not ADDRESS.search(message), message
    assert str(worker.port) in worker_view(gateway, "w1")["last_error"]  # the detail is in /workers


def test_a_tokenizer_that_cannot_be_loaded_is_not_named_to_clients(procs: ProcessGroup) -> None:
    worker = procs.echo_worker("w1", "--model", "m")
    gateway = start_gateway(procs, [{"name": "w1", "url": worker.url, "models": ["m"], "tokenizer": "/etc/passwd"}])
    resp = httpx.post(f"{gateway.url}/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2}, timeout=30)
    assert resp.status_code == 503, resp.text
    error = resp.json()["error"]
    assert error["code"] == "tokenizer_unavailable" and "/etc" not in error["message"] and "passwd" not in error["message"], error
    assert "/etc/passwd" in gateway.log_tail(20000)  # the operator still learns which file
