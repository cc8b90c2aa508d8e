"""The worker's OpenAI-compatible HTTP server (FastAPI) over ``AsyncLLMEngine``.

Endpoints: ``/v1/completions``, ``/v1/chat/completions`` (streaming and not), ``/v1/models``,
``/health``, ``/metrics`` (Prometheus), ``/tokenize``, ``/detokenize``, ``/reset_prefix_cache``.

Prompts are tokenized exactly as the gateway (``mesh.request.prompt``) does: chat = ``encode(render_chat
(messages))``, completion text = ``encode(text)``, completion token ids as given; no BOS is
added. So the router's block keys are this engine's block hashes.

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``; bad input is a
400, never a crash. A client that disconnects aborts its request, which frees its blocks.

``n`` (several choices per prompt) runs as vLLM runs it: each choice is its own engine request
(a "child"; ``Child``), numbered ``prompt_index * n + i``; see ``WorkerAPI.children`` for seeds
and prefix sharing, ``usage`` for how the tokens are counted, ``run_choices`` for aborts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt
from starlette.exceptions import HTTPException as StarletteHTTPException

from mesh.core.retention import RETENTION_HEADER, SPILL
from mesh.request.chat import CONTENT_FORMATS, ChatOptions, ChatTemplateError
from workers.engine.llm_engine import AsyncLLMEngine, EngineDeadError, RequestOutput, RequestRejected
from workers.engine.sequence import InvalidSamplingParams, SamplingParams

log = logging.getLogger(__name__)


# ---- errors -----------------------------------------------------------------------------------


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
          500: "server_error", 503: "service_unavailable_error"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    default = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": _TYPES.get(status, default),
                      "param": param, "code": code}}


def field_errors(errors: Sequence[Any]) -> tuple[str, str | None]:
    """(message, param) of a request model's validation errors: the first three, the first field named."""
    params = [".".join(str(x) for x in e.get("loc", ()) if x != "body") for e in errors]
    message = "; ".join(f"{p or 'body'}: {e.get('msg')}" for p, e in list(zip(params, errors))[:3])
    return message or "invalid request body", (params or [None])[0] or None


