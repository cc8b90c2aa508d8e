"""Session bindings and in-flight load shared by several gateway replicas through Redis
(``state.backend: redis``).

Four parts here, one job each (plus ``mesh.state.shared_load`` for load):

- ``RedisStateBackend`` implements ``mesh.core.sessions.StateBackend`` with ``redis.asyncio``: one
  key per session, ``{prefix}s:{session} = target``, written with ``SET ... PX idle_ttl_ms`` on
  every use, so Redis itself expires an idle binding (``PX``, not ``EX ceil(ttl)``: the shared
  binding then lives exactly as long as the local one, also for sub-second TTLs in tests). It
  never raises: every Redis error or timeout is counted (``on_error(op)``, the gateway's
  ``mesh_state_backend_errors_total{op}``) and answers "no shared binding". After an error it
  skips Redis for ``retry_after_s``, so a black-holed server costs one ``timeout_s``, not one per
  request; except after a command error the server answered (``ResponseError``: WRONGTYPE on
  another app's key under our prefix): that fails the one call, and the others go on.
- ``SharedSessionTable`` is the local ``SessionTable`` that policies read (they never do I/O),
  plus: ``mirror`` copies the shared binding into it before a decision, and ``bind`` (the
  ``Router``'s commit) queues the binding for the write-behind flusher.
- ``mesh.state.shared_load.SharedLoad`` shares in-flight load (its own module and invariants).
- ``SharedState`` runs them for one gateway: the flusher and the load sync from the lifespan,
  the error counter and ``mesh_remote_in_flight{target}`` on ``/metrics``. The gateway's proxy
  and ``/debug/route`` call ``SharedSessionTable.mirror`` as a named step right before each
  decision.

The Redis URL is only ever shown redacted (``redact_url``: no password in logs, errors, stats).

A Redis Cluster (``state.cluster: true``; ``url`` and ``cluster_seeds`` are seed nodes) is reached
through redis-py's ``RedisCluster``, which finds the masters, maps keys to hash slots and follows
MOVED/ASK. Where the keys live there:

- Session keys keep their single-server names (``{prefix}s:{session}``, no hash tag) and so spread
  over every master's slots. They are the bulk of the keys (one per live session) and of the
  traffic (a GET per session request, a SET per binding); no command ever touches two of them
  (GET, SET, SET NX + PEXPIRE of one key, DEL), and the write-behind pipeline is not a
  transaction: redis-py's cluster pipeline splits it per master and sends the parts in parallel.
  One hash tag would put them all on one slot of one master, which resharding can never split.
  The cost: a pipeline spans every master, so one master down fails the whole flush (queued again,
  as on one server); with the default ``cluster-require-full-coverage yes`` the cluster refuses
  every key then anyway, until a replica takes over.
- The load keys (``mesh.state.shared_load``) are written together, atomically: they carry the hash tag
  ``{key_prefix}`` (``load_prefix``: ``{mesh:}load:replicas``), so they share one slot. Their
  single-server names are unchanged (the tag is added in cluster mode only).

Failures are the single server's: every call is bounded by ``timeout_s``, an error or timeout goes
local and backs off. Two differences, both from a cluster's masters failing one at a time:
- After a failure the client forgets the cluster's layout (``aclose``: the next call asks a live
  node for its slots again). redis-py does that itself after a failed single command, but not
  after a failed pipeline with its retries off (they are: no hidden retries), so flushes went on
  sending to the dead master of a slot a replica had taken over.
- An outage ends when every master answers ``CLUSTER INFO`` with ``cluster_state:ok``
  (``_probe_primaries``, in the background), not at the first call that succeeds: one master down,
  calls to the others still succeed, and the single server's rule logged the outage's end and
  start again at every such pair of calls (and a master answers PING while it still refuses every
  key with CLUSTERDOWN, until it hears of the failover).

Invariants:
- Redis is the shared truth while it answers; the local table is the fallback. A shared binding
  overrides a different local one; a missing shared one keeps the local one (Redis restarted and
  lost its keys, or it is down): the next commit writes it back, so sharing heals by itself.
  Except while this replica's own write of the session is queued (``_pending``) or in a batch
  being written (``_flushing``), or was made while the read was in flight: then the local
  binding is newer than what Redis answered, and ``mirror`` leaves it alone (else a move would
  route to the old target until the write lands, then flap back).
- Writes are write-behind, not awaited on the request path: ``Router.commit`` is synchronous and
  does no I/O, and awaiting would add a Redis round trip to every session request's first byte.
  One flusher task drains ``_pending`` (last write per session wins) in one pipeline per round;
  the lifespan's stop hook flushes what is left (bounded by ``timeout_s``) before closing. A
  pipeline carries at most ``_chunk`` bindings (oldest first; ``FLUSH_CHUNK`` at most, halved
  after a failed one, doubled back after a good one), so it fits its call's time bound however
  many bindings an outage queued. A flush cancelled mid-write or failed puts its batch back
  (newer queued writes win; at most ``MAX_PENDING`` kept; bindings expired or moved locally
  meanwhile are not written), so the flusher's retry after ``retry_after_s`` (or the final
  flush) sees it; the final flush and ``leave()`` ignore the error back-off (the final flush
  stops at its first failed pipeline).
- A request's end (``touch``: its session's idle time restarts) is queued as a ``Refresh``, not a
  bind: ``SET NX`` (Redis lost it: write it back) plus ``PEXPIRE``; it never overwrites another
  target. It used to rewrite this replica's target, so a turn ending here undid a move another
  replica had made and shared while it ran (the binding flapped between replicas).
- A session with a request in flight here (``SessionTable.begin`` .. ``end``) never expires
  locally, and must not in Redis either: its binding was written with ``PX idle_ttl`` when the
  turn started, so a turn longer than the idle time let the shared key expire mid-turn and
  another replica routed the session's next concurrent turn afresh. The flusher queues a
  ``Refresh`` for every such session each ``idle_ttl_s / 2`` (``_keep_alive``), written in its
  usual pipelines: Redis traffic is bounded by the sessions in flight here, never one call per
  request, and the key always has at least half its idle time left while a turn runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import (AskError, ClusterDownError, NoPermissionError, RedisClusterException, ResponseError,
                              TryAgainError)

from mesh.config import cluster_seed, redact_url
from mesh.core.sessions import SessionTable, _norm
from mesh.state.shared_load import SharedLoad, load_families

log = logging.getLogger("mesh.state.redis_state")

T = TypeVar("T")
OPS = ("get", "set", "delete", "ping", "load")
MAX_PENDING = 100_000  # queued binding writes kept while Redis is unreachable (newest kept)
# Bindings per write pipeline: ~25 ms of client work at 1000, well inside a call's 2 x timeout_s.
# One pipeline of every queued binding took longer than that past ~10k (after an outage), failed,
# was queued again whole with the newer ones, and so never got through again.
FLUSH_CHUNK = 1000
FLUSH_CHUNK_MIN = 16
# Replies of a cluster node about slots, not about data (MovedError is an AskError): redis-py follows
# them in cluster mode, so one that reaches Mesh means the layout is changing; from one server they
# mean state.url is a cluster node and state.cluster is off.
CLUSTER_REPLIES = (AskError, TryAgainError, ClusterDownError)


@dataclass(frozen=True, slots=True)
class Refresh:
    """A queued ``touch``: restart the shared binding's idle time, or write ``target`` if Redis
    has no binding; never over another target (another replica's newer move)."""

    target: str


Write = str | Refresh | None  # a queued write of one session: bind, refresh, or delete (None)


def _target(write: Write) -> str | None:
    return write.target if isinstance(write, Refresh) else write


def redis_client(url: str, timeout_s: float, *, cluster: bool = False, seeds: tuple[str, ...] = ()) -> Any:
    """A ``redis.asyncio`` client for one server, or a ``RedisCluster`` seeded with ``url``'s node
    and ``seeds`` (``host:port``, with ``url``'s scheme, credentials and options); connects lazily."""
    options: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": Retry(NoBackoff(), 0),  # no hidden retries: one attempt, then the local table
        "decode_responses": True,
    }
    try:
        if not cluster:
            return aioredis.Redis.from_url(url, **options)
        nodes = []
        for seed in seeds:
            parsed = cluster_seed(seed)
            if parsed is None:
                raise ValueError(f"cluster seed {seed!r} is not host:port")
            nodes.append(ClusterNode(*parsed))
        return RedisCluster.from_url(url, startup_nodes=nodes or None, **options)
    except (ValueError, RedisClusterException) as exc:  # a URL redis-py cannot parse, a db other than 0
        kind = "Redis Cluster" if cluster else "Redis"
        raise ValueError(f"state.url {redact_url(url)!r} is not a usable {kind} URL: {exc}") from exc


