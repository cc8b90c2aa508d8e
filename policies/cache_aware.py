"""Policy ``cache_aware``: SGLang router's approximate text tree, for comparison and for workers
that publish no KV events.

The rule, decision for decision that of sgl-model-gateway 0.3.2 (PyPI ``sglang-router``; upstream
``src/policies/cache_aware.rs`` ``select_worker`` and ``src/policies/tree.rs``
``prefix_match_with_counts``; checked against the real router by ``bench/cache_aware_parity.py``
and ``tests/e2e/routing/test_cache_aware_parity.py``), with SGLang's defaults:
- load = the router's own in-flight requests per target;
- if ``max_load - min_load > balance_abs_threshold`` (64) and ``max_load > balance_rel_threshold
  (1.5) * min_load`` (f32): the first least-loaded target, in target (config) order;
- else if the longest prefix of the request text in the tree, in characters over the text's
  characters, is above ``cache_threshold`` (0.3; both f32, as upstream): the tenant of the node
  where the match ends, i.e. the target whose request *created* that node (a split node keeps its
  creator; tenants that only pass through never replace it); if that target is not available, the
  first available target (upstream's ``healthy_indices.first()``);
- else the first least-loaded target.

With ``tie_break: random`` every tie above (least loaded, several holders) is drawn at random from
the seeded RNG instead: spreads sequential traffic, which SGLang piles onto its first worker.

The tree is one multi-tenant radix tree of raw text characters per model, learned only from this
router's own decisions (``on_routed`` inserts the request text for the chosen target), never from
the engines: it can claim prefixes the engine already evicted, which is the point of comparing it
with ``kv_aware``. Every ``eviction_interval_s`` (120 s, the Rust config default; the 0.3.2
launcher's CLI passes 60) each target's share is trimmed to ``max_tree_chars`` (2**26) by dropping
its least recently used leaves (approximately as upstream, whose access times are sampled).
"""

from __future__ import annotations

import heapq
import random
import struct
from typing import Any, Literal

from policies.base import ClusterView, Decision, NoCandidate, Policy, RequestInfo
from policies.params import number
from policies.registry import register

TieBreak = Literal["first", "random"]


def _f32(x: float) -> float:
    """``x`` rounded to the nearest f32, as a Python float."""
    return float(struct.unpack("f", struct.pack("f", x))[0])


def _f32_rate(matched: int, total: int) -> float:
    """Upstream's ``matched as f32 / total as f32``. Dividing the two f32 values in f64 and rounding
    once to f32 is exact: f64 has more than 2 * 24 + 2 bits, so the double rounding is innocuous."""
    return _f32(_f32(matched) / _f32(total))


