"""One request's tokens and its place in the paged KV cache.

Index ranges (vLLM v1 vocabulary):
- ``token_ids[:num_prompt_tokens]`` is the prompt, the rest was generated.
- ``token_ids[:num_computed_tokens]`` have their K/V in the cache (prefix hits included). A
  running sequence always has at least one token to compute: the last token, whose K/V is written
  by the step that samples the next one.
- ``block_table[i]`` holds tokens ``[i * block_size, (i + 1) * block_size)``.
- ``block_hashes[i]`` is the chained key (``mesh.core.keys``) of full block ``i``; computed lazily.
- ``num_committed_blocks``: blocks ``[0, n)`` went through the cache's commit (registered or
  found already registered); the block manager owns this counter.
"""

from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass
from itertools import count

from mesh.core.keys import block_keys


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class InvalidSamplingParams(ValueError):
    """A sampling parameter the engine cannot take; ``param`` names it (the API's error field)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _number(name: str, value: object) -> None:
    """A real, finite number: every comparison with NaN is false, so a NaN passed each range check
    below and reached the sampler (logits / NaN), and an infinite temperature flattened it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidSamplingParams(name, f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise InvalidSamplingParams(name, f"{name} must be a finite number, got {value}")


def _integer(name: str, value: object, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidSamplingParams(name, f"{name} must be an integer, got {type(value).__name__}")


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. The constructor refuses what is no number of the right kind (NaN,
    +-inf, a bool, a string): such a value would break the engine loop for every request.
    Ranges (a negative temperature, top_p outside (0, 1], max_tokens < 1) are checked by
    ``validate``, at admission, with the request's context."""

    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    max_tokens: int = 16
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _number("temperature", self.temperature)
        _number("top_p", self.top_p)
        _integer("top_k", self.top_k)
        _integer("max_tokens", self.max_tokens)
        _integer("seed", self.seed, optional=True)
        ids = self.stop_token_ids
        if not isinstance(ids, (tuple, list)) or not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids):
            raise InvalidSamplingParams("stop_token_ids", "stop_token_ids must be integers")
        if not isinstance(ids, tuple):  # hashable and immutable, as the dataclass is
            object.__setattr__(self, "stop_token_ids", tuple(ids))

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def validate(self) -> None:
        if self.temperature < 0:
            raise InvalidSamplingParams("temperature", f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidSamplingParams("top_p", f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise InvalidSamplingParams("top_k", f"top_k must be -1, 0 or positive, got {self.top_k}")
        if self.max_tokens < 1:
            raise InvalidSamplingParams("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")


_ids = count()


class Sequence:
    __slots__ = (
        "seq_id", "request_id", "token_ids", "num_prompt_tokens", "num_computed_tokens",
        "num_cached_tokens", "block_table", "block_hashes", "num_committed_blocks", "status",
        "params", "key_seed", "cache_salt", "block_size", "finish_reason", "admissions", "generator",
        "evict_first", "state_slot", "state_boundary",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        block_size: int,
        key_seed: int,
        cache_salt: str | None = None,
        *,
        evict_first: bool = False,
    ) -> None:
        self.seq_id = next(_ids)
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []
        self.num_committed_blocks = 0
        self.status = SequenceStatus.WAITING
        self.params = params
        self.key_seed = key_seed  # namespace seed of this request's key chain
        self.cache_salt = cache_salt  # announced with the chain's first block (KV events' extra_keys)
        self.block_size = block_size
        self.finish_reason: str | None = None
        self.admissions = 0  # > 1 after a preemption
        self.generator: object | None = None  # the sampler's per-request RNG (seeded requests)
        self.evict_first = evict_first  # retention hint: its blocks go to the eviction front when freed
        self.state_slot: int | None = None  # hybrid models: the running recurrent-state slot
        self.state_boundary = 0  # the block-aligned position whose state the boundary buffer holds

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_blocks(self) -> int:
        return -(-len(self.token_ids) // self.block_size)

    @property
    def num_full_blocks(self) -> int:
        return len(self.token_ids) // self.block_size

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def block_tokens(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size : (i + 1) * self.block_size]

    def keys_upto(self, n_blocks: int) -> list[int]:
        """Keys of full blocks ``[0, n_blocks)``, extending the cached chain as needed."""
        n_blocks = min(n_blocks, self.num_full_blocks)
        have = len(self.block_hashes)
        if n_blocks > have:
            parent = self.block_hashes[-1] if have else None
            # Only the new blocks are hashed: the chain continues from the last known key.
            self.block_hashes += block_keys(
                self.token_ids[have * self.block_size : n_blocks * self.block_size],
                self.block_size, self.key_seed, parent=parent,
            )
        return self.block_hashes[:n_blocks]
