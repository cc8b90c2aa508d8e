"""OpenAI request fields the bundled engine cannot honour are a 400 naming the field, never ignored.

A real ``workers.server.cli --preset tiny`` process, driven directly and through a real gateway process
(``mesh.commands.serve``), over real HTTP (the official ``openai`` client and ``httpx``).

The worker's request models take extra fields (``extra="allow"``, for vLLM's extensions), so
``presence_penalty``, ``frequency_penalty``, ``logit_bias``, ``top_logprobs``,
``response_format``, ``tools``/``tool_choice``, ``suffix``, ``best_of`` or vLLM's ``min_tokens``,
``repetition_penalty``, ``min_p``, ``guided_json``... are each refused where the engine cannot
honour them, not answered by a 200 whose text ignores what was asked (a JSON schema answered
with free text, a tool call never made, a penalty never applied).
vLLM applies the penalties and biases and, without a tool parser, refuses ``tools`` with a 400.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.e2e_bundled import Gateway, start_gateway, start_workers, wait_workers, write_config
from tests.procs import ProcessGroup

MESSAGES = [{"role": "user", "content": "hello"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}]
SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}


@pytest.fixture(scope="module")
def urls(module_procs: ProcessGroup) -> Iterator[dict[str, str]]:
    """``worker``: the bundled worker itself; ``gateway``: a gateway in front of it."""
    workers = start_workers(module_procs, ["w0"], num_kv_blocks=256, wait=False)
    config = write_config(module_procs.log_dir / "gw.yaml", list(workers.values()))
    gw = Gateway(start_gateway(module_procs, config, "gw"))
    wait_workers(workers)
    gw.wait_ready(1)
    yield {"worker": workers["w0"].proc.url, "gateway": gw.proc.url}


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def _post(url: str, route: str, body: dict[str, Any]) -> httpx.Response:
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    base = {"model": "tiny", "max_tokens": 2, **({"messages": MESSAGES} if route == "chat" else {"prompt": "hello"})}
    return httpx.post(url + path, json={**base, **body}, timeout=60)


UNSUPPORTED = [  # (route, field, a value that would change the output)
    ("chat", "presence_penalty", 1.5),
    ("chat", "frequency_penalty", -0.5),
    ("chat", "logit_bias", {"65": 100}),
    ("completion", "presence_penalty", 0.5),
    ("completion", "frequency_penalty", 1.0),
    ("completion", "logit_bias", {"65": -100}),
    ("chat", "repetition_penalty", 1.3),
    ("chat", "min_p", 0.1),
    ("completion", "min_tokens", 4),
    ("chat", "top_logprobs", 3),
    ("chat", "response_format", {"type": "json_object"}),
    ("chat", "response_format", SCHEMA),
    ("completion", "response_format", SCHEMA),
    ("chat", "guided_json", {"type": "object"}),
    ("completion", "guided_choice", ["yes", "no"]),
    ("chat", "structured_outputs", {"json": {"type": "object"}}),
    ("completion", "prompt_logprobs", 1),
    ("completion", "suffix", " the end"),
    ("completion", "best_of", 3),
    ("chat", "tools", TOOLS),  # tool_choice unset with tools: "auto", which needs a tool parser
    ("chat", "functions", [TOOLS[0]["function"]]),
]


@pytest.mark.parametrize("target", ["worker", "gateway"])
@pytest.mark.parametrize(("route", "field", "value"), UNSUPPORTED,
                         ids=[f"{r}-{f}-{i}" for i, (r, f, _) in enumerate(UNSUPPORTED)])
def test_a_field_the_engine_cannot_honour_is_a_400_naming_it(
        urls: dict[str, str], target: str, route: str, field: str, value: Any) -> None:
    resp = _post(urls[target], route, {field: value})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == field, error
    assert field in error["message"] and error["code"] == "unsupported_parameter", error


@pytest.mark.parametrize("tool_choice", ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_tool_choice_other_than_none_is_a_400_naming_it(urls: dict[str, str], tool_choice: Any) -> None:
    for body in ({"tools": TOOLS, "tool_choice": tool_choice}, {"tool_choice": tool_choice}):
        resp = _post(urls["worker"], "chat", body)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == "tool_choice", resp.text


def test_the_openai_client_sees_a_bad_request_naming_the_field(urls: dict[str, str]) -> None:
    client = _client(urls["gateway"])
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, presence_penalty=1.0)
    assert exc.value.param == "presence_penalty" and exc.value.code == "unsupported_parameter", exc.value.body
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, tools=TOOLS)
    assert exc.value.param == "tools", exc.value.body
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="tiny", prompt="hello", max_tokens=2, logit_bias={"65": 50})
    assert exc.value.param == "logit_bias", exc.value.body


def test_the_default_values_of_those_fields_are_accepted(urls: dict[str, str]) -> None:
    """What clients send by default (0 penalties, an empty bias, text format, tools unused) is no 400."""
    client = _client(urls["gateway"])
    chat = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=2, presence_penalty=0, frequency_penalty=0.0, logit_bias={},
        top_logprobs=0, logprobs=False, response_format={"type": "text"}, tools=TOOLS, tool_choice="none",
        extra_body={"repetition_penalty": 1.0, "min_p": 0.0, "min_tokens": 0})
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage is not None
    text = client.completions.create(model="tiny", prompt="hello", max_tokens=2, presence_penalty=0,
                                     frequency_penalty=0, logit_bias={}, best_of=1, suffix=None)
    assert text.choices[0].finish_reason in ("stop", "length") and text.usage is not None


def test_a_bad_max_completion_tokens_is_named_as_sent(urls: dict[str, str]) -> None:
    """A request that sent only ``max_completion_tokens`` has it named in the 400, not ``max_tokens``."""
    resp = _post(urls["worker"], "chat", {"max_tokens": None, "max_completion_tokens": 0})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_completion_tokens", resp.text
    resp = _post(urls["worker"], "chat", {"max_tokens": 5, "max_completion_tokens": 0})  # the one that counts
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_completion_tokens", resp.text
    resp = _post(urls["worker"], "chat", {"max_tokens": 0})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens", resp.text


def test_a_body_sent_without_a_json_content_type_gets_a_400_that_says_so(urls: dict[str, str]) -> None:
    """``curl -d`` without ``-H content-type: application/json`` sends a form type: the gateway reads
    the JSON anyway, the worker (FastAPI) cannot, and its 400 says why (the content type), not
    only 'body: Input should be a valid dictionary or object to extract fields from'."""
    body = b'{"model": "tiny", "prompt": "hello", "max_tokens": 2}'
    resp = httpx.post(urls["worker"] + "/v1/completions", content=body,
                      headers={"content-type": "application/x-www-form-urlencoded"})
    assert resp.status_code == 400 and "Content-Type: application/json" in resp.json()["error"]["message"], resp.text
    resp = httpx.post(urls["worker"] + "/v1/completions", json=[1, 2])
    assert resp.status_code == 400 and "JSON object" in resp.json()["error"]["message"], resp.text
    assert resp.json()["error"]["code"] == "invalid_json", resp.text
    resp = httpx.post(urls["worker"] + "/v1/chat/completions", content=b"", headers={"content-type": "application/json"})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "empty_body", resp.text


@pytest.mark.parametrize("where", ["worker", "gateway"])
def test_stream_options_without_stream_is_a_400(urls: dict[str, str], where: str) -> None:
    """``stream_options`` on a request that does not stream is a 400, as OpenAI and vLLM refuse it
    (never ignored)."""
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "stream_options": {"include_usage": True}}
    resp = httpx.post(urls[where] + "/v1/completions", json=body, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "stream_options"


def test_a_stream_the_engine_rejects_ends_with_the_error_then_done() -> None:
    """After the headers, a rejection or a dead engine is an error event; the stream then ends
    with ``data: [DONE]`` as vLLM's does (without it, the gateway reads a cut stream)."""
    import asyncio

    from workers.engine.llm_engine import RequestRejected
    from workers.engine.sequence import SamplingParams
    from workers.server.app import CacheHints, Child, CompletionRequest, stream_choices

    class Api:  # the generator's only collaborator; the real engine cannot be made to fail here
        model_name = "tiny"

        async def run(self, *args: Any) -> Any:
            raise RequestRejected("no room")
            yield  # an async generator

    req = CompletionRequest(model="tiny", prompt="x", stream=True)
    children = [Child(0, 0, "cmpl-1", [1], SamplingParams(max_tokens=1))]
    resp = stream_choices(Api(), req, "cmpl-1", 0, children, CacheHints(), chat=False)  # type: ignore[arg-type]

    async def read() -> bytes:
        return b"".join([part async for part in resp.body_iterator])  # type: ignore[misc]

    events = [e for e in asyncio.run(read()).split(b"\n\n") if e]
    assert b'"error"' in events[-2] and b"no room" in events[-2]
    assert events[-1] == b"data: [DONE]"


@pytest.mark.parametrize("where", ["worker", "gateway"])
def test_the_openai_client_retrieves_a_model_and_gets_a_404_for_an_unknown_one(urls: dict[str, str], where: str) -> None:
    """``client.models.retrieve`` (GET /v1/models/{id}) returns a served model, and a 404
    (``model_not_found``) only for an unknown one."""
    client = openai.OpenAI(base_url=urls[where] + "/v1", api_key="x", max_retries=0)
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("org/not-here")
    assert err.value.body["code"] == "model_not_found"  # type: ignore[index]
