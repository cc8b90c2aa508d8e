"""``n`` > 1 (several choices per prompt) on the bundled worker, as vLLM serves it: real
``workers.server.cli --preset tiny`` processes, a real gateway process (``mesh.commands.serve``), a real
echo worker, over real HTTP (the official ``openai`` client, ``httpx``, a raw socket).

The worker serves ``n`` choices (no 400 "only n=1 is supported"), and the echo worker answers
``n`` choices too (not one).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from mesh.gateway.disagg_relay import decode_body, prefill_body
from tests.e2e_bundled import BundledWorker, Gateway, start_gateway, start_workers, wait_workers, write_config
from tests.procs import ProcessGroup, wait_until

MODEL = "tiny"
BLOCK = 16
LEAK_KEYS = ("num_requests_running", "num_requests_waiting", "kv_blocks_used", "kv_transfer_pinned_blocks",
             "kv_transfer_leaked_blocks", "kv_transfer_transfers_active")


@dataclass
class Cluster:
    w0: str  # the worker most tests use, behind the gateway
    w1: str  # a second worker: the decode side of the disaggregated test
    gateway: Gateway
    echo: str


@pytest.fixture(scope="module")
def cluster(module_procs: ProcessGroup) -> Iterator[Cluster]:
    workers: dict[str, BundledWorker] = start_workers(module_procs, ["w0", "w1"], num_kv_blocks=256, wait=False)
    echo = module_procs.echo_worker("echo")
    config = write_config(module_procs.log_dir / "gw.yaml", [workers["w0"]])
    gw = Gateway(start_gateway(module_procs, config, "gw"))
    wait_workers(workers)
    gw.wait_ready(1)
    yield Cluster(workers["w0"].proc.url, workers["w1"].proc.url, gw, echo.url)
    gw.close()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^mesh_worker_(\w+) (\S+)$", text, re.M)}


def _assert_idle(url: str) -> None:
    """No engine request left running or waiting, no block in use (nor pinned for a transfer)."""
    def idle() -> bool:
        m = _metrics(url)
        return not any(m.get(k, 0.0) for k in LEAK_KEYS)

    wait_until(idle, 15, f"{url}: no request, block or transfer left")


def _fresh_prompt(words: int = 40) -> str:
    """A prompt no earlier request sent (byte tokenizer: one token per byte)."""
    rng = random.Random()
    return " ".join(f"w{rng.randrange(10**6)}" for _ in range(words))


def _events(text: str) -> list[Any]:
    """The JSON events of an SSE body, then "[DONE]" where it came."""
    out: list[Any] = []
    for line in text.splitlines():
        if line.startswith("data: "):
            out.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    return out


def _check_stream(events: list[Any], n: int, chat: bool) -> dict[int, str]:
    """vLLM's shape of a stream of ``n`` choices (usage asked for); the text of each choice."""
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    *chunks, usage_chunk = events[:-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] > 0
    assert all(c.get("usage") is None for c in chunks)  # usage once, at the end
    assert all(len(c["choices"]) == 1 for c in chunks)
    if chat:  # each choice's role delta, once, before any content
        roles = [c["choices"][0] for c in chunks[:n]]
        assert [r["index"] for r in roles] == list(range(n)) and all(r["delta"]["role"] == "assistant" for r in roles)
        assert not any("role" in c["choices"][0]["delta"] for c in chunks[n:])
        chunks = chunks[n:]
    texts: dict[int, str] = {i: "" for i in range(n)}
    finished: set[int] = set()
    for c in chunks:
        choice = c["choices"][0]
        assert choice["index"] in texts and choice["index"] not in finished, "a chunk after its choice's finish"
        texts[choice["index"]] += (choice["delta"].get("content") or "") if chat else choice["text"]
        if choice["finish_reason"] is not None:
            finished.add(choice["index"])
    assert finished == set(range(n)), "every choice ends with its own finish chunk"
    return texts


# ---- the worker ---------------------------------------------------------------------------------


