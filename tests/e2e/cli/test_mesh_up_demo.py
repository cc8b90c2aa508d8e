"""``mesh up`` as a first-time user runs it (its defaults: two bundled workers on the demo preset),
output to a file: the start-up shows each worker's phase with seconds, and the banner's curl
answers readable text through the real engine, with stop strings, max_tokens, streaming, usage and
the prefix cache behaving as on any preset."""

from __future__ import annotations

import json
import re
import string
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.procs import PYTHON, Proc, ProcessGroup, free_port, wait_http, wait_until

SESSION = {"x-session-id": "first-run"}


@pytest.fixture(scope="module")
def up(module_procs: ProcessGroup) -> Iterator[tuple[Proc, httpx.Client, dict[str, Any]]]:
    port = free_port()
    proc = module_procs.start([PYTHON, "-m", "mesh", "up", "--workers", "2", "--port", str(port)], name="up", port=port)
    wait_http(f"{proc.url}/ready", proc=proc, timeout_s=240)
    banner = wait_until(lambda: re.search(r"-d '(\{.*\})'", proc.log_tail(20_000)), what="the banner's curl")
    with httpx.Client(base_url=proc.url, timeout=120) as client:
        yield proc, client, json.loads(banner.group(1))


def _readable(text: str) -> None:
    assert text and set(text) <= set(string.printable) - set("\t\n\r\x0b\x0c"), repr(text)
    words = re.findall(r"[A-Za-z]{2,}", text)
    assert len(words) >= len(text.split()) * 0.8, text  # words, not byte soup


def _chat(client: httpx.Client, body: dict[str, Any], **extra: Any) -> tuple[str, str, dict[str, Any], str]:
    resp = client.post("/v1/chat/completions", json={**body, **extra}, headers=SESSION)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    choice = data["choices"][0]
    return choice["message"]["content"], choice["finish_reason"], data["usage"], resp.headers["x-mesh-worker"]


def test_start_up_says_what_each_worker_is_doing_when_the_output_is_a_file(up: tuple[Proc, httpx.Client, dict[str, Any]]) -> None:
    log = up[0].log_tail(20_000)
    assert "mesh up: starting 2 workers (worker-0, worker-1)" in log
    for name in ("worker-0", "worker-1"):
        loading = re.search(rf"^mesh up: {name} loading model \(\d+\.\d s\)$", log, re.M)
        ready = re.search(rf"^mesh up: {name} ready \(\d+\.\d s\)$", log, re.M)
        assert loading and ready and loading.start() < ready.start(), log
    assert re.search(r"^mesh up: 2 workers ready in \d+\.\d s; starting the gateway$", log, re.M), log
    assert "\r" not in log and "\x1b[" not in log  # no terminal redraws in a file
    assert "bundled workers, preset demo" in log


def test_the_banner_curl_answers_readable_text_naming_its_worker(up: tuple[Proc, httpx.Client, dict[str, Any]]) -> None:
    _, client, body = up
    assert body["model"] == "demo"
    text, reason, usage, worker = _chat(client, body, messages=[{"role": "user", "content": "hello, who are you?"}])
    _readable(text)
    assert text.startswith(f"Hello from {worker}, a Mesh worker running the demo preset.")
    assert f"Your prompt was {usage['prompt_tokens']} tokens" in text
    assert reason == "stop" and usage["completion_tokens"] == len(text) + 1  # the bytes and the EOS
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_a_repeated_prompt_comes_from_the_prefix_cache_and_the_answer_says_so(
        up: tuple[Proc, httpx.Client, dict[str, Any]]) -> None:
    _, client, body = up
    first = _chat(client, body)
    again = _chat(client, body)
    cached = again[2]["prompt_tokens_details"]["cached_tokens"]
    assert again[3] == first[3] and cached > 0
    _readable(again[0])
    assert f"; {cached} came from my prefix cache" in again[0]


def test_stop_strings_and_max_tokens_are_honoured(up: tuple[Proc, httpx.Client, dict[str, Any]]) -> None:
    _, client, body = up
    text, reason, usage, _ = _chat(client, body, stop=[" a Mesh worker"])
    assert re.fullmatch(r"Hello from worker-\d,", text) and reason == "stop", text
    text, reason, usage, _ = _chat(client, body, max_tokens=10)
    assert (text, reason, usage["completion_tokens"]) == ("Hello from", "length", 10)


def test_the_answer_streams_token_by_token(up: tuple[Proc, httpx.Client, dict[str, Any]]) -> None:
    _, client, body = up
    stream = {**body, "stream": True, "stream_options": {"include_usage": True},
              "messages": [{"role": "user", "content": "stream it, please"}]}
    lines = client.post("/v1/chat/completions", json=stream, headers=SESSION).text.splitlines()
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    pieces = [c["delta"].get("content") or "" for e in events for c in e["choices"]]
    text = "".join(pieces)
    _readable(text)
    assert sum(1 for p in pieces if p) >= len(text) // 2  # not one lump at the end
    assert events[-1]["usage"]["completion_tokens"] == len(text) + 1
    assert [line for line in lines if line][-1] == "data: [DONE]"


def test_the_worker_says_it_is_a_demo_preset(up: tuple[Proc, httpx.Client, dict[str, Any]]) -> None:
    port = re.search(r"worker-0:(\d+)", up[0].log_tail(20_000))
    assert port
    [card] = httpx.get(f"http://127.0.0.1:{port.group(1)}/v1/models", timeout=10).json()["data"]
    assert card["id"] == "demo" and card["note"].startswith("demo preset:") and "scripted" in card["note"]
