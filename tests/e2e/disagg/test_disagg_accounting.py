"""What the disaggregated relay charges to a worker's passive health beyond status codes, as the
ordinary proxy charges it, over a ``mesh serve`` gateway with raw-socket fake workers (and the
relay's mock cluster for the per-code matrix):

- a transfer failure the decode worker reports is the prefill side's: ``kv_transfer_corrupt`` /
  ``_truncated`` (it sent bad or short bytes) charged at once; ``kv_transfer_failed`` (no
  connection, or it broke: the prefill's transfer server or the network between) once the same
  decode worker then takes another prefill worker's transfer for the request; ``kv_transfer_gone``
  (released before the pull: a deadline, a cancel) never. A prefill answer is its worker's success
  only once its transfer was taken, not at its 200, so a prefill worker whose transfer server is
  dead is charged and stops getting traffic;
- when every transfer fails, the error names the last pair (``x-mesh-worker`` and
  ``x-mesh-prefill-worker``);
- a decode stream that closes before any data, and a non-streamed decode 200 with an empty body,
  are the decode worker's failures, charged and retried elsewhere (the empty 200 never reaches
  the client as a success);
- every prefill worker answering 429: the client gets the worker's own ``retry-after``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from mesh.gateway.disagg_relay import RelayConfig, RelayError, relay_disaggregated
from policies.base import Decision
from tests.fakes.http_worker import start_fake
from tests.procs import Proc, ProcessGroup
from tests.support.pd_gateway import circuits, error_of, fake_state, pd_gateway
from tests.support.relay_mock import BODY as RELAY_BODY
from tests.support.relay_mock import INFO, VLLM_PARAMS, Workers, decode_ok, error_response, relay_router, vllm_prefill

BODY = {"model": "echo", "prompt": "a b c d", "max_tokens": 4}

# A worker (argv: name, mode, port). Modes:
# - "prefill": answers a prefill with kv_transfer_params naming itself ("from") and a transfer of
#   its own; answers POST /kv_transfer/release.
# - "decode:STATUS:CODE:BAD": a request whose kv_transfer_params come "from" BAD ("*": any) is
#   answered STATUS with the OpenAI error CODE (a failed pull); others get a completion.
# - "empty": every POST is answered 200 with an empty body (an event stream for a streamed one).
# - "busy:SECONDS": every POST is answered 429 with retry-after SECONDS.
# - "huge": every POST is answered 200 with a JSON body of 65 MiB (past the gateway's 64 MiB bound).
# GET /state: POSTs and releases seen; any other GET: a model list (health checks).
FAKE_WORKER = r'''
state = {"posts": 0, "releases": 0}
SSE = b'data: {"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": "ok"}]}\n\ndata: [DONE]\n\n'


def error(status, code, extra=b""):
    body = json.dumps({"error": {"message": code + " from " + name, "type": "x", "param": None, "code": code}})
    return answer(status.encode() + b" Failed", b"application/json", body.encode(), extra)


def completion(body):
    if body.get("stream"):
        return answer(b"200 OK", b"text/event-stream", SSE)
    out = {"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": "ok from " + name}]}
    return answer(b"200 OK", b"application/json", json.dumps(out).encode())


def post(body):
    state["posts"] += 1
    if mode == "prefill":
        out = {"id": "p", "object": "text_completion", "choices": [{"index": 0, "text": "a"}],
               "kv_transfer_params": {"transfer_id": "%s-%d" % (name, state["posts"]), "from": name,
                                      "remote_host": "127.0.0.1", "remote_port": port, "do_remote_prefill": True}}
        return answer(b"200 OK", b"application/json", json.dumps(out).encode())
    if mode.startswith("decode:"):
        _, status, code, bad = mode.split(":")
        src = (body.get("kv_transfer_params") or {}).get("from")
        return error(status, code) if src is not None and bad in ("*", src) else completion(body)
    if mode == "empty":
        return answer(b"200 OK", b"text/event-stream" if body.get("stream") else b"application/json", b"")
    if mode.startswith("busy:"):
        return error("429", "busy", b"retry-after: %s\r\n" % mode.split(":")[1].encode())
    if mode == "huge":
        return answer(b"200 OK", b"application/json", b'{"pad": "' + b"x" * (65 << 20) + b'"}')
    raise SystemExit("unknown mode " + mode)


async def on_request(method, path, body, reader, writer):
    if method == "GET":
        out = state if path == "/state" else {"object": "list", "data": [{"id": "echo", "object": "model"}]}
        writer.write(answer(b"200 OK", b"application/json", json.dumps(out).encode()))
    elif path == "/kv_transfer/release":
        state["releases"] += 1
        writer.write(answer(b"200 OK", b"application/json", b'{"released": true}'))
    else:
        writer.write(post(body))


serve(on_request)
'''


def fake(procs: ProcessGroup, name: str, mode: str) -> Proc:
    return start_fake(procs, "fake_accounting_worker", FAKE_WORKER, name, mode, "/state")


def post(gateway: Proc, stream: bool) -> httpx.Response:
    return httpx.post(f"{gateway.url}/v1/completions", json={**BODY, "stream": stream}, timeout=30)


# ---- transfers -------------------------------------------------------------------------------


def test_a_prefill_worker_whose_transfers_fail_has_its_circuit_opened(procs: ProcessGroup, tmp_path: Path) -> None:
    """The decode worker cannot pull from "bad" (its transfer server is dead: kv_transfer_failed)
    and pulls from "good" fine. "bad" is charged, not credited at each prefill 200, so its circuit
    opens and requests stop paying a wasted prefill, a failed pull and a new pair on it."""
    workers = {"bad": (fake(procs, "bad", "prefill"), "prefill"), "good": (fake(procs, "good", "prefill"), "prefill"),
               "d0": (fake(procs, "d0", "decode:502:kv_transfer_failed:bad"), "decode")}
    gateway, _ = pd_gateway(procs, tmp_path, workers, threshold=2)
    bad = workers["bad"][0]
    for i in range(30):  # the prefill load scorer spreads them: some meet "bad" first, then a new pair
        resp = post(gateway, stream=bool(i % 2))
        assert resp.status_code == 200, resp.text
        assert (resp.headers["x-mesh-prefill-worker"], resp.headers["x-mesh-worker"]) == ("good", "d0")
        if circuits(gateway)["bad"] == "open":
            break
    assert circuits(gateway) == {"bad": "open", "good": "closed", "d0": "closed"}
    assert fake_state(bad) == {"posts": 2, "releases": 2}  # the threshold's two, each transfer cancelled
    for i in range(4):
        assert post(gateway, stream=bool(i % 2)).headers["x-mesh-prefill-worker"] == "good"
    assert fake_state(bad)["posts"] == 2
    log = gateway.log_tail(20000)
    assert ("circuit opened for worker bad after 2 failures: decode worker d0 answered 502 (kv_transfer_failed): "
            "the transfer from bad failed") in log, log


def test_every_transfer_failing_names_the_pair_and_opens_no_circuit(procs: ProcessGroup, tmp_path: Path) -> None:
    """Every prefill worker's transfer to d0 fails: maybe d0's network, not theirs, so none is
    charged (threshold 1); the client gets the decode worker's error naming the last pair."""
    workers = {"p0": (fake(procs, "p0", "prefill"), "prefill"), "p1": (fake(procs, "p1", "prefill"), "prefill"),
               "d0": (fake(procs, "d0", "decode:502:kv_transfer_failed:*"), "decode")}
    gateway, _ = pd_gateway(procs, tmp_path, workers)
    for stream in (False, True):
        resp = post(gateway, stream)
        assert resp.status_code == 502, resp.text
        err = error_of(resp.json())
        assert err["code"] == "kv_transfer_failed", err
        prefill = resp.headers["x-mesh-prefill-worker"]
        assert prefill in ("p0", "p1") and resp.headers["x-mesh-worker"] == "d0", resp.headers
        assert err["message"] == "kv_transfer_failed from d0", err
    assert [fake_state(workers[n][0]) for n in ("p0", "p1")] == [{"posts": 2, "releases": 2}] * 2
    assert set(circuits(gateway).values()) == {"closed"}
    assert "circuit opened" not in gateway.log_tail(20000)


