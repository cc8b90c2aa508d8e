"""The L2 prefetch plan (workers/prefetch.py): which weights and K/V pages each hook point of a
decode forward prefetches. Pure logic: the kernels themselves are GPU-tested
(tests/gpu/test_prefetch_gpu.py)."""

from __future__ import annotations

import pytest

from workers.config import get_preset
from workers.prefetch import LINEARS, PrefetchConfig, plan, worth_it


def _order(layers: int) -> list[tuple[int, str]]:
    """Hook points in execution order: the model's start, then each linear's pre-hook."""
    return [(-1, "model")] + [(i, n) for i in range(layers) for n in LINEARS]


@pytest.mark.parametrize("distance", [1, 2, 3])
@pytest.mark.parametrize("kv", ["off", "qkv", "down"])
def test_every_linear_and_kv_page_set_is_prefetched_once_ahead_of_its_use(distance: int, kv: str) -> None:
    layers = 5
    p = plan(layers, distance, kv)
    order = _order(layers)
    at = {point: k for k, point in enumerate(order)}
    seen: list[tuple[int, str]] = []
    for point, items in p.items():
        assert point in at, point
        for item in items:
            seen.append(item)
            if item[1] == "kv":  # before the layer's attention, which follows its qkv pre-hook
                assert at[point] <= at[(item[0], "qkv_proj")]
                want = (item[0], "qkv_proj") if kv == "qkv" or item[0] == 0 else (item[0] - 1, "down_proj")
                assert point == want
            else:  # exactly `distance` linears ahead (the first ones at the model's start)
                assert at[point] == max(0, at[item] - distance)
    linears = [o for o in order[1:]]
    want_items = linears + ([(i, "kv") for i in range(layers)] if kv != "off" else [])
    assert sorted(seen) == sorted(want_items)  # each once


def test_config_is_validated() -> None:
    PrefetchConfig()
    for bad in ({"mode": "x"}, {"distance": 0}, {"ctas": 0}, {"kv": "always"}):
        with pytest.raises(ValueError):
            PrefetchConfig(**bad)


def _layer_bytes(name: str) -> int:
    c = get_preset(name)
    h, i = c.hidden_size, c.intermediate_size
    return 2 * (h * (c.q_size + 2 * c.kv_size) + c.q_size * h + 3 * h * i)


def test_only_small_layers_are_prefetched() -> None:
    assert worth_it(_layer_bytes("qwen2-0.5b"))  # 29.8 MB of a 50 MB L2
    assert not worth_it(_layer_bytes("llama3-8b"))  # 436 MB: nothing to gain, never installed