def describe(exc: BaseException, timeout_s: float) -> str:
    """An error as an operator reads it: its class and message, and the node when the error carries
    one apart from its message. Not ``%r``: redis-py 8's repr is only the category
    (``network:ConnectionError``), never the cause (``Error 111 connecting to 127.0.0.1:7102``)."""
    text = str(exc)[:300]
    if isinstance(exc, TimeoutError) and not text:  # asyncio.timeout's bound over the socket timeouts
        text = f"no answer within {timeout_s:g} s"
    addr = getattr(exc, "node_addr", None)
    node = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) and len(addr) == 2 else failed_node(exc)
    if node is not None and node not in text:
        text += f" (node {node})"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def failed_node(exc: BaseException) -> str | None:
    """``host:port`` of the connection an error was raised on (the innermost one in its traceback),
    if any: "Connection closed by server." names no node, and in a cluster the seed is not it."""
    node = None
    tb = exc.__traceback__
    while tb is not None:
        conn = tb.tb_frame.f_locals.get("self")
        if isinstance(conn, AbstractConnection) and getattr(conn, "host", None):
            node = f"{conn.host}:{conn.port}"
        tb = tb.tb_next
    return node


def cluster_ok(info: Mapping[str, Any]) -> bool:
    """``CLUSTER INFO`` of one node, or of each (node name -> info): every one ``cluster_state:ok``."""
    infos = [info] if "cluster_state" in info else list(info.values())
    return bool(infos) and all(isinstance(i, Mapping) and i.get("cluster_state") == "ok" for i in infos)


