"""``mesh worker --preset tiny`` as a real subprocess on a free port, driven over real HTTP."""

from __future__ import annotations

import re
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests.procs import free_port, start_process, stop_process, wait_http

ROOT = Path(__file__).resolve().parents[3]
NUM_BLOCKS = 128  # 2048 tokens of KV
MODEL = "tiny"


def _worker_command() -> list[str]:
    """``python -m mesh worker``; while some other subcommand module of the mesh CLI is not in the
    tree yet, the same ``workers.server.cli.run`` through ``python -m workers.server.cli``."""
    try:
        from mesh.cli import build_parser

        build_parser()
        return [sys.executable, "-m", "mesh", "worker"]
    except ImportError:
        return [sys.executable, "-m", "workers.server.cli"]


@dataclass(frozen=True)
class Worker:
    url: str
    replay_port: int  # the KV events replay (DEALER) endpoint


@pytest.fixture(scope="module")
def tiny_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    """A tiny worker on ports from ``tests.procs.free_port`` (outside the ephemeral range that
    other processes' connections draw from), healthy."""
    port, replay = free_port(), free_port()
    cmd = _worker_command() + [
        "--preset", "tiny", "--host", "127.0.0.1", "--port", str(port), "--num-kv-blocks", str(NUM_BLOCKS),
        "--cpu-threads", "1", "--log-level", "warning",
        "--kv-events-endpoint", f"tcp://*:{free_port()}", "--kv-events-replay-endpoint", f"tcp://*:{replay}",
    ]
    proc = start_process(cmd, name="tiny", log_dir=tmp_path_factory.mktemp("worker"), port=port,
                         env={"PYTHONPATH": str(ROOT)})
    try:
        wait_http(proc.url + "/health", proc=proc, timeout_s=90)
        yield Worker(proc.url, replay)
    finally:
        stop_process(proc, timeout_s=15)


@pytest.fixture(scope="module")
def worker(tiny_worker: Worker) -> str:
    return tiny_worker.url


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def _metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(mesh_worker_\w+) (\S+)$", text, re.M)}


