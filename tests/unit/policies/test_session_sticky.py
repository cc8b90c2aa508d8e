"""session_sticky through the Router with simulated time: bound, new, rebound, expiry, hot spots."""

from __future__ import annotations

from collections import Counter

import pytest

from mesh.core.index import PrefixIndex
from mesh.core.router import Lease, Router
from mesh.core.sessions import SessionTable
from policies.base import NoCandidate, RequestInfo, TargetState
from policies.registry import PluginError, create, names
from policies.session_sticky import FALLBACK_INNER, default_inner

TTL = 60.0
SYSTEM = [101, 102, 103, 104]


def T(tid: str, **kw: object) -> TargetState:
    return TargetState(id=tid, worker=tid.split("@")[0], **kw)  # type: ignore[arg-type]


def turn(sid: str | None, keys: list[int] = SYSTEM) -> RequestInfo:
    return RequestInfo(model="m", block_keys=keys, block_size=16, prompt_tokens=16 * len(keys) + 3, session_id=sid)


def setup(
    ids: list[str], *, inner: object = FALLBACK_INNER, seed: int = 0, **params: object
) -> tuple[Router, dict[str, TargetState], PrefixIndex, SessionTable]:
    targets = {tid: T(tid) for tid in ids}
    index = PrefixIndex()
    table = SessionTable(idle_ttl_s=TTL, max_sessions=10_000)
    policy = create("policy", {"name": "session_sticky", "params": {"inner": inner, **params}})
    return Router(policy, targets, index=index, sessions=table, seed=seed), targets, index, table


def go(router: Router, req: RequestInfo, now: float, finish: bool = True) -> tuple[str, str, Lease]:
    d, lease = router.route(req, now)
    if finish:
        lease.finish(now)
    return d.target or "", d.reason, lease


def test_a_session_keeps_its_target_across_turns() -> None:
    router, targets, _, table = setup(["a", "b", "c", "d"])
    first, reason, _ = go(router, turn("s1"), 0.0)
    assert reason.startswith("new session")
    for i in range(1, 20):
        other = next(t for t in targets if t != first)
        targets[other].in_flight = 0
        targets[first].in_flight = 3  # a little busier, but under the ceiling
        target, reason, _ = go(router, turn("s1"), i * 10.0)
        assert (target, reason) == (first, "bound")
    assert table.live_sessions(first) == 1 and router.session_moves == 0


def test_idle_expiry_unbinds_and_the_next_turn_is_a_new_session() -> None:
    router, targets, _, table = setup(["a", "b"])
    first, _, _ = go(router, turn("s1"), 0.0)
    assert router.decide(turn("s1"), TTL - 0.001).reason == "bound"
    assert router.decide(turn("s1"), TTL).reason.startswith("new session")  # exactly at the idle time
    table.expire(TTL)
    assert len(table) == 0 and table.live_sessions(first) == 0
    _, reason, _ = go(router, turn("s1"), TTL + 1)
    assert reason.startswith("new session") and router.session_moves == 0


@pytest.mark.parametrize(
    ("breakage", "why"),
    [
        ({"healthy": False}, "bound target unhealthy"),
        ({"draining": True}, "bound target draining"),
        ({"circuit_open": True}, "bound target circuit open"),
    ],
)
def test_dead_or_drained_target_rebinds_and_counts_the_move(breakage: dict[str, bool], why: str) -> None:
    router, targets, _, table = setup(["a", "b", "c"])
    first, _, _ = go(router, turn("s1"), 0.0)
    for k, v in breakage.items():
        setattr(targets[first], k, v)
    second, reason, _ = go(router, turn("s1"), 1.0)
    assert second != first and reason.startswith(f"rebound: {why}")
    assert router.session_moves == 1 and table.stats()["moves"] == 1
    third, reason, _ = go(router, turn("s1"), 2.0)  # the session continues on its new target
    assert (third, reason) == (second, "bound")
    assert table.live_sessions(first) == 0 and table.live_sessions(second) == 1


def test_a_removed_target_is_gone_and_the_session_moves() -> None:
    router, targets, _, _ = setup(["a", "b"])
    first, _, _ = go(router, turn("s1"), 0.0)
    del targets[first]
    second, reason, _ = go(router, turn("s1"), 1.0)
    assert second != first and reason.startswith("rebound: bound target gone")


