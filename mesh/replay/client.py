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
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from mesh.replay.prompts import PromptBuilder
from mesh.replay.schedule import Plan
from simulator.traces import DONE, START

if TYPE_CHECKING:
    import httpx

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


# A turn's lifecycle in ``_Player.state``; it only moves forward: WAITING -> LAUNCHED -> SETTLED,
# or WAITING -> SETTLED for a turn skipped because the duration ran out.
_WAITING, _LAUNCHED, _SETTLED = 0, 1, 2

Progress = Callable[[int, int, float], None]  # (requests done, errors, elapsed s)


async def play(plan: Plan, builder: PromptBuilder, opts: ClientOptions,
               progress: Progress | None = None,
               progress_interval_s: float = 0.5) -> PlayResult:
    """Send every request of ``plan``; ``progress(done, errors, elapsed_s)`` is called every
    ``progress_interval_s`` and once at the end."""
    return await _Player(plan, builder, opts).run(progress, progress_interval_s)


def _http_client(opts: ClientOptions) -> httpx.AsyncClient:
    """The replay's client: enough pooled connections for every group in flight, ``timeout_s`` per
    request (connecting: at most 30 s)."""
    import httpx

    limit = (opts.concurrency * 4 if opts.concurrency > 0 else 1024) + 16
    return httpx.AsyncClient(
        base_url=base_url(opts.url), headers=_headers(opts.api_key),
        timeout=httpx.Timeout(opts.timeout_s, connect=min(30.0, opts.timeout_s)),
        limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit),
    )


def _successors(plan: Plan) -> list[list[tuple[int, int, float]]]:
    """Per turn, the turns that depend on it: (dependent pos, START|DONE, delay s)."""
    succ: list[list[tuple[int, int, float]]] = [[] for _ in plan.turns]
    for t in plan.turns:
        for p, trig, delay in t.deps:
            succ[p].append((t.pos, trig, delay))
    return succ


