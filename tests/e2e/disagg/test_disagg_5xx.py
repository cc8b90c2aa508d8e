"""The disaggregated relay charges a worker's 5xx answers as the ordinary proxy does (one rule,
``mesh.gateway.proxy.status_verdict``), for prefill and decode workers alike, over real processes: a
``mesh serve`` gateway with echo workers (an echo prefill answers without ``kv_transfer_params``:
the relay's fallback) and raw-socket fake workers answering one status to every request.

- 502/503/504: a failure of the worker's at once, and the request is retried elsewhere (a prefill
  worker answering 503 to everything has its circuit opened and stops getting traffic);
- 500: retried, and charged only once another worker of that role serves the request; a 500 from
  every worker charges none, and the client gets the last one in the OpenAI shape, naming it;
- a relay cut by the gateway's shutdown answers its 503 without waiting on its transfer's
  release at a hung prefill worker (the release goes on in the background, ended at the gateway's
  exit); ``RelayResponse.body()`` says "shutting down" for a stream the shutdown cut.

Charging is read from the gateway's log ("circuit opened for worker X") and ``/workers``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import httpx
import pytest

from mesh.core.router import Router
from mesh.gateway.disagg_relay import Releases, relay_disaggregated
from policies import create_policy
from policies.base import Decision, RequestInfo, Role, TargetState
from tests.fakes.http_worker import start_fake
from tests.procs import Proc, ProcessGroup, wait_until
from tests.support.pd_gateway import PD_POLICY, circuits, error_of, fake_state, kill_now, pd_gateway, served
from tests.support.shutdown import PlainRequest, refused

BODY = {"model": "echo", "prompt": "a b c d", "max_tokens": 4}

# A worker answering one status to every POST (argv: name, mode, port). Modes: "status:NNN"
# answers NNN with a plain-text body naming the worker (not the OpenAI shape: the gateway
# rewraps it); "hang-release" answers a prefill with kv_transfer_params naming a transfer and
# never answers POST /kv_transfer/release (it keeps the connection open). GET /state: how many
# POSTs it got, and its release requests seen and still open.
FAKE_WORKER = r'''
state = {"posts": 0, "releases": 0, "open": 0}


async def on_request(method, path, body, reader, writer):
    if method == "GET":
        out = state if path == "/state" else {"object": "list", "data": [{"id": "echo", "object": "model"}]}
        writer.write(answer(b"200 OK", b"application/json", json.dumps(out).encode()))
    elif path == "/kv_transfer/release":
        state["releases"] += 1
        state["open"] += 1
        try:
            await reader.read()  # never answered: until the gateway closes the connection
        finally:
            state["open"] -= 1
        return False
    elif mode.startswith("status:"):
        state["posts"] += 1
        code = mode.split(":")[1].encode()
        writer.write(answer(code + b" Failing", b"text/plain", b"boom from " + name.encode()))
    else:  # hang-release: a prefill answer naming a transfer of this worker's
        state["posts"] += 1
        out = {"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": "a"}],
               "kv_transfer_params": {"transfer_id": "t-%d" % state["posts"], "remote_host": "127.0.0.1",
                                      "remote_port": port, "do_remote_prefill": True}}
        writer.write(answer(b"200 OK", b"application/json", json.dumps(out).encode()))


serve(on_request)
'''


def fake_worker(procs: ProcessGroup, name: str, mode: str) -> Proc:
    return start_fake(procs, "fake_5xx_worker", FAKE_WORKER, name, mode, "/state")


def pair_workers(procs: ProcessGroup, role: str, bad: dict[str, str]) -> dict[str, tuple[Proc, str]]:
    """``bad`` (name -> fake mode) and one echo worker in ``role``, one echo worker in the other."""
    other = "decode" if role == "prefill" else "prefill"
    workers = {n: (fake_worker(procs, n, mode), role) for n, mode in bad.items()}
    if len(bad) == 1:
        workers["good"] = (procs.echo_worker("good"), role)
    workers["other"] = (procs.echo_worker("other"), other)
    return workers


def serving_header(role: str) -> str:
    return "x-mesh-prefill-worker" if role == "prefill" else "x-mesh-worker"


def post(gateway: Proc, stream: bool) -> httpx.Response:
    return httpx.post(f"{gateway.url}/v1/completions", json={**BODY, "stream": stream}, timeout=30)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_worker_answering_503_to_everything_has_its_circuit_opened(procs: ProcessGroup, tmp_path: Path,
                                                                      role: str) -> None:
    """The relay charges a worker for a 503: one answering 503 to every request reaches its
    failure threshold and stops getting (and failing) a share of the requests."""
    workers = pair_workers(procs, role, {"bad": "status:503"})
    gateway, _ = pd_gateway(procs, tmp_path, workers, threshold=2)
    bad = workers["bad"][0]
    for i in range(30):  # the load scorer spreads them: some meet "bad" first, then retry on "good"
        resp = post(gateway, stream=bool(i % 2))
        assert resp.status_code == 200 and resp.headers[serving_header(role)] == "good", resp.text
        if circuits(gateway)["bad"] == "open":
            break
    assert circuits(gateway) == {"bad": "open", "good": "closed", "other": "closed"}
    assert fake_state(bad)["posts"] == 2  # the threshold's two; then no more traffic
    for i in range(4):
        assert post(gateway, stream=bool(i % 2)).headers[serving_header(role)] == "good"
    assert fake_state(bad)["posts"] == 2
    log = gateway.log_tail(20000)
    assert f"circuit opened for worker bad after 2 failures: {role} worker bad answered 503" in log, log


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_500_is_charged_once_another_worker_serves_the_request(procs: ProcessGroup, tmp_path: Path,
                                                                 role: str) -> None:
    """A 500 may be the request's fault, so it is charged only when another worker of the same
    role then serves the request (the proxy's rule, which the relay follows)."""
    workers = pair_workers(procs, role, {"bad": "status:500"})
    gateway, _ = pd_gateway(procs, tmp_path, workers)  # threshold 1: one charge opens the circuit
    for i in range(30):
        resp = post(gateway, stream=bool(i % 2))
        assert resp.status_code == 200 and resp.headers[serving_header(role)] == "good", resp.text
        if fake_state(workers["bad"][0])["posts"]:
            break
    assert circuits(gateway) == {"bad": "open", "good": "closed", "other": "closed"}
    log = gateway.log_tail(20000)
    assert f"circuit opened for worker bad after 1 failures: {role} worker bad answered 500" in log, log


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_500_from_every_worker_charges_none_and_reaches_the_client(procs: ProcessGroup, tmp_path: Path,
                                                                     role: str) -> None:
    """A request every worker answers 500 to is the request's problem: no circuit opens (with a
    threshold of 1), and the client gets the last 500 in the OpenAI shape, naming its worker, as
    the proxy answers it."""
    workers = pair_workers(procs, role, {"bad0": "status:500", "bad1": "status:500"})
    gateway, _ = pd_gateway(procs, tmp_path, workers)
    for stream in (False, True, False):
        resp = post(gateway, stream)
        assert resp.status_code == 500, resp.text
        assert resp.headers["content-type"] == "application/json"
        worker = resp.headers[serving_header(role)]
        err = error_of(resp.json())
        assert f"{role} worker {worker} answered 500: boom from {worker}" in err["message"], err
        assert err["code"] == "upstream_error" and err["type"] == "server_error", err
    assert all(fake_state(workers[n][0])["posts"] == 3 for n in ("bad0", "bad1"))  # each request met both
    assert set(circuits(gateway).values()) == {"closed"}
    log = gateway.log_tail(20000)
    assert "circuit opened" not in log and "Traceback" not in log, log


def test_a_hung_prefill_release_does_not_hold_the_shutdown_answer(procs: ProcessGroup, tmp_path: Path) -> None:
    """A relay ended by the shutdown timeout answers its client's 503 without awaiting its
    transfer's release at the prefill worker (up to 5 s; a hung prefill worker would hold the 503
    past uvicorn's last resort, which cuts the client off): the release runs in the background,
    owned by the relay and ended at the gateway's exit."""
    p0 = fake_worker(procs, "p0", "hang-release")
    d0 = procs.echo_worker("d0", "--first-token-delay-s", "30")
    gateway, port = pd_gateway(procs, tmp_path, {"p0": (p0, "prefill"), "d0": (d0, "decode")},
                               "--shutdown-timeout", "1")
    plain = PlainRequest(f"{gateway.url}/v1/completions", BODY)  # decoding on d0 at the timeout
    wait_until(lambda: served(d0) == 1, what="the decode running on d0")
    os.kill(gateway.pid, signal.SIGTERM)
    wait_until(lambda: refused(port), what="new connections refused")
    plain.join()
    assert plain.error is None, f"the request was cut off: {plain.error!r}"
    err = error_of(plain.body)
    assert plain.status == 503 and err["code"] == "shutting_down", plain.body
    # the release went out, and was still unanswered when the client had its answer
    wait_until(lambda: fake_state(p0)["releases"] == 1, what="the transfer's release sent to p0")
    assert fake_state(p0)["open"] == 1
    assert gateway.popen.wait(30) == 0, gateway.log_tail()
    log = gateway.log_tail(20000)
    assert "Task was destroyed" not in log and "Traceback" not in log, log
    assert "circuit opened" not in log, log
    wait_until(lambda: fake_state(p0)["open"] == 0, what="the release's connection closed")
    kill_now(d0)


async def test_releases_close_cancels_a_hung_release_and_drops_later_ones() -> None:
    """``Releases.close``: the releases in flight get the grace, then are cancelled; nothing is
    started after it (no task outlives the owner)."""
    accepted: list[asyncio.StreamReader] = []
    closed = asyncio.Event()

    async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(reader)
        await reader.read()  # never answers; returns when the peer closes
        closed.set()
        writer.close()

    server = await asyncio.start_server(hang, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/kv_transfer/release"
    async with server:
        releases = Releases()
        releases.start(url, "t-1")
        while not accepted:
            await asyncio.sleep(0.01)
        await releases.close(grace_s=0.1)
        assert releases.tasks == set()
        await asyncio.wait_for(closed.wait(), 10)  # the cancelled release closed its connection
        releases.start(url, "t-2")
        assert releases.tasks == set() and releases.dropped == 1 and len(accepted) == 1


async def test_a_stream_cut_by_closing_the_relay_client_ends_with_the_shutdown_error(procs: ProcessGroup) -> None:
    """``RelayResponse.body()`` (bench/disagg.py reads it) says "shutting down" for a stream broken
    by its caller closing the relay's client (the gateway's shutdown), not that the decode worker
    failed."""
    p0 = procs.echo_worker("p0")
    d0 = procs.echo_worker("d0", "--token-delay-s", "0.05", "--repeat", "200")
    policy = create_policy(PD_POLICY)
    targets = {n: TargetState(id=n, worker=n, url=w.url, role=Role.PREFILL if n == "p0" else Role.DECODE,
                              models=frozenset({"echo"})) for n, w in (("p0", p0), ("d0", d0))}
    router = Router(policy, targets)
    info = RequestInfo(model="echo", block_keys=[1], block_size=16, prompt_tokens=8, max_tokens=800)
    client = httpx.AsyncClient()
    resp = await relay_disaggregated(client, router, info, {**BODY, "max_tokens": 800, "stream": True},
                                     Decision("p0", "t", decode_target="d0"))
    chunks: list[bytes] = []
    try:
        async for chunk in resp.body():
            chunks.append(chunk)
            if len(chunks) == 2:
                await client.aclose()
    finally:
        await resp.aclose()
    events = [json.loads(line[6:]) for line in b"".join(chunks).decode().splitlines()
              if line.startswith("data: {")]
    assert any(e.get("choices") for e in events)  # it was mid-answer
    errors = [error_of(e) for e in events if "error" in e]
    assert len(errors) == 1 and errors[0]["code"] == "shutting_down" and "d0" not in errors[0]["message"], errors
    assert b"".join(chunks).endswith(b"data: [DONE]\n\n")
    assert (targets["d0"].in_flight, targets["p0"].in_flight) == (0, 0)
    kill_now(d0)

