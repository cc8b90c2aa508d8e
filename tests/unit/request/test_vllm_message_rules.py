"""Message rules vLLM applies before the chat template, so the gateway's prompt (and keys) equal
the engine's: Claude Code's billing line leaves system text parts, and an assistant message's
``reasoning_content`` is its reasoning."""

from __future__ import annotations

import pytest

from mesh.request.chat import normalize_message


def _system(billing: str) -> dict[str, object]:
    return {"role": "system", "content": [
        {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.{billing}; cch={billing}\nYou are Claude Code."},
        {"type": "text", "text": "Static instructions."}]}


@pytest.mark.parametrize("content_format", ["string", "openai"])
def test_the_billing_line_leaves_system_text_parts(content_format: str) -> None:
    first = normalize_message(_system("77"), content_format)  # type: ignore[arg-type]
    later = normalize_message(_system("91"), content_format)  # type: ignore[arg-type]
    assert first == later  # two requests of one conversation now share their prefix
    text = first["content"] if content_format == "string" else first["content"][0]["text"]
    assert text.startswith("You are Claude Code.") and "billing" not in str(first)


def test_only_a_leading_billing_line_of_a_system_part_goes() -> None:
    user = {"role": "user", "content": [{"type": "text", "text": "x-anthropic-billing-header: a\nhi"}]}
    assert normalize_message(user)["content"] == "x-anthropic-billing-header: a\nhi"
    quoted = {"role": "system", "content": [{"type": "text", "text": "see x-anthropic-billing-header: b"}]}
    assert normalize_message(quoted)["content"] == "see x-anthropic-billing-header: b"


def test_reasoning_content_is_the_reasoning_as_vllm_reads_it() -> None:
    old = normalize_message({"role": "assistant", "content": "ok", "reasoning_content": "think"})
    new = normalize_message({"role": "assistant", "content": "ok", "reasoning": "think"})
    assert old == new and old["reasoning"] == "think"
