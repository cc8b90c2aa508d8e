"""Policy cache_aware (SGLang's approximate text tree) on fixed inputs."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from policies import registry
from policies.base import ClusterView, RequestInfo, TargetState
from policies.cache_aware import CacheAware, TextTree


def req(text: str, model: str = "m") -> RequestInfo:
    return RequestInfo(model=model, block_keys=[], block_size=16, prompt_tokens=len(text), text=text)


RNG = random.Random(0)  # every view's: reproducible random tie-breaks


def view(*targets: TargetState) -> ClusterView:
    return ClusterView(targets=list(targets), now=0.0, rng=RNG)


def route(policy: CacheAware, text: str, targets: list[TargetState], now: float = 0.0) -> str:
    d = policy.decide(req(text), view(*targets))
    assert d.target is not None
    policy.on_routed(req(text), d.target, now)
    return d.target


def test_text_tree_matches_splits_and_tracks_sizes() -> None:
    tree = TextTree()
    tree.insert("hello world", "a", 1.0)
    tree.insert("hello there", "b", 2.0)
    assert tree.match("hello world!") == (11, {"a": 1.0})
    n, tenants = tree.match("hello th")
    assert n == 8 and set(tenants) == {"b"}
    n, tenants = tree.match("help")
    assert n == 3 and set(tenants) == {"a", "b"}
    assert tree.size == {"a": 11, "b": 11}


def test_eviction_trims_each_tenant_lru_leaves_first() -> None:
    tree = TextTree()
    tree.insert("shared-prefix/old", "a", 1.0)
    tree.insert("shared-prefix/new", "a", 5.0)
    tree.insert("shared-prefix/b", "b", 2.0)
    tree.evict(max_chars=17)
    assert tree.size["a"] == 17 and tree.size["b"] == 15
    assert tree.match("shared-prefix/old")[0] == 14  # the old leaf left
    assert tree.match("shared-prefix/new") == (17, {"a": 5.0})


def test_repeat_prefix_goes_back_to_the_same_worker() -> None:
    policy = CacheAware()
    targets = [TargetState("a", "a"), TargetState("b", "b")]
    first = route(policy, "system: be helpful. user: hi", targets)
    for turn in ["system: be helpful. user: hi. assistant: hello. user: more", "system: be helpful. user: hi!"]:
        assert route(policy, turn, targets) == first


def test_low_match_rate_goes_to_the_least_loaded() -> None:
    policy = CacheAware()
    a, b = TargetState("a", "a", in_flight=3), TargetState("b", "b", in_flight=1)
    policy.on_routed(req("abcdefghij"), "a", 0.0)
    d = policy.decide(req("abcXXXXXXXXXXXXXXXXXXXXXXX"), view(a, b))  # 3/26 matched, below 0.3
    assert d.target == "b" and "least loaded" in d.reason
    d = policy.decide(req("abcdefghijXX"), view(a, b))
    assert d.target == "a" and d.scores["a"]["match_rate"] == pytest.approx(10 / 12)


def test_imbalance_overrides_affinity() -> None:
    policy = CacheAware()
    policy.on_routed(req("the long shared prompt"), "a", 0.0)
    busy, idle = TargetState("a", "a", in_flight=100), TargetState("b", "b", in_flight=10)
    d = policy.decide(req("the long shared prompt"), view(busy, idle))
    assert d.target == "b" and "imbalanced" in d.reason
    mild = TargetState("a", "a", in_flight=70)  # 70 - 50 <= 64: balanced enough, affinity wins
    d = policy.decide(req("the long shared prompt"), view(mild, TargetState("b", "b", in_flight=50)))
    assert d.target == "a"


def test_ties_are_random_with_tie_break_random() -> None:
    """``tie_break: random`` (SGLang itself takes the first least-loaded worker and a prefix's
    creator: ``first``, the default, tests/e2e/routing/test_cache_aware_parity.py)."""
    policy = CacheAware(tie_break="random")
    targets = [TargetState(t, t) for t in "abcd"]
    picks = Counter(policy.decide(req(f"fresh {i}"), view(*targets)).target for i in range(400))
    assert set(picks) == set("abcd") and min(picks.values()) > 60
    for t in "abcd":
        policy.on_routed(req("same text for everyone"), t, 0.0)
    picks = Counter(policy.decide(req("same text for everyone"), view(*targets)).target for _ in range(400))
    assert set(picks) == set("abcd")


def test_periodic_eviction_runs_from_on_routed() -> None:
    policy = CacheAware(eviction_interval_s=10, max_tree_chars=5)
    policy.on_routed(req("0123456789"), "a", 0.0)
    policy.on_routed(req("abcdefghij"), "a", 5.0)
    tree = policy.tree("m")
    assert tree is not None and tree.size["a"] == 20
    policy.on_routed(req("ABCDEFGHIJ"), "a", 11.0)
    assert tree.size["a"] <= 5


def test_registered_with_sglang_defaults() -> None:
    policy = registry.create("policy", "cache_aware")
    assert policy.describe() == {
        "name": "cache_aware", "cache_threshold": 0.3, "balance_abs_threshold": 64, "balance_rel_threshold": 1.5,
        "eviction_interval_s": 120.0, "max_tree_chars": 1 << 26,
    }
    with pytest.raises(registry.PluginError):
        registry.create("policy", {"name": "cache_aware", "params": {"cache_threshold": 2}})
