"""The attention backend interface of the bundled engine.

Paged KV cache layout, per layer (vLLM / nano-vllm vocabulary):
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
A token's slot is ``block_id * block_size + offset``; ``block_tables[i]`` lists the blocks of
sequence i in order (padded with -1 past its last block).

Every method works on a whole batch; the backend never allocates KV blocks (the block manager
owns them) and never reorders sequences. A prefix hit and a miss take the same kernel: the cached
prefix is simply context that ``prefill`` reads from the cache.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class AttentionBackend(ABC):
    name: str = "abstract"

    @abstractmethod
    def store_kv(
        self,
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 = do not store
    ) -> None:
        """Write each token's K and V into its slot of the paged cache."""

    @abstractmethod
    def prefill(
        self,
        q: torch.Tensor,  # [total_new_tokens, num_heads, head_dim], sequences concatenated
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
        cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32, offsets of each sequence's new tokens in q
        context_lens: torch.Tensor,  # [num_seqs] int32: cached prefix + new tokens (all already stored)
        scale: float,
    ) -> torch.Tensor:  # [total_new_tokens, num_heads, head_dim]
        """Causal attention of the new tokens over their whole context (cached prefix + new).

        New token j of sequence i sits at absolute position ``context_lens[i] - q_len_i + j`` and
        attends to positions ``<=`` its own. GQA: query head h reads KV head
        ``h // (num_heads // num_kv_heads)``.
        """

    @abstractmethod
    def decode(
        self,
        q: torch.Tensor,  # [num_seqs, num_heads, head_dim], one new token per sequence
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
        context_lens: torch.Tensor,  # [num_seqs] int32, including the new token (already stored)
        scale: float,
    ) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
        """Attention of each sequence's single new token over its whole context."""


def get_backend(device: torch.device | str, name: str = "auto") -> AttentionBackend:
    """``triton`` on CUDA when Triton imports, else ``torch`` (SDPA over gathered pages)."""
    device = torch.device(device)
    if name == "auto":
        name = "triton" if device.type == "cuda" and _has_triton() else "torch"
    if name == "triton":
        from workers.model.attention.triton_backend import TritonBackend

        return TritonBackend()
    if name == "torch":
        from workers.model.attention.torch_backend import TorchBackend

        return TorchBackend()
    raise ValueError(f"unknown attention backend {name!r} (expected auto, torch or triton)")


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
