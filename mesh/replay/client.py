"""The replay's HTTP client: plays a ``Plan`` against an OpenAI-compatible endpoint.

Every request is a streamed ``POST /v1/completions`` (``stream_options.include_usage``,
``ignore_eos``, greedy), with the session id in a header when asked. Per request it records the
send time, the first token's arrival (the first chunk that carries a choice with text or no
finish reason: a closing chunk with only a finish reason is not a token), the gaps between
token chunks, the end of the stream, the server's ``usage`` (prompt, completion and
``prompt_tokens_details.cached_tokens``), the worker named by a response header (Mesh's
``x-mesh-worker``) and any error (HTTP status and message, a transport error, an error event in
the stream): an error is recorded, never raised, and the session goes on.

At most ``concurrency`` session groups are in flight (0: no limit); a group takes a slot once its
first arrival has come and one is free, and gives it back when its last request ended. With
``duration_s`` no request is released after that many seconds; requests in flight finish.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from mesh.replay.prompts import PromptBuilder
from mesh.replay.schedule import Plan
from simulator.traces import DONE, START

_decode = msgspec.json.decode
_encode = msgspec.json.encode


class ReplayError(RuntimeError):
    """The replay cannot start (unreachable endpoint, no model): one line for the user."""


@dataclass(frozen=True, slots=True)
class ClientOptions:
    url: str
    model: str
    api_key: str | None = None
    session_header: str | None = "x-session-id"  # None: send no session id
    worker_header: str = "x-mesh-worker"
    concurrency: int = 16  # session groups in flight; 0 = no limit
    duration_s: float | None = None  # release nothing after this many seconds
    timeout_s: float = 600.0  # per request
    ignore_eos: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Outcome:
    """What one request did; times are seconds from the replay's start (NaN: never)."""

    sent: bool = False
    send: float = math.nan
    first: float = math.nan
    end: float = math.nan
    tokens: int = 0  # token chunks received
    gaps: list[float] = field(default_factory=list)  # s between consecutive token chunks
    prompt_tokens: int | None = None  # usage, as the server reported it
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    worker: str | None = None
    status: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.sent and self.error is None


@dataclass(slots=True)
class PlayResult:
    outcomes: list[Outcome]
    wall_s: float
    started_unix: float
    truncated: bool  # the duration ran out before every request was sent

    @property
    def sent(self) -> int:
        return sum(o.sent for o in self.outcomes)

    @property
    def errors(self) -> int:
        return sum(o.sent and o.error is not None for o in self.outcomes)


def base_url(url: str) -> str:
    return url.rstrip("/").removesuffix("/v1")