def _error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return _error_response(400, "request body is not valid JSON", None, "invalid_json")
        whole = next((e for e in errors if tuple(e.get("loc", ())) == ("body",)), None)
        if whole is not None and whole.get("type") == "missing":  # as the gateway says it
            return _error_response(400, "request body is empty; expected a JSON object", None, "empty_body")
        if whole is not None and isinstance(whole.get("input"), (bytes, str)):  # FastAPI read no JSON
            return _error_response(400, "request body must be JSON, sent with the header "
                                   "Content-Type: application/json", None, "invalid_content_type")
        if whole is not None and whole.get("input") is not None:
            kind = type(whole["input"]).__name__
            return _error_response(400, f"request body must be a JSON object, not {kind}", None, "invalid_json")
        return _error_response(400, *field_errors(errors))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return _error_response(503, str(exc), code="engine_dead")

    @app.exception_handler(RequestRejected)
    async def _rejected(_: Request, exc: RequestRejected) -> JSONResponse:
        return _error_response(400, str(exc))

    @app.exception_handler(Exception)
    async def _any(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return _error_response(500, f"internal error: {type(exc).__name__}")


# ---- request bodies ---------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: StrictInt | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: StrictInt = -1
    n: StrictInt | None = 1  # null: 1 (OpenAI's and vLLM's default); range: ``check_choices``
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    seed: StrictInt | None = None
    ignore_eos: bool = False
    cache_salt: str | None = None
    user: str | None = None


class CompletionRequest(_Common):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16  # OpenAI's default for completions
    echo: bool = False
    logprobs: StrictInt | None = None


class ChatRequest(_Common):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: bool | None = None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool | None = None  # None: vLLM's default (True), unless continue_final_message


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    tokens: list[StrictInt]


# ---- text out of a token stream -----------------------------------------------------------------


class StopText:
    """Accumulates generated text; holds back what could still become a stop string. The text ends
    before the first stop string found, or after it with ``include`` (vLLM's
    ``include_stop_str_in_output``)."""

    def __init__(self, stops: list[str], include: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include = include
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.sent = 0

    def push(self, piece: str) -> tuple[str, bool]:
        # A new match ends in ``piece``, so it starts at most ``hold`` characters before it: only
        # that tail is searched (the whole text, per token and stop, cost seconds of event loop).
        start = max(0, len(self.text) - self.hold)
        self.text += piece
        hits = [(i, i + len(s)) for s, i in ((s, self.text.find(s, start)) for s in self.stops) if i >= 0]
        if hits:
            first, end = min(hits)
            self.text = self.text[: end if self.include else first]
            return self._emit(len(self.text)), True
        return self._emit(max(self.sent, len(self.text) - self.hold)), False

    def flush(self) -> str:
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        delta = self.text[self.sent : upto]
        self.sent = max(self.sent, upto)
        return delta


@dataclass
class Chunk:
    text: str
    finish_reason: str | None
    output: RequestOutput


@dataclass(frozen=True, slots=True)
class CacheHints:
    """How a request's KV is keyed and kept: ``salt`` (vLLM's ``cache_salt``, a key namespace of
    its own) and ``evict_first`` (the router's retention hint, ``x-mesh-retention: spill``: once
    the request ends its blocks are evicted before any other's)."""

    salt: str | None = None
    evict_first: bool = False


def cache_hints(req: _Common, request: Request) -> CacheHints:
    return CacheHints(req.cache_salt, request.headers.get(RETENTION_HEADER, "").strip().lower() == SPILL)


@dataclass(frozen=True)
class Child:
    """One choice of a request: its own engine request over its prompt's tokens."""

    index: int  # the choice's index: prompt * n + i (OpenAI's and vLLM's numbering)
    prompt: int  # the index of its prompt in the request
    rid: str  # its engine request id
    ids: list[int]
    params: SamplingParams
    gate: int | None = None  # start after this child (its prompt's first) has its first output


# ---- the app ------------------------------------------------------------------------------------


class WorkerAPI:
    """Request handling; state lives here (one instance per app), never in module globals."""

    def __init__(self, engine: AsyncLLMEngine, tokenizer: Any, model_name: str, info: dict[str, Any],
                 content_format: str = "auto") -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.info = info
        if content_format not in CONTENT_FORMATS:
            raise ValueError(f"chat template content format must be one of {CONTENT_FORMATS}, not {content_format!r}")
        self.content_format = content_format  # --chat-template-content-format: "auto" = the template's
        self.max_model_len = engine.engine.max_model_len

    # -- prompt and params --

    def check_model(self, model: str | None) -> None:
        if model and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")

    def completion_prompts(self, prompt: Any, add_special_tokens: bool = True) -> list[list[int]]:
        if isinstance(prompt, str):
            prompts: list[Any] = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise APIError(400, "the prompt is empty", "prompt")
        return [encode_text(self.tokenizer, p, "prompt", add_special_tokens) if isinstance(p, str) else list(p)
                for p in prompts]

    def chat_prompt(self, messages: list[dict[str, Any]], body: dict[str, Any]) -> list[int]:
        """Rendered with the request's template options (``mesh.request.chat.ChatOptions``, as the gateway
        renders it), encoded without special tokens unless the body asks (vLLM's chat default)."""
        try:
            text = self.tokenizer.render_chat(messages, ChatOptions.from_body(body).forced(self.content_format))
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), "messages") from exc
        return encode_text(self.tokenizer, text, "messages", special_tokens(body, default=False))

    def params(self, req: _Common, max_tokens: int | None, prompt_len: int) -> SamplingParams:
        """One prompt's sampling params (a child's seed is derived from them: ``children``);
        ``check_choices`` has checked ``n`` first."""
        if req.stream_options is not None and not req.stream:  # OpenAI's and vLLM's rule
            raise APIError(400, "stream_options can only be set when stream is true", "stream_options")
        check_unsupported(req)
        check_sampling(req)
        if max_tokens is None:  # as much as fits (vLLM's default)
            cap = min(self.max_model_len, self.engine.engine.capacity_tokens)
            max_tokens = max(1, cap - prompt_len)
        temperature = 0.0 if 0 < req.temperature < GREEDY_BELOW else req.temperature  # a negative one stays a 400
        try:  # NaN and infinities are refused by SamplingParams itself (the one place that checks them)
            return SamplingParams(
                temperature=temperature, top_p=req.top_p, top_k=req.top_k, max_tokens=max_tokens,
                seed=req.seed, ignore_eos=req.ignore_eos, stop_token_ids=tuple(req.stop_token_ids or ()),
            )
        except InvalidSamplingParams as exc:
            raise APIError(400, str(exc), exc.param) from exc

    def validate(self, ids: list[int], params: SamplingParams, param: str, max_tokens_name: str = "max_tokens") -> None:
        """``max_tokens_name``: the field the request set (chat: ``max_completion_tokens`` wins)."""
        try:
            self.engine.engine.validate(ids, params)
        except InvalidSamplingParams as exc:
            raise APIError(400, str(exc).replace("max_tokens", max_tokens_name),
                           max_tokens_name if exc.param == "max_tokens" else exc.param) from exc
        except ValueError as exc:
            message = str(exc)
            name = next((p for p in ("temperature", "top_p", "top_k", "max_tokens") if p in message), param)
            if "capacity" in message or name == "max_tokens":
                name = max_tokens_name
            code = "context_length_exceeded" if "context length" in message else None
            raise APIError(400, message, name, code) from exc

    def children(self, rid: str, prompts: list[list[int]], plist: list[SamplingParams], n: int) -> list[Child]:
        """The request's choices, in choice order (``prompt * n + i``), each its own engine request.

        Seeds: child ``i`` of a seeded prompt samples with ``seed + i`` (vLLM's rule, in
        ``ParentRequest._get_child_sampling_params``): the choices differ, and the same request
        gives the same choices again. Past 2**64 - 1 the sum wraps (torch reads a seed modulo
        2**64). Unseeded children draw from the engine's generator, so they differ too; greedy
        children are identical (as in vLLM).

        Prefix sharing: this engine registers a block in its prefix cache once it is computed, so
        children admitted together would each compute the whole prompt. Child 0 of a prompt runs
        first; its siblings start at its first output (the prompt is computed and committed by
        then) and are admitted on its blocks. Not worth a step when no full block can be shared.
        """
        share = n > 1 and self.engine.engine.config.enable_prefix_caching
        block = self.engine.engine.config.block_size
        out: list[Child] = []
        for p, (ids, params) in enumerate(zip(prompts, plist, strict=True)):
            first = len(out)
            gate = first if share and (len(ids) - 1) // block > 0 else None
            for i in range(n):
                k = first + i
                seeded = params if params.seed is None or i == 0 else replace(params, seed=child_seed(params.seed, i))
                out.append(Child(k, p, rid if len(prompts) * n == 1 else f"{rid}-{k}", ids, seeded,
                                 gate if i else None))
        return out

    # -- running a request --

    async def run(
        self, rid: str, ids: list[int], params: SamplingParams, cache: CacheHints, stops: list[str],
        include_stop: bool = False,
    ) -> AsyncIterator[Chunk]:
        """Text chunks of one request; leaving early (stop string, disconnect) aborts it."""
        decoder = self.tokenizer.stream_decoder()
        text = StopText(stops, include_stop)
        gen = self.engine.generate(rid, ids, params, cache.salt, evict_first=cache.evict_first)
        try:
            async for out in gen:
                delta, stopped = text.push("".join(decoder.push(t) for t in out.new_token_ids))
                if stopped:
                    yield Chunk(delta, "stop", out)
                    return
                if out.finished:
                    yield Chunk(delta + text.flush(), out.finish_reason, out)
                    return
                # one chunk per engine output, with text or not (vLLM streams every token too):
                # a client's TTFT and inter-token times see each token, not only printable ones
                yield Chunk(delta, None, out)
        finally:
            await gen.aclose()

    async def collect(self, rid: str, ids: list[int], params: SamplingParams, cache: CacheHints,
                      stops: list[str], include_stop: bool = False) -> tuple[str, str | None, RequestOutput]:
        parts: list[str] = []
        last: Chunk | None = None
        async for chunk in self.run(rid, ids, params, cache, stops, include_stop):
            parts.append(chunk.text)
            last = chunk
        if last is None:
            raise APIError(500, "the request produced no output")
        return "".join(parts), last.finish_reason, last.output


