"""One request's tokens and its place in the paged KV cache.

Index ranges (vLLM v1 vocabulary):
- ``token_ids[:num_prompt_tokens]`` is the prompt, the rest was generated.
- ``token_ids[:num_computed_tokens]`` have their K/V in the cache (prefix hits included). A
  running sequence always has at least one token to compute: the last token, whose K/V is written
  by the step that samples the next one.
- ``block_table[i]`` holds tokens ``[i * block_size, (i + 1) * block_size)``.
- ``block_hashes[i]`` is the chained key (``mesh.keys``) of full block ``i``; computed lazily.
- ``num_committed_blocks``: blocks ``[0, n)`` went through the cache's commit (registered or
  found already registered); the block manager owns this counter.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from itertools import count

from mesh.keys import block_keys


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    max_tokens: int = 16
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def validate(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 or positive, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")


_ids = count()


class Sequence:
    __slots__ = (
        "seq_id", "request_id", "token_ids", "num_prompt_tokens", "num_computed_tokens",
        "num_cached_tokens", "block_table", "block_hashes", "num_committed_blocks", "status",
        "params", "key_seed", "cache_salt", "block_size", "finish_reason", "admissions", "generator",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        block_size: int,
        key_seed: int,
        cache_salt: str | None = None,
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
