"""MiniMax-Text-01's lightning attention: the engine's recurrence with a constant decay per head.

As transformers 5.24 ``MiniMaxLightningAttention`` computes it, per token::

    q, k, v = silu(qkv_proj(x))           (per head: [q_h | k_h | v_h], no normalization, no scale)
    S_t = exp(-slope_h) S_{t-1} + k_t^T v_t,    o_t = q_t S_t
    out = out_proj(sigmoid(output_gate(x)) * RMSNorm(o over all heads, eps 1e-6))

so the state is ``[heads, head_dim, head_dim]`` and ``recurrent.scan_step`` runs it with
``g = -slope`` (its checkpoints and resumes apply unchanged). The slopes depend on the head and
the layer's depth (``minimax_slopes``); a checkpoint carries them as ``slope_rate`` (loaded over
the formula's values) beside decay tables derived from them for HF's blocked prefill
(``decay_tables``: the loader checks them against the slopes, the engine does not read them).
"""

from __future__ import annotations

import torch
from torch import nn

from workers.model.layers import RMSNorm
from workers.model.recurrent import RecurrentMetadata, scan_step

NORM_EPS = 1e-6  # HF builds the output norm with MiniMaxRMSNorm's default eps, not rms_norm_eps


def minimax_slopes(num_heads: int, layer: int, num_layers: int) -> torch.Tensor:
    """Decay rate per head of layer ``layer`` (HF ``get_slope_rate``): ALiBi's geometric slopes,
    shrunk linearly with depth (the last layer's barely decays). [heads] float32."""
    base = 1 / (2 ** (8 / num_heads))
    rate = base ** (torch.arange(num_heads, dtype=torch.float32) + 1)
    return rate * (1 - layer / (num_layers - 1 + 1e-5) + 1e-5)


def decay_tables(slope: torch.Tensor, block: int) -> dict[str, torch.Tensor]:
    """HF's derived buffers for a prefill block of ``block`` tokens (``decay_factors``), by name."""
    rate = slope.float()[:, None, None]  # [H, 1, 1]
    pos = torch.arange(block, dtype=torch.float32) + 1
    diag = rate * (pos[:, None] - pos[None, :])[None, None]
    return {
        "query_decay": torch.exp(-rate * pos[:, None]),
        "key_decay": torch.exp(-rate * (block - pos[:, None])),
        "diagonal_decay": torch.where(diag >= 0, -diag, float("-inf")).exp(),
    }


class LightningAttention(nn.Module):
    """The recurrent mixer of a MiniMax lightning layer (HF names: ``self_attn.qkv_proj`` ...)."""

    def __init__(self, hidden: int, num_heads: int, head_dim: int, chunk: int, layer: int, num_layers: int,
                 layer_index: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.chunk = num_heads, head_dim, chunk
        self.layer, self.num_layers = layer, num_layers  # depth, for the slopes
        self.layer_index = layer_index  # the row of this layer in the state tensor
        size = num_heads * head_dim
        self.qkv_proj = nn.Linear(hidden, 3 * size, bias=False)
        self.output_gate = nn.Linear(hidden, size, bias=False)
        self.norm = RMSNorm(size, NORM_EPS)
        self.out_proj = nn.Linear(size, hidden, bias=False)
        # A buffer: built by ``reset_slopes`` on the device, overwritten by a checkpoint's slope_rate.
        self.register_buffer("slope_rate", minimax_slopes(num_heads, layer, num_layers), persistent=False)

    def reset_slopes(self) -> None:
        """The formula's slopes (a model built on the meta device has no buffer values yet)."""
        self.slope_rate = minimax_slopes(self.num_heads, self.layer, self.num_layers).to(self.qkv_proj.weight.device)

    def forward(self, x: torch.Tensor, num_prefill_tokens: int, cu_seqlens: list[int],
                meta: RecurrentMetadata) -> torch.Tensor:
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        qkv = nn.functional.silu(self.qkv_proj(x)).view(t, h, 3, d)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        g = (-self.slope_rate.float()).expand(t, h)
        o = scan_step(q, k, v, g, num_prefill_tokens, cu_seqlens, meta, self.layer_index, self.chunk)
        o, _ = self.norm(o.reshape(t, h * d).to(x.dtype))
        return self.out_proj(torch.sigmoid(self.output_gate(x)) * o)
