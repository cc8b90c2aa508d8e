"""Copy counts per (target, tier, engine hash): the blocks an engine holds more than once.

vLLM does not deduplicate GPU blocks (a block-aligned prompt served again recomputes its last
block into a new block with the same hash), and its offloading connector's overlapping chunks
list a block twice on the CPU tier; each copy is stored and removed by its own event. So a store
on a tier of a hash that the target holds there for the same key is one more copy; a removal
without counts takes one copy away, and the block leaves the tier only with the last. A store
from the root of a chain (no parent) of held blocks is a report, not a copy: vLLM's
``kv_cache_report_mode: "full"`` announces every prefix hit again that way, with no removal to
follow (counted, the index kept claiming evicted prefixes). vLLM's own copies are stored below a
parent (the recomputed last block of a hit), except a one-block prompt or a request that skips
the cache read: those copies go uncounted, so the index forgets such a block one removal early
(a miss, never a stale claim). A removal's ``remaining`` counts (vLLM's
``remaining_copy_counts``) are the engine's word: 0 removes, n > 0 keeps n copies. Engines that deduplicate never store a held hash twice and never
reach this table. Invariants: only hashes held 2+ times on a tier are here (the count is the
copies beyond the first); every hash here is in the target's engine map; empty dicts are dropped
at once. Ownership: one ``CopyCounts`` per ``PrefixIndex``, written only through its methods.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from policies.base import Tier


class CopyCounts:
    """target -> tier -> engine hash -> copies beyond the first."""

    __slots__ = ("_per",)

    def __init__(self) -> None:
        self._per: dict[str, dict[Tier, dict[int, int]]] = {}

    def __contains__(self, target: object) -> bool:
        return target in self._per

    def drop_target(self, target: str) -> None:
        self._per.pop(target, None)

    def copies(self, target: str, tier: Tier) -> dict[int, int]:
        """``target``'s hashes held in 2+ copies on ``tier`` -> their copies (a fresh dict)."""
        return {h: c + 1 for h, c in self._per.get(target, {}).get(tier, {}).items()}

    def total(self) -> int:
        """Copies beyond the first, over every target and tier."""
        return sum(sum(d.values()) for per in self._per.values() for d in per.values())

    def tier(self, target: str, tier: Tier) -> dict[int, int]:
        """``target``'s counts on ``tier``, created empty (``prune`` drops it again)."""
        per = self._per.get(target)
        if per is None:
            per = self._per[target] = {}
        extra = per.get(tier)
        if extra is None:
            extra = per[tier] = {}
        return extra

    def prune(self, target: str, emap: dict[int, int] | None = None, hashes: Sequence[int] = ()) -> None:
        """Drop ``target``'s empty count dicts, and first the counts of ``hashes`` that left
        ``emap`` (a hash no tier holds has no copy on any)."""
        per = self._per.get(target)
        if per is None:
            return
        for tier, extra in list(per.items()):
            if emap is not None and extra and not extra.keys().isdisjoint(hashes):
                for h in hashes:
                    if h in extra and h not in emap:
                        del extra[h]
            if not extra:
                del per[tier]
        if not per:
            del self._per[target]

    def count_store(
        self, target: str, bit: int, emap: dict[int, int], engine_hashes: Sequence[int], keys: Sequence[int],
        tier: Tier, ids: Mapping[int, int], held: list[int], *, report: bool = False,
    ) -> None:
        """Before a store on ``tier`` is written: each of its hashes already mapped to the same key
        (renamed hashes forgotten first) is one more copy when the target (``bit``) holds that
        key's node on ``tier`` (``held``: the tier's holder masks, by nid), else (held on the
        other tier only, or its node evicted by the budget) the first again. ``report``: the
        store is from a chain's root, a held block keeps its count (see the module's doc)."""
        extra = self.tier(target, tier)
        for h, key in zip(engine_hashes, keys):
            if emap.get(h) != key:
                continue  # new to the target (or renamed: forgotten with every copy)
            n = ids.get(key)
            if n is not None and held[n] & bit:
                if not report:
                    extra[h] = extra.get(h, 0) + 1
            else:
                extra.pop(h, None)
        self.prune(target)

    def take(
        self, target: str, emap: dict[int, int], engine_hashes: Sequence[int], tier: Tier | None,
        remaining: Sequence[int] | None,
    ) -> tuple[Sequence[int], int]:
        """The copy accounting of a removal, before any block goes: returns the hashes whose
        block leaves ``tier`` (in order) and how many entries only took copies away (known hashes
        kept). Entries apply in order; a kept entry after one that removed the same hash is
        ignored (the engine cannot still hold a block it removed in the same event)."""
        if remaining is not None and len(remaining) != len(engine_hashes):
            raise ValueError(f"BlockRemoved has {len(engine_hashes)} hashes but {len(remaining)} copy counts")
        per = self._per.get(target)
        if tier is None:  # every tier, every copy
            if per:
                for extra in per.values():
                    for h in engine_hashes:
                        extra.pop(h, None)
                self.prune(target)
            return engine_hashes, 0
        extra = per.get(tier, {}) if per else {}
        counted = remaining is not None and any(remaining)
        if not counted and (not extra or extra.keys().isdisjoint(engine_hashes)):
            return engine_hashes, 0  # no copy of these on this tier (the usual case)
        if remaining is None:
            out, kept = _take_one_each(extra, engine_hashes)
        else:
            out, kept = _take_counted(self.tier(target, tier), emap, engine_hashes, remaining)
        self.prune(target)
        return out, kept


def _take_one_each(extra: dict[int, int], engine_hashes: Sequence[int]) -> tuple[list[int], int]:
    """A removal without counts takes one copy of each hash: returns the hashes that had none
    left to give (their block leaves the tier) and how many only lost a copy."""
    out: list[int] = []
    kept = 0
    for h in engine_hashes:
        c = extra.get(h)
        if c is None:
            out.append(h)
            continue
        kept += 1
        if c > 1:
            extra[h] = c - 1
        else:
            del extra[h]
    return out, kept


def _take_counted(
    extra: dict[int, int], emap: dict[int, int], engine_hashes: Sequence[int], remaining: Sequence[int]
) -> tuple[list[int], int]:
    """A removal with the engine's counts (authoritative): 0 removes, n > 0 keeps n copies."""
    out: list[int] = []
    kept = 0
    gone: set[int] = set()
    for h, r in zip(engine_hashes, remaining):
        if not r:
            gone.add(h)
            out.append(h)
            extra.pop(h, None)
        elif h not in gone and h in emap:
            kept += 1
            if r > 1:
                extra[h] = r - 1
            else:
                extra.pop(h, None)
    return out, kept