async def run_choices(api: WorkerAPI, children: Sequence[Child], cache: CacheHints, stops: list[str],
                      include_stop: bool = False) -> AsyncIterator[tuple[Child, Chunk]]:
    """Every child's text chunks, interleaved as they come; ends when every child has finished.

    An error in one child (the engine died, refused it) is raised here and ends them all.
    Leaving early (that error, a stop by the caller, a client that went away: close this
    generator, e.g. with ``contextlib.aclosing``) cancels every child's task and waits for them:
    each one's ``WorkerAPI.run`` exit aborts its engine request, so none is left running."""
    if len(children) == 1:  # no task, no queue: the common case stays as direct as it was
        child = children[0]
        async with aclosing(api.run(child.rid, child.ids, child.params, cache, stops, include_stop)) as one:
            async for chunk in one:
                yield child, chunk
        return
    queue: asyncio.Queue[tuple[Child, Chunk | None] | Exception] = asyncio.Queue()
    started = [asyncio.Event() for _ in children]  # set at a child's first output (or its end)

    async def produce(k: int, child: Child) -> None:
        try:
            if child.gate is not None:
                await started[child.gate].wait()
            async with aclosing(api.run(child.rid, child.ids, child.params, cache, stops, include_stop)) as chunks:
                async for chunk in chunks:
                    started[k].set()
                    queue.put_nowait((child, chunk))
            queue.put_nowait((child, None))
        except Exception as exc:  # the consumer raises it (cancellation is no error: it passes)
            queue.put_nowait(exc)
        finally:
            started[k].set()  # no sibling waits for a child that ended without output

    tasks = [asyncio.create_task(produce(k, c), name=c.rid) for k, c in enumerate(children)]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if isinstance(item, Exception):
                raise item
            child, chunk = item
            if chunk is None:
                running -= 1
            else:
                yield child, chunk
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect_choices(api: WorkerAPI, children: Sequence[Child], cache: CacheHints, stops: list[str],
                          include_stop: bool = False) -> list[tuple[str, str | None, RequestOutput]]:
    """(text, finish reason, last output) of every child, in choice order."""
    parts: list[list[str]] = [[] for _ in children]
    last: list[Chunk | None] = [None] * len(children)
    async with aclosing(run_choices(api, children, cache, stops, include_stop)) as chunks:
        async for child, chunk in chunks:
            parts[child.index].append(chunk.text)
            last[child.index] = chunk
    if any(c is None for c in last):
        raise APIError(500, "the request produced no output")
    return [("".join(p), c.finish_reason, c.output) for p, c in zip(parts, last, strict=True) if c is not None]


