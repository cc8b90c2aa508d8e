"""The pipeline policy: filters -> weighted scorers -> picker, its explanation, profiles, errors."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence

import pytest

from mesh.core.index import PrefixIndex
from mesh.core.router import Router
from policies.base import ClusterView, NoCandidate, RequestInfo, Role, TargetState
from policies.pipeline import Pipeline, Scorer
from policies.registry import PluginError, create, register

LLM_D = [{"name": "prefix", "weight": 2}, {"name": "kv_utilization", "weight": 1}, {"name": "load", "weight": 1}]


def T(tid: str, **kw: object) -> TargetState:
    return TargetState(id=tid, worker=tid, **kw)  # type: ignore[arg-type]


def req(keys: Sequence[int] = (1, 2, 3, 4), **kw: object) -> RequestInfo:
    base: dict[str, object] = {"model": "m", "block_keys": list(keys), "block_size": 16, "prompt_tokens": 16 * len(keys)}
    base.update(kw)
    return RequestInfo(**base)  # type: ignore[arg-type]


def pipeline(**params: object) -> Pipeline:
    return create("policy", {"name": "pipeline", "params": params})


def test_weighted_sum_picks_and_explains_every_term() -> None:
    index = PrefixIndex()
    index.store("warm", [1, 2, 3, 4])
    ts = [T("warm", in_flight=4, kv_usage=0.5), T("cold", in_flight=0, kv_usage=0.0)]
    d = pipeline(scorers=LLM_D).decide(req(), ClusterView(ts, 0.0, index))
    # warm: 2*1.0 + 1*0.5 + 1*0.0 = 2.5 ; cold: 2*0 + 1*1.0 + 1*1.0 = 2.0
    assert d.target == "warm"
    assert d.scores["warm"] == pytest.approx({"prefix": 1.0, "kv_utilization": 0.5, "load": 0.0, "total": 2.5})
    assert d.scores["cold"] == pytest.approx({"prefix": 0.0, "kv_utilization": 1.0, "load": 1.0, "total": 2.0})
    assert d.overlaps["warm"].gpu_blocks == 4 and "cold" not in d.overlaps
    assert d.reason == "highest weighted score"
    json.dumps(d.explain())  # the /debug/route body serializes


def test_load_outweighs_a_partial_prefix_when_weighted_so() -> None:
    index = PrefixIndex()
    index.store("warm", [1])  # 1 of 4 blocks
    ts = [T("warm", in_flight=10), T("cold", in_flight=0)]
    scorers = [{"name": "prefix", "weight": 1}, {"name": "load", "weight": 1}]
    assert pipeline(scorers=scorers).decide(req(), ClusterView(ts, 0.0, index)).target == "cold"


def test_no_scorers_is_a_fair_random_choice() -> None:
    ts = [T(f"w{i}") for i in range(4)]
    p = pipeline()
    counts = Counter(p.decide(req(), ClusterView(ts, 0.0)).target for _ in range(2000))
    assert set(counts) == {"w0", "w1", "w2", "w3"} and min(counts.values()) > 400


def test_health_and_model_filters_are_always_applied() -> None:
    ts = [T("dead", healthy=False), T("alive")]
    p = pipeline(filters=["model_match"], scorers=["load"])
    for _ in range(50):
        assert p.decide(req(), ClusterView(ts, 0.0)).target == "alive"
    assert [f.name for f in p.profile.filters] == ["healthy", "model_match"]  # type: ignore[union-attr]


def test_a_filter_that_empties_the_set_is_named() -> None:
    ts = [T("a", models=frozenset({"other"}))]
    with pytest.raises(NoCandidate, match="model_match"):
        pipeline().decide(req(), ClusterView(ts, 0.0))


def test_admission_filter_in_a_pipeline_moves_traffic_off_full_targets() -> None:
    ts = [T("full", in_flight=2, max_in_flight=2), T("room", in_flight=1, max_in_flight=2)]
    p = pipeline(filters=["healthy", "admission_headroom"], scorers=[{"name": "kv_utilization", "weight": 1}])
    assert {p.decide(req(), ClusterView(ts, 0.0)).target for _ in range(20)} == {"room"}


def test_duplicate_scorer_names_get_distinct_terms() -> None:
    p = pipeline(scorers=["load", {"name": "load", "weight": 2}])
    d = p.decide(req(), ClusterView([T("a", in_flight=1), T("b")], 0.0))
    assert set(d.scores["b"]) == {"load", "load#2", "total"}
    assert d.scores["b"]["total"] == 3.0


@pytest.mark.parametrize("weight", [-1, float("nan"), float("inf"), "2", True, None])
def test_weights_must_be_finite_non_negative_numbers(weight: object) -> None:
    with pytest.raises(PluginError, match="weight"):
        pipeline(scorers=[{"name": "load", "weight": weight}])


def test_zero_weight_scorer_is_explained_but_not_summed() -> None:
    p = pipeline(scorers=[{"name": "load", "weight": 0}, {"name": "kv_utilization", "weight": 1}])
    d = p.decide(req(), ClusterView([T("a", in_flight=5, kv_usage=0.0), T("b", kv_usage=0.5)], 0.0))
    assert d.target == "a" and d.scores["a"]["load"] == 0.0 and d.scores["a"]["total"] == 1.0


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"scorers": [{"name": "load", "wieght": 2}]}, "unknown keys"),
        ({"scorers": [42]}, "expected a name"),
        ({"scorers": "load"}, "must be a list"),
        ({"filters": [{"name": "no_such_filter"}]}, "unknown filter 'no_such_filter'"),
        ({"scorers": ["no_such_scorer"]}, "unknown scorer 'no_such_scorer'"),
        ({"picker": "no_such_picker"}, "unknown picker 'no_such_picker'"),
        ({"picker": "softmax", "profiles": {}}, "not both"),
        ({"profiles": {"prefill": {}}}, "exactly 'prefill' and 'decode'"),
        ({"profiles": {"prefill": {}, "decode": {"scorer": []}}}, "unknown keys"),
        ({"profiles": {"prefill": [], "decode": {}}}, "must be a map"),
        ({"filters": ["load"]}, "unknown filter 'load'"),  # a scorer is not a filter
    ],
)
def test_bad_pipeline_specs_raise_plugin_errors(params: dict[str, object], message: str) -> None:
    with pytest.raises(PluginError, match=message):
        pipeline(**params)


class _Wild(Scorer):
    trusted = False

    def __init__(self, values: list[object]) -> None:
        self.values = values

    def score(self, request, cluster, candidates):  # type: ignore[no-untyped-def]
        return list(self.values)


register("scorer", "test_wild")(_Wild)


def test_plugin_scores_are_clamped_into_range() -> None:
    p = pipeline(scorers=[{"name": "test_wild", "params": {"values": [7.0, -3.0, float("nan")]}}])
    d = p.decide(req(), ClusterView([T("a"), T("b"), T("c")], 0.0))
    assert [d.scores[t]["test_wild"] for t in "abc"] == [1.0, 0.0, 0.0]
    assert d.target == "a"


@pytest.mark.parametrize(("values", "message"), [([1.0], "returned 1 scores for 2"), (["x", "y"], "other than numbers")])
def test_plugin_scores_of_wrong_shape_raise(values: list[object], message: str) -> None:
    p = pipeline(scorers=[{"name": "test_wild", "params": {"values": values}}])
    with pytest.raises(PluginError, match=message):
        p.decide(req(), ClusterView([T("a"), T("b")], 0.0))


PD = {
    "prefill": {"scorers": [{"name": "prefix", "weight": 2}, {"name": "prefill_load", "weight": 1}]},
    "decode": {"filters": ["healthy", "admission_headroom"], "scorers": ["load"]},
}


def test_profiles_pick_a_prefill_and_a_decode_target() -> None:
    index = PrefixIndex()
    index.store("p1", [1, 2, 3, 4])
    ts = [
        T("p0", role=Role.PREFILL), T("p1", role=Role.PREFILL),
        T("d0", role=Role.DECODE, in_flight=3), T("d1", role=Role.DECODE, in_flight=1),
        T("d2", role=Role.DECODE, in_flight=0, max_in_flight=1, kv_capacity_blocks=10, kv_usage=0.99),
        T("m0"),
    ]
    d = pipeline(profiles=PD).decide(req(), ClusterView(ts, 0.0, index))
    assert (d.target, d.decode_target) == ("p1", "d1")
    assert set(d.scores) == {"p0", "p1", "d0", "d1"}  # d2 has no room; m0 is mixed
    assert "prefill" in d.reason and "decode" in d.reason


def test_profiles_fall_back_to_mixed_targets_without_a_pair() -> None:
    index = PrefixIndex()
    index.store("m1", [1, 2, 3, 4])
    ts = [T("p0", role=Role.PREFILL), T("m0"), T("m1")]
    d = pipeline(profiles=PD).decide(req(), ClusterView(ts, 0.0, index))
    assert d.target == "m1" and d.decode_target is None and "mixed-role fallback" in d.reason
    with pytest.raises(NoCandidate, match="no mixed-role candidate"):
        pipeline(profiles=PD).decide(req(), ClusterView([T("p0", role=Role.PREFILL)], 0.0))


def test_short_or_mostly_cached_prompts_prefill_on_the_decode_worker() -> None:
    """Conditional disaggregation (``local_prefill_tokens``): a pair only when the decode target
    would have to prefill more than the threshold itself; its own cached prefix counts."""
    index = PrefixIndex()
    index.store("d0", [1, 2, 3])  # d0 caches 3 of the 4-block prompt's blocks
    ts = [T("p0", role=Role.PREFILL), T("d0", role=Role.DECODE), T("d1", role=Role.DECODE, in_flight=5)]
    policy = pipeline(profiles=PD, local_prefill_tokens=32)
    local = policy.decide(req(), ClusterView(ts, 0.0, index))  # 64 tokens, 48 cached on d0: 16 left
    assert (local.target, local.decode_target) == ("d0", None) and "prefills locally (16 uncached" in local.reason
    long = policy.decide(req(keys=range(1, 9)), ClusterView(ts, 0.0, index))  # 128 tokens, 80 uncached
    assert (long.target, long.decode_target) == ("p0", "d0")
    always = pipeline(profiles=PD).decide(req(), ClusterView(ts, 0.0, index))  # default 0: always a pair
    assert (always.target, always.decode_target) == ("p0", "d0")
    assert policy.describe()["local_prefill_tokens"] == 32
    for bad in (-1, 1.5, True):
        with pytest.raises(PluginError, match="local_prefill_tokens"):
            pipeline(profiles=PD, local_prefill_tokens=bad)
    with pytest.raises(PluginError, match="needs prefill/decode profiles"):
        pipeline(scorers=LLM_D, local_prefill_tokens=8)


def test_pipeline_through_router_decide_and_route() -> None:
    index = PrefixIndex()
    index.store("b", [1, 2, 3])
    targets = {t.id: t for t in (T("a"), T("b"), T("c"))}
    router = Router(pipeline(scorers=LLM_D), targets, index=index)
    d, lease = router.route(req(), now=0.0)
    assert d.target == "b"
    assert targets["b"].in_flight == 1 and targets["b"].prefill_tokens == 16  # 1 of 4 blocks uncached
    lease.finish(1.0)
    assert targets["b"].in_flight == 0
    assert router.decide(req(), 1.0, exclude=["b"]).target in {"a", "c"}


def test_describe_lists_the_configured_plugins() -> None:
    desc = pipeline(scorers=LLM_D, picker="weighted_random").describe()
    assert desc == {
        "name": "pipeline",
        "filters": ["healthy", "model_match"],
        "scorers": [{"name": "prefix", "weight": 2.0}, {"name": "kv_utilization", "weight": 1.0},
                    {"name": "load", "weight": 1.0}],
        "picker": "weighted_random",
    }


def test_explanation_is_bounded_to_the_best_candidates_and_the_pick() -> None:
    index = PrefixIndex()
    ts = [T(f"w{i:02d}", in_flight=i) for i in range(40)]
    p = pipeline(scorers=["load"], explain_top=5)
    d = p.decide(req(), ClusterView(ts, 0.0, index))
    assert d.target == "w00" and set(d.scores) == {f"w{i:02d}" for i in range(5)}
    full = pipeline(scorers=["load"], explain_top=1000).decide(req(), ClusterView(ts, 0.0, index))
    assert len(full.scores) == 40
    rand = pipeline(scorers=["load"], picker="weighted_random", explain_top=3)
    for _ in range(30):  # a random pick outside the best 3 is still explained
        d = rand.decide(req(), ClusterView(ts, 0.0, index))
        assert d.target in d.scores and len(d.scores) == 3


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "16"])
def test_explain_top_must_be_a_positive_integer(bad: object) -> None:
    with pytest.raises(PluginError, match="explain_top"):
        pipeline(explain_top=bad)


def test_model_and_lora_matching_inside_the_pipeline() -> None:
    ts = [
        T("other", models=frozenset({"x"})),
        T("nolora", models=frozenset({"m"}), loras=frozenset({"chat"})),
        T("good", models=frozenset({"m"}), loras=frozenset({"sql"})),
    ]
    p = pipeline(filters=["model_match", "healthy"], scorers=["load"])
    assert {p.decide(req(lora="sql"), ClusterView(ts, 0.0)).target for _ in range(20)} == {"good"}
    assert {p.decide(req(), ClusterView(ts, 0.0)).target for _ in range(40)} == {"nolora", "good"}
    implicit = pipeline(filters=["admission_headroom"], scorers=["load"])  # matching is never off
    assert {implicit.decide(req(lora="sql"), ClusterView(ts, 0.0)).target for _ in range(20)} == {"good"}
    assert [f.name for f in implicit.profile.filters] == ["healthy", "model_match", "admission_headroom"]  # type: ignore[union-attr]
