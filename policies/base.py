"""The decision core's types: what a policy sees and what it returns.

Invariants (DESIGN.md, "One decision core"):
- A policy never does I/O and never reads a clock: time arrives as ``ClusterView.now``.
- A policy reads ``TargetState``s; the gateway registry (live) or the simulator owns and mutates
  them. The same policy object runs in both.
- Randomness comes from ``ClusterView.rng`` (the router's, seeded by ``mesh simulate --seed``), so
  a simulation or a test is reproducible, and deciding changes no state of the policy's: a
  preview (``/debug/route``) decides on a copy of the RNG and leaves nothing behind.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from mesh.core.lookahead import merge_overlaps, prompt_keys  # the decision core's keying (no policy import)


class Role(str, enum.Enum):
    MIXED = "mixed"
    PREFILL = "prefill"
    DECODE = "decode"


class Tier(str, enum.Enum):
    GPU = "GPU"
    CPU = "CPU"


@dataclass(slots=True)
class TargetState:
    """One routable target: a worker, or one data-parallel rank of a worker.

    Owned and mutated by the gateway's registry or by the simulator; policies only read it.
    """

    id: str  # unique: "worker" for rank 0 of a single-rank worker, else "worker@rank"
    worker: str
    dp_rank: int = 0
    url: str = ""
    models: frozenset[str] = frozenset()
    loras: frozenset[str] = frozenset()
    role: Role = Role.MIXED
    block_size: int = 16
    healthy: bool = True
    draining: bool = False
    circuit_open: bool = False
    index_healthy: bool = True  # its KV event stream is live (else prefix scores are not trusted)
    in_flight: int = 0  # requests sent and not yet finished
    routed_blocks: int = 0  # full prompt blocks of the requests ever committed here (the blind-stream check)
    prefill_tokens: int = 0  # prompt tokens of in-flight requests still before their first token
    decode_tokens: int = 0  # context tokens of in-flight requests past their first token (x their ``n``)
    kv_usage: float = 0.0  # 0..1, from the worker's metrics when known
    kv_capacity_blocks: int = 0  # 0 = unknown
    live_sessions: int = 0  # session bindings currently pointing here
    session_blocks: int = 0  # KV footprint of the sessions active here (``mesh.core.retention``), blocks
    max_in_flight: int = 0  # admission ceiling, 0 = none

    @property
    def available(self) -> bool:
        return self.healthy and not self.draining and not self.circuit_open

    @property
    def at_admission_limit(self) -> bool:
        """The admission rule, the one definition every caller uses: a target with a
        ``max_in_flight`` takes no new request while that many are in flight."""
        return 0 < self.max_in_flight <= self.in_flight


def target_id(worker: str, dp_rank: int = 0, dp_size: int = 1) -> str:
    return worker if dp_size <= 1 else f"{worker}@{dp_rank}"


@dataclass(frozen=True, slots=True)
class Overlap:
    """A target's longest cached prefix of a request, in blocks.

    ``gpu_blocks`` leading blocks are on the GPU; the next ``cpu_blocks`` continue the prefix
    from the CPU offload tier.
    """

    gpu_blocks: int = 0
    cpu_blocks: int = 0

    @property
    def blocks(self) -> int:
        return self.gpu_blocks + self.cpu_blocks


NO_OVERLAP = Overlap()


@dataclass(slots=True)
class RequestInfo:
    """What a policy knows of a request (built by the gateway or by the simulator)."""

    model: str
    block_keys: Sequence[int]
    block_size: int
    prompt_tokens: int
    max_tokens: int = 0
    session_id: str | None = None  # already bounded and hashed by the gateway
    # Sequences the request generates (OpenAI's ``n``): they share the prompt's blocks, and each
    # holds up to ``max_tokens`` more and decodes over the whole context in the worker's batch.
    choices: int = 1
    text: str = ""  # rendered prompt, for text-based (approximate) policies
    lora: str | None = None
    request_id: str = ""
    # The text SGLang's router matches on (chat: the messages' contents joined by spaces, no roles
    # or template); None: use ``text``. cache_aware routes on it, as sglang-router does.
    routing_text: str | None = None
    # The prompt's token ids and plain key seed, for targets whose engines hash each block with the
    # tokens after it (``mesh.core.lookahead``); None: no such keys (the simulator).
    tokens: Sequence[int] | np.ndarray | None = None
    key_seed: int = 0

    @property
    def footprint_blocks(self) -> int:
        """The KV blocks the request leaves on its worker: its prompt and every choice's output."""
        tokens = self.prompt_tokens + self.max_tokens * self.choices
        return -(-tokens // max(1, self.block_size))


class PrefixIndexView(Protocol):
    def match(self, keys: Sequence[int]) -> Mapping[str, Overlap]:
        """Per target, its longest cached prefix of ``keys``; targets with none may be absent."""
        ...


class SessionView(Protocol):
    def bound_target(self, session_id: str, now: float) -> str | None:
        """The target a live (not idle-expired) session is bound to, if any."""
        ...


@dataclass(slots=True)
class ClusterView:
    """A read-only view of the cluster handed to a policy for one decision."""

    targets: Sequence[TargetState]
    now: float
    index: PrefixIndexView | None = None
    sessions: SessionView | None = None
    # True for /debug/route and tests: policies list every candidate's terms in the Decision.
    # False on the request path (Router.route): only the pick's terms are needed, so policies may
    # skip building per-candidate explanations (the decision itself must not change).
    explain: bool = True
    # Every random choice of this decision draws from it (the router's own; a copy for a preview).
    rng: random.Random = field(default_factory=random.Random)
    _overlaps: Mapping[str, Overlap] | None = None
    _overlaps_for: Sequence[int] | None = None

    def overlaps(self, request: RequestInfo) -> Mapping[str, Overlap]:
        """Prefix overlaps of ``request`` per target, computed once per decision."""
        if self._overlaps is None or self._overlaps_for is not request.block_keys:
            self._overlaps = self.index.match(request.block_keys) if self.index else {}
            lookaheads: Mapping[str, int] | None = getattr(self.index, "lookaheads", None)
            if lookaheads and request.tokens is not None:  # only while some target hashes with lookahead
                self._overlaps = _with_lookahead(self.index, request, request.tokens, self._overlaps, lookaheads)
            self._overlaps_for = request.block_keys
        return self._overlaps

    def available(self, request: RequestInfo | None = None) -> list[TargetState]:
        """Targets that are healthy, not draining, circuit closed, and serve the model."""
        out = [t for t in self.targets if t.available]
        if request is not None:
            out = [t for t in out if not t.models or request.model in t.models]
        return out


def _with_lookahead(index: Any, request: RequestInfo, tokens: Sequence[int] | np.ndarray,
                    plain: Mapping[str, Overlap], lookaheads: Mapping[str, int]) -> Mapping[str, Overlap]:
    """``plain`` with each lookahead target's overlap replaced by the match of the prompt's
    lookahead keys (a block counts only when the tokens after it match too)."""
    ahead = {la: index.match(prompt_keys(tokens, request.block_size, request.key_seed, la))
             for la in set(lookaheads.values())}
    return merge_overlaps(plain, ahead, lookaheads)


@dataclass(slots=True)
class Decision:
    """A routing decision with its explanation (shown by ``POST /debug/route``)."""

    target: str | None
    reason: str
    scores: dict[str, dict[str, float]] = field(default_factory=dict)  # target -> term -> value
    overlaps: dict[str, Overlap] = field(default_factory=dict)
    decode_target: str | None = None  # set for a prefill -> decode pair

    def served_whole(self) -> Decision:
        """The decision a path without a relay serves (the gateway's ordinary proxy, the
        simulator's mixed path): a pair reaching it is served whole by its decode worker; a
        prefill worker never runs a request's decode."""
        if self.decode_target is None:
            return self
        return replace(self, target=self.decode_target, decode_target=None,
                       reason=f"{self.reason} (served whole by its decode worker)")

    def explain(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "decode_target": self.decode_target,
            "reason": self.reason,
            "candidates": {
                tid: {
                    "scores": self.scores.get(tid, {}),
                    "overlap": {
                        "gpu_blocks": self.overlaps.get(tid, NO_OVERLAP).gpu_blocks,
                        "cpu_blocks": self.overlaps.get(tid, NO_OVERLAP).cpu_blocks,
                    },
                }
                for tid in sorted(set(self.scores) | set(self.overlaps))
            },
        }


class Policy:
    """Base of whole policies. Subclasses set ``name`` and implement ``decide``.

    ``on_routed`` and ``on_finished`` let a stateful policy (round robin's cursor, SGLang's
    text tree) learn from what really happened; ``decide`` changes no state (a dry run,
    ``/debug/route``, calls it too) and draws randomness only from ``cluster.rng``.
    """

    name: str = "policy"

    def decide(self, request: RequestInfo, cluster: ClusterView) -> Decision:
        raise NotImplementedError

    def on_routed(self, request: RequestInfo, target: str, now: float) -> None:
        return None

    def on_finished(self, request: RequestInfo, target: str, now: float) -> None:
        return None

    def describe(self) -> dict[str, Any]:
        return {"name": self.name}


class NoCandidate(Exception):
    """No target can take the request (none healthy, none serves the model, all over limits)."""
