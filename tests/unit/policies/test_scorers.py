"""Built-in scorers with fixed inputs: exact scores, the [0, 1] range, and parameter errors."""

from __future__ import annotations

import pytest

from mesh.core.index import PrefixIndex
from mesh.core.sessions import SessionTable
from policies.base import ClusterView, RequestInfo, TargetState, Tier
from policies.registry import PluginError, create
from policies.scorers import fewer_is_better


def T(tid: str, **kw: object) -> TargetState:
    return TargetState(id=tid, worker=tid, **kw)  # type: ignore[arg-type]


def req(keys: list[int] | None = None, **kw: object) -> RequestInfo:
    keys = [1, 2, 3, 4, 5] if keys is None else keys
    base: dict[str, object] = {"model": "m", "block_keys": keys, "block_size": 16, "prompt_tokens": 16 * len(keys)}
    base.update(kw)
    return RequestInfo(**base)  # type: ignore[arg-type]


def score(spec: object, targets: list[TargetState], request: RequestInfo | None = None, *,
          index: PrefixIndex | None = None, sessions: SessionTable | None = None, now: float = 0.0) -> list[float]:
    s = create("scorer", spec)
    out = list(s.score(request or req(), ClusterView(targets, now, index, sessions), targets))
    assert all(0.0 <= v <= 1.0 for v in out), out
    return out


def test_fewer_is_better_normalizes_min_to_one_and_max_to_zero() -> None:
    assert fewer_is_better([2, 4, 6]) == [1.0, 0.5, 0.0]
    assert fewer_is_better([3, 3]) == [1.0, 1.0]
    assert fewer_is_better([7]) == [1.0]


def test_prefix_scores_cached_fraction_with_cpu_tier_weighted_lower() -> None:
    index = PrefixIndex()
    index.store("gpu", [1, 2, 3, 4])  # 4 of 5 blocks on the GPU
    index.store("cpu", [1, 2, 3, 4], Tier.CPU)  # 4 of 5 on the CPU tier
    index.store("mixed", [1, 2])
    index.store("mixed", [1, 2, 3], Tier.CPU)  # 2 GPU + 1 CPU (a GPU block stays on the GPU)
    ts = [T("gpu"), T("cpu"), T("mixed"), T("cold")]
    got = score("prefix", ts, index=index)
    assert got == pytest.approx([0.8, 0.8 * 0.8, (2 + 0.8) / 5, 0.0])


def test_prefix_tier_weights_are_parameters() -> None:
    index = PrefixIndex()
    index.store("cpu", [1, 2, 3, 4, 5], Tier.CPU)
    got = score({"name": "prefix", "params": {"cpu_weight": 0.5}}, [T("cpu")], index=index)
    assert got == pytest.approx([0.5])


def test_prefix_ignores_targets_whose_event_stream_is_down() -> None:
    index = PrefixIndex()
    index.store("a", [1, 2, 3, 4, 5])
    index.store("b", [1, 2, 3, 4, 5])
    assert score("prefix", [T("a"), T("b", index_healthy=False)], index=index) == [1.0, 0.0]


def test_prefix_is_zero_without_index_or_blocks() -> None:
    assert score("prefix", [T("a"), T("b")]) == [0.0, 0.0]
    index = PrefixIndex()
    index.store("a", [1])
    assert score("prefix", [T("a")], req([]), index=index) == [0.0]


@pytest.mark.parametrize("bad", [1.5, -0.1, "1", float("inf")])
def test_prefix_rejects_tier_weights_out_of_range(bad: object) -> None:
    with pytest.raises(PluginError, match="tier weights"):
        create("scorer", {"name": "prefix", "params": {"gpu_weight": bad}})


def test_load_prefers_fewer_in_flight() -> None:
    ts = [T("a", in_flight=0), T("b", in_flight=5), T("c", in_flight=10)]
    assert score("load", ts) == [1.0, 0.5, 0.0]
    assert score("load", [T("a", in_flight=3), T("b", in_flight=3)]) == [1.0, 1.0]


def test_kv_utilization_is_free_fraction_clamped() -> None:
    ts = [T("a", kv_usage=0.25), T("b", kv_usage=1.0), T("c", kv_usage=1.7), T("d", kv_usage=-0.2)]
    assert score("kv_utilization", ts) == pytest.approx([0.75, 0.0, 0.0, 1.0])


def test_session_affinity_marks_only_the_live_bound_target() -> None:
    table = SessionTable(idle_ttl_s=10, max_sessions=10)
    table.bind("s1", "b", now=0.0)
    ts = [T("a"), T("b"), T("c")]
    assert score("session_affinity", ts, req(session_id="s1"), sessions=table, now=5.0) == [0.0, 1.0, 0.0]
    assert score("session_affinity", ts, req(session_id="s1"), sessions=table, now=10.0) == [0.0, 0.0, 0.0]
    assert score("session_affinity", ts, req(session_id="other"), sessions=table) == [0.0, 0.0, 0.0]
    assert score("session_affinity", ts, req(), sessions=table) == [0.0, 0.0, 0.0]


def test_live_sessions_prefers_fewer_bindings() -> None:
    ts = [T("a", live_sessions=4), T("b", live_sessions=0), T("c", live_sessions=2)]
    assert score("live_sessions", ts) == [0.0, 1.0, 0.5]


def test_prefill_load_counts_queued_and_uncached_tokens() -> None:
    index = PrefixIndex()
    index.store("warm", [1, 2, 3, 4, 5])  # all 80 prompt tokens cached
    ts = [
        T("warm", prefill_tokens=100),  # work 100 + 0
        T("cold", prefill_tokens=0),  # work 0 + 80
        T("busy", prefill_tokens=500),  # work 500 + 80
    ]
    got = score("prefill_load", ts, index=index)
    assert got == pytest.approx([1 - 20 / 500, 1.0, 0.0])
