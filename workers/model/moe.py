"""A sparse mixture-of-experts MLP (Mixtral's and MiniMax's): a softmax router picks the top k
experts of each token, renormalizes their weights to sum to 1, and sums the weighted SwiGLU
outputs of those experts.

Parameter names are transformers 5's fused ones: ``gate.weight`` [experts, hidden] (the router),
``experts.gate_up_proj`` [experts, 2 x intermediate, hidden] (rows: gate, then up) and
``experts.down_proj`` [experts, hidden, intermediate]; ``workers.model.hf_loader`` copies a
checkpoint's per-expert ``w1`` / ``w3`` / ``w2`` into their rows.

The experts run one after another over the tokens routed to them (which experts are hit is read
on the host): a clear reference, not a grouped GEMM, and no CUDA graph can hold it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.model import kernels
from workers.model.layers import silu_mul_ref


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def forward(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        gate_up = F.linear(x, self.gate_up_proj[expert])
        act = kernels.silu_mul(gate_up) if kernels.enabled(gate_up) else silu_mul_ref(gate_up)
        return F.linear(act, self.down_proj[expert])


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden, intermediate)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32 summing to 1 per token, expert ids [T, k])."""
        probs = self.gate(x).float().softmax(dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        return weights / weights.sum(dim=-1, keepdim=True), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = torch.zeros_like(x)
        for expert in torch.unique(ids).tolist():  # ascending, as HF sums them
            token, slot = (ids == expert).nonzero(as_tuple=True)
            y = self.experts(expert, x[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out
