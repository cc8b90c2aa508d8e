"""cache_aware matches a chat request on the text sglang-router matches it on (its
``ChatCompletionRequest::extract_text_for_routing``: message contents joined by spaces, no roles,
no template), not on the rendered chat template: the two straddle the 0.3 threshold for a short
shared system prompt and a long new user message (0.296 in SGLang, 0.35 on the ChatML text).
Unit tests of the extraction, and a real gateway's /debug/route."""

from __future__ import annotations

from pathlib import Path

import httpx
import yaml

from mesh.request.prompt import sglang_routing_text
from tests.procs import ProcessGroup, free_port


def test_the_extraction_follows_sglang_message_by_message() -> None:
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}},
                                     {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "ans", "reasoning_content": "why"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function",
                                                               "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "out", "tool_call_id": "1"},
        {"role": "assistant", "content": "", "reasoning_content": " think "},
    ]
    # the tool-call-only assistant message (no content, no reasoning) is left out
    assert sglang_routing_text(messages) == "sys a b ans why out think"


def test_a_gateway_matches_chat_on_the_sglang_text(procs: ProcessGroup, tmp_path: Path) -> None:
    echo = procs.echo_worker("e0")
    config = tmp_path / "mesh.yaml"
    config.write_text(yaml.safe_dump({"policy": "cache_aware",
                                      "workers": [{"name": "e0", "url": echo.url, "models": ["echo"]}]}))
    gateway = procs.gateway(config, port=free_port())
    system = "s" * 100
    first = [{"role": "system", "content": system}, {"role": "user", "content": "hello"}]
    second = [{"role": "system", "content": system}, {"role": "user", "content": "u" * 240}]
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        assert http.post("/v1/chat/completions", json={"model": "echo", "messages": first, "max_tokens": 1}).status_code == 200
        route = http.post("/debug/route", json={"model": "echo", "messages": second}).json()
    rate = route["decision"]["candidates"]["e0"]["scores"]["match_rate"]
    shared = len(system) + 1  # the system prompt and the space after it
    assert abs(rate - shared / len(sglang_routing_text(second))) < 1e-6, route  # 0.296, not 0.35
    assert route["decision"]["target"] == "e0" and "prefix match" not in route["decision"]["reason"]
