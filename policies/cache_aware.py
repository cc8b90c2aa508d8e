"""Policy ``cache_aware``: SGLang router's approximate text tree, for comparison and for workers
that publish no KV events.

The rule (sgl-model-gateway ``cache_aware``, REFERENCE.md section 3), with SGLang's defaults:
- load = the router's own in-flight requests per target;
- if ``max_load - min_load > balance_abs_threshold`` (64) and ``max_load > balance_rel_threshold
  (1.5) * min_load``: the least loaded target;
- else if the longest prefix of the request text in the tree, over the text length, exceeds
  ``cache_threshold`` (0.3): a target holding that prefix;
- else the least loaded target.

The tree is one multi-tenant radix tree of raw text characters per model, learned only from this
router's own decisions (``on_routed`` inserts the request text for the chosen target), never from
the engines: it can claim prefixes the engine already evicted, which is the point of comparing it
with ``kv_aware``. Every ``eviction_interval_s`` (120 s) each target's share is trimmed to
``max_tree_chars`` (2**26) by dropping its least recently used leaves.

Fixed here: SGLang breaks ties by taking the first worker; every tie below is broken at random.
"""

from __future__ import annotations

import heapq
import math
import random
from typing import Any

from policies.base import ClusterView, Decision, NoCandidate, Policy, RequestInfo
from policies.registry import register


class _Node:
    __slots__ = ("text", "parent", "children", "tenants")

    def __init__(self, text: str, parent: _Node | None) -> None:
        self.text = text  # the edge label from the parent
        self.parent = parent
        self.children: dict[str, _Node] = {}  # first character -> child
        self.tenants: dict[str, float] = {}  # tenant -> last access time


def _common(a: str, b: str, start: int) -> int:
    """Length of the common prefix of ``a`` and ``b[start:]`` (slice compares run in C)."""
    n = min(len(a), len(b) - start)
    if a[:n] == b[start : start + n]:
        return n
    lo, hi = 0, n  # a[:lo] matches, a[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[start : start + mid]:
            lo = mid
        else:
            hi = mid
    return lo


class TextTree:
    """A multi-tenant radix tree over characters. Invariant: a tenant on a node is on every
    ancestor of it; ``size[t]`` is the number of characters on the nodes holding ``t``."""

    def __init__(self) -> None:
        self.root = _Node("", None)
        self.size: dict[str, int] = {}

    def insert(self, text: str, tenant: str, now: float) -> None:
        node = self.root
        node.tenants[tenant] = now
        self.size.setdefault(tenant, 0)
        i = 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                leaf = _Node(text[i:], node)
                leaf.tenants[tenant] = now
                node.children[text[i]] = leaf
                self.size[tenant] += len(text) - i
                return
            n = _common(child.text, text, i)
            if n < len(child.text):
                child = self._split(child, n)
            if tenant not in child.tenants:
                self.size[tenant] += len(child.text)
            child.tenants[tenant] = now
            node = child
            i += n

    def _split(self, child: _Node, n: int) -> _Node:
        parent = child.parent
        assert parent is not None  # the root is never split  # noqa: S101
        mid = _Node(child.text[:n], parent)
        mid.tenants = dict(child.tenants)
        parent.children[child.text[0]] = mid
        child.text = child.text[n:]
        child.parent = mid
        mid.children[child.text[0]] = child
        return mid

    def match(self, text: str) -> tuple[int, dict[str, float]]:
        """``(matched characters, tenants holding them)`` of the longest prefix of ``text``."""
        node = self.root
        i = 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                break
            n = _common(child.text, text, i)
            i += n
            node = child
            if n < len(child.text):
                break
        return i, node.tenants

    def evict(self, max_chars: int) -> None:
        """Trim every tenant to ``max_chars``, least recently used leaves first."""
        for tenant, size in list(self.size.items()):
            if size > max_chars:
                self._evict_tenant(tenant, max_chars)

    def _evict_tenant(self, tenant: str, max_chars: int) -> None:
        heap: list[tuple[float, int, _Node]] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            kids = [c for c in node.children.values() if tenant in c.tenants]
            if kids:
                stack.extend(kids)
            elif node is not self.root:
                heap.append((node.tenants[tenant], id(node), node))
        heapq.heapify(heap)
        while self.size[tenant] > max_chars and heap:
            _, _, node = heapq.heappop(heap)
            del node.tenants[tenant]
            self.size[tenant] -= len(node.text)
            parent = node.parent
            assert parent is not None  # noqa: S101
            if not node.tenants and not node.children:
                del parent.children[node.text[0]]
            if parent is not self.root and not any(tenant in c.tenants for c in parent.children.values()):
                heapq.heappush(heap, (parent.tenants[tenant], id(parent), parent))