def test_rebinding_prefers_the_target_holding_most_of_the_prefix() -> None:
    router, targets, index, _ = setup(["a", "b", "c", "d"])
    convo = SYSTEM + [201, 202, 203, 204]
    index.store("a", convo)
    index.store("c", convo[:6])  # c holds 6 of 8 blocks, b and d only the system prompt
    index.store("b", SYSTEM)
    index.store("d", SYSTEM)
    first, _, _ = go(router, turn("s1", convo), 0.0)
    assert first == "a"
    targets["a"].healthy = False
    assert go(router, turn("s1", convo + [205]), 1.0)[0] == "c"


def test_new_sessions_go_prefix_first_then_fewest_sessions_then_load() -> None:
    router, targets, index, table = setup(["a", "b", "c"])
    index.store("c", SYSTEM[:2])
    assert go(router, turn("p", SYSTEM), 0.0)[0] == "c"  # only c has any prefix, though it has load
    for sid in ("x1", "x2"):
        table.bind(sid, "a", 0.0)
    table.bind("y1", "b", 0.0)
    targets["b"].in_flight = 5
    # No prefix anywhere: fewest live sessions wins (c has 1 (p), b 1, a 2); b and c tie, load decides: c.
    assert go(router, turn("q", [900, 901]), 1.0)[0] == "c"


def test_new_sessions_spread_fairly_over_equal_targets() -> None:
    router, _, _, _ = setup(["a", "b", "c", "d"], seed=5)
    firsts = Counter(go(router, turn(f"s{i}", [1000 + i]), 0.0)[0] for i in range(400))
    assert set(firsts) == {"a", "b", "c", "d"} and max(firsts.values()) - min(firsts.values()) <= 2


def test_hot_spot_load_ceiling_moves_new_sessions_elsewhere() -> None:
    router, targets, index, _ = setup(["a", "b", "c", "d"], load_factor=1.5, load_slack=4.0)
    index.store("a", SYSTEM)  # every new session's prefix lives on a: a magnet
    leases, placed = [], Counter()
    for i in range(60):  # nobody finishes: load piles up
        ceiling = 1.5 * sum(t.in_flight for t in targets.values()) / 4 + 4.0
        over = {t.id for t in targets.values() if t.in_flight > ceiling}
        target, reason, lease = go(router, turn(f"s{i}"), float(i), finish=False)
        assert reason.startswith("new session")
        assert target not in over  # a target over the ceiling never takes a new session
        leases.append(lease)
        placed[target] += 1
    assert placed["a"] >= 9  # prefix first while a is under the ceiling
    assert placed["a"] <= 21 and len(placed) >= 3  # without the ceiling all 60 would go to a
    for lease in leases:
        lease.finish(100.0)
    assert all(t.in_flight == 0 for t in targets.values())


def test_a_bound_session_leaves_a_target_over_the_ceiling() -> None:
    router, targets, _, _ = setup(["a", "b", "c", "d"], load_factor=2.0, load_slack=4.0)
    first, _, _ = go(router, turn("s1"), 0.0)
    targets[first].in_flight = 20  # mean 5, ceiling 14
    second, reason, _ = go(router, turn("s1"), 1.0)
    assert second != first and reason.startswith("rebound: bound target over load ceiling")
    assert router.session_moves == 1


def test_absolute_ceiling_and_admission_limit() -> None:
    router, targets, _, _ = setup(["a", "b"], max_in_flight=3, load_factor=0)
    first, _, _ = go(router, turn("s1"), 0.0)
    targets[first].in_flight = 3
    assert go(router, turn("s1"), 1.0)[1] == "bound"  # at the ceiling is allowed
    targets[first].in_flight = 4
    assert go(router, turn("s1"), 2.0)[1].startswith("rebound: bound target over load ceiling")
    now_on = go(router, turn("s1"), 3.0)[0]
    targets[now_on].max_in_flight, targets[now_on].in_flight = 2, 2
    targets[first].in_flight = 0
    assert go(router, turn("s1"), 4.0)[1].startswith("rebound: bound target at its admission limit")


def test_overloaded_everywhere_keeps_the_binding() -> None:
    router, targets, _, _ = setup(["a", "b"], max_in_flight=2, load_factor=0)
    first, _, _ = go(router, turn("s1"), 0.0)
    for t in targets.values():
        t.in_flight = 10
    assert go(router, turn("s1"), 1.0)[:2] == (first, "bound")  # moving would not help


def test_a_new_session_with_every_target_excluded_is_no_candidate() -> None:
    # The gateway leaves out targets at their admission limit; with all of them out a new session
    # must be NoCandidate (the request then waits in the admission queue), not a crash.
    router, _, _, _ = setup(["a", "b"])
    with pytest.raises(NoCandidate):
        router.decide(turn("new"), 0.0, exclude=["a", "b"])


