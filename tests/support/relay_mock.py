"""Workers emulated by ``httpx.MockTransport`` for the tests of ``mesh.gateway.disagg_relay``
(vLLM's P/D HTTP contract: a prefill with ``max_tokens: 1`` and ``kv_transfer_params:
{do_remote_decode: true}`` answers ``kv_transfer_params`` that the decode request carries back):
a scripted cluster, the answers it can give, a router over its targets and a request's body,
routing info and vLLM's transfer parameters."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx

from mesh.core.router import Router
from policies import create_policy
from policies.base import RequestInfo, Role, TargetState

POLICY = {"name": "pipeline", "params": {"profiles": {"prefill": {"scorers": ["prefill_load"]},
                                                       "decode": {"scorers": ["load"]}}}}
INFO = RequestInfo(model="m", block_keys=[1, 2, 3], block_size=16, prompt_tokens=50, max_tokens=8)
VLLM_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [3, 4, 5],
               "remote_engine_id": "engine-p", "remote_host": "10.0.0.1", "remote_port": 5600, "tp_size": 1}
BODY = {"model": "m", "prompt": "hi", "max_tokens": 8, "max_completion_tokens": 8, "stream": True,
        "stream_options": {"include_usage": True}, "min_tokens": 2, "temperature": 0}


def relay_router(*names: str) -> Router:
    """A router over mock targets ``names`` (prefill ones start with "p", the others decode) with ``POLICY``."""
    targets = {n: TargetState(id=n, worker=n, url=f"http://{n}", role=Role.PREFILL if n.startswith("p") else Role.DECODE,
                              models=frozenset({"m"})) for n in names}
    return Router(create_policy(POLICY), targets)


def error_response(status: int, code: str, headers: dict[str, str] | None = None) -> httpx.Response:
    """A worker's error answer in the OpenAI shape, ``code`` as its message and code."""
    return httpx.Response(status, json={"error": {"message": code, "type": "x", "param": None, "code": code}},
                          headers=headers)


class Workers:
    """A scripted cluster: per host, a list of answers (callables of the request) used in turn."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict[str, Any], str | None]] = []
        self.script: dict[str, list[Callable[[httpx.Request, dict[str, Any]], httpx.Response]]] = {}

    def on(self, host: str, *answers: Callable[[httpx.Request, dict[str, Any]], httpx.Response]) -> None:
        self.script.setdefault(host, []).extend(answers)

    def handler(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"{}")
        host = request.url.host
        self.calls.append((host, request.url.path, body, request.headers.get("x-request-id")))
        answers = self.script.get(host) or []
        if not answers:
            raise httpx.ConnectError(f"{host} is down", request=request)
        answer = answers.pop(0) if len(answers) > 1 else answers[0]
        return answer(request, body)

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(self.handler))


def vllm_prefill(params: dict[str, Any] | None = VLLM_PARAMS) -> Callable[[httpx.Request, dict[str, Any]], httpx.Response]:
    """A vLLM prefill worker's answer: one token and ``params`` as its ``kv_transfer_params``."""
    def answer(_: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        out: dict[str, Any] = {"id": "cmpl-p", "object": "text_completion", "choices": [{"index": 0, "text": "x"}],
                               "usage": {"prompt_tokens": 50, "completion_tokens": 1,
                                         "prompt_tokens_details": {"cached_tokens": 32}}}
        if params is not None:
            out["kv_transfer_params"] = params
        return httpx.Response(200, json=out)
    return answer


def decode_ok(text: str = "hello world") -> Callable[[httpx.Request, dict[str, Any]], httpx.Response]:
    """A decode worker's answer of ``text``, streamed when the request asks for a stream."""
    def answer(_: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        if body.get("stream"):  # a streamed body, as a real worker's
            sse = f'data: {{"choices":[{{"text":"{text}"}}]}}\n\ndata: [DONE]\n\n'.encode()
            return httpx.Response(200, stream=httpx.ByteStream(sse), headers={"content-type": "text/event-stream"})
        data = json.dumps({"choices": [{"index": 0, "text": text}], "usage": {"completion_tokens": 2}}).encode()
        return httpx.Response(200, stream=httpx.ByteStream(data), headers={"content-type": "application/json"})
    return answer
