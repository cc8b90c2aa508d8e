"""What the bundled worker answers, read by the official ``openai`` client from a real
``workers.server.cli --preset tiny`` process over real HTTP (streamed and not)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.e2e_bundled import start_workers
from tests.procs import ProcessGroup

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def client(module_procs: ProcessGroup) -> Iterator[openai.OpenAI]:
    workers = start_workers(module_procs, ["w0"], num_kv_blocks=256)
    yield openai.OpenAI(base_url=f"{workers['w0'].proc.url}/v1", api_key="unused", max_retries=0, timeout=60)


def _greedy(client: openai.OpenAI, stream: bool = False, **extra: object) -> tuple[str, str | None]:
    kw = {"model": "tiny", "prompt": PROMPT, "max_tokens": 40, "temperature": 0, **extra}
    if not stream:
        choice = client.completions.create(**kw).choices[0]  # type: ignore[call-overload]
        return choice.text, choice.finish_reason
    chunks = [c for c in client.completions.create(stream=True, **kw) if c.choices]  # type: ignore[call-overload]
    return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason


def _a_stop_in(text: str) -> tuple[int, str]:
    """Two characters of ``text`` (past its first) that are no replacement character."""
    k = next(i for i in range(1, len(text) - 2) if "\ufffd" not in text[i : i + 2])
    return text.find(text[k : k + 2]), text[k : k + 2]


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output_keeps_the_stop_string(client: openai.OpenAI, stream: bool) -> None:
    """vLLM's ``include_stop_str_in_output``: the text ends with the stop string (not ignored, not cut)."""
    full, _ = _greedy(client)
    at, stop = _a_stop_in(full)
    assert _greedy(client, stream, stop=[stop]) == (full[:at], "stop")
    kept = _greedy(client, stream, stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert kept == (full[: at + len(stop)], "stop")


def test_streams_parse_and_match_the_unstreamed_answer(client: openai.OpenAI) -> None:
    """Chunk object names, one id, the final usage chunk (no choices, cached tokens), finish reasons,
    a seeded answer equal streamed and not."""
    messages = [{"role": "user", "content": "hello there"}]
    kw = {"model": "tiny", "messages": messages, "max_tokens": 12, "temperature": 0.8, "seed": 7}
    whole = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    assert whole.object == "chat.completion" and whole.choices[0].finish_reason in ("stop", "length")
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert {c.object for c in chunks} == {"chat.completion.chunk"} and len({c.id for c in chunks}) == 1
    *body, last = chunks
    assert last.choices == [] and last.usage is not None and all(c.usage is None for c in body)
    assert last.usage.prompt_tokens_details is not None and last.usage.prompt_tokens_details.cached_tokens >= 16
    assert body[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in body) == whole.choices[0].message.content
    assert body[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    text = [c for c in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, stream=True,
                                                 stream_options={"include_usage": True})]
    assert {c.object for c in text} == {"text_completion"} and text[-1].choices == []
    assert text[-1].usage is not None and text[-1].usage.completion_tokens == 8
    assert text[-2].choices[0].finish_reason == "length"
