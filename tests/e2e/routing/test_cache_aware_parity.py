"""cache_aware decides as the real sglang-router does (sgl-model-gateway 0.3.2, the PyPI
``sglang-router`` in the venv).

Unit tests pin each rule read from upstream ``src/policies/cache_aware.rs`` and ``tree.rs``: a low
match goes to the *first* least-loaded worker, a match to the tenant that *created* the matched
node, match rates and thresholds compare in f32, and a holder that left sends the request to the
first available worker. The end-to-end test runs both routers as real processes in front of the
same echo workers on a fixed agentic sequence (sequential, then a burst that triggers the
load-balance branch, then sequential again) and asserts they pick the same worker every time.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.cache_aware_parity import cluster, compare, workload
from policies.base import ClusterView, RequestInfo, TargetState
from policies.cache_aware import CacheAware


def req(text: str) -> RequestInfo:
    return RequestInfo(model="m", block_keys=[], block_size=16, prompt_tokens=len(text), text=text)


def view(*targets: TargetState) -> ClusterView:
    return ClusterView(targets=list(targets), now=0.0)


def targets(*loads: int) -> list[TargetState]:
    return [TargetState(t, t, in_flight=n) for t, n in zip("abcd", loads)]


def test_low_match_goes_to_the_first_least_loaded_target() -> None:
    """Upstream ``healthy_indices.iter().min_by_key(load)``: Rust's min_by_key keeps the first."""
    policy = CacheAware()
    ts = targets(2, 1, 1, 3)
    picks = {policy.decide(req(f"fresh prompt {i}"), view(*ts)).target for i in range(20)}
    assert picks == {"b"}


def test_match_goes_to_the_tenant_that_created_the_matched_node() -> None:
    """Upstream ``prefix_match_with_counts``: the matched node's ``last_tenant``, set when the node
    was created as a leaf and inherited by the node a split makes above it; another tenant passing
    through never replaces it."""
    policy = CacheAware()
    policy.on_routed(req("shared system prompt -- session one"), "c", 0.0)
    policy.on_routed(req("shared system prompt -- session two, much longer than the first"), "a", 1.0)
    policy.on_routed(req("shared system prompt -- session one"), "b", 2.0)
    ts = targets(0, 0, 0)
    # ends inside the split node "shared system prompt -- session " (c created it, a and b hold it)
    assert policy.decide(req("shared system prompt -- sess"), view(*ts)).target == "c"
    # ends inside a's own leaf
    assert policy.decide(req("shared system prompt -- session two, much"), view(*ts)).target == "a"


def test_match_rate_and_threshold_compare_in_f32() -> None:
    """``matched as f32 / len as f32 > cache_threshold (f32)``: 3000001/10000003 is above 0.3 in
    f64 but rounds to 0.3f32, which is not above the threshold, so the first least loaded wins."""
    policy = CacheAware()
    prefix = "x" * 3_000_001
    policy.on_routed(req(prefix), "b", 0.0)
    d = policy.decide(req(prefix + "y" * 7_000_002), view(*targets(0, 0)))
    assert d.target == "a" and "least loaded" in d.reason
    d = policy.decide(req(prefix + "y" * 6_999_000), view(*targets(0, 0)))  # clearly above 0.3
    assert d.target == "b"


def test_a_holder_that_left_sends_the_request_to_the_first_available_target() -> None:
    """Upstream: the matched tenant is not a healthy worker -> ``healthy_indices.first()``, not
    another holder of the prefix."""
    policy = CacheAware()
    policy.on_routed(req("long shared prompt one"), "c", 0.0)
    policy.on_routed(req("long shared prompt one"), "b", 1.0)
    a, b, c = targets(5, 0, 0)
    c.healthy = False
    d = policy.decide(req("long shared prompt one"), view(a, b, c))
    assert d.target == "a"


def test_random_ties_stay_available_as_an_option() -> None:
    policy = CacheAware(tie_break="random")
    picks = {policy.decide(req(f"fresh {i}"), view(*targets(0, 0, 0))).target for i in range(60)}
    assert picks == {"a", "b", "c"}
    with pytest.raises(ValueError, match="tie_break"):
        CacheAware(tie_break="last")


def test_mesh_and_sglang_router_pick_the_same_workers(tmp_path: Path) -> None:
    """Both routers as real processes, same echo workers in the same order, same 100 requests."""
    requests = workload(seed=7, kind="completions", sequential=25, burst=70, after=10)
    with cluster(3, tmp_path) as c:
        result = compare(c, requests, "completions", burst_delay_s=4.0)
    summary = result.summary()
    burst = [r for r, req_ in zip(result.sglang, requests) if req_.phase == "burst"]
    # the burst did leave the holder: the load-balance branch ran on both routers
    assert len(set(burst)) > 1, summary["phases"]
    assert result.first_difference() is None, (summary["first_difference"], summary["phases"])
    assert result.sglang == result.mesh
