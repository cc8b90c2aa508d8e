"""Policy plugins that misbehave at routing time, for tests/e2e/config/test_hostile_policies.py.

``Misbehaving`` reads what to do from the prompt (``mode:NAME``), so one gateway serves every case.
"""

from __future__ import annotations

from typing import Any

from policies.base import ClusterView, Decision, Policy, RequestInfo


class Misbehaving(Policy):
    name = "misbehaving"

    def __init__(self, good: str = "e0", other: str = "e1") -> None:
        self.good = good
        self.other = other

    def _mode(self, request: RequestInfo) -> str:
        for word in request.text.split():
            if word.startswith("mode:"):
                return word[5:]
        return "good"

    def decide(self, request: RequestInfo, cluster: ClusterView) -> Any:
        mode = self._mode(request)
        if mode == "raise":
            raise RuntimeError("plugin bug")
        if mode == "none":
            return None
        if mode == "exit":  # a plugin calling sys.exit (or argparse failing) at routing time
            raise SystemExit(1)
        if mode == "string":
            return self.good
        if mode == "foreign":
            return Decision("no-such-worker", "made up")
        if mode == "unavailable":  # a real target that does not serve the request's model
            return Decision(self.other, "wrong model")
        return Decision(self.good, "fine")

    def on_routed(self, request: RequestInfo, target: str, now: float) -> None:
        if self._mode(request) == "hook":
            raise RuntimeError("plugin hook bug")

    def on_finished(self, request: RequestInfo, target: str, now: float) -> None:
        if self._mode(request) == "hook":
            raise RuntimeError("plugin hook bug")


class NotAPolicy:
    """A class without decide()."""


def not_a_class() -> None:
    return None


class Redecider(Policy):
    """A prefill/decode policy (it has ``pd``) whose decisions alternate: "prefill here" on
    ``local`` (no pair), then the pair (``prefill``, ``decode``). A gateway that decides a
    second time for one request gets the pair on its ordinary path."""

    name = "redecider"

    def __init__(self, local: str = "d0", prefill: str = "p0", decode: str = "d1") -> None:
        self.pd = True
        self.local, self.prefill, self.decode = local, prefill, decode
        self.calls = 0

    def decide(self, request: RequestInfo, cluster: ClusterView) -> Decision:
        self.calls += 1
        if self.calls % 2:
            return Decision(self.local, "prefill locally")
        return Decision(self.prefill, "pair", decode_target=self.decode)
