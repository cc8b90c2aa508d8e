"""The one check of a plugin's numeric parameters: a finite number in its range, never a bool.

Plugins call ``number`` in their constructors, so a bad value in YAML fails at config load
(``mesh config validate``) with a message naming the plugin and the parameter.
"""

from __future__ import annotations

import math
from typing import Any

from policies.registry import PluginError


def number(owner: str, name: str, value: Any, lo: float, hi: float | None = None, *, above: bool = False) -> float:
    """``value`` as a float, if it is a finite number in ``[lo, hi]`` (``(lo, hi]`` with
    ``above``); else ``PluginError`` naming ``owner`` (e.g. ``policy 'kv_aware'``) and ``name``."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or value < lo or (above and value == lo) or (hi is not None and value > hi):
        low = f"> {lo}" if above else f">= {lo}"
        bound = low if hi is None else f"in {'(' if above else '['}{lo}, {hi}]"
        raise PluginError(f"{owner}: {name} must be a finite number {bound}, got {value!r}")
    return float(value)