# What torch's generators and index tensors take: past these the engine loop itself would fail
# (one request's seed or top_k killed the loop for every request until a restart).
SEED_RANGE = (-(2**63), 2**64 - 1)
MAX_CHOICES = 128  # choices (n * prompts) of one request: each is an engine sequence (vLLM has no cap)
MAX_TOP_K = 2**31 - 1
GREEDY_BELOW = 1e-5  # vLLM's epsilon: logits / 1e-300 overflowed to NaN and sampled token 0 forever
MAX_STOPS = 1024  # each is searched at every token (OpenAI takes 4)
MAX_CACHE_SALT_CHARS = 1024  # the engine keeps a seed per salt (4096 deep): megabyte salts held gigabytes


def num_choices(req: _Common) -> int:
    return 1 if req.n is None else req.n


def check_choices(req: _Common, num_prompts: int) -> int:
    """``n`` (the choices per prompt), checked: at least 1, at most ``MAX_CHOICES`` in all."""
    n = num_choices(req)
    if n < 1:
        raise APIError(400, f"n must be at least 1, got {n}", "n")
    if n * num_prompts > MAX_CHOICES:
        shown = f"{n} x {num_prompts} prompts = {n * num_prompts}" if num_prompts > 1 else str(n)
        raise APIError(400, f"at most {MAX_CHOICES} choices (n x prompts) per request are supported, got {shown}", "n")
    return n


def child_seed(seed: int, i: int) -> int:
    """Child ``i``'s seed: ``seed + i`` (vLLM's), wrapped into ``SEED_RANGE`` modulo 2**64 (what torch reads)."""
    s = seed + i
    return s - 2**64 if s > SEED_RANGE[1] else s


def check_sampling(req: _Common) -> None:
    """Reject sampling values the engine loop cannot take (400 here, never a dead engine); NaN and
    infinities are ``SamplingParams``' own check (``WorkerAPI.params``)."""
    if req.seed is not None and not SEED_RANGE[0] <= req.seed <= SEED_RANGE[1]:
        raise APIError(400, f"seed must lie in [-2**63, 2**64), got {req.seed}", "seed")
    if req.cache_salt is not None and len(req.cache_salt) > MAX_CACHE_SALT_CHARS:  # the engine caches salts
        raise APIError(400, f"cache_salt must be at most {MAX_CACHE_SALT_CHARS} characters", "cache_salt")
    if isinstance(req.stop, list) and len(req.stop) > MAX_STOPS:
        raise APIError(400, f"at most {MAX_STOPS} stop sequences are supported, got {len(req.stop)}", "stop")
    if req.top_k > MAX_TOP_K:
        raise APIError(400, f"top_k must be at most {MAX_TOP_K}, got {req.top_k}", "top_k")