def test_seeded_choices_differ_and_child_i_samples_with_seed_plus_i(cluster: Cluster) -> None:
    """vLLM's seed rule: choice i of a request with ``seed`` is the answer of ``seed + i`` (so the
    choices differ, and the same request answers the same again); 2**64 - 1 + 1 wraps to 0."""
    kw: dict[str, Any] = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0}
    resp = _client(cluster.w0).completions.create(n=3, seed=11, extra_body={"ignore_eos": True}, **kw)
    kw["ignore_eos"] = True
    texts = [c.text for c in resp.choices]
    assert [c.index for c in resp.choices] == [0, 1, 2] and len(set(texts)) == 3
    assert resp.usage is not None and resp.usage.prompt_tokens == len("Once upon a time")
    assert resp.usage.completion_tokens == 3 * 12
    for i in range(3):
        one = httpx.post(cluster.w0 + "/v1/completions", json={**kw, "seed": 11 + i}, timeout=60).json()
        assert one["choices"][0]["text"] == texts[i]
    wrapped = httpx.post(cluster.w0 + "/v1/completions", json={**kw, "n": 2, "seed": 2**64 - 1}, timeout=60)
    zero = httpx.post(cluster.w0 + "/v1/completions", json={**kw, "seed": 0}, timeout=60)
    assert wrapped.status_code == 200 and wrapped.json()["choices"][1]["text"] == zero.json()["choices"][0]["text"]


def test_greedy_choices_are_identical_and_lists_number_prompt_times_n_plus_i(cluster: Cluster) -> None:
    """Greedy children agree (as in vLLM); a list of prompts (text, or token ids) numbers its choices
    prompt * n + i; prompt tokens count once per prompt, completion tokens over every choice."""
    ids = [72, 101, 108, 108, 111, 32, 116, 104, 101, 114, 101]
    base = {"model": MODEL, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    one = [httpx.post(cluster.w0 + "/v1/completions", json={**base, "prompt": p}, timeout=60).json()["choices"][0]["text"]
           for p in ("The sky is", ids)]
    for prompt in (["The sky is", bytes(ids).decode()], [list(b"The sky is"), ids]):
        resp = httpx.post(cluster.w0 + "/v1/completions", json={**base, "prompt": prompt, "n": 3}, timeout=60).json()
        assert [c["index"] for c in resp["choices"]] == list(range(6))
        assert [c["text"] for c in resp["choices"]] == [one[0]] * 3 + [one[1]] * 3
        usage = resp["usage"]
        assert usage["prompt_tokens"] == len("The sky is") + len(ids) and usage["completion_tokens"] == 6 * 6
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_a_streamed_completion_interleaves_its_choices_as_vllm_does(cluster: Cluster) -> None:
    """One choice per chunk with its index, chunks interleaved, a finish chunk per choice, the
    usage chunk once, [DONE]; the texts are the unstreamed answer's. Lists of prompts stream too."""
    body = {"model": MODEL, "prompt": "Streams of choices", "max_tokens": 10, "temperature": 0.9, "seed": 3,
            "ignore_eos": True, "n": 3}
    whole = httpx.post(cluster.w0 + "/v1/completions", json=body, timeout=60).json()
    raw = httpx.post(cluster.w0 + "/v1/completions", json={**body, "stream": True,
                                                          "stream_options": {"include_usage": True}}, timeout=60)
    events = _events(raw.text)
    texts = _check_stream(events, 3, chat=False)
    assert [texts[i] for i in range(3)] == [c["text"] for c in whole["choices"]]
    order = [e["choices"][0]["index"] for e in events[:-2]]
    assert order != sorted(order), "the choices' chunks interleave as they come"
    usage = events[-2]["usage"]  # the unstreamed request cached the prompt's full block
    assert usage == {**whole["usage"], "prompt_tokens_details": {"cached_tokens": BLOCK}}
    listed = httpx.post(cluster.w0 + "/v1/completions", json={
        **body, "prompt": ["first prompt", "second"], "n": 2, "stream": True, "stream_options": {"include_usage": True}},
        timeout=60)
    assert len(_check_stream(_events(listed.text), 4, chat=False)) == 4


def test_chat_streams_a_role_delta_per_choice_and_usage_once(cluster: Cluster) -> None:
    messages = [{"role": "user", "content": "Tell me three things"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0.8, "seed": 21, "n": 3}
    whole = _client(cluster.w0).chat.completions.create(**body)  # type: ignore[call-overload]
    assert [c.index for c in whole.choices] == [0, 1, 2] and all(c.message.role == "assistant" for c in whole.choices)
    raw = httpx.post(cluster.w0 + "/v1/chat/completions", json={**body, "stream": True,
                                                               "stream_options": {"include_usage": True}}, timeout=60)
    events = _events(raw.text)
    texts = _check_stream(events, 3, chat=True)
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert whole.usage is not None and events[-2]["usage"]["completion_tokens"] == whole.usage.completion_tokens
    assert events[-2]["usage"]["prompt_tokens"] == whole.usage.prompt_tokens  # once, not per choice


def test_choices_after_the_first_reuse_the_prompts_blocks(cluster: Cluster) -> None:
    """The first child prefills the prompt; its siblings are admitted on its cached blocks. Usage
    reports the prompt's cached tokens once (those cached before the request), never over the prompt."""
    prompt = _fresh_prompt()
    full = (len(prompt) - 1) // BLOCK * BLOCK  # what a prefix hit can cover (the last token is computed)
    before = _metrics(cluster.w0)
    resp = httpx.post(cluster.w0 + "/v1/completions", json={
        "model": MODEL, "prompt": prompt, "n": 4, "max_tokens": 2, "temperature": 0}, timeout=60).json()
    after = _metrics(cluster.w0)
    computed = after["prefill_computed_tokens_total"] - before["prefill_computed_tokens_total"]
    hits = after["prefix_cache_hits_total"] - before["prefix_cache_hits_total"]
    assert computed == len(prompt) + 3 * (len(prompt) - full), "siblings compute only the tail past the shared blocks"
    assert hits == 3 * full
    assert resp["usage"]["prompt_tokens"] == len(prompt) and resp["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    again = httpx.post(cluster.w0 + "/v1/completions", json={
        "model": MODEL, "prompt": prompt, "n": 2, "max_tokens": 2, "temperature": 0}, timeout=60).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == full
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in resp["choices"][:2]]