class RedisStateBackend:
    """``StateBackend`` over Redis; every call is bounded by ``timeout_s`` and never raises."""

    def __init__(
        self,
        url: str,
        idle_ttl_s: float,
        *,
        key_prefix: str = "mesh:",
        timeout_s: float = 0.1,
        retry_after_s: float = 0.5,
        on_error: Callable[[str], None] | None = None,
        cluster: bool = False,
        seeds: tuple[str, ...] = (),
    ) -> None:
        if not (idle_ttl_s > 0):
            raise ValueError(f"idle_ttl_s must be > 0, got {idle_ttl_s!r}")
        if cluster and ("{" in key_prefix or "}" in key_prefix):
            raise ValueError(f"key_prefix {key_prefix!r} must not contain '{{' or '}}' in a Redis Cluster")
        self.redis = redis_client(url, timeout_s, cluster=cluster, seeds=seeds)
        self.cluster = cluster
        self.url = redact_url(url)  # the only form ever shown (logs, stats); the client holds the secret
        self.idle_ttl_s = float(idle_ttl_s)  # follows sessions.idle_ttl_s (SharedSessionTable sets it)
        self.key_prefix = key_prefix
        self.prefix = key_prefix + "s:"  # sessions: no hash tag, spread over a cluster's slots
        # Keys written together (mesh.state.shared_load's) share one slot of a cluster: hash tag {key_prefix}.
        self.load_prefix = f"{{{key_prefix}}}" if cluster else key_prefix
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.on_error = on_error
        self.errors: dict[str, int] = dict.fromkeys(OPS, 0)
        self.skipped = 0  # calls not sent while backing off after an error
        self._down_until = 0.0
        self._down_logged = False  # an outage was logged; cleared (and logged) when Redis answers again
        self._probe: asyncio.Task[None] | None = None  # cluster: is every master back? (_answered)
        self._probe_after = 0.0
        # One server: is state.url a Redis Cluster node (INFO cluster)? Asked before the first call
        # after start and after each outage; a cluster node makes this backend local_only for good.
        self._mode_checked = cluster
        self.local_only = False  # refused configuration: no Redis call at all (sessions and load local)

    def key(self, session_id: str) -> str:
        return self.prefix + session_id

    @property
    def ttl_ms(self) -> int:
        return max(1, round(self.idle_ttl_s * 1000))

    # -- StateBackend --
    async def get_session(self, session_id: str, now: float) -> str | None:
        return await self._call("get", lambda: self.redis.get(self.key(session_id)), None)

    async def set_session(self, session_id: str, target: str, now: float) -> bool:
        """Bind or refresh; True when the session moved from another (live) target."""
        async def op() -> bool:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.get(self.key(session_id))
                pipe.set(self.key(session_id), target, px=self.ttl_ms)
                old, _ = await pipe.execute()
            return old is not None and old != target

        return await self._call("set", op, False)

    async def delete_session(self, session_id: str) -> None:
        await self._call("delete", lambda: self.redis.delete(self.key(session_id)), None)

    # -- batches and lifecycle --
    async def write_many(self, bindings: Mapping[str, Write], *, backoff: bool = True) -> bool:
        """One pipeline: ``SET PX`` each bound session, ``DEL`` each ``None``, ``SET NX PX`` +
        ``PEXPIRE`` each ``Refresh``; False on error.

        ``backoff=False`` (the final flush) tries even right after an error, still bounded by the timeout.
        """
        async def op() -> bool:
            async with self.redis.pipeline(transaction=False) as pipe:
                for sid, target in bindings.items():
                    if target is None:
                        pipe.delete(self.key(sid))
                    elif isinstance(target, Refresh):
                        pipe.set(self.key(sid), target.target, px=self.ttl_ms, nx=True)
                        pipe.pexpire(self.key(sid), self.ttl_ms)
                    else:
                        pipe.set(self.key(sid), target, px=self.ttl_ms)
                results = await pipe.execute(raise_on_error=False)
            self._refused_writes([r for r in results if isinstance(r, Exception)])
            return True

        if not bindings:
            return True
        return await self._call("set", op, False, backoff=backoff)

    def _refused_writes(self, errors: list[Exception]) -> None:
        """A batch's commands that failed. Any error but a refusal fails the batch (raised: queued
        again). Refusals (WRONGTYPE on another app's key, NOPERM) are counted, logged and dropped:
        the rest of the batch is written, and a key refused for good is not retried forever (it
        failed the whole batch, queued again every ``retry_after_s``, and so every binding in it)."""
        if not errors:
            return
        for exc in errors:
            if not self.refused(exc):
                raise exc
        self.errors["set"] += 1
        self._log_data_error("set", errors[0], f" ({len(errors)} command(s) of a batch, dropped)")
        if self.on_error is not None:
            self.on_error("set")

    async def ping(self) -> bool:
        """PING the server; in a cluster every master (one down: not reachable)."""
        return await self._call("ping", self._ping, False, backoff=False)

    async def _ping(self) -> Any:
        if self.cluster:
            return await self.redis.ping(target_nodes=RedisCluster.PRIMARIES)
        return await self.redis.ping()

    async def aclose(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._probe
        with contextlib.suppress(Exception):
            await self.redis.aclose()

    def stats(self) -> dict[str, Any]:
        return {"url": self.url, "cluster": self.cluster, "errors": dict(self.errors), "skipped": self.skipped}

    def refused(self, exc: BaseException) -> bool:
        """True when Redis answered and refused this one command (WRONGTYPE, OOM, NOPERM): the data
        or the server's settings, not Redis being away. A cluster's slot replies are not that."""
        return isinstance(exc, ResponseError) and not (self.cluster and isinstance(exc, CLUSTER_REPLIES))

    async def _call(self, op: str, fn: Callable[[], Any], default: T, *, backoff: bool = True) -> T:
        if self.local_only or (backoff and time.monotonic() < self._down_until):
            self.skipped += 1
            return default
        try:
            async with asyncio.timeout(self.timeout_s * 2):  # hard bound over the socket timeouts
                if not self._mode_checked and not await self._single_server():
                    return default
                result: T = await fn()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # RedisError, TimeoutError, OSError: all mean "go local"
            self.errors[op] += 1
            if self.refused(exc):
                # The server answered: this command failed (WRONGTYPE: another app's data under our
                # prefix), not Redis. No back-off, or one bad key stops every other call too.
                self._log_data_error(op, exc)
            else:
                self._down_until = time.monotonic() + self.retry_after_s
                self._mode_checked = self.cluster  # one server: what answers next may be another server
                if not self._down_logged:  # one line per outage, not one per call
                    self._down_logged = True
                    where = f"Redis Cluster (seed {self.url})" if self.cluster else self.url
                    log.warning("state backend %s unreachable (%s: %s): going local, retrying every %.1f s",
                                where, op, describe(exc, self.timeout_s * 2), self.retry_after_s)
                log.debug("state backend %s failed: %s", op, describe(exc, self.timeout_s * 2))
                if self.cluster:
                    await self._forget_layout()
            if self.on_error is not None:
                self.on_error(op)
            return default
        self._answered()
        return result

    async def _single_server(self) -> bool:
        """One server: False (and ``local_only`` for good, one ERROR) when ``state.url`` is a Redis
        Cluster node. Such a node answers PING and the keys of its own slots, and MOVED for every
        other key: sessions flapped between replicas, a write batch holding one such key failed
        whole, and load sharing saw no peers. Asked once per connection (start, each outage's end)."""
        try:
            info = await self.redis.info("cluster")
        except ResponseError:  # an ACL without INFO: cannot tell (a MOVED reply still names the setting)
            info = {}
        self._mode_checked = True
        if str(info.get("cluster_enabled", "0")) != "1":
            return True
        self.local_only = True
        log.error("state backend %s is a Redis Cluster node, but state.cluster is off: set state.cluster: true "
                  "(and its nodes in state.cluster_seeds). Refused: sessions and load stay local to this replica, "
                  "nothing is written to Redis, until a restart with that setting", self.url)
        return False

    def _answered(self) -> None:
        """A call succeeded. One server: an outage is over (one line). A cluster: a call to a live
        master says nothing of a dead one, so the end waits until every master answers and says the
        cluster is ok (``_probe_primaries``, in the background, at most one per ``retry_after_s``)."""
        if not self._down_logged:
            return
        if not self.cluster:
            self._log_recovered()
        elif (self._probe is None or self._probe.done()) and time.monotonic() >= self._probe_after:
            self._probe_after = time.monotonic() + self.retry_after_s
            self._probe = asyncio.create_task(self._probe_primaries(), name="mesh-state-probe")

    async def _probe_primaries(self) -> None:
        """The outage is over once every master answers and says ``cluster_state:ok``: a master
        answers PING while it still refuses every key (CLUSTERDOWN) until it learns of a failover."""
        try:
            async with asyncio.timeout(self.timeout_s * 2):
                info = await self.redis.cluster_info(target_nodes=RedisCluster.PRIMARIES)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # still down: the outage goes on (no line, no error counted)
            if not self.refused(exc):
                log.debug("state backend cluster probe failed: %r", exc)
                return
            info = None  # an ACL without CLUSTER INFO: every master answered, that will do
        if info is not None and not cluster_ok(info):
            log.debug("state backend cluster probe: not every master says ok yet")
            return
        if self._down_logged:
            self._log_recovered()

    def _log_recovered(self) -> None:
        self._down_logged = False
        log.warning("state backend %s answers again: sharing sessions and load through it", self.url)

    async def _forget_layout(self) -> None:
        """Cluster: drop every node connection and the slot map; the next call asks a live node for
        the layout again (a replica may have taken a dead master's slots). Bounded by ``timeout_s``
        (``aclose`` waits for a discovery in flight)."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.timeout_s):
                await self.redis.aclose()

    def acl_needs(self) -> str:
        """The key patterns (and commands) a Redis ACL must allow this backend's user."""
        if not self.cluster:
            return f"the keys ~{self.key_prefix}*"
        return f"the keys ~{self.key_prefix}* ~{self.load_prefix}* (load keys carry a hash tag) and EVAL (+@scripting)"

    def _log_data_error(self, op: str, exc: Exception, what: str = "") -> None:
        """A warning for the 1st, 2nd, 4th, ... command error of each op (bounded log volume)."""
        n = self.errors[op]
        if n & (n - 1) == 0:
            text = str(exc)[:200]
            hint = f"; another app's keys under key_prefix {self.key_prefix!r}?" if "WRONGTYPE" in text else ""
            if isinstance(exc, CLUSTER_REPLIES):  # (only ever refused with cluster off)
                hint = "; state.url is a Redis Cluster node: set state.cluster: true"
            elif isinstance(exc, NoPermissionError) or "NOPERM" in text or "no permissions" in text:
                hint = f"; the Redis user's ACL must allow {self.acl_needs()}"
            log.warning("state backend %s: Redis refused a command%s (%d so far): %s%s", op, what, n, text, hint)


class SharedSessionTable(SessionTable):
    """The local ``SessionTable`` (read by policies), kept in step with a shared backend."""

    def __init__(self, backend: RedisStateBackend, idle_ttl_s: float = 600.0, max_sessions: int = 1_000_000) -> None:
        super().__init__(idle_ttl_s, max_sessions)
        self.backend = backend
        self._pending: dict[str, Write] = {}  # session -> target to write, None to delete, or Refresh
        self._flushing: list[dict[str, Write]] = []  # batches taken from _pending, being written
        self._chunk = FLUSH_CHUNK  # bindings per pipeline now (halved after a failure)
        self._wake = asyncio.Event()
        self.mirrored = 0  # local bindings set or changed from the shared one
        self.shared_load: SharedLoad | None = None  # set by SharedState when state.load_sync_s > 0

    # -- the router's writes: local at once, shared by the flusher --
    def bind(self, session_id: str, target: str, now: float) -> bool:
        moved = super().bind(session_id, target, now)
        self._pending[session_id] = target
        self._wake.set()
        return moved

    def unbind(self, session_id: str) -> bool:
        done = super().unbind(session_id)
        if done:
            self._pending[session_id] = None
            self._wake.set()
        return done

    def touch(self, session_id: str, target: str, now: float) -> None:
        """``SessionTable.touch`` (a request on ``target`` ended), shared as a ``Refresh``: the
        idle time restarts in Redis too, without overwriting a move another replica made."""
        b = self._bindings.get(_norm(session_id))
        if b is not None and b[0] != target and b[1] + self.idle_ttl_s > now:
            return  # moved to another live target meanwhile (a later turn): left alone
        SessionTable.bind(self, session_id, target, now)  # local only: not queued as a bind
        if self._pending.get(session_id) != target:  # a queued bind to it says more: it stays
            self._pending[session_id] = Refresh(target)
            self._wake.set()

    # -- the gateway's read before a decision --
    async def mirror(self, session_id: str, now: float) -> str | None:
        """Copy the shared binding into the local table; returns it (None: keep the local one).

        Never over a local write that Redis may not have yet: one queued or being flushed (not
        even read then), or one made while the read was in flight.
        """
        if self._writing(session_id):
            return None
        local = self.bound_target(session_id, now)
        shared = await self.backend.get_session(session_id, now)
        after = self.bound_target(session_id, now)
        if self._writing(session_id) or (after is not None and after != local):
            return None  # this replica bound it meanwhile: its binding is newer than the read
        if shared is not None and shared != local:
            super().bind(session_id, shared, now)  # not queued: it came from the backend
            self.mirrored += 1
        return shared

    def _writing(self, session_id: str) -> bool:
        """True while a local bind or delete of the session is queued or in a batch not yet
        written (a ``Refresh`` claims nothing newer than Redis: the shared binding still wins)."""
        return any(session_id in writes and not isinstance(writes[session_id], Refresh)
                   for writes in (self._pending, *self._flushing))

    # -- write-behind --
    async def flush(self, *, final: bool = False) -> bool:
        """Write the queued bindings, a pipeline of at most ``_chunk`` at a time, until none is
        left or one fails (False); ``final`` (shutdown) ignores the back-off. A backend that
        refused its configuration (``local_only``) drops them: nothing is ever written."""
        if self.backend.local_only:
            self._pending.clear()
            return True
        while self._pending:
            if not await self._flush_chunk(final):
                return False
        return True

    async def _flush_chunk(self, final: bool) -> bool:
        """Write the oldest ``_chunk`` queued bindings in one pipeline.

        A batch that failed (Redis down, slow, or backing off) is queued again (newer writes win)
        for the flusher's retry, minus what has expired or moved locally meanwhile: it used to be
        dropped, so every binding made during a blip of Redis stayed unshared until that session's
        next request through this replica (the other replicas routed it afresh).
        """
        if len(self._pending) <= self._chunk:
            batch, self._pending = self._pending, {}
        else:
            batch = {sid: self._pending.pop(sid) for sid in list(itertools.islice(self._pending, self._chunk))}
        self.backend.idle_ttl_s = self.idle_ttl_s  # a config reload changes the table's TTL
        self._flushing.append(batch)
        try:
            ok = await self.backend.write_many(batch, backoff=not final)
        except asyncio.CancelledError:
            self._requeue(batch)  # back for the final flush
            raise
        finally:
            self._flushing.remove(batch)
        self._chunk = min(FLUSH_CHUNK, self._chunk * 2) if ok else max(FLUSH_CHUNK_MIN, self._chunk // 2)
        if not ok and not final:
            self._requeue(batch)
        return ok

    def _requeue(self, batch: dict[str, Write]) -> None:
        """Put a batch back under the newer queued writes; the queue keeps its newest MAX_PENDING.

        A binding no longer held locally (expired, evicted or moved since) is not put back: a retry
        must not bring it back to life in Redis (the table's expiry passes remove idle bindings,
        so presence, whatever the clock, is what counts here).
        """
        held = {sid: t for sid, t in batch.items() if t is None or self.bound_target(sid, -math.inf) == _target(t)}
        self._pending = {**held, **self._pending}
        extra = len(self._pending) - MAX_PENDING
        if extra > 0:  # oldest first (insertion order): a long outage must not grow it without bound
            for sid in list(itertools.islice(self._pending, extra)):
                del self._pending[sid]

    def _keep_alive(self) -> int:
        """Queue a ``Refresh`` for each session with a request in flight here (not already queued:
        a queued write restarts its idle time too); returns how many. ``_active`` holds normalized
        ids, which are the gateway's (hashed, 32 chars) as they are."""
        queued = 0
        for sid in self._active:
            b = self._bindings.get(sid)
            if b is None or sid in self._pending:
                continue
            self._pending[sid] = Refresh(b[0])
            queued += 1
        if queued:
            self._wake.set()
        return queued

    async def run_flusher(self) -> None:
        keep_at = time.monotonic() + self.idle_ttl_s / 2
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, keep_at - time.monotonic())):
                    await self._wake.wait()
            now = time.monotonic()
            if now >= keep_at:  # in-flight sessions' shared bindings must outlive their turns
                self._keep_alive()
                keep_at = now + self.idle_ttl_s / 2  # a reload's new TTL applies from the next round
            self._wake.clear()
            if not await self.flush() and self._pending:
                await asyncio.sleep(self.backend.retry_after_s)  # retry once the back-off is over
                self._wake.set()

    def stats(self) -> dict[str, Any]:
        load = self.shared_load.stats() if self.shared_load is not None else None
        return {**super().stats(), "mirrored": self.mirrored, "backend": self.backend.stats(), "load": load}


