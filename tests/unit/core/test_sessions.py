"""SessionTable: exact idle expiry against a brute-force model, bounded memory, hostile ids."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mesh.core.sessions import MAX_ID_CHARS, MemoryStateBackend, SessionTable, session_key

TTL = 10.0


class Model:
    """The obvious implementation: scan everything, every time."""

    def __init__(self, ttl: float, cap: int) -> None:
        self.ttl, self.cap, self.seq = ttl, cap, 0
        self.b: dict[str, tuple[str, float, int]] = {}

    def live(self, now: float) -> dict[str, tuple[str, float, int]]:
        return {s: v for s, v in self.b.items() if v[1] + self.ttl > now}

    def bind(self, sid: str, target: str, now: float) -> bool:
        self.b = self.live(now)
        old = self.b.get(sid)
        self.seq += 1
        if old is None:
            if len(self.b) >= self.cap:
                del self.b[min(self.b, key=lambda s: (self.b[s][1], self.b[s][2]))]
            self.b[sid] = (target, now, self.seq)
            return False
        self.b[sid] = (target, max(old[1], now), self.seq)
        return old[0] != target


ops = st.lists(
    st.tuples(
        st.sampled_from(["bind", "bind", "bind", "expire", "unbind"]),
        st.integers(0, 11),  # session
        st.integers(0, 3),  # target
        st.floats(-1.0, 6.0, allow_nan=False),  # time step (negative: a late, older timestamp)
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(ops=ops, cap=st.integers(1, 8))
def test_expiry_and_eviction_match_a_brute_force_model(ops: list[tuple[str, int, int, float]], cap: int) -> None:
    table, model = SessionTable(TTL, cap), Model(TTL, cap)
    clock = 0.0
    for op, s, t, step in ops:
        clock = max(0.0, clock + step) if step >= 0 else clock
        now = clock + min(step, 0.0)  # sometimes a timestamp from slightly in the past
        sid, target = f"s{s}", f"t{t}"
        if op == "bind":
            assert table.bind(sid, target, now) == model.bind(sid, target, now)
        elif op == "expire":
            table.expire(now)
            model.b = model.live(now)
        else:
            assert table.unbind(sid) == (model.b.pop(sid, None) is not None)
        for i in range(12):
            want = model.live(clock).get(f"s{i}")
            assert table.bound_target(f"s{i}", clock) == (want[0] if want else None)
    table.expire(clock)
    live = model.live(clock)
    assert len(table) == len(live)
    for t in range(4):
        assert table.live_sessions(f"t{t}") == sum(1 for v in live.values() if v[0] == f"t{t}")
    assert len(table) <= cap


def test_binding_expires_exactly_at_the_idle_ttl() -> None:
    table = SessionTable(idle_ttl_s=10, max_sessions=10)
    table.bind("s", "a", now=100.0)
    assert table.bound_target("s", 109.999) == "a"
    assert table.bound_target("s", 110.0) is None  # live while last_used + ttl > now
    table.bind("s", "a", now=105.0)  # refresh: the idle clock restarts
    assert table.bound_target("s", 114.0) == "a"
    assert table.expire(115.0) == 1 and len(table) == 0 and table.live_sessions("a") == 0


def test_moves_are_reported_and_counted_only_between_live_targets() -> None:
    table = SessionTable(idle_ttl_s=10, max_sessions=10)
    assert table.bind("s", "a", 0.0) is False
    assert table.bind("s", "a", 1.0) is False
    assert table.bind("s", "b", 2.0) is True
    assert table.live_sessions("a") == 0 and table.live_sessions("b") == 1
    assert table.bind("s", "a", 50.0) is False  # expired first: a new session, not a move
    assert table.stats()["moves"] == 1 and table.stats()["expired"] == 1 and table.stats()["created"] == 2


def test_a_late_older_timestamp_never_shortens_a_binding() -> None:
    table = SessionTable(idle_ttl_s=10, max_sessions=10)
    table.bind("s", "a", 100.0)
    table.bind("s", "a", 95.0)
    assert table.bound_target("s", 109.0) == "a"


def test_unbind_target_drops_all_its_sessions() -> None:
    table = SessionTable(idle_ttl_s=10, max_sessions=100)
    for i in range(10):
        table.bind(f"s{i}", "a" if i % 2 else "b", float(i))
    assert table.unbind_target("a") == 5
    assert table.live_sessions("a") == 0 and table.live_sessions("b") == 5 and len(table) == 5
    assert table.bound_target("s1", 10.0) is None and table.bound_target("s2", 10.0) == "b"
    assert table.stats()["per_target"] == {"b": 5}


def test_unbind_targets_drops_a_workers_ranks_in_one_call() -> None:
    table = SessionTable(idle_ttl_s=10, max_sessions=100)
    for i in range(9):
        table.bind(f"s{i}", ("w@0", "w@1", "v")[i % 3], float(i))
    assert table.unbind_targets(["w@0", "w@1"]) == 6
    assert len(table) == 3 and table.stats()["per_target"] == {"v": 3}
    assert table.unbind_targets(["gone"]) == 0


def test_resize_evicts_the_least_recently_used_down_to_the_new_limit() -> None:
    table = SessionTable(idle_ttl_s=100, max_sessions=10)
    for i in range(8):
        table.bind(f"s{i}", "a", float(i))
    table.bind("s0", "a", 9.0)  # s0 used last: it survives
    assert table.resize(3) == 5
    assert len(table) == 3 and table.max_sessions == 3
    assert {s for s in (f"s{i}" for i in range(8)) if table.bound_target(s, 9.5)} == {"s0", "s6", "s7"}
    assert table.stats()["evicted"] == 5 and table.live_sessions("a") == 3
    table.bind("new", "a", 10.0)  # the new limit holds
    assert len(table) == 3


def test_memory_stays_bounded_under_a_million_one_shot_sessions() -> None:
    cap = 10_000
    table = SessionTable(idle_ttl_s=1e9, max_sessions=cap)  # nothing idles out: only the cap bounds it
    for i in range(1_000_000):
        table.bind(f"one-shot-{i}", f"w{i % 8}", i * 1e-3)
    assert len(table) == cap
    assert len(table._order) == cap and sum(table._counts.values()) == cap
    assert table.stats()["evicted"] == 1_000_000 - cap
    # The survivors are the most recent ones: LRU eviction.
    assert table.bound_target("one-shot-999999", 1000.0) == "w7"
    assert table.bound_target("one-shot-0", 1000.0) is None


def test_expiry_releases_every_one_shot_session() -> None:
    table = SessionTable(idle_ttl_s=5, max_sessions=1_000_000)
    for i in range(50_000):
        table.bind(f"s{i}", f"w{i % 4}", i * 1e-4)  # all within 5 s
    assert len(table) == 50_000
    assert table.expire(100.0) == 50_000
    assert len(table) == 0 and all(table.live_sessions(f"w{i}") == 0 for i in range(4))


@pytest.mark.parametrize(
    "sid",
    [
        "x" * 10_000_000,
        "\x00\n\r\t\"'<script>",
        "ünïcødé-🙂" * 40,
        "\ud800lone-surrogate" * 10,
        "-" * MAX_ID_CHARS + "z",
    ],
)
def test_hostile_ids_are_bounded_and_still_sticky(sid: str) -> None:
    table = SessionTable(idle_ttl_s=10, max_sessions=10)
    table.bind(sid, "a", 0.0)
    assert table.bound_target(sid, 1.0) == "a"
    assert all(len(k) <= MAX_ID_CHARS for k in table._bindings)


def test_empty_ids_bind_nothing() -> None:
    table = SessionTable(idle_ttl_s=10, max_sessions=10)
    assert table.bound_target("", 0.0) is None
    with pytest.raises(ValueError, match="empty"):
        table.bind("", "a", 0.0)


def test_session_key_hashes_bounds_and_salts() -> None:
    raw = "user-42\nsecret" * 1000
    key = session_key(raw)
    assert key is not None and len(key) == 32 and "user" not in key
    assert session_key(raw) == key and session_key(raw.encode()) == key
    assert session_key(raw, salt="other") != key
    assert session_key("") is None and session_key("   ") is None and session_key(None) is None
    assert session_key("\udcff") is not None  # a lone surrogate does not crash


@pytest.mark.parametrize(("ttl", "cap"), [(0, 10), (-1, 10), (float("nan"), 10), (float("inf"), 10), (10, 0), (10, 1.5)])
def test_bad_table_parameters_raise(ttl: float, cap: int) -> None:
    with pytest.raises(ValueError):
        SessionTable(idle_ttl_s=ttl, max_sessions=cap)


async def test_memory_state_backend_gets_sets_and_deletes() -> None:
    backend = MemoryStateBackend(SessionTable(idle_ttl_s=10, max_sessions=10))
    assert backend.idle_ttl_s == 10
    assert await backend.set_session("s", "a", 0.0) is False
    assert await backend.get_session("s", 5.0) == "a"
    assert await backend.set_session("s", "b", 6.0) is True
    assert await backend.get_session("s", 15.0) == "b"
    assert await backend.get_session("s", 16.0) is None
    await backend.delete_session("s")
    assert len(backend.table) == 0


def test_next_expiries_are_the_soonest_idle_bindings_in_order() -> None:
    t = SessionTable(idle_ttl_s=10)
    for i, sid in enumerate(("c", "a", "b", "busy")):
        t.bind(sid, f"t{i}", float(i))
    t.begin("busy", 3.0)  # a session with a request in flight never expires: not listed
    t.bind("c", "t0", 5.0)  # refreshed: now the last idle one to expire
    assert t.next_expiries(10) == [("a", "t1", 11.0), ("b", "t2", 12.0), ("c", "t0", 15.0)]
    assert t.next_expiries(1) == [("a", "t1", 11.0)]
    t.expire(11.0)
    assert [sid for sid, _, _ in t.next_expiries(10)] == ["b", "c"]
