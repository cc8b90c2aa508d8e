"""Built-in pickers: choose one candidate index from the weighted totals.

Every tie is broken by the decision's RNG (``ClusterView.rng``), uniformly among the tied candidates: "always the
first worker" (SGLang's known complaint) would pile equal-score traffic onto one target.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

from policies.params import number
from policies.pipeline import Picker
from policies.registry import register

TIE_EPS = 1e-9  # totals this close (relative to their size) are a tie


@register("picker", "max_score")
class MaxScore(Picker):
    """The highest total; ties spread uniformly at random."""

    def pick(self, totals: Sequence[float], columns: Sequence[Sequence[float]], rng: random.Random) -> int:
        best = max(totals)
        cut = best - TIE_EPS * max(1.0, abs(best))
        ranked = sorted(totals)  # C speed; only a real tie pays for the Python scan below
        if len(ranked) < 2 or ranked[-2] < cut:
            return totals.index(best)
        return rng.choice([i for i, v in enumerate(totals) if v >= cut])

    def summary(self, terms: Sequence[str]) -> str:
        return "highest weighted score"


@register("picker", "weighted_random")
class WeightedRandom(Picker):
    """Probability proportional to the total; uniform when every total is 0."""

    def pick(self, totals: Sequence[float], columns: Sequence[Sequence[float]], rng: random.Random) -> int:
        n = len(totals)
        if sum(totals) <= 0:
            return rng.randrange(n)
        return rng.choices(range(n), weights=totals)[0]

    def summary(self, terms: Sequence[str]) -> str:
        return "random draw weighted by score"


@register("picker", "softmax")
class Softmax(Picker):
    """Probability proportional to ``exp(total / temperature)`` (Dynamo's sampling at T > 0)."""

    def __init__(self, temperature: float = 0.1) -> None:
        self.temperature = number("picker 'softmax'", "temperature", temperature, 0.0, above=True)

    def pick(self, totals: Sequence[float], columns: Sequence[Sequence[float]], rng: random.Random) -> int:
        top, t = max(totals), self.temperature
        weights = [math.exp((v - top) / t) for v in totals]  # shifted: the best weighs 1, no overflow
        return rng.choices(range(len(totals)), weights=weights)[0]

    def summary(self, terms: Sequence[str]) -> str:
        return f"softmax draw (temperature {self.temperature:g})"

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "temperature": self.temperature}


@register("picker", "lexicographic")
class Lexicographic(Picker):
    """Ranks by the scorers in their configured order: the first scorer decides, the next breaks
    its ties, and so on; remaining ties spread at random. Weights do not matter here.

    Expresses "prefix overlap first, then fewest live sessions, then load" exactly, which no
    weighted sum can for every input.
    """

    def pick(self, totals: Sequence[float], columns: Sequence[Sequence[float]], rng: random.Random) -> int:
        alive = list(range(len(totals)))
        for col in columns:
            best = max(col[i] for i in alive)
            cut = best - TIE_EPS * max(1.0, abs(best))
            alive = [i for i in alive if col[i] >= cut]
            if len(alive) == 1:
                return alive[0]
        return rng.choice(alive)

    def summary(self, terms: Sequence[str]) -> str:
        return "best by " + " > ".join(terms) if terms else "random (no scorers)"