def shared_session_table(config: Any) -> SharedSessionTable:
    """The gateway's session table for ``state.backend: redis`` (``config``: a ``MeshConfig``)."""
    state, sessions = config.state, config.sessions
    backend = RedisStateBackend(state.url, sessions.idle_ttl_s, key_prefix=state.key_prefix, timeout_s=state.timeout_s,
                                cluster=state.cluster, seeds=tuple(state.cluster_seeds))
    return SharedSessionTable(backend, sessions.idle_ttl_s, sessions.max_sessions)


class SharedState:
    """The Redis side of one gateway replica: the shared table's flusher, load sync and metrics.

    Built by ``mesh.gateway.app.build_gateway`` when ``state.backend: redis``; the gateway calls
    ``start`` and ``stop`` in its lifespan. The per-request step (``table.mirror`` of a parsed
    request's session before its decision) is the proxy's, named there.
    """

    def __init__(self, table: SharedSessionTable, targets: Any, metrics: Any, load_sync_s: float) -> None:
        self.table = table
        self.backend = table.backend
        errors = metrics.counter(
            "mesh_state_backend_errors", "State backend (Redis) calls that failed or timed out; the gateway went local", ["op"]
        )
        for op in OPS:
            errors.labels(op)
        self.backend.on_error = lambda op: errors.labels(op).inc()
        self.load = SharedLoad(self.backend, targets, load_sync_s) if load_sync_s > 0 else None
        table.shared_load = self.load  # read by tests and stats; None when load sharing is off
        if self.load is not None:
            load = self.load
            metrics.add_collector(lambda: load_families(load))
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        if not await self.backend.ping() and not self.backend.local_only:  # local_only: an ERROR said why
            log.warning("state backend %s not reachable at start; using local session bindings and load until it is",
                        self.backend.url)  # redacted
        self._tasks.append(asyncio.create_task(self.table.run_flusher(), name="mesh-state-flusher"))
        if self.load is not None:
            self._tasks.append(asyncio.create_task(self.load.run(), name="mesh-load-sync"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        if self.load is not None:
            await self.load.leave()  # other replicas drop this one's load now, not after its TTL
        await self.table.flush(final=True)  # the last bindings, even right after an error; bounded by timeout_s
        await self.backend.aclose()
