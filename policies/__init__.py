"""Routing policies: plugin interfaces and built-ins. Nothing in this package does I/O."""

from policies.base import (
    ClusterView,
    Decision,
    NoCandidate,
    Overlap,
    Policy,
    RequestInfo,
    Role,
    TargetState,
    Tier,
)
from policies.registry import PluginError, create, register

__all__ = [
    "ClusterView",
    "Decision",
    "NoCandidate",
    "Overlap",
    "PluginError",
    "Policy",
    "RequestInfo",
    "Role",
    "TargetState",
    "Tier",
    "create",
    "register",
]


def create_policy(spec, *, strict=False, **context):  # type: ignore[no-untyped-def]
    """Build a routing policy from its YAML spec (see ``policies.registry``); a spec that names a
    plugin anywhere is wrapped in ``policies.guard.GuardedPolicy`` (falls back on a plugin's bug;
    ``strict``: raises ``PluginError`` instead)."""
    from policies.guard import GuardedPolicy, names_a_plugin
    from policies.registry import KINDS, names

    policy = create("policy", spec, **context)
    builtin = {name for kind in KINDS for name in names(kind)}
    if not names_a_plugin(spec, builtin):
        return policy
    return GuardedPolicy(policy, create("policy", "least_load", **context), strict=strict)
