"""Third-party policy plugins run behind a guard: a plugin bug costs a fallback, not the gateway.

``create_policy`` wraps a policy in ``GuardedPolicy`` when its spec names a plugin anywhere
(``module:Class`` or an entry point, as the policy or as a nested filter/scorer/picker/policy);
built-in-only specs are not wrapped (no cost on the default path, and they raise ``NoCandidate``
only when nothing can serve).

Invariants:
- ``decide`` returns the plugin's decision only when it is a ``Decision`` whose ``target`` (and
  ``decode_target``, if set) is one of the view's available candidates for the request, or whose
  ``target`` is None (the plugin's own "no candidate", which the router turns into a 503). A plugin
  that raises (anything but ``NoCandidate``), returns something else, or names a target outside
  the candidates (unknown, excluded after a failure, unhealthy, draining, wrong model) is answered
  by the fallback policy (``least_load``), with the reason in the decision's explanation.
- ``on_routed`` / ``on_finished`` of the plugin never raise out of the guard (a raising hook made
  every request a 500 after it had been routed).
- Every fallback is counted in ``FALLBACKS[reason]`` (process-wide, monotonic; ``mesh.metrics``
  shows it as ``mesh_policy_fallbacks_total{reason}``; reasons are this module's fixed set, never
  plugin text). The guard logs the 1st, 10th, 100th, ... of each reason, never one line a request.
- ``strict`` (``mesh simulate``) raises ``PluginError`` instead of falling back: a simulated
  comparison must not report the fallback's numbers under the plugin's name.
- A slow plugin cannot be cut short here: policies run synchronously on the gateway's loop.

Trust rule for configs (``policies.registry``): a config names code. ``module:Class`` imports that
module (its import-time side effects run, also at ``mesh config validate``), so a config file must
be as trusted as the Python path it runs with; but no class is ever called unless it has its
kind's method (``decide``/``filter``/``score``/``pick``), so a config cannot instantiate an
arbitrary library class (``subprocess:Popen`` with YAML params) as a plugin.
"""

from __future__ import annotations

import logging
from typing import Any

from policies.base import ClusterView, Decision, NoCandidate, Policy, RequestInfo
from policies.registry import PluginError

log = logging.getLogger("mesh.policies.guard")

REASONS = ("raised", "not_a_decision", "bad_target", "hook_raised")
FALLBACKS: dict[str, int] = dict.fromkeys(REASONS, 0)


def _count(reason: str, plugin: str, detail: str) -> None:
    FALLBACKS[reason] += 1
    n = FALLBACKS[reason]
    if n & (n - 1) == 0 or n % 1000 == 0:  # 1, 2, 4, ... then every 1000th: bounded log volume
        log.warning("policy plugin %s: %s (%s; %d so far); a built-in policy answered instead", plugin, reason,
                    detail, n)


class GuardedPolicy(Policy):
    """A plugin policy checked on every decision; ``fallback`` answers when it misbehaves."""

    def __init__(self, plugin: Any, fallback: Policy, *, strict: bool = False) -> None:
        self.plugin = plugin
        self.fallback = fallback
        self.strict = strict  # mesh simulate: a plugin bug is an error (its numbers would be the fallback's)
        self.name = str(getattr(plugin, "name", type(plugin).__name__))
        self.label = f"{type(plugin).__module__}:{type(plugin).__qualname__}"

    def decide(self, request: RequestInfo, cluster: ClusterView) -> Decision:
        try:
            decision = self.plugin.decide(request, cluster)
        except NoCandidate:
            raise
        except (Exception, SystemExit) as exc:  # the plugin's bug, whatever it is (sys.exit: a 500)
            return self._fall_back("raised", f"{type(exc).__name__}: {str(exc)[:200]}", request, cluster)
        if not isinstance(decision, Decision):
            return self._fall_back("not_a_decision", f"returned {type(decision).__name__}", request, cluster)
        if decision.target is None:
            return decision
        ids = {t.id for t in cluster.available(request)}
        for role, tid in (("target", decision.target), ("decode_target", decision.decode_target)):
            if tid is not None and tid not in ids:
                return self._fall_back("bad_target", f"{role} {str(tid)[:100]!r} is not an available candidate",
                                       request, cluster)
        return decision

    def _fall_back(self, reason: str, detail: str, request: RequestInfo, cluster: ClusterView) -> Decision:
        self._check_strict(reason, detail)
        _count(reason, self.label, detail)
        decision = self.fallback.decide(request, cluster)  # NoCandidate here: truly nothing can serve
        decision.reason = f"fallback to {self.fallback.name}: plugin {self.name} {reason} ({detail}); {decision.reason}"
        return decision

    def on_routed(self, request: RequestInfo, target: str, now: float) -> None:
        self._hook("on_routed", request, target, now)

    def on_finished(self, request: RequestInfo, target: str, now: float) -> None:
        self._hook("on_finished", request, target, now)

    def _hook(self, name: str, request: RequestInfo, target: str, now: float) -> None:
        hook = getattr(self.plugin, name, None)
        if hook is None:
            return
        try:
            hook(request, target, now)
        except (Exception, SystemExit) as exc:
            detail = f"{name}: {type(exc).__name__}: {str(exc)[:200]}"
            self._check_strict("hook_raised", detail)
            _count("hook_raised", self.label, detail)

    def _check_strict(self, reason: str, detail: str) -> None:
        if self.strict:
            raise PluginError(f"policy plugin {self.label}: {reason} ({detail})")

    def describe(self) -> dict[str, Any]:
        describe = getattr(self.plugin, "describe", None)
        try:
            out = dict(describe()) if callable(describe) else {"name": self.name}
        except Exception as exc:
            out = {"name": self.name, "describe_error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        return {**out, "guarded": True, "fallback": self.fallback.name}

    def __getattr__(self, name: str) -> Any:
        """Other attributes a caller reads come from the plugin; a wrapper's ``inner`` (which the
        gateway's /debug/route dry-runs) comes guarded too, never bare."""
        plugin = self.__dict__.get("plugin")
        if plugin is None:
            raise AttributeError(name)
        if name == "inner":
            inner = getattr(plugin, "inner", None)
            if inner is None:
                raise AttributeError(name)
            return GuardedPolicy(inner, self.fallback, strict=self.strict)
        return getattr(plugin, name)


# Params whose plain-string value is itself a spec (``picker: "my_mod:MyPicker"``, ``inner: ...``).
_SPEC_KEYS = frozenset({"picker", "inner", "policy"})


def names_a_plugin(spec: Any, builtin: set[str]) -> bool:
    """True when ``spec`` (or any spec nested in its params) names something not built in."""
    if isinstance(spec, str):
        return spec not in builtin
    if isinstance(spec, dict):
        name = spec.get("name")
        if isinstance(name, str) and name not in builtin:
            return True
        # a plugin picker or inner policy named by a plain string escaped the guard (traceback / 500)
        return any(names_a_plugin(v, builtin) for k, v in spec.items()
                   if isinstance(v, dict | list) or (k in _SPEC_KEYS and isinstance(v, str)))
    if isinstance(spec, list):
        return any(names_a_plugin(v, builtin) for v in spec if isinstance(v, dict | str))
    return False
