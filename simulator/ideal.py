"""A trace's ideal hit rate: the reference row of ``mesh simulate``'s table.

An ideal cache of unbounded size reuses, for every request, the leading blocks of its prompt
already seen: ``session`` counts those seen before in the same session (what a perfect session
router on workers that never evict reaches), ``global`` those seen before at all (one infinite
cache shared by everyone). Token-weighted over all prompt tokens, in the simulation's blocks, and
never the whole prompt (an engine computes at least the last token, as the simulated workers and
vLLM do). Requests count in trace order; a request without a session belongs to the group its
dependencies link it to (``session_groups``), alone if none.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from simulator.session_gate import session_groups
from simulator.traces import Trace


@dataclass(frozen=True, slots=True)
class IdealHitRate:
    session: float
    global_: float


def _matched(keys: np.ndarray, seen: set[int]) -> int:
    """Leading keys of ``keys`` in ``seen``: chained keys name their whole prefix, so the matched
    ones are a prefix and a binary search finds its end."""
    lo, hi = 0, int(keys.size)
    while lo < hi:
        mid = (lo + hi) // 2
        if int(keys[mid]) in seen:
            lo = mid + 1
        else:
            hi = mid
    return lo


def ideal_hit_rate(trace: Trace) -> IdealHitRate:
    bs = trace.block_size
    groups = trace.groups if trace.groups is not None else session_groups(trace.requests)
    by_group: dict[object, set[int]] = {}
    seen_all: set[int] = set()
    total = hit_session = hit_global = 0
    for r, g in zip(trace.requests, groups, strict=True):
        cap = max(0, r.prompt_tokens - 1) // bs * bs  # whole blocks, the last token computed
        seen = by_group.setdefault(("s", r.session) if r.session is not None else ("g", g), set())
        hit_session += min(_matched(r.keys, seen) * bs, cap)
        hit_global += min(_matched(r.keys, seen_all) * bs, cap)
        total += r.prompt_tokens
        keys = r.keys.tolist()
        seen.update(keys)
        seen_all.update(keys)
    if not total:
        return IdealHitRate(0.0, 0.0)
    return IdealHitRate(hit_session / total, hit_global / total)