def test_dp_ranks_are_separate_targets() -> None:
    router, targets, _, table = setup(["w0@0", "w0@1", "w1@0", "w1@1"])
    first, _, _ = go(router, turn("s1"), 0.0)
    assert go(router, turn("s1"), 1.0)[0] == first
    targets[first].healthy = False  # one rank down, its worker's other rank still serves
    second, reason, _ = go(router, turn("s1"), 2.0)
    assert second != first and reason.startswith("rebound") and table.live_sessions(second) == 1


def test_requests_without_a_session_use_the_inner_policy() -> None:
    router, _, index, table = setup(["a", "b"])
    index.store("b", SYSTEM)
    target, reason, _ = go(router, turn(None), 0.0)
    assert target == "b" and reason == "best by prefix > live_sessions > load" and len(table) == 0


def test_without_a_session_store_it_says_so() -> None:
    policy = create("policy", {"name": "session_sticky", "params": {"inner": "least_load"}})
    router = Router(policy, {"a": T("a")})
    assert router.decide(turn("s1"), 0.0).reason.startswith("no session store")


def test_decide_alone_binds_nothing() -> None:
    router, _, _, table = setup(["a", "b"])
    router.decide(turn("s1"), 0.0)
    assert len(table) == 0


def test_default_inner_is_kv_aware_when_installed() -> None:
    expected = "kv_aware" if "kv_aware" in names("policy") else FALLBACK_INNER
    assert default_inner() == expected
    desc = create("policy", "session_sticky").describe()
    assert desc["inner"]["name"] == ("kv_aware" if expected == "kv_aware" else "pipeline")


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"load_factor": -1}, "load_factor"),
        ({"load_slack": float("nan")}, "load_slack"),
        ({"max_in_flight": "10"}, "max_in_flight"),
        ({"inner": "no_such_policy"}, "unknown policy 'no_such_policy'"),
    ],
)
def test_bad_parameters_raise_plugin_errors(params: dict[str, object], message: str) -> None:
    with pytest.raises(PluginError, match=message):
        create("policy", {"name": "session_sticky", "params": params})


def test_a_request_of_n_choices_decodes_over_its_prompt_once_per_choice() -> None:
    """Each of OpenAI's ``n`` sequences reads the whole context at every decode step: the target's
    decode load counts the prompt ``n`` times, prefill (shared prompt blocks) once."""
    router, targets, _, _ = setup(["a"])
    req = RequestInfo(model="m", block_keys=SYSTEM, block_size=16, prompt_tokens=67, choices=3)
    _, _, lease = go(router, req, 0.0, finish=False)
    a = targets["a"]
    assert (a.in_flight, a.prefill_tokens, a.decode_tokens) == (1, 67, 0)
    lease.first_token()
    assert (a.in_flight, a.prefill_tokens, a.decode_tokens) == (1, 0, 201)
    lease.finish(1.0)
    assert (a.in_flight, a.prefill_tokens, a.decode_tokens) == (0, 0, 0)


@pytest.mark.parametrize("slack", [0, 1])
def test_new_sessions_sharing_a_system_prompt_spread_over_every_target(slack: int) -> None:
    """The first worker that caches the shared system prompt does not attract every new session."""
    router, targets, index, table = setup(["a", "b", "c"], inner="kv_aware", session_slack=slack)
    placed = []
    for i in range(9):  # sequential new conversations: each finishes before the next starts
        keys = SYSTEM + [1000 * (i + 1) + j for j in range(2)]
        target, reason, _ = go(router, turn(f"s{i}", keys), float(i))
        index.store(target, keys)  # the worker now caches the whole prompt
        placed.append(target)
        assert reason.startswith("new session, spread"), reason
    counts = Counter(placed)
    assert set(counts) == {"a", "b", "c"} and max(counts.values()) - min(counts.values()) <= slack + 1
    if slack == 0:
        assert counts == {"a": 3, "b": 3, "c": 3}
    for i, home in enumerate(placed):  # every later turn returns home
        keys = SYSTEM + [1000 * (i + 1) + j for j in range(4)]
        assert go(router, turn(f"s{i}", keys), 20.0 + i)[:2] == (home, "bound")
    assert router.session_moves == 0 and [table.live_sessions(t) for t in "abc"] == [counts[t] for t in "abc"]