class Health:
    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []

    def record_failure(self, tid: str, now: float, error: str) -> None:
        self.log.append(("F", tid))

    def record_success(self, tid: str) -> None:
        self.log.append(("S", tid))


async def _relay(w: Workers, names: tuple[str, ...], decode: str = "d0", body: dict[str, Any] | None = None) -> tuple[Any, Health]:
    router, health = relay_router(*names), Health()
    async with w.client() as client:
        try:
            resp = await relay_disaggregated(client, router, INFO, body or {**RELAY_BODY, "stream": False},
                                             Decision("p0", "t", decode_target=decode), health=health,
                                             config=RelayConfig(max_pairs=3))
            out: Any = (resp.status, b"".join([c async for c in resp.body()]), resp.prefill, resp.decode)
            await resp.aclose()
        except RelayError as exc:
            out = exc
    assert all((t.in_flight, t.prefill_tokens, t.decode_tokens) == (0, 0, 0) for t in router.targets.values())
    return out, health


@pytest.mark.parametrize("code, status, charged", [
    ("kv_transfer_corrupt", 502, True), ("kv_transfer_truncated", 502, True),
    ("kv_transfer_failed", 502, True), ("kv_transfer_gone", 410, False),
])
async def test_which_transfer_failures_are_the_prefill_workers(code: str, status: int, charged: bool) -> None:
    """p0's transfer fails, p1's to the same decode worker works: the failure is p0's (once; never
    a success too), except ``gone`` (the transfer was released before the pull: not a fault)."""
    w = Workers()
    w.on("p0", vllm_prefill())
    w.on("p1", vllm_prefill())
    w.on("d0", lambda *_: error_response(status, code), decode_ok())
    out, health = await _relay(w, ("p0", "p1", "d0"))
    assert out[2:] == ("p1", "d0"), out
    assert health.log == ([("F", "p0")] if charged else []) + [("S", "p1"), ("S", "d0")]


