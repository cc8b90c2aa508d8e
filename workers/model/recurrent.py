"""A gated linear-attention recurrent layer (Mamba2-SSD-style scalar decay per head) for hybrid models.

Per request and layer the state is ``S`` of shape ``[heads, d_k, d_v]`` (float32). Token t with
query q_t, key k_t (both L2-normalized per head), value v_t and log decay g_t <= 0 does

    S_t = exp(g_t) * S_{t-1} + k_t^T v_t,        o_t = q_t S_t

then ``o`` is RMS-normed per head, gated by ``silu(z)`` and projected back. Three forms of the
same recurrence, held to each other by tests:

- ``naive_scan``: token by token (the reference);
- ``chunk_scan``: prefill; segments of at most ``chunk`` tokens, each in closed form (intra-segment
  attention with decay weights ``exp(b_t - b_s)``, plus the carried state), the state carried
  between segments. Segment boundaries sit at absolute multiples of ``chunk`` and at the
  requested snapshot offsets, so the state at a block-aligned position is computed by the same
  operations whether a step ends there or not;
- ``decode_step``: one token for a batch of states (``recurrent_triton.decode_step`` on CUDA).

``chunk_prefill`` runs ``chunk_scan`` for every prefill sequence of a step against the state
tensor (reads each sequence's slot, writes its final state back and its snapshots into their
slots); ``recurrent_triton.chunk_prefill`` is the same function as one Triton launch on CUDA.

``scan_step`` runs them over one engine step's tokens, slot by slot; the mixers around it differ
in how q, k, v and g come from the layer input and how o goes back: ``GatedLinearAttention``
here (the presets), ``workers.model.lightning.LightningAttention`` (MiniMax-Text-01).

Ownership: the state tensor ``[recurrent layers, slots, heads, d_k, d_v]`` belongs to the model
runner; ``RecurrentMetadata`` names, per sequence of a step, the slot it reads and writes, and
where mid-step snapshots go (the block manager's ``StateCheckpoints`` plans the slots).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class RecurrentMetadata:
    """The recurrent side of one step (``AttentionMetadata.recurrent``)."""

    states: torch.Tensor  # [recurrent layers, slots, heads, d_k, d_v] float32
    prefill_slots: list[int] = field(default_factory=list)  # per prefill sequence
    # absolute position of each prefill sequence's first new token; 0: the state starts at zero
    prefill_starts: list[int] = field(default_factory=list)
    # per prefill sequence: (tokens into its chunk, destination slot), offsets < chunk length
    prefill_snaps: list[list[tuple[int, int]]] = field(default_factory=list)
    decode_slots: torch.Tensor | None = None  # [num decodes] int64


def naive_scan(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token recurrence: q, k [T, H, dk], v [T, H, dv], g [T, H], state [H, dk, dv]."""
    s = state.float().clone()
    outs = []
    for t in range(q.shape[0]):
        s = s * g[t].float().exp()[:, None, None] + k[t].float()[:, :, None] * v[t].float()[:, None, :]
        outs.append(torch.einsum("hk,hkv->hv", q[t].float(), s))
    return torch.stack(outs) if outs else v.new_zeros(v.shape, dtype=torch.float32), s


