"""Policy kv_aware on fixed inputs: the cost (prefill work, decode weighed by decode_weight), tiers,
health fallback, ties, sampling."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from mesh.core.index import PrefixIndex
from policies import registry
from policies.base import ClusterView, NoCandidate, Overlap, RequestInfo, TargetState, Tier
from policies.kv_aware import KvAware

KEYS = list(range(1, 11))  # a 10-block prompt


def request(blocks: int = 10, bs: int = 16) -> RequestInfo:
    return RequestInfo(model="m", block_keys=KEYS[:blocks], block_size=bs, prompt_tokens=blocks * bs + 5)


RNG = random.Random(0)  # every view's: reproducible ties and samples


def view(targets: list[TargetState], index: PrefixIndex | None) -> ClusterView:
    return ClusterView(targets=targets, now=0.0, index=index, rng=RNG)


def test_the_target_holding_the_prefix_wins_and_the_explanation_shows_the_cost() -> None:
    index = PrefixIndex()
    index.store("a", KEYS[:8])
    index.store("b", KEYS[:2])
    a, b = TargetState("a", "a"), TargetState("b", "b")
    d = KvAware().decide(request(), view([a, b], index))
    assert d.target == "a"
    prompt = (10 * 16 + 5) / 16
    assert d.scores["a"]["cost"] == pytest.approx(prompt - 8)
    assert d.scores["b"]["cost"] == pytest.approx(prompt - 2)
    assert d.overlaps == {"a": Overlap(8, 0), "b": Overlap(2, 0)}
    assert d.explain()["candidates"]["a"]["overlap"] == {"gpu_blocks": 8, "cpu_blocks": 0}


def test_queued_prefill_and_decode_load_outweigh_a_small_overlap() -> None:
    index = PrefixIndex()
    index.store("a", KEYS[:3])
    a = TargetState("a", "a", prefill_tokens=16 * 20, decode_tokens=16 * 4)
    b = TargetState("b", "b", decode_tokens=16 * 2)
    d = KvAware().decide(request(), view([a, b], index))
    prompt = (10 * 16 + 5) / 16
    assert d.scores["a"]["cost"] == pytest.approx(20 + prompt - 3 + 0.05 * 4)
    assert d.scores["b"]["cost"] == pytest.approx(prompt + 0.05 * 2)
    assert d.target == "b"


def test_decode_weight_weighs_decoding_context_against_prefill() -> None:
    index = PrefixIndex()
    index.store("a", KEYS)
    a = TargetState("a", "a", decode_tokens=16 * 80)  # all cached, but busy decoding 80 blocks
    b = TargetState("b", "b")
    assert KvAware().decide(request(), view([a, b], index)).target == "a"  # 4 blocks of decode < 10.3 to prefill
    assert KvAware(decode_weight=1.0).decide(request(), view([a, b], index)).target == "b"  # Dynamo's weight


def test_a_follow_up_turn_stays_with_its_long_prefix_beside_busier_decoding() -> None:
    """A 600-block turn cached on a worker decoding 2,400 blocks of context, against an idle one."""
    keys = list(range(1, 601))
    index = PrefixIndex()
    index.store("home", keys[:560])
    info = RequestInfo(model="m", block_keys=keys, block_size=16, prompt_tokens=600 * 16)
    home = TargetState("home", "home", decode_tokens=16 * 2400)
    idle = TargetState("idle", "idle")
    assert KvAware().decide(info, view([home, idle], index)).target == "home"
    assert KvAware(decode_weight=1.0).decide(info, view([home, idle], index)).target == "idle"


def test_prefill_load_scale_weighs_prefill_against_decode() -> None:
    index = PrefixIndex()
    index.store("a", KEYS)
    a = TargetState("a", "a", decode_tokens=16 * 8)  # all cached, but busy decoding
    b = TargetState("b", "b")
    assert KvAware(decode_weight=1.0).decide(request(), view([a, b], index)).target == "a"
    assert KvAware(decode_weight=1.0, prefill_load_scale=0.5).decide(request(), view([a, b], index)).target == "b"


def test_cpu_hits_count_below_gpu_hits() -> None:
    index = PrefixIndex()
    index.store("a", KEYS[:6])
    index.store("b", KEYS[:2])
    index.store("b", KEYS[2:8], Tier.CPU, parent=KEYS[1])
    d = KvAware(cpu_weight=0.75).decide(request(), view([TargetState("a", "a"), TargetState("b", "b")], index))
    assert d.overlaps["b"] == Overlap(2, 6)
    assert d.scores["b"]["cost"] == pytest.approx((165 / 16) - 2 - 0.75 * 6)
    assert d.target == "b"  # 2 + 4.5 = 6.5 credited blocks beat 6
    d = KvAware(cpu_weight=0.5).decide(request(), view([TargetState("a", "a"), TargetState("b", "b")], index))
    assert d.target == "a"  # 2 + 3 = 5 < 6


def test_an_unhealthy_index_gets_no_overlap_credit() -> None:
    index = PrefixIndex()
    index.store("a", KEYS)
    a = TargetState("a", "a", index_healthy=False, decode_tokens=16)
    b = TargetState("b", "b")
    d = KvAware().decide(request(), view([a, b], index))
    assert d.target == "b" and "a" not in d.overlaps
    assert d.scores["a"]["index_healthy"] == 0.0 and d.scores["a"]["gpu_overlap"] == 0.0


def test_ties_are_broken_at_random_not_first() -> None:
    targets = [TargetState(t, t) for t in "abcd"]
    policy = KvAware()
    picks = Counter(policy.decide(request(), view(targets, None)).target for _ in range(400))
    assert set(picks) == set("abcd") and min(picks.values()) > 60


def test_softmax_sampling_prefers_low_cost_but_explores() -> None:
    index = PrefixIndex()
    index.store("a", KEYS)
    targets = [TargetState("a", "a"), TargetState("b", "b")]
    policy = KvAware(temperature=0.5)
    picks = Counter(policy.decide(request(), view(targets, index)).target for _ in range(1000))
    # normalized costs 0 and 1: P(b) = e^-2 / (1 + e^-2) ~ 0.12
    assert 60 < picks["b"] < 200 and picks["a"] > picks["b"]


def test_full_targets_are_skipped_while_another_has_room_and_no_candidate_raises() -> None:
    index = PrefixIndex()
    index.store("a", KEYS)
    a = TargetState("a", "a", in_flight=4, max_in_flight=4)
    b = TargetState("b", "b")
    assert KvAware().decide(request(), view([a, b], index)).target == "b"
    assert KvAware().decide(request(), view([a], index)).target == "a"  # all full: still routes
    with pytest.raises(NoCandidate):
        KvAware().decide(request(), view([TargetState("c", "c", healthy=False)], index))


def test_registered_and_params_validated() -> None:
    policy = registry.create("policy", {"name": "kv_aware", "params": {"cpu_weight": 0.8}})
    assert isinstance(policy, KvAware) and policy.describe()["cpu_weight"] == 0.8
    with pytest.raises(registry.PluginError):
        registry.create("policy", {"name": "kv_aware", "params": {"cpu_weight": 1.5}})
    with pytest.raises(registry.PluginError):
        registry.create("policy", {"name": "kv_aware", "params": {"temperature": -1}})


def test_explanation_is_limited_to_the_cheapest_targets_and_the_pick() -> None:
    index = PrefixIndex()
    index.store("t39", KEYS)
    targets = [TargetState(f"t{i}", f"t{i}", decode_tokens=16 * i) for i in range(39)]
    targets.append(TargetState("t39", "t39"))
    d = KvAware(explain_top=5).decide(request(), view(targets, index))
    assert d.target == "t39"
    assert set(d.scores) == {"t0", "t1", "t2", "t3", "t39"}
    assert d.overlaps == {"t39": Overlap(10, 0)}
