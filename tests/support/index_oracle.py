"""A brute-force oracle of ``PrefixIndex.match`` for the index's tests: the overlap of each target
walked key by key from what the index itself says it holds."""

from __future__ import annotations

from mesh.core.index import PrefixIndex
from policies.base import Overlap, Tier


def consistent_with_holdings(
    index: PrefixIndex, keys: list[int], targets: list[str]
) -> dict[str, Overlap]:
    """The match a brute force would give from the index's own ``holds``."""
    out = {}
    for t in targets:
        total = gpu = 0
        for k in keys:
            tier = index.holds(t, k)
            if tier is None:
                break
            if gpu == total and tier is Tier.GPU:
                gpu += 1
            total += 1
        if total:
            out[t] = Overlap(gpu, total - gpu)
    return out