def chunk_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    state: torch.Tensor,
    chunk: int = 64,
    start: int = 0,
    snap_at: tuple[int, ...] | list[int] = (),
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The recurrence over T tokens at absolute positions ``[start, start + T)``; outputs
    [T, H, dv] (float32), the final state and the states after each offset of ``snap_at``
    (0 < offset <= T, ascending).

    Every segment is computed at once (padded to ``chunk`` tokens: a pad has k = v = 0 and no
    decay, so it changes nothing): its intra-segment attention with decay weights and its own
    state from zero; then one pass over the segments carries the state (``S_i = A_i S_{i-1} +
    local_i``), and each segment's tokens read the state it started from."""
    t_len = q.shape[0]
    cuts = {o for o in snap_at if 0 < o < t_len}
    first = (-start) % chunk or chunk
    cuts.update(range(first, t_len, chunk))
    bounds = [0, *sorted(cuts), t_len]
    s0 = state.float()
    if t_len == 0:
        return v.new_zeros(v.shape, dtype=torch.float32), s0, [s0 for _ in snap_at]
    dev = q.device
    lo = torch.tensor(bounds[:-1], device=dev)
    n = torch.tensor(bounds[1:], device=dev) - lo
    width = int(max(b - a for a, b in zip(bounds, bounds[1:], strict=False)))
    pos = torch.arange(width, device=dev)
    valid = pos[None, :] < n[:, None]  # [S, L]
    idx = (lo[:, None] + pos[None, :]).clamp_max(t_len - 1)
    keep = valid[..., None, None].float()
    qs, ks, vs = q.float()[idx], k.float()[idx] * keep, v.float()[idx] * keep  # [S, L, H, d]
    gs = g.float()[idx] * valid[..., None]  # [S, L, H]
    b = gs.cumsum(1)
    diff = b[:, :, None, :] - b[:, None, :, :]  # [S, t, s, H]: decay from token s to token t
    causal = torch.ones(width, width, dtype=torch.bool, device=dev).tril()
    decay = diff.masked_fill(~causal[None, :, :, None], float("-inf")).exp()
    w = torch.einsum("sthk,suhk->stuh", qs, ks) * decay
    o = torch.einsum("stuh,suhv->sthv", w, vs)
    tail = (b[:, -1:, :] - b).exp()  # [S, L, H]: decay from token s to its segment's end
    local = torch.einsum("slh,slhk,slhv->shkv", tail, ks, vs)
    total = b[:, -1, :].exp()[:, :, None, None]  # [S, H, 1, 1]
    before, cur = [], s0
    for i in range(len(bounds) - 1):  # the state each segment starts from, and after it
        before.append(cur)
        cur = cur * total[i] + local[i]
        before.append(cur)
    starts = torch.stack(before[0::2])
    o = o + torch.einsum("sthk,shkv->sthv", qs, starts) * b.exp()[..., None]
    out = o[valid]  # segments in order, pads dropped: [T, H, dv]
    after = dict(zip(bounds[1:], before[1::2], strict=True))
    return out, cur, [after[o] if o in after else s0 for o in snap_at]


def chunk_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    states: torch.Tensor,
    cu_seqlens: list[int],
    slots: list[int],
    starts: list[int],
    snaps: list[list[tuple[int, int]]],
    chunk: int,
) -> torch.Tensor:
    """The prefill sequences of a step: sequence i is tokens ``[cu_seqlens[i], cu_seqlens[i+1])``
    of q, k [T, H, dk], v [T, H, dv], g [T, H] at absolute positions from ``starts[i]``; its state
    starts from ``states[slots[i]]`` (from zero where ``starts[i]`` is 0) and ends there; each
    ``(offset, dest)`` of ``snaps[i]`` writes the state after ``offset`` tokens into
    ``states[dest]``. ``states`` is one layer's ``[slots, H, dk, dv]`` float32. Returns o
    [cu_seqlens[len(slots)], H, dv] float32."""
    outs = []
    for i, slot in enumerate(slots):
        lo, hi = cu_seqlens[i], cu_seqlens[i + 1]
        s0 = states[slot] if starts[i] else torch.zeros_like(states[slot])
        seq_snaps = snaps[i] if snaps else []
        o, s, taken = chunk_scan(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], s0, chunk, starts[i],
                                 [off for off, _ in seq_snaps])
        for (_, dest), st in zip(seq_snaps, taken, strict=True):  # first: a snapshot at 0 is a view of the slot
            states[dest] = st
        states[slot] = s
        outs.append(o)
    return torch.cat(outs) if outs else v.new_zeros((0, *v.shape[1:]), dtype=torch.float32)


