"""Pickers: the best wins, ties spread fairly (never "always the first"), the decision's RNG reproduces."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from policies.registry import PluginError, create


class Seeded:
    """A picker with the RNG a decision would hand it (``ClusterView.rng``), seeded."""

    def __init__(self, spec: object, seed: int | None) -> None:
        self.picker = create("picker", spec)
        self.rng = random.Random(seed)

    def pick(self, totals: list[float], columns: list[list[float]]) -> int:
        return int(self.picker.pick(totals, columns, self.rng))


def picker(spec: object, seed: int | None = 0) -> Seeded:
    return Seeded(spec, seed)


def chi_square(counts: Counter[int], k: int, n: int) -> float:
    expected = n / k
    return sum((counts.get(i, 0) - expected) ** 2 / expected for i in range(k))


# 99.9th percentile of chi-square with k-1 degrees of freedom, for k = 4 and k = 8.
CHI2_999 = {4: 16.27, 8: 24.32}


def test_max_score_picks_the_unique_best() -> None:
    p = picker("max_score")
    assert p.pick([0.1, 0.9, 0.5], []) == 1
    assert p.pick([3.0], []) == 0


@pytest.mark.parametrize("k", [4, 8])
def test_max_score_spreads_ties_across_seeds(k: int) -> None:
    totals = [1.0] * k + [0.5, 0.2]
    n = 4000
    counts = Counter(picker("max_score", seed).pick(totals, []) for seed in range(n))
    assert set(counts) == set(range(k))  # never a lower score, every tied one chosen
    assert chi_square(counts, k, n) < CHI2_999[k], counts


def test_max_score_spreads_ties_within_one_stream() -> None:
    p = picker("max_score", seed=7)
    counts = Counter(p.pick([2.0, 2.0, 2.0, 2.0], []) for _ in range(4000))
    assert chi_square(counts, 4, 4000) < CHI2_999[4], counts


def test_max_score_treats_float_rounding_as_a_tie() -> None:
    a = 0.1 + 0.2  # 0.30000000000000004
    counts = Counter(picker("max_score", s).pick([a, 0.3, 0.1], []) for s in range(400))
    assert counts[0] > 100 and counts[1] > 100 and counts[2] == 0


def test_same_seed_same_choices() -> None:
    totals = [1.0, 1.0, 1.0, 1.0, 1.0]
    a = picker("max_score", 42)
    b = picker("max_score", 42)
    assert [a.pick(totals, []) for _ in range(50)] == [b.pick(totals, []) for _ in range(50)]


def test_weighted_random_follows_the_weights() -> None:
    p = picker("weighted_random", 3)
    n = 20000
    counts = Counter(p.pick([3.0, 1.0, 0.0], []) for _ in range(n))
    assert counts[2] == 0
    assert 0.72 < counts[0] / n < 0.78  # expected 0.75


def test_weighted_random_is_uniform_when_all_zero() -> None:
    p = picker("weighted_random", 5)
    counts = Counter(p.pick([0.0, 0.0, 0.0, 0.0], []) for _ in range(4000))
    assert chi_square(counts, 4, 4000) < CHI2_999[4], counts


def test_softmax_low_temperature_is_nearly_greedy_and_high_is_nearly_uniform() -> None:
    totals = [1.0, 0.5, 0.0, 0.0]
    cold = picker({"name": "softmax", "params": {"temperature": 0.01}}, 1)
    assert all(cold.pick(totals, []) == 0 for _ in range(500))
    hot = picker({"name": "softmax", "params": {"temperature": 1000.0}}, 1)
    counts = Counter(hot.pick(totals, []) for _ in range(4000))
    assert chi_square(counts, 4, 4000) < CHI2_999[4], counts


def test_softmax_probabilities_match_exp_weights() -> None:
    p = picker({"name": "softmax", "params": {"temperature": 0.5}}, 9)
    n = 20000
    counts = Counter(p.pick([1.0, 0.0], []) for _ in range(n))
    expected = math.exp(2.0) / (math.exp(2.0) + 1.0)  # ~0.881
    assert abs(counts[0] / n - expected) < 0.015


def test_softmax_survives_huge_totals() -> None:
    p = picker({"name": "softmax", "params": {"temperature": 0.001}}, 1)
    assert p.pick([1e6, 1e6 - 1, 0.0], []) == 0


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "hot"])
def test_softmax_rejects_bad_temperature(bad: object) -> None:
    with pytest.raises(PluginError, match="temperature"):
        picker({"name": "softmax", "params": {"temperature": bad}})


def test_lexicographic_ranks_by_first_column_then_the_next() -> None:
    p = picker("lexicographic")
    prefix = [0.5, 0.5, 0.2, 0.5]
    sessions = [0.0, 1.0, 1.0, 1.0]
    load = [1.0, 0.0, 1.0, 1.0]
    assert p.pick([0.0] * 4, [prefix, sessions, load]) == 3
    # A higher first term wins however bad the rest are.
    assert p.pick([0.0] * 3, [[0.9, 0.8, 0.8], [0.0, 1.0, 1.0], [0.0, 1.0, 1.0]]) == 0


def test_lexicographic_spreads_full_ties() -> None:
    counts = Counter(picker("lexicographic", s).pick([0.0] * 4, [[1.0] * 4, [0.5] * 4]) for s in range(4000))
    assert chi_square(counts, 4, 4000) < CHI2_999[4], counts
