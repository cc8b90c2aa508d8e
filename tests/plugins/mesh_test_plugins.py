"""Third-party plugins written outside the ``policies`` package, loaded by ``module:Class``.

``tests/unit/policies/test_plugin_loading.py`` puts this directory on ``sys.path`` and names these classes in
YAML, exactly as an operator would name their own module.
"""

from __future__ import annotations

from policies.base import ClusterView, Decision, NoCandidate, Policy, RequestInfo, TargetState
from policies.pipeline import Filter, Picker, Scorer


class PreferPrefix(Scorer):
    """1.0 for targets whose id starts with ``prefix``, else 0."""

    name = "prefer_prefix"

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def score(self, request: RequestInfo, cluster: ClusterView, candidates: list[TargetState]) -> list[float]:
        return [1.0 if t.id.startswith(self.prefix) else 0.0 for t in candidates]


class DropIds(Filter):
    """Drops the targets named in ``ids``."""

    name = "drop_ids"

    def __init__(self, ids: list[str]) -> None:
        self.ids = frozenset(ids)

    def filter(self, request: RequestInfo, cluster: ClusterView, candidates: list[TargetState]) -> list[TargetState]:
        return [t for t in candidates if t.id not in self.ids]


class LastOfBest(Picker):
    """The last candidate with the best total (a deliberately odd, observable rule)."""

    name = "last_of_best"

    def pick(self, totals, columns, rng):  # type: ignore[no-untyped-def]
        best = max(totals)
        return max(i for i, v in enumerate(totals) if v == best)


class Alphabetical(Policy):
    """A whole policy: the available target with the smallest id."""

    name = "alphabetical"

    def __init__(self, reverse: bool = False) -> None:
        self.reverse = reverse
        self.routed: list[str] = []

    def decide(self, request: RequestInfo, cluster: ClusterView) -> Decision:
        ids = sorted((t.id for t in cluster.available(request)), reverse=self.reverse)
        if not ids:
            raise NoCandidate("nobody")
        return Decision(ids[0], "alphabetical")

    def on_routed(self, request: RequestInfo, target: str, now: float) -> None:
        self.routed.append(target)


class NotAScorer:
    """Has the wrong shape: no score() method."""

    def __init__(self) -> None:
        pass


class NotAPolicy:
    """Has the wrong shape: no decide() method."""


NOT_A_CLASS = 42