def _wait_idle(url: str, timeout: float = 20) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(url)
        if (m["mesh_worker_kv_blocks_used"] == 0 and m["mesh_worker_num_requests_running"] == 0
                and m["mesh_worker_num_requests_waiting"] == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def test_openai_client_completions_and_chat_stream_and_not(worker: str) -> None:
    client = _client(worker)
    args = dict(model=MODEL, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(prompt="The quick brown fox", **args)
    assert full.object == "text_completion" and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12 and full.usage.prompt_tokens == len(b"The quick brown fox")
    chunks = list(client.completions.create(prompt="The quick brown fox", stream=True,
                                            stream_options={"include_usage": True}, **args))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].choices == []

    messages = [{"role": "user", "content": "Say something."}]
    chat = client.chat.completions.create(messages=messages, **args)
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    stream = list(client.chat.completions.create(messages=messages, stream=True,
                                                 stream_options={"include_usage": True}, **args))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == chat.choices[0].message.content
    assert [c.choices[0].finish_reason for c in stream if c.choices][-1] == "length"
    assert stream[-1].usage.prompt_tokens == chat.usage.prompt_tokens
    # The prompt is the gateway's rendering: ChatML bytes.
    tok = httpx.post(f"{worker}/tokenize", json={"messages": messages}).json()
    assert tok["count"] == chat.usage.prompt_tokens
    assert client.models.list().data[0].id == MODEL


def test_repeated_prompt_reports_truthful_cached_tokens(worker: str) -> None:
    client = _client(worker)
    prompt = f"{uuid.uuid4().hex} " + "a long shared context line. " * 10  # 33 + 280 bytes
    n = len(prompt.encode())
    before = _wait_idle(worker)
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    after = _wait_idle(worker)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16
    assert after["mesh_worker_prompt_cached_tokens_total"] - before["mesh_worker_prompt_cached_tokens_total"] == (n - 1) // 16 * 16
    computed = after["mesh_worker_prefill_computed_tokens_total"] - before["mesh_worker_prefill_computed_tokens_total"]
    assert computed == n + (n - (n - 1) // 16 * 16)
    assert second.choices[0].text == first.choices[0].text


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"model": MODEL, "prompt": ""}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "x" * 9000}, "prompt"),  # over max_model_len 8192
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3000}, "max_tokens"),  # KV capacity 2048
        ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 99999]}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"model": MODEL}, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 0}, "n"),  # n > 1 works: tests/e2e/worker/test_worker_n.py
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "no role"}]}, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature"),
    ],
)
def test_bad_input_is_a_400_in_openai_shape(worker: str, path: str, body: dict, param: str) -> None:
    r = httpx.post(f"{worker}{path}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param


def test_malformed_body_and_unknown_model(worker: str) -> None:
    r = httpx.post(f"{worker}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(f"{worker}/v1/completions", json={"model": "other", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert httpx.get(f"{worker}/health").status_code == 200  # still serving


def test_client_disconnect_frees_blocks(worker: str) -> None:
    body = {"model": MODEL, "prompt": "disconnect " * 30, "max_tokens": 1500, "ignore_eos": True}
    start = _wait_idle(worker)["mesh_worker_generation_tokens_total"]
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{worker}/v1/completions", json={**body, "stream": True}) as r:
            lines = r.iter_lines()
            for _ in range(6):
                next(lines)
            assert _metrics(worker)["mesh_worker_kv_blocks_used"] > 0  # the request holds blocks
    m = _wait_idle(worker)
    assert m["mesh_worker_kv_blocks_used"] == 0
    assert m["mesh_worker_generation_tokens_total"] - start < 1500  # aborted, not run to the end
    start = m["mesh_worker_generation_tokens_total"]

    # Non-streaming: the client gives up (timeout) while the request is still generating.
    errors: list[Exception] = []

    def call() -> None:
        try:
            httpx.post(f"{worker}/v1/completions", json=body, timeout=1.5)
        except httpx.TimeoutException as exc:
            errors.append(exc)

    t = threading.Thread(target=call)
    t.start()
    t.join()
    assert errors, "the request finished before the client gave up; make it longer"
    m = _wait_idle(worker)
    assert m["mesh_worker_kv_blocks_used"] == 0 and m["mesh_worker_num_requests_running"] == 0
    assert m["mesh_worker_generation_tokens_total"] - start < 1500


def test_kv_events_of_a_request_reach_a_subscriber(tiny_worker: Worker) -> None:
    worker = tiny_worker.url
    import msgspec
    import zmq

    from mesh.core.keys import block_keys, namespace_seed

    prompt = f"events {uuid.uuid4().hex} " + "x" * 40  # 88 bytes: 5 full blocks
    _client(worker).completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    tokens = list(prompt.encode())
    keys = block_keys(tokens, 16, namespace_seed(MODEL))
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{tiny_worker.replay_port}")
    stored: list[int] = []
    try:
        for _ in range(50):  # the publisher thread may be a moment behind the response
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            while True:
                assert dealer.poll(5000)
                _, _topic, seq, payload = dealer.recv_multipart()
                if int.from_bytes(seq, "big", signed=True) == -1:
                    break
                for ev in msgspec.msgpack.decode(payload)[1]:
                    if ev["type"] == "BlockStored":
                        stored += ev["block_hashes"]
            if set(keys) <= set(stored):
                break
            time.sleep(0.1)
    finally:
        dealer.close(linger=0)
        ctx.term()
    assert set(keys) <= set(stored)  # the engine's hashes are the router's keys of the prompt


def test_stop_strings_cut_the_text_even_across_chunks() -> None:
    from workers.server.app import StopText

    text = StopText(["END", "\n\n"])
    out = []
    for piece in ["Hello E", "N", "D tail"]:
        delta, stopped = text.push(piece)
        out.append(delta)
        if stopped:
            break
    assert "".join(out) == "Hello " and stopped  # "E" was held back until "END" was decided
    plain = StopText([])
    assert plain.push("abc") == ("abc", False) and plain.flush() == ""