# Request fields (OpenAI's and vLLM's) this engine cannot honour, each with the values that mean
# "off" (null always does). Any other value is a 400 naming the field: the request models take
# extra fields (vLLM's extensions), so an unread one was a 200 whose text ignored what was asked
# (a schema answered with free text, a penalty never applied). vLLM honours all of them.
_OFF_EVERYWHERE: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": ({},), "repetition_penalty": (1,),
    "min_p": (0,), "min_tokens": (0,), "bad_words": ([],), "allowed_token_ids": (), "prompt_logprobs": (),
    "use_beam_search": (False,), "response_format": ({"type": "text"},), "structured_outputs": (),
    "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (), "logits_processors": (),
}
_OFF_CHAT = {**_OFF_EVERYWHERE, "top_logprobs": (0,), "echo": (False,), "functions": ([],)}
_OFF_COMPLETION = {**_OFF_EVERYWHERE, "suffix": ("",), "best_of": (1,)}


def check_unsupported(req: _Common) -> None:
    """400 (``unsupported_parameter``) for a field the engine would ignore at a value that changes
    the output; and for tool calling, which needs a tool parser this worker does not have."""
    extra = req.model_extra or {}
    chat = isinstance(req, ChatRequest)
    # best_of = n is what sampling n choices is (vLLM keeps the best_of best of n samples)
    for name, off in (_OFF_CHAT if chat else {**_OFF_COMPLETION, "best_of": (num_choices(req),)}).items():
        value = extra.get(name)
        if value is not None and not any(_same(value, o) for o in off):
            shown = repr(value)
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            raise APIError(400, f"{name} is not supported by this worker (got {shown}); leave it unset"
                           + (f" or {off[0]!r}" if off else ""), name, "unsupported_parameter")
    if chat:
        check_tools(extra)


def check_tools(extra: dict[str, Any]) -> None:
    """Tools reach the chat template (as in vLLM), but no tool call is ever parsed out of the text:
    only ``tool_choice: "none"`` can be honoured. Tools without a choice mean "auto" (OpenAI, vLLM)."""
    choice = extra.get("tool_choice")
    if choice is None and extra.get("tools"):
        raise APIError(400, "tool calling is not supported by this worker (tools without tool_choice mean "
                       "'auto'): set tool_choice to 'none' to have the model answer in text, or leave tools out",
                       "tools", "unsupported_parameter")
    if choice is not None and choice != "none":
        shown = repr(choice) if isinstance(choice, str) else "a named function"
        raise APIError(400, f"tool calling is not supported by this worker (tool_choice {shown}): "
                       "set tool_choice to 'none' to have the model answer in text", "tool_choice",
                       "unsupported_parameter")


def _same(value: Any, off: Any) -> bool:
    """``value`` is the "off" value ``off``, of the same kind (``False`` is no penalty of 0)."""
    if isinstance(off, bool) or isinstance(value, bool):
        return value is off
    return type(value) in (int, float) and type(off) in (int, float) and value == off or \
        type(value) is type(off) and value == off


def special_tokens(body: dict[str, Any], default: bool) -> bool:
    """The body's ``add_special_tokens`` (vLLM: completions default on, chat off)."""
    value = body.get("add_special_tokens", default)
    if not isinstance(value, bool):
        raise APIError(400, "'add_special_tokens' must be a boolean", "add_special_tokens")
    return value


def encode_text(tokenizer: Any, text: str, param: str, add_special_tokens: bool = False) -> list[int]:
    """Tokenize client text; a lone surrogate (valid JSON, invalid Unicode) is a 400, not a 500."""
    try:
        return tokenizer.encode(text, add_special_tokens)  # type: ignore[no-any-return]
    except UnicodeEncodeError as exc:
        raise APIError(400, f"{param} is not valid Unicode text (a lone surrogate?)", param, "invalid_unicode") from exc