def test_among_the_least_crowded_targets_the_cached_prefix_still_wins() -> None:
    router, targets, index, _ = setup(["a", "b", "c"], inner="kv_aware", session_slack=0)
    index.store("b", SYSTEM)
    targets["a"].live_sessions = 1
    target, reason, _ = go(router, turn("new", SYSTEM + [7, 8]), 0.0)
    assert target == "b" and "spread (<= 0 live sessions)" in reason


def test_a_target_one_session_ahead_still_takes_a_new_session_by_its_prefix() -> None:
    router, targets, index, _ = setup(["a", "b"], inner="kv_aware")  # session_slack 1
    index.store("a", SYSTEM)
    targets["a"].live_sessions = 1
    assert go(router, turn("new", SYSTEM + [7]), 0.0)[0] == "a"
    targets["a"].live_sessions = 2  # two ahead: out of the spread
    assert go(router, turn("newer", SYSTEM + [8]), 1.0)[0] == "b"


def test_a_new_session_whose_prompt_is_mostly_a_cached_system_prompt_is_still_spread() -> None:
    router, targets, index, _ = setup(["a", "b"], inner="kv_aware", session_slack=0)
    system = list(range(500, 540))
    index.store("a", system)
    targets["a"].live_sessions = 1
    target, reason, _ = go(router, turn("new", system + [9]), 0.0)  # 40 of 41 blocks cached on a
    assert target == "b" and reason.startswith("new session, spread (<= 0 live sessions)")


def test_spread_new_false_keeps_the_inner_policys_placement() -> None:
    router, targets, index, _ = setup(["a", "b"], inner="kv_aware", spread_new=False)
    index.store("a", SYSTEM)
    targets["a"].live_sessions = 3
    assert go(router, turn("new", SYSTEM + [5]), 0.0)[0] == "a"


@pytest.mark.parametrize("params", [{"spread_new": "yes"}, {"spread_new": 1}])
def test_bad_spread_params_are_refused(params: dict[str, object]) -> None:
    with pytest.raises(PluginError, match="session_sticky"):
        create("policy", {"name": "session_sticky", "params": params})


def test_a_session_whose_blocks_were_evicted_stays_home() -> None:
    router, targets, index, _ = setup(["a", "b"], inner="kv_aware")
    convo = SYSTEM + list(range(200, 240))
    home, _, _ = go(router, turn("s", convo), 0.0)
    other = "b" if home == "a" else "a"
    index.store(other, convo)  # the other worker holds the whole conversation (another session's copy)
    assert go(router, turn("s", convo + [1]), 1.0)[:2] == (home, "bound")  # home caches none of it


def test_spread_by_kv_room_puts_a_new_session_where_the_least_context_is_in_flight() -> None:
    router, targets, index, _ = setup(["a", "b", "c"], inner="kv_aware", spread_by="kv_room")
    index.store("a", SYSTEM)
    targets["a"].decode_tokens = 6000  # its sessions hold the most KV right now
    targets["b"].live_sessions, targets["b"].prefill_tokens = 1, 100
    targets["c"].live_sessions, targets["c"].decode_tokens = 2, 0  # two ahead of a: out of the spread
    target, reason, _ = go(router, turn("new", SYSTEM + [3]), 0.0)
    assert target == "b" and "100 tokens in flight" in reason
    with pytest.raises(PluginError, match="spread_by"):
        create("policy", {"name": "session_sticky", "params": {"spread_by": "random"}})


def _evicted_home(capacity: int, room_elsewhere: int, **params: object) -> tuple[str, str, str, Router]:
    """A session bound home, whose home then lost its blocks; the other target's active
    sessions leave it ``room_elsewhere`` blocks of its ``capacity``. Returns (home, other,
    the next turn's target and reason)."""
    router, targets, index, _ = setup(["a", "b"], inner="kv_aware", **params)
    for t in targets.values():
        t.kv_capacity_blocks = capacity
    convo = SYSTEM + list(range(200, 240))
    home, _, _ = go(router, turn("s", convo), 0.0)
    other = "b" if home == "a" else "a"
    index.remove(home, convo)  # evicted at home
    targets[other].session_blocks = capacity - room_elsewhere
    target, reason, _ = go(router, turn("s", convo + [1]), 1.0)
    return home, other, f"{target}|{reason}", router


def test_an_evicted_session_moves_to_a_target_with_room_for_it() -> None:
    home, other, got, router = _evicted_home(capacity=1000, room_elsewhere=500)
    target, reason = got.split("|")
    assert target == other and reason.startswith("rebound: evicted at home, room elsewhere"), reason
    assert router.session_moves == 1


