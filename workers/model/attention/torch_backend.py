"""Torch attention backend: the CPU production backend and the reference the Triton one is held to.

Each sequence's pages are gathered out of the paged cache (``block_tables``) into a contiguous
K/V and handed to ``torch.nn.functional.scaled_dot_product_attention``.

GQA is handled without copying K/V per query head: the ``group = num_heads // num_kv_heads``
query heads that share a KV head are folded into SDPA's query-length dimension, so SDPA sees
``num_kv_heads`` heads with ``group * q_len`` queries each; the causal mask is repeated ``group``
times along the query axis to match.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.model.attention.base import AttentionBackend


class TorchBackend(AttentionBackend):
    name = "torch"

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        _check_cache(k_cache, v_cache)
        if k.shape[0] != slot_mapping.shape[0] or v.shape[0] != slot_mapping.shape[0]:
            raise ValueError(
                f"store_kv: {k.shape[0]} K rows, {v.shape[0]} V rows, {slot_mapping.shape[0]} slots"
            )
        keep = slot_mapping >= 0
        slots = slot_mapping[keep].to(torch.long)
        # The flattened views share storage with the caches: writing them writes the cache.
        flat_k = k_cache.view(-1, *k_cache.shape[2:])
        flat_v = v_cache.view(-1, *v_cache.shape[2:])
        flat_k.index_copy_(0, slots, k[keep].to(k_cache.dtype))
        flat_v.index_copy_(0, slots, v[keep].to(v_cache.dtype))

    def prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        _check_cache(k_cache, v_cache)
        num_heads, num_kv_heads, group = _heads(q, k_cache)
        out = torch.empty_like(q)
        cu = cu_seqlens_q.tolist()
        ctx_lens = context_lens.tolist()
        for i, ctx_len in enumerate(ctx_lens):
            start, end = cu[i], cu[i + 1]
            q_len = end - start
            if q_len == 0:
                continue
            if q_len > ctx_len:
                raise ValueError(f"prefill: sequence {i} has {q_len} new tokens > context {ctx_len}")
            k, v = _gather(k_cache, v_cache, block_tables[i], ctx_len)  # [kvh, ctx, d]
            # [q_len, H, d] -> [kvh, group * q_len, d]; row r = g * q_len + j.
            qi = q[start:end].reshape(q_len, num_kv_heads, group, -1).permute(1, 2, 0, 3)
            qi = qi.reshape(num_kv_heads, group * q_len, -1)
            mask = _causal_mask(q_len, ctx_len, q.device).repeat(group, 1)
            o = F.scaled_dot_product_attention(
                qi.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, scale=scale
            )[0]
            o = o.view(num_kv_heads, group, q_len, -1).permute(2, 0, 1, 3)
            out[start:end] = o.reshape(q_len, num_heads, -1)
        return out

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        _check_cache(k_cache, v_cache)
        num_seqs = q.shape[0]
        num_heads, num_kv_heads, group = _heads(q, k_cache)
        if num_seqs == 0:
            return torch.empty_like(q)
        block_size = k_cache.shape[1]
        max_len = int(context_lens.max())
        if max_len <= 0:
            raise ValueError("decode: every sequence needs a context of at least one token")
        # One padded gather for the whole batch; padding past each context is masked out.
        nblocks = -(-max_len // block_size)
        tables = block_tables[:, :nblocks].to(torch.long).clamp(min=0)
        pos = torch.arange(max_len, device=q.device)
        mask = (pos[None, :] < context_lens.to(q.device)[:, None]).view(num_seqs, 1, 1, max_len)
        # Slots past a context hold whatever was there (maybe NaN bit patterns from torch.empty):
        # zero them, since a masked score still multiplies its V row by 0 (0 * NaN = NaN).
        k = _pages(k_cache, tables, max_len).masked_fill(~mask.transpose(2, 3), 0)  # [B, kvh, L, d]
        v = _pages(v_cache, tables, max_len).masked_fill(~mask.transpose(2, 3), 0)
        qg = q.reshape(num_seqs, num_kv_heads, group, -1)  # the group is the query axis
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
        return o.reshape(num_seqs, num_heads, -1)


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "caches must be [num_blocks, block_size, num_kv_heads, head_dim] and of one shape, "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")


def _heads(q: torch.Tensor, k_cache: torch.Tensor) -> tuple[int, int, int]:
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"q head_dim {q.shape[2]} != cache head_dim {k_cache.shape[3]}")
    return num_heads, num_kv_heads, num_heads // num_kv_heads


def _gather(
    k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, ctx_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's first ``ctx_len`` tokens of K and V, as [num_kv_heads, ctx_len, head_dim]."""
    block_size = k_cache.shape[1]
    blocks = table[: -(-ctx_len // block_size)].to(torch.long)
    if bool((blocks < 0).any()):
        raise ValueError(f"block table has -1 inside a context of {ctx_len} tokens")
    k = k_cache[blocks].flatten(0, 1)[:ctx_len].transpose(0, 1)
    v = v_cache[blocks].flatten(0, 1)[:ctx_len].transpose(0, 1)
    return k, v


def _pages(cache: torch.Tensor, tables: torch.Tensor, length: int) -> torch.Tensor:
    """[B, nblocks] block ids -> [B, num_kv_heads, length, head_dim]."""
    b = tables.shape[0]
    x = cache[tables]  # [B, nblocks, block_size, kvh, d]
    return x.view(b, -1, *cache.shape[2:])[:, :length].transpose(1, 2)


def _causal_mask(q_len: int, ctx_len: int, device: torch.device) -> torch.Tensor:
    """[q_len, ctx_len] bool: new token j (absolute position ctx_len - q_len + j) sees keys <= it."""
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)
    k_pos = torch.arange(ctx_len, device=device)
    return k_pos[None, :] <= q_pos[:, None]
