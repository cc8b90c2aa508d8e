"""Validation of an OpenAI completion body, as pure functions: what routing reads and what must
never reach a worker (a non-object body, an absurd ``max_tokens`` or ``n``, token ids out of
range). Each failure is a 400 in the OpenAI error shape naming the parameter."""

from __future__ import annotations

from typing import Any

import msgspec

from mesh.core.keys import MAX_TOKEN_ID
from mesh.errors import bad_request

MAX_MODEL_CHARS = 256
MAX_CHOICES = 1024  # OpenAI ``n`` accepted by the gateway (vLLM sets no limit)

_decode = msgspec.json.Decoder().decode


def decode_body(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise bad_request("request body is empty; expected a JSON object", code="empty_body")
    try:
        body = _decode(raw)
    except msgspec.MsgspecError as exc:
        message = str(exc)
        code = "invalid_utf8" if "UTF-8" in message else "invalid_json"
        raise bad_request(f"request body is not valid JSON: {message}", code=code) from exc
    except RecursionError:  # msgspec's own depth limit (about 1,000 levels)
        raise bad_request("request body is nested too deeply", code="too_deeply_nested") from None
    if not isinstance(body, dict):
        raise bad_request(f"request body must be a JSON object, not {type(body).__name__}", code="invalid_json")
    return body


def validate_common(body: dict[str, Any], max_tokens_limit: int) -> tuple[str, bool, int]:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a non-empty string", "model", "missing_model")
    if len(model) > MAX_MODEL_CHARS or not model.isprintable():
        raise bad_request(f"'model' must be at most {MAX_MODEL_CHARS} printable characters", "model")
    stream = body.get("stream")
    if stream is None:
        stream = False
    elif not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", "stream")
    max_tokens = 0
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise bad_request(f"'{name}' must be an integer", name)
        if value < 1 or value > max_tokens_limit:
            raise bad_request(f"'{name}' must lie in [1, {max_tokens_limit}], got {value}", name, "invalid_max_tokens")
        max_tokens = max(max_tokens, value)
    return model, stream, max_tokens


def validate_choices(body: dict[str, Any]) -> int:
    """OpenAI's ``n`` (null or absent: 1). Bounded here so that one request cannot claim absurd
    load; the worker applies its own limit (the bundled one: 128)."""
    n = body.get("n")
    if n is None:
        return 1
    if not isinstance(n, int) or isinstance(n, bool):
        raise bad_request("'n' must be an integer", "n")
    if not 1 <= n <= MAX_CHOICES:
        raise bad_request(f"'n' must lie in [1, {MAX_CHOICES}], got {n}", "n")
    return n


def chat_messages(body: dict[str, Any]) -> list[Any]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' is required and must be a non-empty array", "messages", "missing_messages")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request("each message must be an object with a string 'role'", "messages", "invalid_messages")
    return messages


def completion_prompt(body: dict[str, Any]) -> str | list[int]:
    """The prompt routed on: the string, or the first of a batch; token ids are range-checked."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return prompt[0]
        if all(_is_token(p) for p in prompt):
            return prompt
        if all(isinstance(p, list) and p and all(_is_token(t) for t in p) for p in prompt):
            return prompt[0]
    raise bad_request(
        "'prompt' is required: a string, an array of strings, or token ids in [0, 2**32)", "prompt", "invalid_prompt"
    )


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKEN_ID