class _Player:
    """One run of ``play``: the dependency bookkeeping, the tasks in flight and the HTTP client.

    Invariants: ``finished`` counts the SETTLED turns and ``all_done`` is set exactly when it
    reaches ``n``; ``group_done[g]`` is set once every turn of group ``g`` is SETTLED (it then
    gives its concurrency slot back); ``remaining[j]`` counts the dependencies of turn ``j`` not
    fired yet and ``release[j]`` is the latest release time they asked for; once ``stopping`` is
    set nothing new is launched. Times are seconds from ``t0`` (the loop's clock at the start).
    """

    def __init__(self, plan: Plan, builder: PromptBuilder, opts: ClientOptions) -> None:
        self.plan = plan
        self.builder = builder
        self.opts = opts
        self.turns = plan.turns
        self.n = len(plan.turns)
        self.out = [Outcome() for _ in range(self.n)]
        self.succ = _successors(plan)
        self.remaining = [len(t.deps) for t in self.turns]
        self.release = [0.0] * self.n
        self.state = [_WAITING] * self.n
        self.group_left = [len(g) for g in plan.groups]
        self.group_done = [asyncio.Event() for _ in plan.groups]
        self.loop = asyncio.get_running_loop()
        self.finished = 0
        self.all_done = asyncio.Event()
        self.tasks: set[asyncio.Task[None]] = set()
        self.slots = asyncio.Semaphore(opts.concurrency) if opts.concurrency > 0 else None
        self.client = _http_client(opts)
        self.truncated = False  # some turn was skipped: the duration ran out
        self.stopping = False  # the replay is being cancelled: nothing new is launched
        self.started_unix = time.time()
        self.t0 = self.loop.time()
        self.deadline = self.t0 + opts.duration_s if opts.duration_s is not None else math.inf

    def now(self) -> float:
        return self.loop.time() - self.t0

    def errors(self) -> int:
        return sum(o.error is not None and o.sent for o in self.out)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` as a task tracked in ``tasks`` (cancelled when the replay stops)."""
        task = self.loop.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def run(self, progress: Progress | None, interval_s: float) -> PlayResult:
        """Admit the groups and wait until every turn settled; always cancels what is left and
        closes the client."""
        admitter = self.loop.create_task(self.admit())
        reporter = self.loop.create_task(self.report(progress, interval_s)) if progress is not None else None
        try:
            if self.n:
                await self.all_done.wait()
        finally:
            await self.stop(admitter, reporter)
        wall = self.now()
        if progress is not None:
            progress(self.finished, self.errors(), wall)
        return PlayResult(self.out, wall, self.started_unix, self.truncated)

    async def stop(self, admitter: asyncio.Task[None], reporter: asyncio.Task[None] | None) -> None:
        """Cancel the admitter, the reporter and every tracked task, wait for them, close the client."""
        self.stopping = True
        for task in (admitter, reporter, *self.tasks):
            if task is not None:
                task.cancel()
        await asyncio.gather(admitter, *(t for t in (reporter,) if t is not None), *self.tasks,
                             return_exceptions=True)
        await self.client.aclose()

    async def report(self, progress: Progress, interval_s: float) -> None:
        """Call ``progress`` every ``interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            progress(self.finished, self.errors(), self.now())

    async def admit(self) -> None:
        """Admit the groups in order of first arrival; a group that would start past the deadline
        (or is reached after it) is never admitted and its arrivals are skipped."""
        plan = self.plan
        for g in sorted(range(len(plan.groups)), key=lambda g: (plan.group_start[g], g)):
            if self.t0 + plan.group_start[g] > self.deadline or self.loop.time() > self.deadline:
                for p in plan.groups[g]:
                    if self.state[p] == _WAITING and self.turns[p].arrival is not None:
                        self.skip(p)
                continue
            await self.admit_group(g)

    async def admit_group(self, g: int) -> None:
        """Take a slot (if limited), wait for the group's first arrival, then launch its arrivals
        shifted by how late the group was admitted; the slot returns when the group is done."""
        start = self.plan.group_start[g]
        if self.slots is not None:
            await self.slots.acquire()
        wait = self.t0 + start - self.loop.time()
        if wait > 0:
            await asyncio.sleep(wait)
        shift = max(0.0, self.now() - start)
        if self.slots is not None:
            self.spawn(_release_after(self.group_done[g], self.slots))
        for p in self.plan.groups[g]:
            t = self.turns[p]
            if t.arrival is not None and self.state[p] == _WAITING:
                self.launch(p, t.arrival + shift)

    def launch(self, pos: int, at: float) -> None:
        """Schedule turn ``pos`` to be sent at ``at`` s, or skip it when that is past the deadline."""
        if self.stopping:
            return
        if self.t0 + at > self.deadline:
            self.skip(pos)
            return
        self.state[pos] = _LAUNCHED
        self.spawn(self.send_turn(pos, at))

    def fire(self, j: int, when: float) -> None:
        """One dependency of turn ``j`` fired, asking for release at ``when``; the last one launches it."""
        if self.state[j] != _WAITING:
            return
        self.release[j] = max(self.release[j], when)
        self.remaining[j] -= 1
        if self.remaining[j] == 0:
            self.launch(j, self.release[j])

    def fire_dependents(self, pos: int, trigger: int, at: float) -> None:
        """Fire the dependents of ``pos`` released by ``trigger`` (START or DONE) at ``at`` + delay."""
        for j, trig, delay in self.succ[pos]:
            if trig == trigger:
                self.fire(j, at + delay)

    def settle(self, pos: int) -> None:
        """Mark turn ``pos`` SETTLED (sent and ended, or skipped) and count it in its group."""
        self.state[pos] = _SETTLED
        self.finished += 1
        g = self.turns[pos].group
        self.group_left[g] -= 1
        if self.group_left[g] == 0:
            self.group_done[g].set()
        if self.finished == self.n:
            self.all_done.set()

    def skip(self, pos: int) -> None:
        """Not sent (the duration ran out), and nor are its dependents still waiting."""
        self.truncated = True
        stack = [pos]
        while stack:
            p = stack.pop()
            if self.state[p] == _SETTLED:
                continue
            self.settle(p)
            stack.extend(j for j, _, _ in self.succ[p] if self.state[j] == _WAITING)

    async def send_turn(self, pos: int, at: float) -> None:
        """Send turn ``pos`` at ``at`` s and record its outcome; a failure is recorded, never raised
        (cancellation excepted). Whatever happens the turn settles and its DONE dependents fire."""
        delay = self.t0 + at - self.loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        o = self.out[pos]
        o.sent = True
        o.send = self.now()
        self.fire_dependents(pos, START, o.send)
        try:
            await self.request(pos, o)
        except asyncio.CancelledError:
            o.error = o.error or "cancelled (the replay stopped)"
            raise
        except Exception as exc:  # noqa: BLE001 - recorded: a request's failure never stops the replay
            o.error = _short(exc)
        finally:
            o.end = self.now()
            if math.isnan(o.first) and o.error is None:
                o.error = "the stream ended without a token"
            self.settle(pos)
            self.fire_dependents(pos, DONE, o.end)

    async def request(self, pos: int, o: Outcome) -> None:
        """POST turn ``pos`` as a streamed completion and record status, worker and the stream in ``o``."""
        t = self.turns[pos]
        opts = self.opts
        body = {"model": opts.model, "prompt": self.builder.prompt(t.request), "max_tokens": t.max_tokens,
                "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0,
                **({"ignore_eos": True} if opts.ignore_eos else {}), **opts.extra_body}
        headers = {"content-type": "application/json"}
        if opts.session_header and t.session is not None:
            headers[opts.session_header] = t.session
        async with self.client.stream("POST", "/v1/completions", content=_encode(body), headers=headers) as resp:
            o.status = resp.status_code
            o.worker = resp.headers.get(opts.worker_header) or None
            if resp.status_code != 200:
                o.error = f"HTTP {resp.status_code}: {_error_text(await resp.aread())}"
                return
            await _read_stream(resp, o, self.now)


async def _read_stream(resp: httpx.Response, o: Outcome, now: Callable[[], float]) -> None:
    """Record the server-sent events of ``resp`` in ``o`` until ``[DONE]``, the end of the body,
    or the first malformed or error event (recorded as ``o.error``)."""
    last = math.nan  # arrival of the previous token chunk
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
        _record_usage(event.get("usage"), o)
        if _carries_token(event):
            at = now()
            if math.isnan(o.first):
                o.first = at
            else:
                o.gaps.append(at - last)
            last = at
            o.tokens += 1


def _record_usage(usage: Any, o: Outcome) -> None:
    """Copy the server's ``usage`` (when the event has one) into ``o``."""
    if not usage:
        return
    o.prompt_tokens = usage.get("prompt_tokens")
    o.completion_tokens = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        o.cached_tokens = int(details["cached_tokens"])


def _carries_token(event: dict[str, Any]) -> bool:
    """Whether an event is a token chunk: a choice with text, or with no finish reason (a closing
    chunk with only a finish reason is not a token). An event counts as one token at most."""
    return any(choice.get("text") or choice.get("finish_reason") is None for choice in event.get("choices") or ())


async def _release_after(event: asyncio.Event, slots: asyncio.Semaphore) -> None:
    """Give a concurrency slot back once its group is done."""
    await event.wait()
    slots.release()