BAD_N = [  # (route, body fields, the param named)
    ("completion", {"n": 0}, "n"),
    ("completion", {"n": -2}, "n"),
    ("chat", {"n": "2"}, "n"),
    ("completion", {"n": 1.5}, "n"),
    ("chat", {"n": True}, "n"),
    ("chat", {"n": 129}, "n"),
    ("completion", {"n": 65, "prompt": ["a", "b"]}, "n"),  # 130 choices over two prompts
    ("completion", {"n": 3, "best_of": 2}, "best_of"),
    ("completion", {"n": 2, "best_of": 3}, "best_of"),
]


@pytest.mark.parametrize(("route", "fields", "param"), BAD_N, ids=[f"{r}-{i}" for i, (r, _, _) in enumerate(BAD_N)])
def test_bad_n_is_a_400_naming_the_field(cluster: Cluster, route: str, fields: dict[str, Any], param: str) -> None:
    path, base = (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}) if route == "chat"
                  else ("/v1/completions", {"prompt": "hi"}))
    resp = httpx.post(cluster.w0 + path, json={"model": MODEL, "max_tokens": 2, **base, **fields}, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param and resp.json()["error"]["type"] == "invalid_request_error"


def test_n_null_is_one_choice_and_best_of_equal_to_n_is_accepted(cluster: Cluster) -> None:
    base = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    assert len(httpx.post(cluster.w0 + "/v1/completions", json={**base, "n": None}, timeout=30).json()["choices"]) == 1
    resp = httpx.post(cluster.w0 + "/v1/completions", json={**base, "n": 3, "best_of": 3}, timeout=30)
    assert resp.status_code == 200 and len(resp.json()["choices"]) == 3
    most = httpx.post(cluster.w0 + "/v1/completions", json={**base, "n": 64, "prompt": ["a", "b"]}, timeout=60)
    assert most.status_code == 200 and [c["index"] for c in most.json()["choices"]] == list(range(128))


def test_a_client_that_leaves_aborts_every_choice(cluster: Cluster) -> None:
    """Streamed (the connection closed mid-stream) and not (the socket closed while waiting): every
    child's engine request is aborted, the engine's running and waiting counts fall back to 0."""
    body = {"model": MODEL, "prompt": _fresh_prompt(10), "n": 3, "max_tokens": 1000, "ignore_eos": True}
    with httpx.stream("POST", cluster.w0 + "/v1/completions", json={**body, "stream": True}, timeout=60) as resp:
        seen: set[int] = set()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                seen.add(json.loads(line[6:])["choices"][0]["index"])
            if seen == {0, 1, 2}:
                assert _metrics(cluster.w0)["num_requests_running"] == 3
                break  # leaving the lines closes the connection (httpcore closes it on GeneratorExit)
    _assert_idle(cluster.w0)

    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", int(cluster.w0.rsplit(":", 1)[1]))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(data), data))
        wait_until(lambda: _metrics(cluster.w0)["num_requests_running"] == 3, 15, "3 children running")
    _assert_idle(cluster.w0)


def test_a_stop_string_ends_its_choice_and_leaves_nothing_running(cluster: Cluster) -> None:
    """Each choice is cut at its own first stop string (its engine request aborted), the others run on."""
    body = {"model": MODEL, "prompt": "abc", "n": 4, "max_tokens": 200, "ignore_eos": True, "seed": 1}
    whole = [c["text"] for c in httpx.post(cluster.w0 + "/v1/completions", json=body, timeout=60).json()["choices"]]
    k = next(i for i in range(1, len(whole[0]) - 2) if "\ufffd" not in whole[0][i : i + 2])
    stop = whole[0][k : k + 2]
    cut = httpx.post(cluster.w0 + "/v1/completions", json={**body, "stop": [stop]}, timeout=60).json()["choices"]
    for c, w in zip(cut, whole, strict=True):
        ends = w.find(stop)
        assert (c["text"], c["finish_reason"]) == ((w[:ends], "stop") if ends >= 0 else (w, "length"))
    _assert_idle(cluster.w0)


# ---- an error in one child ends them all ------------------------------------------------------


class _OneFails:
    """``WorkerAPI.run``'s stand-in: child 1 fails after a chunk, the others would run forever.
    The real engine cannot be made to fail one request of several (as in test_worker_openai_params)."""

    model_name = MODEL

    def __init__(self) -> None:
        self.open: set[str] = set()
        self.closed: set[str] = set()

    async def run(self, rid: str, *args: Any) -> AsyncIterator[Any]:
        from workers.engine.llm_engine import RequestOutput, RequestRejected
        from workers.server.app import Chunk

        self.open.add(rid)
        try:
            for k in range(10**6):
                yield Chunk("x", None, RequestOutput(rid, [1], False, None, 3, 0, k + 1))
                if rid.endswith("-1"):
                    raise RequestRejected("child 1 refused")
                await asyncio.sleep(0.01)
        finally:
            self.closed.add(rid)


def _children(n: int) -> list[Any]:
    from workers.engine.sequence import SamplingParams
    from workers.server.app import Child

    return [Child(i, 0, f"cmpl-1-{i}", [1, 2, 3], SamplingParams(max_tokens=9), 0 if i else None) for i in range(n)]


def test_an_error_in_one_choice_ends_the_stream_with_the_error_then_done() -> None:
    from workers.server.app import CacheHints, CompletionRequest, stream_choices

    api = _OneFails()
    req = CompletionRequest(model=MODEL, prompt="x", stream=True, n=3)
    resp = stream_choices(api, req, "cmpl-1", 0, _children(3), CacheHints(), chat=False)  # type: ignore[arg-type]

    async def read() -> bytes:
        return b"".join([part async for part in resp.body_iterator])  # type: ignore[misc]

    events = [e for e in asyncio.run(read()).split(b"\n\n") if e]
    assert b'"error"' in events[-2] and b"child 1 refused" in events[-2] and events[-1] == b"data: [DONE]"
    assert api.open == api.closed == {"cmpl-1-0", "cmpl-1-1", "cmpl-1-2"}, "every child's request was closed"


def test_an_error_in_one_choice_fails_the_unstreamed_answer_and_closes_the_others() -> None:
    from workers.engine.llm_engine import RequestRejected
    from workers.server.app import CacheHints, collect_choices

    api = _OneFails()

    async def collect() -> None:
        await collect_choices(api, _children(3), CacheHints(), [])  # type: ignore[arg-type]

    with pytest.raises(RequestRejected, match="child 1 refused"):
        asyncio.run(collect())
    assert api.open == api.closed == {"cmpl-1-0", "cmpl-1-1", "cmpl-1-2"}


# ---- through the gateway, disaggregated, and the echo worker ----------------------------------


def test_n_through_a_real_gateway_with_the_openai_client(cluster: Cluster) -> None:
    """The gateway relays the body unchanged: 3 choices, usage, and its load accounting (and the
    worker's engine) back to 0 afterwards."""
    client = _client(cluster.gateway.proc.url)
    messages = [{"role": "user", "content": "through the gateway"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, n=3, max_tokens=5,  # type: ignore[arg-type]
                                          temperature=0.7, seed=2, extra_body={"ignore_eos": True})
    assert [c.index for c in chat.choices] == [0, 1, 2] and chat.usage is not None
    assert chat.usage.completion_tokens == 15 and all(c.finish_reason == "length" for c in chat.choices)
    stream = client.completions.create(model=MODEL, prompt="through the gateway", n=3, max_tokens=6,
                                       temperature=0.7, seed=2, stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1, 2}
    assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason) == 3
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.prompt_tokens == len("through the gateway") and usage.completion_tokens == 18
    whole = client.completions.create(model=MODEL, prompt="through the gateway", n=3, max_tokens=6,
                                      temperature=0.7, seed=2, extra_body={"ignore_eos": True})
    assert [c.text for c in whole.choices] == [
        "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(3)]
    wait_until(lambda: cluster.gateway.in_flight("w0") == 0, 10, "the gateway's in-flight count back to 0")
    _assert_idle(cluster.w0)


@pytest.mark.parametrize("n", [0, -1, 1025, "2", 1.5, True])
def test_the_gateway_refuses_a_bad_n_itself(cluster: Cluster, n: Any) -> None:
    """The gateway bounds ``n`` before routing (1..1024: one request cannot claim absurd load)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": n, "max_tokens": 2}
    resp = httpx.post(cluster.gateway.proc.url + "/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "n" and "x-mesh-worker" not in resp.headers


@pytest.mark.parametrize("stream", [False, True])
def test_disaggregated_prefill_once_then_n_choices_on_the_decode_worker(cluster: Cluster, stream: bool) -> None:
    """The prefill computes the prompt once (one sequence, one transfer); the decode worker runs the
    n choices on the transferred blocks. Greedy: each choice is the one-worker answer."""
    body: dict[str, Any] = {"model": MODEL, "prompt": _fresh_prompt(), "max_tokens": 6, "temperature": 0,
                            "ignore_eos": True, "n": 3, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    one = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    reference = httpx.post(cluster.w0 + "/v1/completions", json={**one, "n": 1}, timeout=60).json()
    prefill = httpx.post(cluster.w0 + "/v1/completions", json=prefill_body(body), timeout=60)
    assert prefill.status_code == 200, prefill.text
    kv = prefill.json()["kv_transfer_params"]
    assert len(prefill.json()["choices"]) == 1 and kv["remote_block_keys"]
    decode = httpx.post(cluster.w1 + "/v1/completions", json=decode_body(body, kv), timeout=60)
    assert decode.status_code == 200, decode.text
    if stream:
        events = _events(decode.text)
        texts = _check_stream(events, 3, chat=False)
        usage = events[-2]["usage"]
    else:
        texts = {c["index"]: c["text"] for c in decode.json()["choices"]}
        usage = decode.json()["usage"]
    assert texts == {i: reference["choices"][0]["text"] for i in range(3)}
    assert usage["prompt_tokens_details"]["cached_tokens"] == len(kv["remote_block_keys"]) * BLOCK
    for url in (cluster.w0, cluster.w1):
        _assert_idle(url)


@pytest.mark.parametrize("stream", [False, True])
def test_the_echo_worker_answers_n_choices(cluster: Cluster, stream: bool) -> None:
    body = {"model": "echo", "messages": [{"role": "user", "content": "one two three"}], "n": 3, "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {})}
    resp = httpx.post(cluster.echo + "/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    if stream:
        events = _events(resp.text)
        assert _check_stream(events, 3, chat=True) == {i: "one two three" for i in range(3)}
        usage = events[-2]["usage"]
    else:
        choices = resp.json()["choices"]
        assert [(c["index"], c["message"]["content"]) for c in choices] == [(i, "one two three") for i in range(3)]
        usage = resp.json()["usage"]
    assert usage["completion_tokens"] == 3 * 3
    bad = httpx.post(cluster.echo + "/v1/completions", json={"model": "echo", "prompt": "x", "n": 0}, timeout=30)
    assert bad.status_code == 400 and "'n'" in bad.json()["error"]["message"]