class _Node:
    __slots__ = ("text", "parent", "children", "tenants", "creator")

    def __init__(self, text: str, parent: _Node | None, creator: str | None = None) -> None:
        self.text = text  # the edge label from the parent
        self.parent = parent
        self.children: dict[str, _Node] = {}  # first character -> child
        self.tenants: dict[str, float] = {}  # tenant -> last access time
        # upstream's ``last_tenant``: the tenant whose insert created this node (a split node
        # inherits it); the tenant a match ending here routes to while it still holds the node
        self.creator = creator


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
                leaf = _Node(text[i:], node, tenant)
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
        mid = _Node(child.text[:n], parent, child.creator)
        mid.tenants = dict(child.tenants)
        parent.children[child.text[0]] = mid
        child.text = child.text[n:]
        child.parent = mid
        mid.children[child.text[0]] = child
        return mid

    def match(self, text: str) -> tuple[int, dict[str, float]]:
        """``(matched characters, tenants holding them)`` of the longest prefix of ``text``."""
        matched, node = self._walk(text)
        return matched, node.tenants

    def match_tenant(self, text: str) -> tuple[int, str | None]:
        """``(matched characters, the tenant upstream routes to)``: the creator of the node where
        the match ends while it still holds that node, else its earliest remaining tenant (upstream
        then takes the first of a hash map's iteration, which is arbitrary; nothing is cached here,
        a lookup must not change the tree)."""
        matched, node = self._walk(text)
        if node.creator is not None and node.creator in node.tenants:
            return matched, node.creator
        return matched, next(iter(node.tenants), None)

    def _walk(self, text: str) -> tuple[int, _Node]:
        """The longest prefix of ``text`` in the tree: its length and the node it ends in (the node
        of a partial edge match counts, as upstream's)."""
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
        return i, node

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
    """Params (SGLang's defaults): ``cache_threshold`` 0.3, ``balance_abs_threshold`` 64,
    ``balance_rel_threshold`` 1.5, ``eviction_interval_s`` 120, ``max_tree_chars`` 2**26;
    ``tie_break`` ``first`` (SGLang's) or ``random`` (drawn from ``cluster.rng``)."""

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        eviction_interval_s: float = 120.0,
        max_tree_chars: int = 1 << 26,
        tie_break: TieBreak = "first",
    ) -> None:
        # finite: NaN passes every comparison (never balance, never evict) and an infinite
        # max_tree_chars overflows
        owner = "policy 'cache_aware'"
        number(owner, "cache_threshold", cache_threshold, 0.0, 1.0)
        number(owner, "balance_abs_threshold", balance_abs_threshold, 0.0)
        number(owner, "balance_rel_threshold", balance_rel_threshold, 1.0)
        number(owner, "eviction_interval_s", eviction_interval_s, 0.0, above=True)
        number(owner, "max_tree_chars", max_tree_chars, 0.0, above=True)
        if tie_break not in ("first", "random"):
            raise ValueError(f"tie_break must be 'first' (SGLang's) or 'random', got {tie_break!r}")
        self.cache_threshold = float(cache_threshold)
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = float(balance_rel_threshold)
        self.eviction_interval_s = float(eviction_interval_s)
        self.max_tree_chars = int(max_tree_chars)
        self.tie_break: TieBreak = tie_break
        # upstream compares in f32: f32(0.3) is a hair above 0.3, so an f64 rate of exactly
        # 3/10 and rates just above it do not pass
        self._threshold32 = _f32(self.cache_threshold)
        self._rel32 = _f32(self.balance_rel_threshold)
        self._trees: dict[str, TextTree] = {}  # model -> tree
        self._next_eviction: float | None = None

    def decide(self, request: RequestInfo, cluster: ClusterView) -> Decision:
        found = cluster.available(request)
        if not found:
            raise NoCandidate(f"no healthy worker serves model {request.model!r}")
        loads = {t.id: t.in_flight for t in found}  # in target order: "first" means first here
        lo, hi = min(loads.values()), max(loads.values())
        scores: dict[str, dict[str, float]] = {tid: {"load": float(v)} for tid, v in loads.items()}
        if hi - lo > self.balance_abs_threshold and _f32(hi) > _f32(_f32(lo) * self._rel32):
            return Decision(self._least_loaded(loads, cluster.rng), f"cache_aware: load imbalanced ({lo}..{hi}), least loaded",
                            scores)
        text = request.routing_text if request.routing_text is not None else request.text
        tree = self._trees.get(request.model)
        matched, tenant = self._match(tree, text, loads, cluster.rng) if tree is not None and text else (0, None)
        rate = _f32_rate(matched, len(text)) if text else 0.0
        for tid in self._holders(tree, text, loads) if cluster.explain and tree is not None and text else ():
            scores[tid]["match_rate"] = rate
        if tenant in scores:  # the request path (explain off) still shows the pick's rate
            scores[tenant]["match_rate"] = rate
        if rate > self._threshold32 and tenant is not None:
            why = f"cache_aware: text prefix match {matched}/{len(text)} chars ({rate:.2f})"
            if tenant in loads:
                return Decision(tenant, why, scores)
            # upstream: the matched worker is gone or unhealthy -> the first healthy worker
            return Decision(next(iter(loads)), f"{why}, holder {tenant} unavailable: first available", scores)
        return Decision(self._least_loaded(loads, cluster.rng), f"cache_aware: match rate {rate:.2f} <= "
                        f"{self.cache_threshold}, least loaded", scores)

    def _match(self, tree: TextTree, text: str, loads: dict[str, int], rng: random.Random) -> tuple[int, str | None]:
        if self.tie_break == "first":
            return tree.match_tenant(text)
        matched, tenants = tree.match(text)  # random: any available holder of the prefix
        holders = [tid for tid in loads if tid in tenants]
        return matched, (rng.choice(holders) if holders else None)

    @staticmethod
    def _holders(tree: TextTree, text: str, loads: dict[str, int]) -> list[str]:
        """Available targets holding the matched prefix (for the explanation only)."""
        _, tenants = tree.match(text)
        return [tid for tid in loads if tid in tenants]

    def _least_loaded(self, loads: dict[str, int], rng: random.Random) -> str:
        lo = min(loads.values())
        if self.tie_break == "first":
            return next(tid for tid, v in loads.items() if v == lo)  # Rust's min_by_key: the first
        return rng.choice([tid for tid, v in loads.items() if v == lo])

    def on_routed(self, request: RequestInfo, target: str, now: float) -> None:
        tree = self._trees.get(request.model)
        if tree is None:
            tree = self._trees[request.model] = TextTree()
        tree.insert(request.routing_text if request.routing_text is not None else request.text, target, now)
        if self._next_eviction is None:
            self._next_eviction = now + self.eviction_interval_s
        elif now >= self._next_eviction:
            self._next_eviction = now + self.eviction_interval_s
            for t in self._trees.values():
                t.evict(self.max_tree_chars)

    def tree(self, model: str) -> TextTree | None:
        return self._trees.get(model)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "cache_threshold": self.cache_threshold,
            "balance_abs_threshold": self.balance_abs_threshold,
            "balance_rel_threshold": self.balance_rel_threshold,
            "eviction_interval_s": self.eviction_interval_s,
            "max_tree_chars": self.max_tree_chars,
        }
        if self.tie_break != "first":  # listed when it departs from SGLang's rule
            out["tie_break"] = self.tie_break
        return out
