"""Bindings made during a Redis outage are claims (``mesh.state.redis_backend.Claim``): written
only where Redis holds no binding, the shared one winning wherever it exists, and every replica's
binding that the shared one replaced counted by reason. Two ``SharedSessionTable``s play two
replicas against a real redis-server that is killed and restarted (empty) on its port.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from mesh.state.redis_state import Claim, RedisStateBackend, SharedSessionTable
from tests.procs import ProcessGroup
from tests.support.redis_server import RedisServer


@pytest.fixture
def server(procs: ProcessGroup) -> Iterator[RedisServer]:
    srv = RedisServer(procs)
    srv.start()
    yield srv
    srv.kill()


def table(server: RedisServer, prefix: str) -> SharedSessionTable:
    return SharedSessionTable(RedisStateBackend(server.url, 60, key_prefix=prefix, timeout_s=0.2, retry_after_s=0.0), 60)


async def outage_binds(tables: list[SharedSessionTable], binds: list[tuple[int, str, str]], now: float) -> None:
    """Each table reads and binds while Redis is down, as the proxy does (mirror, then commit)."""
    for i, sid, target in binds:
        assert await tables[i].mirror(sid, now) is None
        assert tables[i].backend.down
        tables[i].bind(sid, target, now)


def test_claims_of_an_empty_redis_first_writer_wins_and_the_other_replica_adopts_it(server: RedisServer) -> None:
    async def go() -> tuple[object, ...]:
        a, b = table(server, "claim1:"), table(server, "claim1:")
        try:
            server.kill()
            await outage_binds([a, b], [(0, "s", "e0"), (1, "s", "e1"), (1, "only-b", "e1")], 1.0)
            queued = (a._pending["s"], b._pending["s"])
            a.touch("s", "e0", 1.5)  # a request's end keeps the claim (a Refresh would never report a loss)
            server.start()  # restarted empty: Redis has no binding of any session
            assert await a.flush() and await b.flush()
            with server.client() as c:
                shared = c.get("claim1:s:s"), c.get("claim1:s:only-b")
            return (queued, a._pending, shared, a.bound_target("s", 2.0), b.bound_target("s", 2.0),
                    b.bound_target("only-b", 2.0), a.replica_moves, b.replica_moves, b.live_sessions("e0"))
        finally:
            await a.backend.aclose()
            await b.backend.aclose()

    queued, a_pending, shared, on_a, on_b, only_b, a_moves, b_moves, b_e0 = asyncio.run(go())
    assert queued == (Claim("e0"), Claim("e1")) and a_pending == {}
    assert shared == ("e0", "e1")  # A's claim was first; B's session nobody else had is B's
    assert on_a == on_b == "e0" and only_b == "e1"
    assert a_moves == {"redis_unavailable": 0, "replica_conflict": 0}
    assert b_moves == {"redis_unavailable": 1, "replica_conflict": 0}
    assert b_e0 == 1  # the adopted binding counts on its new target


def test_a_claim_yields_at_the_next_read_once_redis_answers(server: RedisServer) -> None:
    async def go() -> tuple[object, ...]:
        a, b = table(server, "claim2:"), table(server, "claim2:")
        try:
            a.bind("s", "e0", 1.0)
            assert await a.flush()
            server.kill()
            await outage_binds([b], [(0, "s", "e1")], 2.0)
            during = b.bound_target("s", 2.0)
            server.start()
            with server.client() as c:
                c.set("claim2:s:s", "e0", px=60_000)  # the shared binding a frozen Redis kept
            shared = await b.mirror("s", 3.0)  # B's next decision reads it: it wins at once
            return during, shared, b.bound_target("s", 3.0), dict(b._pending), b.replica_moves
        finally:
            await a.backend.aclose()
            await b.backend.aclose()

    during, shared, after, pending, moves = asyncio.run(go())
    assert during == "e1" and shared == after == "e0"
    assert pending == {}  # the claim is dropped: nothing of B's outage is written over it
    assert moves["redis_unavailable"] == 1


def test_a_bind_made_while_redis_answers_stays_a_plain_write_and_a_replaced_live_binding_is_a_conflict(
        server: RedisServer) -> None:
    async def go() -> tuple[object, ...]:
        a, b = table(server, "claim3:"), table(server, "claim3:")
        try:
            a.bind("s", "e0", 1.0)
            assert await a.flush()
            await b.mirror("s", 2.0)
            b.bind("s", "e1", 2.0)  # an informed move: it overwrites
            queued = b._pending["s"]
            assert await b.flush()
            await a.mirror("s", 3.0)  # A's live e0 replaced by B's move
            return queued, a.bound_target("s", 3.0), a.replica_moves, b.replica_moves
        finally:
            await a.backend.aclose()
            await b.backend.aclose()

    queued, on_a, a_moves, b_moves = asyncio.run(go())
    assert queued == "e1" and on_a == "e1"
    assert a_moves == {"redis_unavailable": 0, "replica_conflict": 1}
    assert b_moves == {"redis_unavailable": 0, "replica_conflict": 0}
