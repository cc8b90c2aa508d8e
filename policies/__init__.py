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


def create_policy(spec, **context):  # type: ignore[no-untyped-def]
    """Build a routing policy from its YAML spec (see ``policies.registry``)."""
    return create("policy", spec, **context)
