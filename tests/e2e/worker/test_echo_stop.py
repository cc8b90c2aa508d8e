"""The echo worker (``mesh up --engine echo``) honours ``stop`` as the bundled worker does: the text
ends before the first stop string (after it with ``include_stop_str_in_output``), finish_reason
``stop``, usage counting the words sent; streamed and not, chat and completions."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.procs import ProcessGroup

TEXT = "the quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def echo(module_procs: ProcessGroup) -> Iterator[httpx.Client]:
    worker = module_procs.echo_worker("echo-stop")
    with httpx.Client(base_url=worker.url, timeout=30) as client:
        yield client


def _chat(client: httpx.Client, **extra: Any) -> tuple[str, str, dict[str, Any]]:
    body = {"model": "echo", "max_tokens": 50, "messages": [{"role": "user", "content": TEXT}], **extra}
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    choice = data["choices"][0]
    return choice["message"]["content"], choice["finish_reason"], data["usage"]


def test_a_stop_string_ends_the_text_before_it(echo: httpx.Client) -> None:
    text, reason, usage = _chat(echo, stop=" over")
    assert (text, reason) == ("the quick brown fox jumps", "stop")
    assert usage["completion_tokens"] == 5
    assert _chat(echo, stop=["zzz", "brown", "quick"])[0] == "the "  # the first found in the text wins
    assert _chat(echo, stop="fox", include_stop_str_in_output=True)[0] == "the quick brown fox"
    assert _chat(echo, stop="the")[:2] == ("", "stop")


def test_a_stop_string_past_max_tokens_is_a_length_finish(echo: httpx.Client) -> None:
    text, reason, _ = _chat(echo, stop="lazy", max_tokens=3)
    assert (text, reason) == ("the quick brown ", "length")


def test_a_streamed_completion_stops_too(echo: httpx.Client) -> None:
    body = {"model": "echo", "prompt": TEXT, "max_tokens": 50, "stop": ["jumps"], "stream": True,
            "stream_options": {"include_usage": True}}
    events = [json.loads(line[6:]) for line in echo.post("/v1/completions", json=body).text.splitlines()
              if line.startswith("data: {")]
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert text == "the quick brown fox "
    assert [c["finish_reason"] for e in events for c in e["choices"]][-1] == "stop"
    assert events[-1]["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("stop", [3, [1], ["a", None]])
def test_a_stop_that_is_not_strings_is_a_400(echo: httpx.Client, stop: Any) -> None:
    resp = echo.post("/v1/completions", json={"model": "echo", "prompt": TEXT, "stop": stop})
    assert resp.status_code == 400 and "stop" in resp.json()["error"]["message"], resp.text
