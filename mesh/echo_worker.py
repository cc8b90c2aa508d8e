"""A small OpenAI-compatible echo worker: the stand-in engine of ``mesh up`` and of tests.

It answers ``/v1/chat/completions`` and ``/v1/completions`` (streaming and not) by echoing the
last user message (or the prompt) word by word, up to ``max_tokens`` words and ending before the
first ``stop`` string (or after it, with vLLM's ``include_stop_str_in_output``), ``n`` (1 to 128)
choices of it (streamed, their chunks interleave word by word); ``/v1/models`` (``--lora
NAME[=BASE]`` adds an adapter as vLLM lists one); ``/health``. Usage counts prompt tokens with the
byte-level tokenizer (the gateway's default) and ``cached_tokens = 0`` (it has no cache; tests set
``--cached-tokens N`` to have it report N).

Failure injection for tests (flags, or env ``MESH_ECHO_<FLAG>``; also ``POST /admin/faults``):
``--fail-rate P`` answers 500 before any output with probability P; ``--fail-on TEXT`` answers 500
to every prompt containing TEXT; ``--crash-after-tokens N`` kills the process after streaming N
tokens; ``--unhealthy`` makes ``/health`` answer 503; ``--repeat N`` echoes the text N times.
Timing: ``--first-token-delay-s``, ``--token-delay-s`` per output word, ``--prompt-token-delay-s``
per prompt token before answering (a TTFT that grows with the prompt, as a real prefill's).

    python -m mesh.echo_worker --port 9001 [--model echo] [--token-delay-s 0.01]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from mesh.request.options import ChatTemplateError
from mesh.request.tokenizer import ByteTokenizer

_encode = msgspec.json.Encoder().encode
_WORDS = re.compile(r"\S+\s*")


@dataclass
class EchoSettings:
    name: str = "echo-0"
    models: tuple[str, ...] = ("echo",)
    loras: tuple[tuple[str, str], ...] = ()  # (adapter, base model)
    token_delay_s: float = 0.0
    first_token_delay_s: float = 0.0
    prompt_token_delay_s: float = 0.0  # per prompt token before the first (a prefill whose TTFT grows with the prompt)
    fail_rate: float = 0.0
    fail_on: str = ""  # prompts containing it answer 500 ("" = never)
    crash_after_tokens: int = 0  # 0 = never
    unhealthy: bool = False
    default_max_tokens: int = 16
    repeat: int = 1  # the echoed text, this many times over
    cached_tokens: int = 0  # reported as usage.prompt_tokens_details.cached_tokens (at most the prompt's)


def _error(status: int, message: str, type_: str = "invalid_request_error") -> Response:
    body = {"error": {"message": message, "type": type_, "param": None, "code": None}}
    return Response(_encode(body), status, media_type="application/json")


def create_echo_app(settings: EchoSettings | None = None) -> FastAPI:
    echo = _Echo(settings or EchoSettings())
    app = FastAPI(title="mesh echo worker")
    app.state.settings = echo.settings
    app.state.echo = echo
    app.add_api_route("/health", echo.health, methods=["GET"])
    app.add_api_route("/v1/models", echo.models, methods=["GET"])
    app.add_api_route("/admin/faults", echo.faults, methods=["POST"])
    app.add_api_route("/v1/chat/completions", echo.chat, methods=["POST"])
    app.add_api_route("/v1/completions", echo.completions, methods=["POST"])
    return app


class _Echo:
    """The echo worker's route handlers; its settings (changed at runtime by ``/admin/faults``) and
    its count of served requests live here, one per app."""

    def __init__(self, settings: EchoSettings) -> None:
        self.settings = settings
        self.tokenizer = ByteTokenizer()
        self.served = 0

    async def health(self) -> Response:
        if self.settings.unhealthy:
            return _error(503, "unhealthy (injected)", "service_unavailable_error")
        return Response(b'{"status":"ok"}', media_type="application/json")

    async def models(self) -> dict[str, Any]:
        settings = self.settings
        data = [{"id": m, "object": "model", "created": 0, "owned_by": settings.name, "root": m, "parent": None}
                for m in settings.models]
        data += [{"id": a, "object": "model", "created": 0, "owned_by": settings.name, "root": f"/adapters/{a}",
                  "parent": base} for a, base in settings.loras]
        return {"object": "list", "data": data}

    async def faults(self, request: Request) -> Response:
        """Change fault injection at runtime: any of fail_rate, crash_after_tokens, unhealthy, delays."""
        settings = self.settings
        try:
            changes = msgspec.json.decode(await request.body())
            if not isinstance(changes, dict):
                raise ValueError("body must be a JSON object")
            for key, value in changes.items():
                if key in ("fail_rate", "fail_on", "crash_after_tokens", "unhealthy", "token_delay_s", "first_token_delay_s",
                           "prompt_token_delay_s"):
                    # by name, from the JSON body: each value converted to the setting's own type
                    setattr(settings, key, type(getattr(settings, key))(value))
        except (msgspec.MsgspecError, ValueError, TypeError) as exc:
            return _error(400, f"invalid faults: {exc}")
        return Response(_encode({"name": settings.name, "served": self.served}), media_type="application/json")

    async def chat(self, request: Request) -> Response:
        return await self.complete(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self.complete(request, chat=False)

    async def complete(self, request: Request, chat: bool) -> Response:
        settings = self.settings
        try:
            body = msgspec.json.decode(await request.body())
        except msgspec.MsgspecError as exc:
            return _error(400, f"invalid JSON: {exc}")
        if not isinstance(body, dict):
            return _error(400, "body must be a JSON object")
        model = body.get("model")
        if model not in settings.models and all(model != a for a, _ in settings.loras):
            return _error(404, f"model {model!r} not served here", "not_found_error")
        try:
            prompt_text, echo_text = _texts(body, chat, self.tokenizer)
        except (ChatTemplateError, ValueError) as exc:
            return _error(400, str(exc))
        try:
            max_tokens = _max_tokens(body, settings.default_max_tokens)
            include_usage = _include_usage(body)
            n = _choices(body)
            stops = _stops(body)
        except ValueError as exc:
            return _error(400, str(exc))
        if (settings.fail_rate and random.random() < settings.fail_rate) or (
                settings.fail_on and settings.fail_on in prompt_text):
            return _error(500, "injected failure", "server_error")
        self.served += 1
        if settings.repeat > 1:
            echo_text = " ".join([echo_text] * settings.repeat)
        echo_text, stopped = _cut_at_stop(echo_text, stops, body.get("include_stop_str_in_output") is True)
        words = _WORDS.findall(echo_text) or ([] if stopped else ["echo"])
        out = words[: int(max_tokens)]
        finish = "length" if len(words) > len(out) else "stop"  # a stop string past max_tokens: length
        usage: dict[str, Any] = {
            "prompt_tokens": len(prompt_text.encode()),
            "completion_tokens": n * len(out),
            "total_tokens": len(prompt_text.encode()) + n * len(out),
            "prompt_tokens_details": {"cached_tokens": min(settings.cached_tokens, len(prompt_text.encode()))},
        }
        answer = _Answer(("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24], str(model), out, finish, chat, n)
        # the request id it was sent (the gateway's, forwarded): tests check what reached the worker
        headers = {"x-echo-worker": settings.name, "x-echo-request-id": request.headers.get("x-request-id", "")}
        if settings.prompt_token_delay_s:  # the prefill: before any byte of the answer
            await asyncio.sleep(settings.prompt_token_delay_s * usage["prompt_tokens"])
        if body.get("stream"):
            stream = self.stream(answer, usage if include_usage else None)
            return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
        if settings.first_token_delay_s or settings.token_delay_s:
            await asyncio.sleep(settings.first_token_delay_s + settings.token_delay_s * len(out))
        return Response(_encode(answer.whole(usage)), media_type="application/json", headers=headers)

    async def stream(self, answer: _Answer, usage: dict[str, Any] | None) -> AsyncIterator[bytes]:
        """The answer's SSE events: per word one chunk per choice (``crash_after_tokens`` kills the
        process mid-stream), the finish chunks, the usage chunk when asked for, ``[DONE]``."""
        settings, chat, n = self.settings, answer.chat, answer.n
        if settings.first_token_delay_s:
            await asyncio.sleep(settings.first_token_delay_s)
        if chat:
            for index in range(n):
                yield answer.event({"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
        for i, word in enumerate(answer.words):
            if settings.crash_after_tokens and i >= settings.crash_after_tokens:
                os._exit(17)  # a crash, on purpose: the socket dies mid-stream
            if settings.token_delay_s:
                await asyncio.sleep(settings.token_delay_s)
            delta: dict[str, Any] = {"delta": {"content": word}} if chat else {"text": word, "logprobs": None}
            for index in range(n):
                yield answer.event({"index": index, **delta, "finish_reason": None})
        last: dict[str, Any] = {"delta": {}} if chat else {"text": "", "logprobs": None}
        for index in range(n):
            yield answer.event({"index": index, **last, "finish_reason": answer.finish})
        if usage is not None:
            payload = {"id": answer.rid, "object": answer.chunk_object, "created": answer.created, "model": answer.model,
                       "choices": [], "usage": usage}
            yield b"data: " + _encode(payload) + b"\n\n"
        yield b"data: [DONE]\n\n"


@dataclass
class _Answer:
    """One echo answer: its id, model, words and finish reason, for ``n`` choices."""

    rid: str
    model: str
    words: list[str]
    finish: str
    chat: bool
    n: int
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def event(self, choice: dict[str, Any]) -> bytes:
        payload = {"id": self.rid, "object": self.chunk_object, "created": self.created, "model": self.model,
                   "choices": [choice]}
        return b"data: " + _encode(payload) + b"\n\n"

    def whole(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The non-streamed answer's body."""
        text = "".join(self.words)
        if self.chat:
            choices: list[dict[str, Any]] = [{"index": i, "message": {"role": "assistant", "content": text},
                                              "finish_reason": self.finish} for i in range(self.n)]
            obj = "chat.completion"
        else:
            choices = [{"index": i, "text": text, "logprobs": None, "finish_reason": self.finish} for i in range(self.n)]
            obj = "text_completion"
        return {"id": self.rid, "object": obj, "created": int(time.time()), "model": self.model, "choices": choices,
                "usage": usage}