@register("policy", "cache_aware")
class CacheAware(Policy):
    """Params (SGLang's CLI defaults): ``cache_threshold`` 0.3, ``balance_abs_threshold`` 64,
    ``balance_rel_threshold`` 1.5, ``eviction_interval_s`` 120, ``max_tree_chars`` 2**26, ``seed``."""

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        eviction_interval_s: float = 120.0,
        max_tree_chars: int = 1 << 26,
        seed: int | None = None,
    ) -> None:
        for name, value in (("cache_threshold", cache_threshold), ("balance_abs_threshold", balance_abs_threshold),
                            ("balance_rel_threshold", balance_rel_threshold),
                            ("eviction_interval_s", eviction_interval_s), ("max_tree_chars", max_tree_chars)):
            # NaN passed every comparison below (never balance, never evict: the trees grew for
            # good), and an infinite max_tree_chars raised OverflowError, not a parameter error
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        if balance_abs_threshold < 0 or balance_rel_threshold < 1.0:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1")
        if eviction_interval_s <= 0 or max_tree_chars <= 0:
            raise ValueError("eviction_interval_s and max_tree_chars must be positive")
        self.cache_threshold = float(cache_threshold)
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = float(balance_rel_threshold)
        self.eviction_interval_s = float(eviction_interval_s)
        self.max_tree_chars = int(max_tree_chars)
        self._rng = random.Random(seed)
        self._trees: dict[str, TextTree] = {}  # model -> tree
        self._next_eviction: float | None = None

    def decide(self, request: RequestInfo, cluster: ClusterView) -> Decision:
        found = cluster.available(request)
        if not found:
            raise NoCandidate(f"no healthy worker serves model {request.model!r}")
        loads = {t.id: t.in_flight for t in found}
        lo, hi = min(loads.values()), max(loads.values())
        scores: dict[str, dict[str, float]] = {tid: {"load": float(v)} for tid, v in loads.items()}
        if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:
            return Decision(self._least_loaded(loads), f"cache_aware: load imbalanced ({lo}..{hi}), least loaded",
                            scores)
        text = request.text
        tree = self._trees.get(request.model)
        matched, tenants = tree.match(text) if tree is not None and text else (0, {})
        rate = matched / len(text) if text else 0.0
        holders = [tid for tid in loads if tid in tenants]
        for tid in holders:
            scores[tid]["match_rate"] = rate
        if rate > self.cache_threshold and holders:
            pick = self._rng.choice(holders)
            return Decision(pick, f"cache_aware: text prefix match {matched}/{len(text)} chars ({rate:.2f})", scores)
        return Decision(self._least_loaded(loads), f"cache_aware: match rate {rate:.2f} <= "
                        f"{self.cache_threshold}, least loaded", scores)

    def _least_loaded(self, loads: dict[str, int]) -> str:
        lo = min(loads.values())
        return self._rng.choice([tid for tid, v in loads.items() if v == lo])

    def on_routed(self, request: RequestInfo, target: str, now: float) -> None:
        tree = self._trees.get(request.model)
        if tree is None:
            tree = self._trees[request.model] = TextTree()
        tree.insert(request.text, target, now)
        if self._next_eviction is None:
            self._next_eviction = now + self.eviction_interval_s
        elif now >= self._next_eviction:
            self._next_eviction = now + self.eviction_interval_s
            for t in self._trees.values():
                t.evict(self.max_tree_chars)

    def tree(self, model: str) -> TextTree | None:
        return self._trees.get(model)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "cache_threshold": self.cache_threshold,
            "balance_abs_threshold": self.balance_abs_threshold,
            "balance_rel_threshold": self.balance_rel_threshold,
            "eviction_interval_s": self.eviction_interval_s,
            "max_tree_chars": self.max_tree_chars,
        }

