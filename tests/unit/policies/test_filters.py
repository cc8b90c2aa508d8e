"""Built-in filters with fixed inputs: who is kept, who is dropped, and bad parameters."""

from __future__ import annotations

import pytest

from mesh.core.index import PrefixIndex
from policies.base import ClusterView, RequestInfo, Role, TargetState
from policies.registry import PluginError, create


def T(tid: str, **kw: object) -> TargetState:
    return TargetState(id=tid, worker=tid, **kw)  # type: ignore[arg-type]


def req(**kw: object) -> RequestInfo:
    base: dict[str, object] = {"model": "m", "block_keys": [1, 2, 3, 4], "block_size": 16, "prompt_tokens": 64}
    base.update(kw)
    return RequestInfo(**base)  # type: ignore[arg-type]


def run(name: str, targets: list[TargetState], request: RequestInfo | None = None, index: PrefixIndex | None = None,
        **params: object) -> list[str]:
    f = create("filter", {"name": name, "params": params})
    request = request or req()
    return [t.id for t in f.filter(request, ClusterView(targets, 0.0, index), list(targets))]


def test_healthy_drops_unhealthy_draining_and_open_circuits() -> None:
    ts = [T("ok"), T("sick", healthy=False), T("drain", draining=True), T("open", circuit_open=True)]
    assert run("healthy", ts) == ["ok"]


def test_model_match_keeps_serving_targets_and_unreported_ones() -> None:
    ts = [T("a", models=frozenset({"m"})), T("b", models=frozenset({"other"})), T("any")]
    assert run("model_match", ts) == ["a", "any"]


def test_model_match_checks_the_lora_adapter() -> None:
    ts = [
        T("has", models=frozenset({"m"}), loras=frozenset({"sql"})),
        T("lacks", models=frozenset({"m"}), loras=frozenset({"chat"})),
        T("unreported", models=frozenset({"m"})),
    ]
    assert run("model_match", ts, req(lora="sql")) == ["has", "unreported"]
    assert run("model_match", ts) == ["has", "lacks", "unreported"]  # no adapter asked for


def test_role_filter_defaults_to_mixed_and_takes_a_list() -> None:
    ts = [T("m"), T("p", role=Role.PREFILL), T("d", role=Role.DECODE)]
    assert run("role", ts) == ["m"]
    assert run("role", ts, roles=["prefill", "decode"]) == ["p", "d"]


@pytest.mark.parametrize("roles", [[], "prefill", ["gpu"]])
def test_role_filter_rejects_bad_roles(roles: object) -> None:
    with pytest.raises(PluginError, match="role"):
        create("filter", {"name": "role", "params": {"roles": roles}})


def test_admission_headroom_respects_the_in_flight_ceiling() -> None:
    ts = [T("full", in_flight=4, max_in_flight=4), T("room", in_flight=3, max_in_flight=4), T("nolimit", in_flight=99)]
    assert run("admission_headroom", ts) == ["room", "nolimit"]


def test_admission_headroom_respects_kv_usage_limit() -> None:
    ts = [T("hot", kv_usage=0.97), T("cool", kv_usage=0.5)]
    assert run("admission_headroom", ts, max_kv_usage=0.9) == ["cool"]
    assert run("admission_headroom", ts) == ["hot", "cool"]  # default limit 1.0


def test_admission_headroom_needs_free_blocks_for_the_uncached_part() -> None:
    # The request needs ceil((64 + 64) / 16) = 8 blocks; 4 are cached on "cached".
    ts = [
        T("tight", kv_capacity_blocks=100, kv_usage=0.95),  # 5 free < 8
        T("cached", kv_capacity_blocks=100, kv_usage=0.95),  # 5 free >= 8 - 4
        T("roomy", kv_capacity_blocks=100, kv_usage=0.5),
        T("unknown", kv_usage=0.95),  # capacity unknown: not judged
    ]
    index = PrefixIndex()
    index.store("cached", [1, 2, 3, 4])
    r = req(max_tokens=64)
    assert run("admission_headroom", ts, r, index) == ["cached", "roomy", "unknown"]
    assert run("admission_headroom", ts, r, index, require_kv_room=False) == ["tight", "cached", "roomy", "unknown"]


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), "0.9", True])
def test_admission_headroom_rejects_bad_kv_limit(bad: object) -> None:
    with pytest.raises(PluginError, match="max_kv_usage"):
        create("filter", {"name": "admission_headroom", "params": {"max_kv_usage": bad}})


def test_index_healthy_prefers_live_streams_but_never_empties() -> None:
    ts = [T("live"), T("broken", index_healthy=False)]
    assert run("index_healthy", ts) == ["live"]
    assert run("index_healthy", [T("b1", index_healthy=False), T("b2", index_healthy=False)]) == ["b1", "b2"]


def test_filters_keep_candidate_order() -> None:
    ts = [T(f"w{i}", models=frozenset({"m"})) for i in range(9, -1, -1)]
    assert run("model_match", ts) == [f"w{i}" for i in range(9, -1, -1)]


def test_admission_headroom_needs_room_for_every_choice() -> None:
    # n=4 choices of up to 64 tokens share the 64-token prompt: ceil((64 + 4 * 64) / 16) = 20 blocks,
    # plus 3: each choice after the first recomputes the last prompt token into a block of its own
    ts = [T("small", kv_capacity_blocks=100, kv_usage=0.85), T("big", kv_capacity_blocks=100, kv_usage=0.5)]
    assert run("admission_headroom", ts, req(max_tokens=64)) == ["small", "big"]  # one choice: 8 <= 15
    assert run("admission_headroom", ts, req(max_tokens=64, choices=4)) == ["big"]  # 23 > 15 free