def _max_tokens(body: dict[str, Any], default: int) -> int:
    """The words to echo: ``max_tokens`` (or ``max_completion_tokens``), a positive integer."""
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"'{name}' must be a positive integer")
        return value
    return default


MAX_CHOICES = 128  # as the bundled worker's (workers.server.app.MAX_CHOICES)


def _choices(body: dict[str, Any]) -> int:
    """``n``: the choices to answer (null: 1), a positive integer up to ``MAX_CHOICES``."""
    value = body.get("n")
    if value is None:
        return 1
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError("'n' must be a positive integer")
    if value > MAX_CHOICES:
        raise ValueError(f"'n' must be at most {MAX_CHOICES}, got {value}")
    return value


MAX_STOPS = 1024  # as the bundled worker's (workers.server.app.MAX_STOPS)


def _stops(body: dict[str, Any]) -> list[str]:
    """``stop``: null, a string, or a list of strings (empty ones never match)."""
    value = body.get("stop")
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(v, str) for v in stops):
        raise ValueError("'stop' must be a string or a list of strings")
    if len(stops) > MAX_STOPS:
        raise ValueError(f"at most {MAX_STOPS} stop sequences are supported, got {len(stops)}")
    return [v for v in stops if v]


def _cut_at_stop(text: str, stops: list[str], include: bool) -> tuple[str, bool]:
    """``text`` up to the first stop string (exclusive, or inclusive with ``include``); whether one was found."""
    hits = [(i, i + len(stop)) for stop in stops if (i := text.find(stop)) >= 0]
    if not hits:
        return text, False
    start, end = min(hits)
    return text[: end if include else start], True


