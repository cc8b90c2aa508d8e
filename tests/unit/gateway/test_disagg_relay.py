"""``mesh.gateway.disagg_relay``: the relay's contract and its retry, queue and lease rules, against workers
emulated by ``httpx.MockTransport`` (``tests/support/relay_mock.py``; vLLM's P/D HTTP contract: a prefill with ``max_tokens: 1``
and ``kv_transfer_params: {do_remote_decode: true}`` answers ``kv_transfer_params`` that the
decode request carries back, both with one ``X-Request-Id``). Real processes: ``test_disagg.py``."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from time import monotonic
from typing import Any

import httpx
import pytest

from mesh.core.router import Router
from mesh.core.sessions import SessionTable
from mesh.gateway.disagg_relay import DecodeQueue, RelayConfig, RelayError, RelayStats, relay_disaggregated
from policies import create_policy
from policies.base import Decision
from tests.support.relay_mock import (
    BODY,
    INFO,
    POLICY,
    VLLM_PARAMS,
    Workers,
    decode_ok,
    error_response,
    relay_router,
    vllm_prefill,
)


async def _run(workers: Workers, router: Router, body: dict[str, Any], decision: Decision | None = None,
               **kw: Any) -> tuple[int, bytes, Any]:
    decision = decision or Decision("p0", "t", decode_target="d0")
    async with workers.client() as client:
        resp = await relay_disaggregated(client, router, INFO, body, decision, **kw)
        try:
            raw = b"".join([c async for c in resp.body()])
        finally:
            await resp.aclose()
    for t in router.targets.values():  # every lease finished exactly once
        assert (t.in_flight, t.prefill_tokens, t.decode_tokens) == (0, 0, 0), t
    return resp.status, raw, resp


async def test_vllm_contract_prefill_then_decode_with_returned_params() -> None:
    w = Workers()
    w.on("p0", vllm_prefill())
    w.on("d0", decode_ok())
    status, raw, resp = await _run(w, relay_router("p0", "d0"), BODY, request_id="req-1")
    assert status == 200 and raw == b'data: {"choices":[{"text":"hello world"}]}\n\ndata: [DONE]\n\n'
    (p_host, p_path, p_body, p_rid), (d_host, d_path, d_body, d_rid) = w.calls
    assert (p_host, p_path, d_host, d_path) == ("p0", "/v1/completions", "d0", "/v1/completions")
    assert p_body["max_tokens"] == 1 and p_body["max_completion_tokens"] == 1 and p_body["stream"] is False
    assert "stream_options" not in p_body and "min_tokens" not in p_body
    assert p_body["kv_transfer_params"]["do_remote_decode"] is True
    assert d_body == {**BODY, "kv_transfer_params": VLLM_PARAMS}  # the client's body, plus the params
    assert p_rid == d_rid == "req-1"
    assert resp.prefill_usage["prompt_tokens_details"]["cached_tokens"] == 32
    assert ("x-mesh-worker", "d0") in resp.headers and ("x-mesh-prefill-worker", "p0") in resp.headers


async def test_prefill_without_kv_params_falls_back_to_a_plain_decode() -> None:
    w = Workers()
    w.on("p0", vllm_prefill(None))
    w.on("d0", decode_ok())
    stats = RelayStats()
    status, _, _ = await _run(w, relay_router("p0", "d0"), {**BODY, "stream": False}, stats=stats)
    assert status == 200 and stats.fallbacks == 1
    assert "kv_transfer_params" not in w.calls[1][2]


async def test_failed_prefill_moves_to_another_pair() -> None:
    w = Workers()
    w.on("p0", lambda *_: error_response(503, "busy"))
    w.on("p1", vllm_prefill())
    w.on("d0", decode_ok())
    stats = RelayStats()
    status, _, resp = await _run(w, relay_router("p0", "p1", "d0"), BODY, stats=stats)
    assert status == 200 and resp.prefill == "p1" and stats.prefill_failures == 1


async def test_a_client_error_from_the_prefill_is_answered_as_is() -> None:
    w = Workers()
    w.on("p0", lambda *_: error_response(400, "context_length_exceeded"))
    with pytest.raises(RelayError) as err:
        await _run(w, relay_router("p0", "d0"), BODY)
    assert err.value.status == 400 and b"context_length_exceeded" in err.value.body
    assert [c[0] for c in w.calls] == ["p0"]


async def test_admission_refusal_tries_another_decode_worker() -> None:
    w = Workers()
    w.on("p0", vllm_prefill())
    w.on("d0", lambda *_: error_response(429, "kv_admission_full", {"retry-after": "1"}))
    w.on("d1", decode_ok())
    stats = RelayStats()
    status, _, resp = await _run(w, relay_router("p0", "d0", "d1"), BODY, stats=stats)
    assert status == 200 and resp.decode == "d1" and stats.decode_refusals == 1


async def test_every_decode_full_waits_in_the_bounded_queue_then_succeeds() -> None:
    w = Workers()
    w.on("p0", vllm_prefill())
    w.on("d0", lambda *_: error_response(429, "kv_admission_full"), lambda *_: error_response(429, "kv_admission_full"), decode_ok())
    queue, stats = DecodeQueue(max_waiting=4), RelayStats()
    status, _, _ = await _run(w, relay_router("p0", "d0"), BODY, queue=queue, stats=stats,
                              config=RelayConfig(retry_after_cap_s=0.01))
    assert status == 200 and queue.waits == 2 and stats.decode_refusals == 2 and queue.waiting == 0


async def test_a_full_queue_answers_429_and_cancels_the_transfer(monkeypatch: pytest.MonkeyPatch) -> None:
    w = Workers()
    w.on("p0", vllm_prefill({**VLLM_PARAMS, "transfer_id": "t1"}))
    w.on("d0", lambda *_: error_response(429, "kv_admission_full"))
    queue = DecodeQueue(max_waiting=0)
    router = relay_router("p0", "d0")
    released: list[dict[str, Any]] = []
    real_post = httpx.AsyncClient.post

    async def post(self: httpx.AsyncClient, url: Any, **kw: Any) -> httpx.Response:
        if str(url).endswith("/kv_transfer/release"):
            released.append(kw["json"])
            return httpx.Response(200, json={"released": True})
        return await real_post(self, url, **kw)

    monkeypatch.setattr(httpx.AsyncClient, "post", post)  # the cancel goes out on its own client
    with pytest.raises(RelayError) as err:
        await _run(w, router, BODY, queue=queue)
    assert err.value.status == 429 and err.value.headers.get("retry-after") == "1"
    assert released == [{"transfer_id": "t1", "cancel": True}] and queue.rejected == 1


async def test_decode_worker_down_retries_the_same_transfer_elsewhere() -> None:
    w = Workers()
    w.on("p0", vllm_prefill())
    w.on("d1", decode_ok())  # d0 has no script: connection refused
    stats = RelayStats()
    status, _, resp = await _run(w, relay_router("p0", "d0", "d1"), BODY, stats=stats)
    assert status == 200 and resp.decode == "d1" and stats.decode_failures == 1
    assert [c[0] for c in w.calls] == ["p0", "d0", "d1"]  # one prefill: its blocks stay pinned
    assert w.calls[2][2]["kv_transfer_params"] == VLLM_PARAMS


async def test_a_transfer_failure_takes_a_new_pair() -> None:
    w = Workers()
    w.on("p0", vllm_prefill())
    w.on("p1", vllm_prefill({**VLLM_PARAMS, "remote_engine_id": "engine-p1"}))
    w.on("d0", lambda *_: error_response(502, "kv_transfer_corrupt"), decode_ok())
    stats = RelayStats()
    status, _, resp = await _run(w, relay_router("p0", "p1", "d0"), BODY, stats=stats)
    assert status == 200 and resp.prefill == "p1" and stats.transfer_failures == 1
    assert w.calls[-1][2]["kv_transfer_params"]["remote_engine_id"] == "engine-p1"


async def test_a_cancelled_request_settles_its_leases() -> None:
    w = Workers()
    gate = asyncio.Event()
    w.on("p0", vllm_prefill())
    router = relay_router("p0", "d0")

    async def slow_handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "d0":
            await gate.wait()
        return w.handler(request)

    w.on("d0", decode_ok())
    async with httpx.AsyncClient(transport=httpx.MockTransport(slow_handler)) as client:
        task = asyncio.create_task(relay_disaggregated(client, router, INFO, BODY, Decision("p0", "t", decode_target="d0")))
        await asyncio.sleep(0.05)
        assert router.targets["d0"].in_flight == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert all((t.in_flight, t.prefill_tokens, t.decode_tokens) == (0, 0, 0) for t in router.targets.values())


async def test_a_session_is_bound_to_its_decode_worker_not_the_prefill() -> None:
    """Decode-side session affinity: the binding follows the worker that holds the conversation's
    KV after the transfer (the decode worker); the prefill lease never moves it."""
    w = Workers()
    w.on("p0", vllm_prefill())
    w.on("d0", decode_ok())
    sessions = SessionTable(idle_ttl_s=60)
    router = Router(create_policy(POLICY), relay_router("p0", "d0").targets, sessions=sessions)
    info = replace(INFO, session_id="s1")
    async with w.client() as client:
        for _ in range(2):
            resp = await relay_disaggregated(client, router, info, BODY, Decision("p0", "t", decode_target="d0"))
            await resp.aclose()
    assert sessions.bound_target("s1", monotonic()) == "d0" and router.session_moves == 0