async def test_a_failed_pull_is_not_charged_when_another_decode_worker_serves() -> None:
    """kv_transfer_failed from d0 (then d0 leaves routing), p1 -> d1 works: d0's network may be
    the broken part, so p0 is neither charged nor credited."""
    w = Workers()
    w.on("p0", vllm_prefill())
    w.on("p1", vllm_prefill())
    router, health = relay_router("p0", "p1", "d0", "d1"), Health()

    def failed_pull(*_: Any) -> httpx.Response:
        router.targets["d0"].draining = True  # the new pair must take d1
        return error_response(502, "kv_transfer_failed")

    w.on("d0", failed_pull)
    w.on("d1", decode_ok())
    async with w.client() as client:
        resp = await relay_disaggregated(client, router, INFO, {**RELAY_BODY, "stream": False},
                                         Decision("p0", "t", decode_target="d0"), health=health)
        await resp.aclose()
    assert (resp.prefill, resp.decode) == ("p1", "d1") and health.log == [("S", "p1"), ("S", "d1")], health.log


async def test_every_transfer_failing_charges_no_prefill_and_credits_none() -> None:
    """Three prefill workers, every transfer to d0 fails: none is recorded as a success (nor
    charged), and the error names the pair and every prefill worker tried."""
    w = Workers()
    for p in ("p0", "p1", "p2"):
        w.on(p, vllm_prefill())
    w.on("d0", lambda *_: error_response(502, "kv_transfer_failed"))
    out, health = await _relay(w, ("p0", "p1", "p2", "d0"))
    assert isinstance(out, RelayError) and out.status == 502 and out.code == "kv_transfer_failed"
    assert health.log == []
    assert out.headers["x-mesh-worker"] == "d0" and out.headers["x-mesh-prefill-worker"] in ("p1", "p2")
    assert "p0" in out.message and "p1" in out.message and "p2" in out.message, out.message


async def test_a_prefill_is_credited_only_once_its_transfer_is_taken() -> None:
    """A prefill's 200 is not its success while the decode side fails for its own reasons: the
    request's outcome for the prefill worker is unknown, so nothing is recorded for it."""
    w = Workers()
    w.on("p0", vllm_prefill({**VLLM_PARAMS, "transfer_id": "t1"}))
    w.on("d0", lambda *_: error_response(503, "boom"))
    out, health = await _relay(w, ("p0", "d0"))
    assert isinstance(out, RelayError) and out.status == 503
    assert health.log == [("F", "d0")]


