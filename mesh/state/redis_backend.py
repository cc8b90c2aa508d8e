"""``RedisStateBackend``: ``mesh.core.sessions.StateBackend`` over ``redis.asyncio``, for one
server or a Redis Cluster (``state.cluster: true``; ``url`` and ``cluster_seeds`` are seed nodes).

One key per session, ``{prefix}s:{session} = target``, written with ``SET ... PX idle_ttl_ms`` on
every use, so Redis itself expires an idle binding exactly when the local table does (``PX``, not
``EX``: sub-second TTLs too). No call ever raises: an error or a timeout is counted
(``on_error(op)``, the gateway's ``mesh_state_backend_errors_total{op}``) and answers "no shared
binding"; Redis is then skipped for ``retry_after_s`` (a black-holed server costs one
``timeout_s``, not one per request), except after a command the server refused (``refused``:
WRONGTYPE, NOPERM), which fails that one call. One WARNING line marks an outage's start, one its end.

The Redis URL is only ever shown redacted (``redact_url``: no password in logs, errors, stats).
Ownership: the backend owns its client and its error counters; ``SharedSessionTable`` and
``SharedLoad`` call it, on the gateway's event loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import AskError, ClusterDownError, NoPermissionError, RedisClusterException, ResponseError, TryAgainError

from mesh.config import cluster_seed, redact_url

log = logging.getLogger("mesh.state.redis_state")  # the Redis state's log channel (operators filter on it)

T = TypeVar("T")
OPS = ("get", "set", "delete", "ping", "load")
# Replies of a cluster node about slots, not about data (MovedError is an AskError): redis-py follows
# them in cluster mode, so one that reaches Mesh means the layout is changing; from one server they
# mean state.url is a cluster node and state.cluster is off.
CLUSTER_REPLIES = (AskError, TryAgainError, ClusterDownError)


@dataclass(frozen=True, slots=True)
class Refresh:
    """A queued ``touch``: restart the shared binding's idle time, or write ``target`` if Redis
    has no binding; never over another target (another replica's newer move)."""

    target: str


@dataclass(frozen=True, slots=True)
class Claim:
    """A binding made while Redis was unreachable (the decision could not see the shared one):
    written only where Redis has no binding of the session (``SET NX``); where it has one, that
    one wins (``write_many`` reports it in ``lost``) and its idle time restarts."""

    target: str


Write = str | Refresh | Claim | None  # a queued write of one session: bind, refresh, claim, or delete (None)


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
    """``StateBackend`` over Redis; every call is bounded by ``timeout_s`` and never raises.

    Keys in a Redis Cluster (redis-py's ``RedisCluster`` finds the masters, maps keys to hash
    slots and follows MOVED/ASK):

    - Session keys keep their single-server names (``{prefix}s:{session}``, no hash tag) and so
      spread over every master's slots: they are the bulk of the keys and of the traffic, and no
      command ever touches two of them (GET, SET, SET NX + PEXPIRE of one key, DEL). The
      write-behind pipeline is no transaction: redis-py splits it per master and sends the parts
      in parallel. (One hash tag would put them all on one slot that resharding can never split.)
      The cost: a pipeline spans every master, so one master down fails the whole flush (queued
      again, as on one server).
    - The load keys (``mesh.state.shared_load``) are written together, atomically: they carry
      the hash tag ``{key_prefix}`` (``load_prefix``), so they share one slot.

    Failures in a cluster, whose masters fail one at a time: after a failure the client forgets
    the layout (``_forget_layout``), since redis-py does not after a failed pipeline with its
    retries off; and an outage ends only when every master says ``cluster_state:ok``
    (``_probe_primaries``), not at the first call that succeeds (a call to a live master says
    nothing of a dead one, and a master answers PING while it refuses every key with CLUSTERDOWN).
    """

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
    async def write_many(self, bindings: Mapping[str, Write], *, backoff: bool = True,
                         lost: dict[str, str] | None = None) -> bool:
        """One pipeline: ``SET PX`` each bound session, ``DEL`` each ``None``, ``SET NX PX`` +
        ``PEXPIRE`` each ``Refresh``, ``SET NX PX`` + ``GET`` + ``PEXPIRE`` each ``Claim``; False
        on error. ``lost`` receives each claim Redis already held another binding of (session ->
        that shared target).

        ``backoff=False`` (the final flush) tries even right after an error, still bounded by the timeout.
        """
        async def op() -> bool:
            claims: list[tuple[str, str, int]] = []  # (session, claimed target, index of its GET's result)
            async with self.redis.pipeline(transaction=False) as pipe:
                n = 0
                for sid, target in bindings.items():
                    if target is None:
                        pipe.delete(self.key(sid))
                    elif isinstance(target, Refresh):
                        pipe.set(self.key(sid), target.target, px=self.ttl_ms, nx=True)
                        pipe.pexpire(self.key(sid), self.ttl_ms)
                        n += 1
                    elif isinstance(target, Claim):
                        pipe.set(self.key(sid), target.target, px=self.ttl_ms, nx=True)
                        pipe.get(self.key(sid))
                        pipe.pexpire(self.key(sid), self.ttl_ms)
                        claims.append((sid, target.target, n + 1))
                        n += 2
                    else:
                        pipe.set(self.key(sid), target, px=self.ttl_ms)
                    n += 1
                results = await pipe.execute(raise_on_error=False)
            self._refused_writes([r for r in results if isinstance(r, Exception)])
            if lost is not None:
                lost.update((sid, results[i]) for sid, want, i in claims if isinstance(results[i], str) and results[i] != want)
            return True

        if not bindings:
            return True
        return await self._call("set", op, False, backoff=backoff)

    def _refused_writes(self, errors: list[Exception]) -> None:
        """A batch's commands that failed. Any error but a refusal fails the batch (raised: queued
        again). Refusals (WRONGTYPE on another app's key, NOPERM) are counted, logged and dropped:
        the rest of the batch is written, and a key refused for good is not retried forever (it
        would fail the whole batch, queued again every ``retry_after_s``, and so every binding in it)."""
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

    @property
    def down(self) -> bool:
        """An outage is in progress: a call failed and none has succeeded since (one server), or
        not every master says the cluster is ok yet (a cluster)."""
        return self._down_logged

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
        other key: sessions would flap between replicas, a write batch holding one such key would
        fail whole, and load sharing would see no peers. Asked once per connection (start, each
        outage's end)."""
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

