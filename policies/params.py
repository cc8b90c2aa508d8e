"""The one check of a policy's numeric parameters: a finite number in its range, never a bool.

Policies call ``number`` in their constructors, so a bad value in YAML fails at config load
(``mesh config validate``) with a message naming the policy and the parameter.
"""

from __future__ import annotations

import math
from typing import Any

from policies.registry import PluginError


def number(policy: str, name: str, value: Any, lo: float, hi: float | None = None) -> float:
    """``value`` as a float, if it is a finite number in ``[lo, hi]``; else ``PluginError``."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise PluginError(f"policy {policy!r}: {name} must be a finite number {bound}, got {value!r}")
    return float(value)
