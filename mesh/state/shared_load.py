"""In-flight load shared by several gateway replicas through Redis (``state.backend: redis``,
``state.load_sync_s``); run for a gateway by ``mesh.state.shared_sessions.SharedState``.

Every ``load_sync_s`` (0.1 s; 0 = off) this replica (a uuid per process) writes its OWN
per-target load (in_flight, prefill_tokens, decode_tokens) as one hash ``{prefix}load:{replica}``
(``PX`` a few periods, so a dead replica's load leaves by itself), lists live replicas in the
sorted set ``{prefix}load:replicas`` (``PX`` a minute, refreshed every round: no key of this
module outlives the last replica) and sums the others' hashes per target. ``TargetState``s
keep meaning "total load on that target", so policies do not change.

Invariants: ``SharedLoad`` remembers the remote part it last added to each target (``applied``)
and moves a target's fields by deltas (``t.in_flight += new - old``), so for every target
``t.<field> == own + applied`` at all times; a ``Lease``'s +1/-1 commutes with that, and own
(what is published) is ``t.<field> - applied``. Remote values are clamped at >= 0, so no field
goes negative. A failed or skipped round (Redis down, timeout, back-off) withdraws every applied
remote part at once (local-only load) and counts ``op="load"``; so does stopping. A target that
leaves the registry (or is replaced under the same id) has its remote part taken off its old
state and forgotten; remote ids this replica does not route to are ignored (not even read: HMGET
of this replica's targets). A round's work is bounded whatever Redis holds: at most ``MAX_PEERS``
peers (the most recently seen), members dated over ``PRUNE_MEMBERS_MS`` ahead are pruned like
those as far behind, and a peer key of another type is skipped (``bad_peers``).

Members are dated by Redis's clock (``TIME``, read every ``CLOCK_REFRESH_S``; this host's clock
plus that offset in between), never by the replica's own: two replicas whose host clocks were over
a minute apart pruned each other's entry every round, silently, and so shared no load at all. A
server that refuses ``TIME`` (an ACL without it) leaves the host's clock in use (warned once).

In a Redis Cluster (``backend.cluster``) every key here carries the hash tag ``{key_prefix}``
(``backend.load_prefix``: ``{mesh:}load:replicas``), so they share one slot, and so one master:
the round's write touches two keys at once, and the peers' hashes are read in one pipeline from that
master. ``TIME`` goes to that master too, so every replica dates by one clock. The write is one Lua
script there (``PUBLISH_LUA``: one command, atomic, MOVED followed like any other) instead of the
MULTI/EXEC pipeline, which redis-py's asyncio cluster client runs by starting a thread and an event
loop for each queued command while the gateway's loop waits (13 ms a round here, 28 ms at worst).
A cluster user therefore needs ``EVAL``; the single-server round is unchanged (no script needed).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from redis.exceptions import ResponseError

from policies.base import TargetState

if TYPE_CHECKING:
    from mesh.state.redis_backend import RedisStateBackend

# The cluster form of the round's MULTI/EXEC (``_publish``), same commands in the same order.
# KEYS: this replica's hash, the replica set (one slot). ARGV: ttl_ms, now_ms, replica id, the
# prune bounds (low, "(high"), the set's ttl_ms, how many members to return, then field, value, ...
# (HSET in chunks: Lua's unpack has a limit of a few thousand values).
PUBLISH_LUA = """
redis.call('DEL', KEYS[1])
for i = 8, #ARGV, 1000 do
  redis.call('HSET', KEYS[1], unpack(ARGV, i, math.min(i + 999, #ARGV)))
end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[4])
redis.call('ZREMRANGEBYSCORE', KEYS[2], ARGV[5], '+inf')
redis.call('PEXPIRE', KEYS[2], ARGV[6])
return redis.call('ZREVRANGEBYSCORE', KEYS[2], '+inf', '-inf', 'LIMIT', 0, ARGV[7])
"""

Load = tuple[int, int, int]  # (in_flight, prefill_tokens, decode_tokens)
LOAD_FIELDS = ("in_flight", "prefill_tokens", "decode_tokens")
ZERO: Load = (0, 0, 0)
PRUNE_MEMBERS_MS = 60_000  # a replica silent this long leaves the member set (its hash left long before)
MAX_PEERS = 256  # other replicas read per round (the most recently seen): a round's work stays bounded
CLOCK_REFRESH_S = 10.0  # how often Redis's clock is read again (host clocks drift slowly)

log = logging.getLogger("mesh.state.shared_load")


class SharedLoad:
    """This replica's per-target load published to Redis; the other live replicas' added in.

    Owns the remote part of every ``TargetState`` load field (``applied``); the registry owns the
    states, ``Lease``s own the local part. Runs on the event loop only (no locks needed).
    """

    def __init__(
        self,
        backend: RedisStateBackend,
        targets: Mapping[str, TargetState],
        period_s: float = 0.1,
        *,
        replica_id: str | None = None,
        ttl_s: float | None = None,
    ) -> None:
        if not (period_s > 0):
            raise ValueError(f"load sync period must be > 0, got {period_s!r}")
        self.backend = backend
        self.targets = targets  # the registry's dict: read every round, never replaced
        self.period_s = float(period_s)
        self.replica_id = replica_id or uuid.uuid4().hex
        # A few periods, and never under 0.5 s: a busy event loop must not make a live replica's
        # load blink out between two of its rounds.
        self.ttl_ms = max(1, round(1000 * (ttl_s if ttl_s is not None else max(5 * self.period_s, 0.5))))
        self.members_key = backend.load_prefix + "load:replicas"
        self.key = self.key_of(self.replica_id)
        self.applied: dict[str, tuple[TargetState, Load]] = {}  # target -> (state it is on, remote part)
        self.peers = 0  # other replicas seen in the last good round
        self.bad_peers = 0  # members of the replica set whose key was not a hash in the last round
        self.rounds = 0
        self.failed_rounds = 0
        self.clock_offset_ms = 0  # Redis's clock minus this host's (``TIME``); dates the replica set
        self._clock_read_at: float | None = None  # monotonic time of the last TIME; None: never
        self._clock_refused = False  # the server refused TIME: the host's clock it is

    def key_of(self, replica: str) -> str:
        return f"{self.backend.load_prefix}load:{replica}"

    # -- reads --
    def remote(self, target: str) -> Load:
        entry = self.applied.get(target)
        return entry[1] if entry is not None and self.targets.get(target) is entry[0] else ZERO

    def own(self, t: TargetState) -> Load:
        """This replica's own load on ``t``: the total minus the remote part applied to it."""
        r = self.remote(t.id)
        return (max(0, t.in_flight - r[0]), max(0, t.prefill_tokens - r[1]), max(0, t.decode_tokens - r[2]))

    # -- one round --
    async def sync_once(self) -> bool:
        """Publish own load, read the others', apply the difference; False (local-only) on error."""
        own = {tid: self.own(t) for tid, t in self.targets.items()}
        remote: dict[str, Load] | None = await self.backend._call("load", lambda: self._exchange(own), None)
        self.rounds += 1
        if remote is None:
            self.failed_rounds += 1
            self.withdraw()
            return False
        self._apply(remote)
        return True

    async def _redis_now_ms(self) -> int:
        """Now in Redis's clock (ms): the host's clock plus the offset read with ``TIME``."""
        due = self._clock_read_at is None or time.monotonic() - self._clock_read_at >= CLOCK_REFRESH_S
        if due and not self._clock_refused:
            before = time.time()
            try:
                seconds, micros = await self._time()
            except ResponseError as exc:  # NOPERM: keep the host's clock (errors of any other kind fail the round)
                self._clock_refused = True
                log.warning("Redis refused TIME (%s): replicas are dated by their own clocks, which must then "
                            "agree within %d s", str(exc)[:200], PRUNE_MEMBERS_MS // 1000)
            else:
                local_ms = (before + time.time()) * 500  # the middle of the round trip, in ms
                self.clock_offset_ms = round(seconds * 1000 + micros / 1000 - local_ms)
                self._clock_read_at = time.monotonic()
        return int(time.time() * 1000) + self.clock_offset_ms

    async def _time(self) -> tuple[int, int]:
        redis = self.backend.redis
        if not self.backend.cluster:
            return await redis.time()
        await redis.initialize()  # the slot map (no I/O once known)
        result: tuple[int, int] = await redis.time(target_nodes=redis.get_node_from_key(self.members_key))
        return result

    async def _exchange(self, own: Mapping[str, Load]) -> dict[str, Load]:
        now_ms = await self._redis_now_ms()
        fields = {"_": "1"}  # never empty: an empty hash would not exist, and that means "dead"
        fields.update({tid: "%d %d %d" % load for tid, load in own.items() if any(load)})
        members = await (self._publish_script if self.backend.cluster else self._publish)(fields, now_ms)
        peers = [m for m in members if m != self.replica_id][:MAX_PEERS]
        if not peers:
            self.peers = 0
            return {}
        fields_read = ["_", *self.targets]  # only the targets routed here: a peer's hash may be huge
        async with self.backend.redis.pipeline(transaction=False) as pipe:
            for m in peers:
                pipe.hmget(self.key_of(m), fields_read)
            # One peer key holding another type (WRONGTYPE) is skipped, not the whole round's error.
            answers = await pipe.execute(raise_on_error=False)
        for a in answers:  # a cluster pipeline hands back a node lost mid-read as a result: the round failed
            if isinstance(a, Exception) and not self.backend.refused(a):
                raise a
        hashes = [{f: v for f, v in zip(fields_read, a) if v is not None} for a in answers if isinstance(a, list)]
        self.bad_peers = len(answers) - len(hashes)
        self.peers = sum(1 for h in hashes if h)
        return sum_loads(hashes)

    async def _publish(self, fields: Mapping[str, str], now_ms: int) -> list[str]:
        """Write this replica's hash and date it in the replica set; the newest members (one server)."""
        redis = self.backend.redis
        async with redis.pipeline(transaction=True) as pipe:  # readers never see it half written
            pipe.delete(self.key)
            pipe.hset(self.key, mapping=fields)
            pipe.pexpire(self.key, self.ttl_ms)
            pipe.zadd(self.members_key, {self.replica_id: now_ms})
            pipe.zremrangebyscore(self.members_key, "-inf", now_ms - PRUNE_MEMBERS_MS)
            # Dated over a minute ahead: no live replica (every one dates by Redis's clock); such
            # an entry was never pruned.
            pipe.zremrangebyscore(self.members_key, f"({now_ms + PRUNE_MEMBERS_MS}", "+inf")
            # The set outlives its last live replica by PRUNE_MEMBERS_MS only: with every replica
            # gone (crashed: no leave()) nothing prunes it, and it had no TTL, so it stayed forever.
            pipe.pexpire(self.members_key, PRUNE_MEMBERS_MS)
            pipe.zrevrangebyscore(self.members_key, "+inf", "-inf", start=0, num=MAX_PEERS + 1)  # the newest
            members: list[str] = (await pipe.execute())[-1]
        return members

    async def _publish_script(self, fields: Mapping[str, str], now_ms: int) -> list[str]:
        """``_publish`` in a cluster: the same commands as one script on the slot of both keys."""
        argv = [self.ttl_ms, now_ms, self.replica_id, now_ms - PRUNE_MEMBERS_MS, f"({now_ms + PRUNE_MEMBERS_MS}",
                PRUNE_MEMBERS_MS, MAX_PEERS + 1, *(x for item in fields.items() for x in item)]
        members: list[str] = await self.backend.redis.eval(PUBLISH_LUA, 2, self.key, self.members_key, *argv)
        return members

    def _apply(self, remote: Mapping[str, Load]) -> None:
        for tid, (state, _) in list(self.applied.items()):
            if self.targets.get(tid) is not state:  # removed, or replaced under the same id
                self._set(tid, state, ZERO)
        for tid, t in self.targets.items():
            self._set(tid, t, remote.get(tid, ZERO))

    def _set(self, tid: str, t: TargetState, new: Load) -> None:
        entry = self.applied.get(tid)
        old = entry[1] if entry is not None and entry[0] is t else ZERO
        if new != old:
            t.in_flight += new[0] - old[0]
            t.prefill_tokens += new[1] - old[1]
            t.decode_tokens += new[2] - old[2]
        if any(new):
            self.applied[tid] = (t, new)
        elif entry is not None and entry[0] is t:
            del self.applied[tid]

    def withdraw(self) -> None:
        """Take every applied remote part off its state: back to this replica's own load."""
        for tid, (state, _) in list(self.applied.items()):
            self._set(tid, state, ZERO)
        self.applied.clear()
        self.peers = 0

    # -- lifecycle --
    async def run(self) -> None:
        try:
            while True:
                await self.sync_once()
                await asyncio.sleep(self.period_s)
        finally:
            self.withdraw()

    async def leave(self) -> None:
        """Stop sharing: local-only load here, and this replica's load gone from Redis at once."""
        self.withdraw()

        async def op() -> None:
            # Not a transaction in a cluster (see the module docstring); a reader in between sees a
            # member without a hash: a dead replica, skipped, as it is a moment later.
            async with self.backend.redis.pipeline(transaction=not self.backend.cluster) as pipe:
                pipe.delete(self.key)
                pipe.zrem(self.members_key, self.replica_id)
                await pipe.execute()

        await self.backend._call("load", op, None, backoff=False)

    def stats(self) -> dict[str, Any]:
        return {"replica": self.replica_id, "peers": self.peers, "bad_peers": self.bad_peers, "rounds": self.rounds,
                "failed_rounds": self.failed_rounds, "clock_offset_ms": self.clock_offset_ms,
                "remote": {tid: dict(zip(LOAD_FIELDS, load)) for tid, (_, load) in self.applied.items()}}


def parse_load(value: str) -> Load | None:
    """``"in_flight prefill decode"`` -> a load clamped at >= 0; None when malformed."""
    parts = value.split()
    if len(parts) != 3:
        return None
    try:
        a, b, c = (max(0, int(p)) for p in parts)
    except ValueError:
        return None
    return (a, b, c)


def sum_loads(hashes: list[Mapping[str, str]]) -> dict[str, Load]:
    """Per target, the sum of every replica hash's load (the ``_`` marker and bad values skipped)."""
    out: dict[str, Load] = {}
    for h in hashes:
        for tid, value in h.items():
            load = parse_load(value) if tid != "_" else None
            if load is not None:
                a, b, c = out.get(tid, ZERO)
                out[tid] = (a + load[0], b + load[1], c + load[2])
    return out


def load_families(load: SharedLoad) -> list[Any]:
    from prometheus_client.core import GaugeMetricFamily

    remote = GaugeMetricFamily("mesh_remote_in_flight", "In-flight requests other gateway replicas have on a target", labels=["target"])
    tokens = GaugeMetricFamily("mesh_remote_tokens", "Prefill/decode tokens other replicas have in flight on a target",
                               labels=["target", "phase"])
    for tid in sorted(load.targets):
        r = load.remote(tid)
        remote.add_metric([tid], r[0])
        tokens.add_metric([tid, "prefill"], r[1])
        tokens.add_metric([tid, "decode"], r[2])
    peers = GaugeMetricFamily("mesh_load_sync_peers", "Other gateway replicas whose load was read in the last sync round",
                              value=load.peers)
    return [remote, tokens, peers]