def _usage(outputs: Sequence[tuple[int, RequestOutput]]) -> dict[str, Any]:
    """Usage of a request from each choice's last output, with its prompt's index.

    As vLLM counts it: ``prompt_tokens`` once per prompt (not per choice), ``completion_tokens``
    summed over every choice. ``cached_tokens``: per prompt, the fewest among its choices (the
    prompt tokens found cached when the request came; siblings reusing the first choice's
    blocks are not counted again), summed over the prompts, so it never exceeds
    ``prompt_tokens`` (the gateway compares it with its prediction for the prompt). vLLM
    reports one child's count, whichever produced its first streamed output or the last
    finishing child of the last prompt (non-streamed): the same number when no sibling reused
    another's blocks, up to the whole prompt more when one did.
    """
    prompts: dict[int, list[RequestOutput]] = {}
    for p, out in outputs:
        prompts.setdefault(p, []).append(out)
    prompt = sum(outs[0].num_prompt_tokens for outs in prompts.values())
    cached = sum(min(o.num_cached_tokens for o in outs) for outs in prompts.values())
    completion = sum(out.num_output_tokens for _, out in outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Await ``work``; cancel it (which aborts its requests) if the client goes away."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.2)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise APIError(499, "client disconnected")
    finally:
        if not task.done():
            task.cancel()


def _stops(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


def include_stop_str(req: _Common) -> bool:
    """vLLM's ``include_stop_str_in_output`` (default false): the stop string ends the text."""
    value = (req.model_extra or {}).get("include_stop_str_in_output", False)
    if not isinstance(value, bool):
        raise APIError(400, "include_stop_str_in_output must be a boolean", "include_stop_str_in_output")
    return value


async def end_in_flight(engine: AsyncLLMEngine) -> None:
    """A shutdown's drain timed out: every request still generating ends as on a dead engine (a
    stream with an error event and [DONE], an unanswered request with a 503); their generators'
    exits abort them in the engine. Runs on the event loop, which owns the streams' queues."""
    engine.fail_all("the worker is shutting down")


def create_app(engine: AsyncLLMEngine, tokenizer: Any, model_name: str, info: dict[str, Any] | None = None,
               content_format: str = "auto") -> FastAPI:
    """``content_format``: vLLM's ``--chat-template-content-format`` ("auto", "string", "openai")."""
    api = WorkerAPI(engine, tokenizer, model_name, info or {}, content_format)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="mesh worker", lifespan=lifespan)
    app.state.api = api
    install_error_handlers(app)
    Routes(api).install(app)
    return app


class Routes:
    """The HTTP route handlers over one ``WorkerAPI`` (its engine and tokenizer); ``install`` adds them to an app."""

    def __init__(self, api: WorkerAPI) -> None:
        self.api = api
        self.engine = api.engine
        self.tokenizer = api.tokenizer

    def install(self, app: FastAPI) -> None:
        """Registers every route, in this order (``/v1/models`` before ``/v1/models/{model:path}``)."""
        for path, method, endpoint in (
            ("/v1/completions", "POST", self.completions),
            ("/v1/chat/completions", "POST", self.chat),
            ("/v1/models", "GET", self.models),
            ("/v1/models/{model:path}", "GET", self.model),
            ("/health", "GET", self.health),
            ("/metrics", "GET", self.metrics),
            ("/tokenize", "POST", self.tokenize),
            ("/detokenize", "POST", self.detokenize),
            ("/reset_prefix_cache", "POST", self.reset_prefix_cache),
        ):
            app.add_api_route(path, endpoint, methods=[method])

    async def completions(self, req: CompletionRequest, request: Request) -> Any:
        api = self.api
        api.check_model(req.model)
        include_stop = include_stop_str(req)
        if req.echo or req.logprobs is not None:
            raise APIError(400, "echo and logprobs are not supported", "echo" if req.echo else "logprobs")
        prompts = api.completion_prompts(req.prompt, special_tokens(req.model_extra or {}, default=True))
        n = check_choices(req, len(prompts))
        plist = [api.params(req, req.max_tokens, len(ids)) for ids in prompts]
        for ids, p in zip(prompts, plist, strict=True):
            api.validate(ids, p, "prompt")
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        children = api.children(rid, prompts, plist, n)
        if req.stream:
            return stream_choices(api, req, rid, created, children, cache_hints(req, request), chat=False)
        results = await _unless_disconnected(request, collect_choices(
            api, children, cache_hints(req, request), _stops(req.stop), include_stop))
        return {
            "id": rid, "object": "text_completion", "created": created, "model": api.model_name,
            "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": reason}
                        for i, (text, reason, _) in enumerate(results)],
            "usage": _usage([(c.prompt, out) for c, (_, _, out) in zip(children, results, strict=True)]),
        }

    async def chat(self, req: ChatRequest, request: Request) -> Any:
        api = self.api
        api.check_model(req.model)
        include_stop = include_stop_str(req)
        if req.logprobs:
            raise APIError(400, "logprobs are not supported", "logprobs")
        ids = api.chat_prompt(req.messages, req.model_extra or {})
        n = check_choices(req, 1)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = api.params(req, max_tokens, len(ids))
        named = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        api.validate(ids, params, "messages", named)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        children = api.children(rid, [ids], [params], n)
        if req.stream:
            return stream_choices(api, req, rid, created, children, cache_hints(req, request), chat=True)
        results = await _unless_disconnected(
            request, collect_choices(api, children, cache_hints(req, request), _stops(req.stop), include_stop))
        return {
            "id": rid, "object": "chat.completion", "created": created, "model": api.model_name,
            "choices": [{"index": i, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": reason} for i, (text, reason, _) in enumerate(results)],
            "usage": _usage([(0, out) for _, _, out in results]),
        }

    def model_card(self) -> dict[str, Any]:
        api = self.api
        card = {"id": api.model_name, "object": "model", "created": int(time.time()), "owned_by": "mesh",
                "root": api.model_name, "max_model_len": api.max_model_len}
        return {**card, "note": api.info["note"]} if "note" in api.info else card  # the demo preset says so

    async def models(self) -> Any:
        return {"object": "list", "data": [self.model_card()]}

    async def model(self, model: str) -> Any:
        """The openai client's ``models.retrieve``."""
        if model != self.api.model_name:
            raise APIError(404, f"the model {model!r} does not exist", "model", "model_not_found")
        return self.model_card()

    async def health(self) -> Any:
        if not self.engine.alive:
            return _error_response(503, f"engine loop is not running: {self.engine.error!r}")
        return {"status": "ok", "model": self.api.model_name, **self.api.info}

    async def metrics(self) -> Response:
        return Response(render_metrics(self.engine.engine.stats()),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    async def tokenize(self, req: TokenizeRequest) -> Any:
        body = dict(req.model_extra or {})
        if req.add_generation_prompt is not None:
            body["add_generation_prompt"] = req.add_generation_prompt
        if req.messages is not None:
            ids = self.api.chat_prompt(req.messages, body)
        elif req.prompt is not None:
            ids = encode_text(self.tokenizer, req.prompt, "prompt", special_tokens(body, default=True))
        else:
            raise APIError(400, "give 'prompt' or 'messages'", "prompt")
        return {"count": len(ids), "max_model_len": self.api.max_model_len, "tokens": ids}

    async def detokenize(self, req: DetokenizeRequest) -> Any:
        vocab = self.engine.engine.model_config.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:  # a Hugging Face tokenizer raised (a 500) on a negative or huge id
            raise APIError(400, f"token id {bad} is out of vocabulary (0 <= id < {vocab})", "tokens")
        return {"prompt": self.tokenizer.decode(req.tokens)}

    async def reset_prefix_cache(self) -> Any:
        if not await self.engine.reset_prefix_cache():
            raise APIError(400, "blocks are in use; reset refused", code="blocks_in_use")
        return {"status": "ok"}


def stream_choices(api: WorkerAPI, req: _Common, rid: str, created: int, children: Sequence[Child],
                   cache: CacheHints, chat: bool) -> StreamingResponse:
    """Server-sent events as vLLM sends them: chat first sends each choice's role delta; then the
    choices' chunks interleave as they come, one choice per chunk, each with its ``index``;
    each choice ends with its own chunk carrying its finish reason; the usage chunk (no
    choices), when asked for, comes once after them all; then ``data: [DONE]``."""
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    include_stop = include_stop_str(req)  # checked by the route already: no raise after the headers
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choice: dict[str, Any] | None, usage: dict[str, Any] | None = None) -> bytes:
        body: dict[str, Any] = {"id": rid, "object": kind, "created": created, "model": api.model_name,
                                "choices": [choice] if choice else []}
        if include_usage:
            body["usage"] = usage
        return _sse(body)

    def choice(index: int, text: str | None, reason: str | None, first: bool = False) -> dict[str, Any]:
        if not chat:
            return {"index": index, "text": text or "", "logprobs": None, "finish_reason": reason}
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
        if text:
            delta["content"] = text
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}

    async def body() -> AsyncIterator[bytes]:
        if chat:
            for child in children:
                yield chunk(choice(child.index, None, None, first=True))
        last: dict[int, tuple[int, RequestOutput]] = {}  # choice -> (prompt, its last output)
        try:
            async with aclosing(run_choices(api, children, cache, _stops(req.stop), include_stop)) as chunks:
                async for child, c in chunks:
                    last[child.index] = (child.prompt, c.output)
                    if c.text or c.finish_reason is None:
                        yield chunk(choice(child.index, c.text, None))
                    if c.finish_reason is not None:
                        yield chunk(choice(child.index, None if chat else "", c.finish_reason))
        except (EngineDeadError, RequestRejected) as exc:  # headers are sent: report in the stream
            # ...then end it as vLLM does, with [DONE] after the error event.
            yield _sse(error_body(503 if isinstance(exc, EngineDeadError) else 400, str(exc)))
            yield b"data: [DONE]\n\n"
            return
        except Exception as exc:  # a bug: the client still gets a whole stream that says so
            log.exception("stream %s failed", rid)
            yield _sse(error_body(500, f"internal error: {type(exc).__name__}"))
            yield b"data: [DONE]\n\n"
            return
        if include_usage and last:
            yield chunk(None, _usage(list(last.values())))
        yield b"data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


# ---- metrics ------------------------------------------------------------------------------------

_GAUGES = {
    "num_requests_running": "Requests in the running batch",
    "num_requests_waiting": "Requests waiting for admission",
    "kv_cache_usage": "Fraction of KV blocks held by requests (0-1)",
    "kv_blocks_total": "KV blocks in the cache",
    "kv_blocks_used": "KV blocks held by requests",
    "kv_blocks_cached": "KV blocks registered in the prefix cache (used or free)",
    "cpu_kv_blocks_total": "Blocks of the CPU offload tier (0: off)",
    "cpu_kv_blocks_cached": "KV blocks held in the CPU offload tier",
    "state_checkpoints_total": "Recurrent-state checkpoint slots of a hybrid model (0: not hybrid, or off)",
    "state_checkpoints_cached": "Recurrent-state checkpoints held (hybrid models)",
}
_COUNTERS = {
    "prompt_tokens": "Prompt tokens of admitted requests",
    "prompt_cached_tokens": "Prompt tokens served from the prefix cache (sum of usage.cached_tokens)",
    "prefix_cache_queries": "Tokens looked up in the prefix cache (every admission)",
    "prefix_cache_hits": "Tokens found in the prefix cache (every admission)",
    "prefill_computed_tokens": "Prompt tokens run through the model",
    "generation_tokens": "Tokens generated",
    "preemptions": "Requests preempted under KV pressure",
    "blocks_evicted": "Cached KV blocks evicted to make room",
    "evict_first_requests": "Requests with the router's retention hint (x-mesh-retention: spill): blocks evicted first",
    "cpu_prefix_cache_hits": "Tokens found in the CPU offload tier (part of prefix_cache_hits)",
    "cpu_blocks_restored": "KV blocks copied back from the CPU tier to the GPU (CPU hits)",
    "cpu_blocks_saved": "KV blocks copied from the GPU to the CPU tier (on eviction or a cpu_save)",
    "cpu_blocks_evicted": "KV blocks dropped from the CPU tier to make room",
    "state_checkpoints_saved": "Recurrent-state checkpoints written (interval and end of turn; hybrid models)",
    "state_checkpoints_end_of_turn": "Recurrent-state checkpoints written at a turn's end (part of state_checkpoints_saved)",
    "state_checkpoints_restored": "Prefix hits resumed from a recurrent-state checkpoint (hybrid models)",
    "state_checkpoints_evicted": "Recurrent-state checkpoints dropped to make room (LRU)",
    "prefix_unresumable_tokens": "Cached prompt tokens not reused: no recurrent-state checkpoint covers them (hybrid models)",
    "kv_events_published": "KV event batches published",
    "kv_events_dropped": "KV event batches dropped (publisher queue full)",
}
# vLLM's names for the load signals a router reads, so Mesh can treat this worker like vLLM.
_VLLM_ALIASES = {
    "num_requests_running": "vllm:num_requests_running",
    "num_requests_waiting": "vllm:num_requests_waiting",
    "kv_cache_usage": "vllm:kv_cache_usage_perc",
}


def render_metrics(stats: dict[str, float]) -> bytes:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    class _Snapshot:
        def collect(self) -> Any:
            for key, doc in _GAUGES.items():
                yield GaugeMetricFamily(f"mesh_worker_{key}", doc, value=stats[key])
                if key in _VLLM_ALIASES:
                    yield GaugeMetricFamily(_VLLM_ALIASES[key], doc, value=stats[key])
            for key, doc in _COUNTERS.items():
                yield CounterMetricFamily(f"mesh_worker_{key}", doc, value=stats[key])

    registry = CollectorRegistry()
    registry.register(_Snapshot())
    return generate_latest(registry)

