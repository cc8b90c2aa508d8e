"""Hung workers hold no request past the upstream timeouts.

- A worker SIGSTOPped under load: requests that had no byte from it are retried on the other
  worker within the first-byte timeout (streams) or as soon as its health check fails (buffered
  answers); streams it was in the middle of end with an error event and ``[DONE]`` after the idle
  timeout. No request waits for the stop to end.
- A worker that sends ``200`` heads and then nothing while answering ``/health``: every request
  is retried on the good worker within the timeouts, and its circuit opens.
- A stream that stalls after two events ends with the error event and ``[DONE]``.
- A SIGSTOPped decode worker of the disaggregated relay: its legs are retried on the other one.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx

from tests.e2e.reliability.gateway_helpers import Outcome, request, sse_data, start_gateway, worker_view
from tests.fakes.misbehaving_worker import misbehaving
from tests.procs import ProcessGroup, wait_until
from tests.support.pd_gateway import PD_POLICY

FIRST_BYTE_S = 1.0
IDLE_S = 1.0
STOP_S = 12.0  # the stop outlasts every bound by far: a request held until SIGCONT shows it
SLACK_S = 4.0  # a loaded 2-core box: retries, back-off and scheduling on top of the bound
PROMPT = "one two three four five six seven eight"  # 8 tokens of 0.05 s: streams in flight at the stop
SERVER = {"first_byte_timeout_s": FIRST_BYTE_S, "idle_timeout_s": IDLE_S, "request_timeout_s": 120}
LONG_PROMPT = " ".join(["word"] * 100)  # 100 tokens of 0.05 s: still streaming well after the stop


def stream_on(url: str, worker: str, started: threading.Event, out: list[Outcome]) -> None:
    """One long stream served by ``worker`` (round robin: the next request goes to the other
    worker, so ask again until it lands there); ``started`` at its first byte."""
    body = {"model": "m", "prompt": LONG_PROMPT, "max_tokens": 100, "stream": True}
    with httpx.Client(base_url=url, timeout=60) as client:
        for _ in range(20):
            start = time.monotonic()
            with client.stream("POST", "/v1/completions", json=body) as resp:
                if resp.headers.get("x-mesh-worker") != worker:
                    continue
                started.set()
                raw = resp.read()
            out.append(Outcome(True, resp.status_code, worker, time.monotonic() - start, sse_data(raw), raw))
            return


def test_a_sigstopped_worker_under_load_holds_no_request_past_the_first_byte_timeout(procs: ProcessGroup) -> None:
    a = procs.echo_worker("a", "--model", "m", "--token-delay-s", "0.05")
    b = procs.echo_worker("b", "--model", "m", "--token-delay-s", "0.05")
    gateway = start_gateway(
        procs, [{"name": "a", "url": a.url, "models": ["m"]}, {"name": "b", "url": b.url, "models": ["m"]}],
        server=SERVER, policy="round_robin",
        health={"interval_s": 0.3, "timeout_s": 0.3, "unhealthy_threshold": 1},
        circuit_breaker={"failure_threshold": 100},  # health alone takes it out: the timeouts are under test
    )
    outcomes: list[tuple[float, Outcome]] = []
    stop = threading.Event()

    def load(i: int) -> None:
        time.sleep(i * 0.05)  # staggered over a request's 0.4 s: some are in flight at any moment
        with httpx.Client(base_url=gateway.url, timeout=60) as client:
            n = 0
            while not stop.is_set():
                n += 1
                began = time.monotonic()
                outcomes.append((began, request(client, stream=(i + n) % 2 == 0, prompt=PROMPT, max_tokens=8)))

    pinned: list[Outcome] = []  # a stream certainly in flight on a at the stop
    on_a = threading.Event()
    threads = [threading.Thread(target=load, args=(i,)) for i in range(8)]
    threads.append(threading.Thread(target=stream_on, args=(gateway.url, "a", on_a, pinned)))
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)  # both workers busy
        assert on_a.wait(20), "no stream landed on a"
        os.kill(a.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        time.sleep(5.0)  # well past every bound, well before the stop ends
        assert worker_view(gateway, "a")["healthy"] is False  # its health check found it out
        stop.set()
        for t in threads:
            t.join(STOP_S)
        assert not any(t.is_alive() for t in threads), "a request was held until the stopped worker resumed"
    finally:
        os.kill(a.pid, signal.SIGCONT)
        stop.set()
    during = [o for began, o in outcomes if began >= stopped_at - 1.0]  # in flight at the stop, or sent after
    assert len(during) >= 16, len(during)
    for o in during:
        assert o.whole or o.cut_cleanly, o
        assert o.seconds < FIRST_BYTE_S + 1.0 + SLACK_S, o  # the echo answer takes ~0.3 s; the rest is the bound
    (cut,) = pinned
    assert cut.cut_cleanly, cut  # an error event and [DONE] at the idle timeout (held: the join above fails)
    assert sum(o.whole and o.worker == "b" for o in during) >= 8, "the other worker served the requests"
    print(f"{len(during)} requests around the stop, longest {max(o.seconds for o in during):.2f} s, "
          f"{sum(o.cut_cleanly for o in during)} streams cut")


def test_a_worker_that_sends_a_head_and_then_nothing_is_retried_and_its_circuit_opens(procs: ProcessGroup) -> None:
    mute = misbehaving(procs, "mute", "mute")
    good = misbehaving(procs, "good", "good")
    gateway = start_gateway(
        procs, [{"name": "mute", "url": mute.url, "models": ["m"]}, {"name": "good", "url": good.url, "models": ["m"]}],
        server=SERVER, policy="round_robin", health={"interval_s": 3600},  # it answers /health: passive health acts
        circuit_breaker={"failure_threshold": 3, "open_s": 3600},
    )
    with httpx.Client(base_url=gateway.url, timeout=60) as client:
        outcomes = [request(client, stream=i % 2 == 0) for i in range(8)]
    for o in outcomes:
        assert o.whole and o.worker == "good", o
        assert o.seconds < max(FIRST_BYTE_S, IDLE_S) + SLACK_S, o
    view = worker_view(gateway, "mute")
    assert view["healthy"] is True and view["circuit"] == "open", view


def test_a_stream_that_stalls_midway_ends_with_an_error_event_and_done(procs: ProcessGroup) -> None:
    stall = misbehaving(procs, "stall", "stall")
    gateway = start_gateway(procs, [{"name": "stall", "url": stall.url, "models": ["m"]}], server=SERVER,
                            health={"interval_s": 3600}, circuit_breaker={"failure_threshold": 1, "open_s": 3600})
    with httpx.Client(base_url=gateway.url, timeout=60) as client:
        o = request(client, stream=True)
    assert o.cut_cleanly and o.worker == "stall", o
    assert [e for e in o.events if "t0" in e or "t1" in e] == o.events[:2], o.events  # its two events went out first
    error = json.loads(o.events[-2])["error"]
    assert "stall" in error["message"] and "silent" in error["message"], error
    assert IDLE_S * 0.9 < o.seconds < IDLE_S + SLACK_S, o
    wait_until(lambda: worker_view(gateway, "stall")["circuit"] == "open", 5, "the stalled worker's circuit open")


def test_a_sigstopped_decode_worker_holds_no_relayed_request(procs: ProcessGroup) -> None:
    # A buffered decode answer's head comes once it is generated: no read timeout may cut it, so
    # the stopped worker's legs end when its health check fails, retried on the other decode worker.
    p0 = procs.echo_worker("p0", "--model", "m")
    d1 = procs.echo_worker("d1", "--model", "m", "--token-delay-s", "0.05")
    d2 = procs.echo_worker("d2", "--model", "m", "--token-delay-s", "0.05")
    gateway = start_gateway(
        procs, [{"name": "p0", "url": p0.url, "models": ["m"], "role": "prefill"},
                {"name": "d1", "url": d1.url, "models": ["m"], "role": "decode"},
                {"name": "d2", "url": d2.url, "models": ["m"], "role": "decode"}],
        server=SERVER, policy=PD_POLICY,
        health={"interval_s": 0.3, "timeout_s": 0.3, "unhealthy_threshold": 1},
        circuit_breaker={"failure_threshold": 100},
    )
    outcomes: list[tuple[float, Outcome]] = []
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(base_url=gateway.url, timeout=60) as client:
            while not stop.is_set():
                began = time.monotonic()
                outcomes.append((began, request(client, stream=False, prompt=PROMPT, max_tokens=8)))

    threads = [threading.Thread(target=load) for _ in range(6)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        os.kill(d1.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        time.sleep(4.0)
        assert worker_view(gateway, "d1")["healthy"] is False
        stop.set()
        for t in threads:
            t.join(STOP_S)
        assert not any(t.is_alive() for t in threads), "a relayed request was held until the decode worker resumed"
    finally:
        os.kill(d1.pid, signal.SIGCONT)
        stop.set()
    during = [o for began, o in outcomes if began >= stopped_at - 1.0]
    assert len(during) >= 8, len(during)
    for o in during:
        assert o.whole, o
        assert o.seconds < 1.0 + SLACK_S, o
    assert sum(o.worker == "d2" for o in during) >= 8
