"""``bench/e2e_routing.py``'s ``--variant`` specs: a policy spec, or the wrapper of policy, worker and config."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[3]


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("e2e_routing_bench", REPO / "bench" / "e2e_routing.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return _bench()


def test_a_wrapper_with_only_a_policy_is_the_wrapper_not_a_policy_spec(bench: ModuleType) -> None:
    policy = {"name": "session_sticky", "params": {"rebalance_margin": 1}}
    spec = bench._variant_spec("v", {"policy": policy})
    assert spec.policy == policy and spec.config == {} and spec.session_ids


def test_a_policy_spec_map_and_a_full_wrapper(bench: ModuleType) -> None:
    assert bench._variant_spec("v", {"name": "kv_aware"}).policy == {"name": "kv_aware"}
    assert bench._variant_spec("v", "kv_aware").policy == "kv_aware"
    spec = bench._variant_spec("v", {"policy": "kv_aware", "session_ids": False, "config": {"retention": {"spill_hint": False}}})
    assert spec.policy == "kv_aware" and not spec.session_ids and spec.config == {"retention": {"spill_hint": False}}
    with pytest.raises(ValueError, match="unknown keys"):
        bench._variant_spec("v", {"policy": "kv_aware", "workers": {}})