def _headers(api_key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {api_key}"} if api_key else {}


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text and text[0] else type(exc).__name__


async def discover_model(url: str, api_key: str | None = None, timeout_s: float = 10.0) -> str:
    """The first model of ``GET /v1/models``; ``ReplayError`` (one line) when unreachable or empty."""
    import httpx

    base = base_url(url)
    try:
        async with httpx.AsyncClient(timeout=timeout_s, headers=_headers(api_key)) as client:
            resp = await client.get(base + "/v1/models")
    except httpx.HTTPError as exc:
        raise ReplayError(f"cannot reach {base}: {_short(exc)}") from None
    if resp.status_code != 200:
        raise ReplayError(f"{base}/v1/models answered HTTP {resp.status_code}: {_error_text(resp.content)}; "
                          "pass --model")
    try:
        data = _decode(resp.content).get("data") or []
        model = str(data[0]["id"])
    except (msgspec.DecodeError, AttributeError, IndexError, KeyError, TypeError):
        raise ReplayError(f"{base}/v1/models lists no model; pass --model") from None
    return model


async def check_reachable(url: str, api_key: str | None = None, timeout_s: float = 10.0) -> None:
    """``ReplayError`` unless something answers HTTP at ``url`` (any status)."""
    import httpx

    base = base_url(url)
    try:
        async with httpx.AsyncClient(timeout=timeout_s, headers=_headers(api_key)) as client:
            await client.get(base + "/v1/models")
    except httpx.HTTPError as exc:
        raise ReplayError(f"cannot reach {base}: {_short(exc)}") from None


def _error_text(content: bytes, limit: int = 200) -> str:
    try:
        obj = _decode(content)
        if isinstance(obj, dict):
            err = obj.get("error", obj)
            msg = err.get("message") if isinstance(err, dict) else err
            if msg:
                return " ".join(str(msg).split())[:limit]
    except msgspec.DecodeError:
        pass
    return " ".join(content.decode(errors="replace").split())[:limit] or "(empty body)"


async def play(plan: Plan, builder: PromptBuilder, opts: ClientOptions,
               progress: Callable[[int, int, float], None] | None = None,
               progress_interval_s: float = 0.5) -> PlayResult:
    """Send every request of ``plan``; ``progress(done, errors, elapsed_s)`` is called every
    ``progress_interval_s`` and once at the end."""
    import httpx

    turns = plan.turns
    n = len(turns)
    out = [Outcome() for _ in range(n)]
    succ: list[list[tuple[int, int, float]]] = [[] for _ in range(n)]
    for t in turns:
        for p, trig, delay in t.deps:
            succ[p].append((t.pos, trig, delay))
    remaining = [len(t.deps) for t in turns]
    release = [0.0] * n
    state = [0] * n  # 0 waiting, 1 released/sent, 2 finished or skipped
    group_left = [len(g) for g in plan.groups]
    group_done = [asyncio.Event() for _ in plan.groups]
    loop = asyncio.get_running_loop()
    finished = 0
    all_done = asyncio.Event()
    tasks: set[asyncio.Task[None]] = set()
    slots = asyncio.Semaphore(opts.concurrency) if opts.concurrency > 0 else None
    limit = (opts.concurrency * 4 if opts.concurrency > 0 else 1024) + 16
    client = httpx.AsyncClient(
        base_url=base_url(opts.url), headers=_headers(opts.api_key),
        timeout=httpx.Timeout(opts.timeout_s, connect=min(30.0, opts.timeout_s)),
        limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit),
    )
    truncated = False
    stopping = False  # the replay is being cancelled: nothing new is launched
    started_unix = time.time()
    t0 = loop.time()
    deadline = t0 + opts.duration_s if opts.duration_s is not None else math.inf

    def now() -> float:
        return loop.time() - t0

    def settle(pos: int) -> None:
        nonlocal finished
        state[pos] = 2
        finished += 1
        g = turns[pos].group
        group_left[g] -= 1
        if group_left[g] == 0:
            group_done[g].set()
        if finished == n:
            all_done.set()

    def skip(pos: int) -> None:
        """Not sent (the duration ran out), and nor are its dependents."""
        nonlocal truncated
        truncated = True
        stack = [pos]
        while stack:
            p = stack.pop()
            if state[p] == 2:
                continue
            settle(p)
            stack.extend(j for j, _, _ in succ[p] if state[j] == 0)

    def fire(j: int, when: float) -> None:
        if state[j] != 0:
            return
        release[j] = max(release[j], when)
        remaining[j] -= 1
        if remaining[j] == 0:
            launch(j, release[j])

    def launch(pos: int, at: float) -> None:
        if stopping:
            return
        if t0 + at > deadline:
            skip(pos)
            return
        state[pos] = 1
        task = loop.create_task(one(pos, at))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def one(pos: int, at: float) -> None:
        delay = t0 + at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        o = out[pos]
        o.sent = True
        o.send = now()
        for j, trig, d in succ[pos]:
            if trig == START:
                fire(j, o.send + d)
        try:
            await request(pos, o)
        except asyncio.CancelledError:
            o.error = o.error or "cancelled (the replay stopped)"
            raise
        except Exception as exc:  # noqa: BLE001 - recorded: a request's failure never stops the replay
            o.error = _short(exc)
        finally:
            o.end = now()
            if math.isnan(o.first) and o.error is None:
                o.error = "the stream ended without a token"
            settle(pos)
            for j, trig, d in succ[pos]:
                if trig == DONE:
                    fire(j, o.end + d)

    async def request(pos: int, o: Outcome) -> None:
        t = turns[pos]
        body = {"model": opts.model, "prompt": builder.prompt(t.request), "max_tokens": t.max_tokens,
                "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0,
                **({"ignore_eos": True} if opts.ignore_eos else {}), **opts.extra_body}
        headers = {"content-type": "application/json"}
        if opts.session_header and t.session is not None:
            headers[opts.session_header] = t.session
        async with client.stream("POST", "/v1/completions", content=_encode(body), headers=headers) as resp:
            o.status = resp.status_code
            o.worker = resp.headers.get(opts.worker_header) or None
            if resp.status_code != 200:
                o.error = f"HTTP {resp.status_code}: {_error_text(await resp.aread())}"
                return
            last = math.nan
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    event = _decode(data)
                except msgspec.DecodeError:
                    o.error = f"malformed stream event: {data[:120]}"
                    return
                if not isinstance(event, dict):
                    continue
                if event.get("error"):
                    o.error = f"stream error: {_error_text(_encode(event))}"
                    return
                usage = event.get("usage")
                if usage:
                    o.prompt_tokens = usage.get("prompt_tokens")
                    o.completion_tokens = usage.get("completion_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        o.cached_tokens = int(details["cached_tokens"])
                for choice in event.get("choices") or ():
                    if choice.get("text") or choice.get("finish_reason") is None:
                        at = now()
                        if math.isnan(o.first):
                            o.first = at
                        else:
                            o.gaps.append(at - last)
                        last = at
                        o.tokens += 1
                        break

    async def admit() -> None:
        order = sorted(range(len(plan.groups)), key=lambda g: (plan.group_start[g], g))
        for g in order:
            if t0 + plan.group_start[g] > deadline or loop.time() > deadline:
                for p in plan.groups[g]:  # never admitted: the duration ran out
                    if state[p] == 0 and turns[p].arrival is not None:
                        skip(p)
                continue
            if slots is not None:
                await slots.acquire()
            wait = t0 + plan.group_start[g] - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            shift = max(0.0, now() - plan.group_start[g])
            if slots is not None:
                task = loop.create_task(_release_after(group_done[g], slots))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            for p in plan.groups[g]:
                t = turns[p]
                if t.arrival is not None and state[p] == 0:
                    launch(p, t.arrival + shift)

    async def report() -> None:
        while True:
            await asyncio.sleep(progress_interval_s)
            progress(finished, sum(o.error is not None and o.sent for o in out), now())  # type: ignore[misc]

    admitter = loop.create_task(admit())
    reporter = loop.create_task(report()) if progress is not None else None
    try:
        if n:
            await all_done.wait()
    finally:
        stopping = True
        for task in (admitter, reporter, *tasks):
            if task is not None:
                task.cancel()
        await asyncio.gather(admitter, *(t for t in (reporter,) if t is not None), *tasks, return_exceptions=True)
        await client.aclose()
    wall = now()
    if progress is not None:
        progress(finished, sum(o.error is not None and o.sent for o in out), wall)
    return PlayResult(out, wall, started_unix, truncated)


async def _release_after(event: asyncio.Event, slots: asyncio.Semaphore) -> None:
    await event.wait()
    slots.release()
