"""Building blocks of a Llama/Qwen2 decoder: RMSNorm, rotary embedding, SwiGLU, paged attention.

Every layer works on a flat batch of tokens ``[num_tokens, ...]`` (sequences concatenated, the
prefill tokens first, then one token per decoding sequence); ``AttentionMetadata`` says where the
boundaries are and where each token's K/V goes in the paged cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from workers.model import kernels
from workers.model.attention.base import AttentionBackend
from workers.model.recurrent import RecurrentMetadata


@dataclass
class AttentionMetadata:
    """Where one step's tokens sit. Tokens ``[0, num_prefill_tokens)`` belong to prefill
    sequences (``cu_seqlens_q`` delimits them), the rest are one decode token per sequence."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = do not store (graph padding)
    num_prefill_tokens: int
    prefill_block_tables: torch.Tensor | None = None  # [num_prefill_seqs, max_blocks] int32
    cu_seqlens_q: torch.Tensor | None = None  # [num_prefill_seqs + 1] int32
    prefill_context_lens: torch.Tensor | None = None  # [num_prefill_seqs] int32
    decode_block_tables: torch.Tensor | None = None  # [num_decode_seqs, max_blocks] int32
    decode_context_lens: torch.Tensor | None = None  # [num_decode_seqs] int32
    recurrent: RecurrentMetadata | None = None  # hybrid models: state slots of this step's sequences

    @property
    def has_decode(self) -> bool:
        return self.decode_context_lens is not None and self.decode_context_lens.numel() > 0


class RMSNorm(nn.Module):
    """HF's RMSNorm (statistics in float32), with an optional fused residual add."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(norm(x + residual), x + residual)``; the second is the next residual."""
        if kernels.enabled(x):
            return kernels.add_rmsnorm(x, residual, self.weight, self.eps)
        return add_rmsnorm_ref(x, residual, self.weight, self.eps)


def add_rmsnorm_ref(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch twin of ``kernels.add_rmsnorm`` (HF's rounding points)."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype), x


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """The torch twin of ``kernels.silu_mul``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, float]) -> torch.Tensor:
    """Llama 3.1's frequency-dependent RoPE scaling (as in HF ``_compute_llama3_parameters``)."""
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (HF ``rotate_half``) from a cos/sin table indexed by position."""

    def __init__(
        self, head_dim: int, max_position: int, theta: float, scaling: dict[str, float] | None = None
    ) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if scaling:
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", freqs.cos(), persistent=False)  # [max_position, head_dim / 2]
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D/2]
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def split_qkv(
        self, positions: torch.Tensor, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (rotated) and v of packed ``qkv`` rows, as [T, heads, head_dim] tensors.

        On CUDA the rotation happens in place in ``qkv`` (one kernel) and q, k, v are strided
        views of it; the backends read views by their strides."""
        t = qkv.shape[0]
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        if kernels.enabled(qkv) and kernels.rope_supported(head_dim):
            kernels.rope_inplace(qkv, positions, self.cos, self.sin, num_heads + num_kv_heads, head_dim)
            q = qkv[:, :q_size].view(t, num_heads, head_dim)
            k = qkv[:, q_size : q_size + kv_size].view(t, num_kv_heads, head_dim)
            v = qkv[:, q_size + kv_size :].view(t, num_kv_heads, head_dim)
            return q, k, v
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q, k = self(positions, q.view(t, num_heads, head_dim), k.view(t, num_kv_heads, head_dim))
        return q, k, v.contiguous().view(t, num_kv_heads, head_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class Attention(nn.Module):
    """GQA self-attention over the paged cache: store this step's K/V, then attend."""

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qkv_bias: bool,
        rotary: RotaryEmbedding,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.scale = head_dim**-0.5
        # q, k and v projections packed in one matrix (rows: q, then k, then v).
        self.qkv_proj = nn.Linear(hidden, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, hidden, bias=False)
        self.rotary = rotary

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        k_cache, v_cache = kv_cache
        if backend.name == "triton" and kernels.enabled(qkv) and kernels.rope_supported(self.head_dim):
            # One launch: q rotated in place, k rotated and v copied into the cache.
            kernels.rope_store_kv(qkv, positions, self.rotary.cos, self.rotary.sin, k_cache, v_cache,
                                  meta.slot_mapping, self.num_heads, self.num_kv_heads, self.head_dim)
            q = qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim)
        else:
            q, k, v = self.rotary.split_qkv(positions, qkv, self.num_heads, self.num_kv_heads, self.head_dim)
            backend.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        o = self._attend(q, k_cache, v_cache, meta, backend)
        return self.o_proj(o.view(t, self.q_size))

    def _attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        p = meta.num_prefill_tokens
        outs = []
        if p:
            outs.append(
                backend.prefill(
                    q[:p], k_cache, v_cache, meta.prefill_block_tables, meta.cu_seqlens_q,
                    meta.prefill_context_lens, self.scale,
                )
            )
        if meta.has_decode:
            outs.append(
                backend.decode(q[p:], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, self.scale)
            )
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)  # rows: gate, then up
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if kernels.enabled(gate_up):
            return self.down_proj(kernels.silu_mul(gate_up))
        return self.down_proj(silu_mul_ref(gate_up))