async def test_a_prefill_200_without_json_is_charged_and_another_pair_serves() -> None:
    """A prefill worker answering 200 with an empty body has nothing to hand the decode worker:
    its failure at once (as the proxy charges an empty 200), and another pair serves."""
    w = Workers()
    w.on("p0", lambda *_: httpx.Response(200, content=b""))
    w.on("p1", vllm_prefill())
    w.on("d0", decode_ok())
    out, health = await _relay(w, ("p0", "p1", "d0"))
    assert out[2:] == ("p1", "d0") and health.log == [("F", "p0"), ("S", "p1"), ("S", "d0")], (out, health.log)


# ---- empty decode answers ----------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
def test_an_empty_decode_answer_is_retried_and_charged(procs: ProcessGroup, tmp_path: Path, stream: bool) -> None:
    """A decode worker answering 200 with nothing (a stream closing before any data; a JSON answer
    with an empty body) is a failure of its own at once, and another decode worker answers, as the
    proxy treats it; the empty 200 never reaches the client."""
    workers = {"p0": (fake(procs, "p0", "prefill"), "prefill"), "empty": (fake(procs, "empty", "empty"), "decode"),
               "good": (fake(procs, "good", "decode:502:kv_transfer_failed:nobody"), "decode")}
    gateway, _ = pd_gateway(procs, tmp_path, workers)  # threshold 1
    for _ in range(30):  # the load scorer spreads them: some meet "empty" first
        resp = post(gateway, stream)
        assert resp.status_code == 200 and resp.headers["x-mesh-worker"] == "good", (resp.status_code, resp.text)
        assert resp.content, resp.headers
        if fake_state(workers["empty"][0])["posts"]:
            break
    assert fake_state(workers["empty"][0])["posts"] == 1
    assert circuits(gateway) == {"p0": "closed", "empty": "open", "good": "closed"}
    what = "closed the stream before any data" if stream else "answered 200 with an empty body"
    log = gateway.log_tail(20000)
    assert f"circuit opened for worker empty after 1 failures: decode worker empty {what}" in log, log


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_an_answer_past_64_mib_is_the_workers_failure_not_the_gateways_memory(procs: ProcessGroup, tmp_path: Path,
                                                                               role: str) -> None:
    """A worker answering a non-streamed body without end (here 65 MiB) is cut at the proxy's bound
    (``MAX_ANSWER_BYTES``), never read whole; it is charged, and another worker answers."""
    good = "prefill" if role == "prefill" else "decode:502:kv_transfer_failed:nobody"
    workers = {"huge": (fake(procs, "huge", "huge"), role), "good": (fake(procs, "good", good), role)}
    other = "prefill" if role == "decode" else "decode"
    workers["other"] = (fake(procs, "other", "prefill" if other == "prefill" else "decode:502:x:nobody"), other)
    gateway, _ = pd_gateway(procs, tmp_path, workers)  # threshold 1
    for _ in range(30):  # the load scorer spreads them: some meet "huge" first
        resp = post(gateway, stream=False)
        assert resp.status_code == 200 and len(resp.content) < 4096, (resp.status_code, resp.text[:200])
        if fake_state(workers["huge"][0])["posts"]:
            break
    assert fake_state(workers["huge"][0])["posts"] == 1
    assert circuits(gateway)["huge"] == "open"
    assert "over 64 MiB" in gateway.log_tail(20000)


# ---- 429 -----------------------------------------------------------------------------------------


def test_every_prefill_429_forwards_the_workers_retry_after(procs: ProcessGroup, tmp_path: Path) -> None:
    """Every prefill worker is busy: the client gets the last one's 429 with its own retry-after
    (as the proxy forwards a worker's headers), not the worker's name alone; no circuit opens."""
    workers = {"b0": (fake(procs, "b0", "busy:7"), "prefill"), "b1": (fake(procs, "b1", "busy:7"), "prefill"),
               "d0": (fake(procs, "d0", "decode:502:kv_transfer_failed:nobody"), "decode")}
    gateway, _ = pd_gateway(procs, tmp_path, workers)
    for stream in (False, True):
        resp = post(gateway, stream)
        assert resp.status_code == 429, resp.text
        assert resp.headers["retry-after"] == "7" and resp.headers["x-mesh-prefill-worker"] in ("b0", "b1"), resp.headers
        assert error_of(resp.json())["code"] == "busy"
    assert set(circuits(gateway).values()) == {"closed"}
    assert json.dumps(fake_state(workers["d0"][0])) == json.dumps({"posts": 0, "releases": 0})