def decode_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, states: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for B sequences: q, k [B, H, dk], v [B, H, dv], g [B, H], states [B, H, dk, dv];
    returns (o [B, H, dv], new states), float32."""
    s = states.float() * g.float().exp()[:, :, None, None] + k.float()[..., :, None] * v.float()[..., None, :]
    return torch.einsum("bhk,bhkv->bhv", q.float(), s), s


def scan_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, num_prefill_tokens: int,
              cu_seqlens: list[int], meta: RecurrentMetadata, layer_index: int, chunk: int) -> torch.Tensor:
    """The recurrence over one step's tokens for one layer (row ``layer_index`` of the state
    tensor): each prefill sequence scans from its slot's state (zero at position 0) and writes
    back its final state and its snapshots; the decode tokens advance their slots one step.
    q, k [T, H, dk], v [T, H, dv], g [T, H]; returns o [T, H, dv] float32."""
    states = meta.states[layer_index]
    outs = []
    if meta.prefill_slots:
        outs.append(_prefill(states)(q, k, v, g, states, cu_seqlens, meta.prefill_slots, meta.prefill_starts,
                                     meta.prefill_snaps, chunk))
    if meta.decode_slots is not None and meta.decode_slots.numel():
        p = num_prefill_tokens
        outs.append(_decode(q[p:], k[p:], v[p:], g[p:], states, meta.decode_slots))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _prefill(states: torch.Tensor) -> Any:
    """The prefill scan for ``states``' device: the Triton kernel on CUDA, else the torch one."""
    if states.is_cuda:
        from workers.model import recurrent_triton

        if recurrent_triton.available():
            return recurrent_triton.chunk_prefill
    return chunk_prefill


def _decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, states: torch.Tensor,
            slots: torch.Tensor) -> torch.Tensor:
    if states.is_cuda:
        from workers.model import recurrent_triton

        if recurrent_triton.available():
            return recurrent_triton.decode_step(q, k, v, g, states, slots)
    o, s = decode_step(q, k, v, g, states.index_select(0, slots))
    states.index_copy_(0, slots, s)
    return o


class GatedLinearAttention(nn.Module):
    """The recurrent mixer of the presets' hybrid layers (in place of self-attention)."""

    def __init__(self, hidden: int, num_heads: int, key_dim: int, value_dim: int, chunk: int, eps: float,
                 layer_index: int) -> None:
        super().__init__()
        self.num_heads, self.key_dim, self.value_dim, self.chunk, self.eps = num_heads, key_dim, value_dim, chunk, eps
        self.layer_index = layer_index  # the row of this layer in the state tensor
        hk, hv = num_heads * key_dim, num_heads * value_dim
        self.sizes = [hk, hk, hv, hv, num_heads]  # q, k, v, z (gate), a (decay input)
        self.in_proj = nn.Linear(hidden, sum(self.sizes), bias=False)
        self.A_log = nn.Parameter(torch.zeros(num_heads))
        self.dt_bias = nn.Parameter(torch.zeros(num_heads))
        self.o_norm = nn.Parameter(torch.ones(value_dim))  # per-head RMSNorm weight
        self.out_proj = nn.Linear(hv, hidden, bias=False)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        t, h = x.shape[0], self.num_heads
        q, k, v, z, a = self.in_proj(x).split(self.sizes, dim=-1)
        q = F.normalize(q.float().view(t, h, self.key_dim), dim=-1)
        k = F.normalize(k.float().view(t, h, self.key_dim), dim=-1)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())  # [T, H] log decay
        return q, k, v.float().view(t, h, self.value_dim), z, g

    def forward(self, x: torch.Tensor, num_prefill_tokens: int, cu_seqlens: list[int],
                meta: RecurrentMetadata) -> torch.Tensor:
        q, k, v, z, g = self._project(x)
        o = scan_step(q, k, v, g, num_prefill_tokens, cu_seqlens, meta, self.layer_index, self.chunk)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps) * self.o_norm.float()
        o = o.view(x.shape[0], -1).to(x.dtype) * F.silu(z)
        return self.out_proj(o)