def _include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise ValueError("'stream_options' must be an object")
    return bool(options.get("include_usage"))


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)


def _texts(body: dict[str, Any], chat: bool, tokenizer: ByteTokenizer) -> tuple[str, str]:
    """(the rendered prompt, the text to echo)."""
    prompt: Any
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("'messages' must be a non-empty array")
        prompt = tokenizer.render_chat(messages)
        users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
        last = users[-1] if users else messages[-1]
        content = last.get("content") if isinstance(last, dict) else ""
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        return prompt, content if isinstance(content, str) else ""
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        if prompt and _is_ids(prompt):
            prompt = tokenizer.decode(prompt)
        elif prompt and all(isinstance(p, str) for p in prompt):
            prompt = prompt[0]
        elif prompt and all(_is_ids(p) for p in prompt):
            prompt = tokenizer.decode(prompt[0])
        else:
            raise ValueError("'prompt' must be a string, strings, or token ids")
    if not isinstance(prompt, str):
        raise ValueError("'prompt' must be a string or token ids")
    return prompt, prompt


def settings_from_args(argv: list[str] | None = None) -> tuple[EchoSettings, str, int]:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="python -m mesh.echo_worker", description="OpenAI-compatible echo worker")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=int(env("MESH_ECHO_PORT", "9001")))
    p.add_argument("--name", default=env("MESH_ECHO_NAME"))
    p.add_argument("--model", action="append", dest="models", help="model id served (repeatable; default echo)")
    p.add_argument("--lora", action="append", dest="loras", default=[], metavar="NAME[=BASE]",
                   help="LoRA adapter served under its own model name (repeatable; BASE: the first --model)")
    p.add_argument("--token-delay-s", type=float, default=float(env("MESH_ECHO_TOKEN_DELAY_S", "0")))
    p.add_argument("--first-token-delay-s", type=float, default=float(env("MESH_ECHO_FIRST_TOKEN_DELAY_S", "0")))
    p.add_argument("--prompt-token-delay-s", type=float, default=float(env("MESH_ECHO_PROMPT_TOKEN_DELAY_S", "0")),
                   help="wait S seconds per prompt token before answering (TTFT grows with the prompt, as a prefill's)")
    p.add_argument("--fail-rate", type=float, default=float(env("MESH_ECHO_FAIL_RATE", "0")))
    p.add_argument("--fail-on", default=env("MESH_ECHO_FAIL_ON", ""), metavar="TEXT",
                   help="answer 500 to requests whose prompt contains TEXT")
    p.add_argument("--crash-after-tokens", type=int, default=int(env("MESH_ECHO_CRASH_AFTER_TOKENS", "0")))
    p.add_argument("--repeat", type=int, default=int(env("MESH_ECHO_REPEAT", "1")), help="echo the text N times")
    p.add_argument("--cached-tokens", type=int, default=int(env("MESH_ECHO_CACHED_TOKENS", "0")),
                   help="report N cached prompt tokens (at most the prompt's) in usage")
    p.add_argument("--unhealthy", action="store_true", default=env("MESH_ECHO_UNHEALTHY", "") not in ("", "0"))
    args = p.parse_args(argv)
    models = tuple(args.models or [env("MESH_ECHO_MODEL", "echo")])
    loras = []
    for spec in args.loras:
        name, _, base = spec.partition("=")
        if not name or (base and base not in models):
            p.error(f"--lora {spec!r}: expected NAME or NAME=BASE with BASE one of --model {list(models)}")
        loras.append((name, base or models[0]))
    settings = EchoSettings(
        name=args.name or f"echo-{args.port}",
        models=models,
        loras=tuple(loras),
        token_delay_s=args.token_delay_s,
        first_token_delay_s=args.first_token_delay_s,
        prompt_token_delay_s=args.prompt_token_delay_s,
        fail_rate=args.fail_rate,
        fail_on=args.fail_on,
        crash_after_tokens=args.crash_after_tokens,
        unhealthy=args.unhealthy,
        repeat=max(1, args.repeat),
        cached_tokens=max(0, args.cached_tokens),
    )
    return settings, args.host, args.port


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    settings, host, port = settings_from_args(argv)
    uvicorn.run(create_echo_app(settings), host=host, port=port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