def test_an_evicted_session_stays_home_when_no_other_target_has_room() -> None:
    home, _, got, router = _evicted_home(capacity=1000, room_elsewhere=40)  # its footprint is 45 blocks
    assert got == f"{home}|bound" and router.session_moves == 0


def test_rehome_below_zero_keeps_an_evicted_session_home() -> None:
    home, _, got, _ = _evicted_home(capacity=1000, room_elsewhere=500, rehome_below=0)
    assert got == f"{home}|bound"


def test_a_session_mostly_cached_at_home_stays_although_another_target_has_room() -> None:
    router, targets, index, _ = setup(["a", "b"], inner="kv_aware")
    for t in targets.values():
        t.kv_capacity_blocks = 1000
    convo = SYSTEM + list(range(200, 240))
    home, _, _ = go(router, turn("s", convo), 0.0)
    index.store(home, convo)
    index.remove(home, convo[30:])  # 30 of 45 blocks still cached at home: over rehome_below (0.5)
    assert go(router, turn("s", convo + [1]), 1.0)[:2] == (home, "bound")


def test_spread_by_footprint_puts_a_new_session_where_there_is_room_for_it() -> None:
    router, targets, index, _ = setup(["a", "b", "c"], inner="kv_aware")
    for t in targets.values():
        t.kv_capacity_blocks = 1000
    index.store("a", SYSTEM)  # a caches the system prompt ...
    targets["a"].session_blocks = 997  # ... but its sessions leave it 3 blocks: the new one needs 6
    targets["b"].session_blocks = 600
    targets["c"].session_blocks = 100
    target, reason, _ = go(router, turn("new", SYSTEM + [3]), 0.0)
    assert target in ("b", "c") and "room for 6 blocks" in reason, reason
    for t in targets.values():
        t.session_blocks = 998  # no room anywhere: the most room wins
    targets["b"].session_blocks = 996
    assert go(router, turn("newer", SYSTEM + [4]), 1.0)[0] == "b"


def test_a_prompt_that_does_not_extend_the_last_one_is_no_eviction() -> None:
    router, targets, index, _ = setup(["a", "b"], inner="kv_aware")
    for t in targets.values():
        t.kv_capacity_blocks = 1000
    home, _, _ = go(router, turn("s", SYSTEM + list(range(200, 240))), 0.0)
    # the session's context was rewritten (a compaction): home matches only the system prompt
    assert go(router, turn("s", SYSTEM + list(range(300, 340))), 1.0)[:2] == (home, "bound")


def _queued_at_home(queued_blocks: int, **params: object) -> tuple[str, str, str, Router]:
    """A session bound home with its whole conversation cached there, then ``queued_blocks`` of
    other requests' prefill queued at home. Returns (home, the next turn's target, its reason)."""
    router, targets, index, _ = setup(["a", "b", "c"], inner="kv_aware", **params)
    convo = SYSTEM + list(range(200, 240))  # 44 blocks; the next turn's prompt is 45
    home, _, _ = go(router, turn("s", convo), 0.0)
    index.store(home, convo)
    targets[home].prefill_tokens = 16 * queued_blocks
    target, reason, _ = go(router, turn("s", convo + [1]), 1.0)
    return home, target, reason, router


def test_a_session_queued_at_home_moves_where_its_wait_is_shorter_by_the_margin() -> None:
    # home: 200 queued + 1 uncached block; elsewhere: the whole 45-block prompt, nothing queued
    home, target, reason, router = _queued_at_home(200, rebalance_margin=1)
    assert target != home and reason.startswith("rebound: queued at home, cheaper elsewhere by over 1 prompts")
    assert router.session_moves == 1


def test_a_session_stays_home_while_its_queue_is_within_the_margin() -> None:
    home, target, reason, router = _queued_at_home(80, rebalance_margin=1)  # 81 at home, 45 + 45 elsewhere
    assert (target, reason) == (home, "bound") and router.session_moves == 0


def test_rebalancing_is_off_by_default() -> None:
    home, target, reason, _ = _queued_at_home(5000)
    assert (target, reason) == (home, "bound")


@pytest.mark.parametrize("params", [{"rebalance_margin": -1}, {"rebalance_margin": 1, "inner": FALLBACK_INNER}])
def test_bad_rebalance_params_are_refused(params: dict[str, object]) -> None:
    with pytest.raises(PluginError, match="rebalance_margin"):
        create("policy", {"name": "session_sticky", "params": params})
