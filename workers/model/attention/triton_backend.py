"""Triton attention backend for CUDA: paged KV store, split-K paged decode, paged varlen prefill.

Kernels (all read K/V straight out of the paged cache through ``block_tables``; nothing is
gathered into a contiguous copy):

* ``_store_kv_kernel``: one program per new token copies its K and V rows into its slot.
* ``_decode_kernel`` + ``_decode_reduce_kernel``: flash-decoding. The context of each sequence is
  shared among ``num_splits`` programs so that batch 1 with a long context still fills every SM;
  one program handles (sequence, KV head, split) and packs the ``group`` query heads that share
  the KV head into the M dimension of ``tl.dot``, so each K/V byte is read once per KV head.
  Splits take interleaved ``BLOCK_N`` tiles of the sequence's real context (split s: tiles s,
  s + num_splits, ...), so the work is even across splits although the split count comes from
  shapes only (under a CUDA graph: the padded block-table width, not the real contexts). Partial
  results (normalised output + log-sum-exp) are merged by the reduce kernel.
* ``_prefill_kernel``: flash-attention over tiles of ``BLOCK_M`` new tokens of one sequence and one
  query head. New token j of sequence i sits at absolute position ``ctx_i - q_len_i + j``; key
  tiles wholly below the tile's first position run without a mask, the rest with the causal mask.
  A prefix hit is the same kernel with ``q_len < ctx``.

Softmax runs in fp32 in the log2 domain (``exp2`` with ``scale * log2(e)`` folded in). No host
synchronisation anywhere: grid sizes come from tensor shapes only, so decode can be captured in a
CUDA graph. Launch parameters live in frozen configs so the benchmark can sweep them.

Triton is imported lazily in effect: without it the module still imports, and ``TritonBackend()``
raises with a message.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from workers.model.attention.base import AttentionBackend

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch backend serves; constructing TritonBackend says why not
    triton = None
    tl = None

LOG2E = 1.4426950408889634


def _jit(fn):  # type: ignore[no-untyped-def]
    """``triton.jit`` when Triton is there; the plain function otherwise (never launched then)."""
    return triton.jit(fn) if triton is not None else fn


@dataclass(frozen=True)
class DecodeConfig:
    # Context tokens per inner step; 0: 16 KB of K per step (64 at head_dim 128, 128 at 64). A
    # step is a chain of dependent loads (table, then K/V), so at short contexts the step count,
    # not bytes, sets the time (NOTES.md run 3).
    block_n: int = 0
    num_warps: int = 4
    num_stages: int = 3
    # Programs that fit on one SM at once with this config (128 regs x 128 threads, 39 KB shared:
    # 4). The context is split so that all programs run in ONE wave: a second, mostly idle wave
    # cost up to 25% (NOTES.md, run 2).
    ctas_per_sm: int = 4
    min_split_tokens: int = 256  # never split finer than this


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int = 128  # new tokens per program
    block_n: int = 128  # context tokens per inner step
    num_warps: int = 8
    num_stages: int = 3


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


@_jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    mask = (h < NUM_KV_HEADS) & (slot >= 0)  # slot -1: nothing is read or written
    dst = slot * (NUM_KV_HEADS * HEAD_DIM) + h * HEAD_DIM + d
    k = tl.load(k_ptr + tok * stride_kt + h * stride_kh + d, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + tok * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@_jit
def _online_softmax_step(acc, m_i, l_i, s, v, IEEE: tl.constexpr):
    """Fold one tile of log2-domain scores ``s`` [M, N] and values ``v`` [N, D] into the state."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen only masked keys
    alpha = tl.exp2(m_i - m_sub)
    p = tl.exp2(s - m_sub[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@_jit
def _qk(q, k, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        return tl.dot(q, tl.trans(k))


@_jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_o_ptr, part_lse_ptr,
    qk_scale,  # scale * log2(e)
    stride_qb, stride_qh, stride_ob, stride_oh, stride_bt,
    stride_cb, stride_ct, stride_ch,  # cache strides: block, token, kv head (head_dim is 1)
    num_splits,
    GROUP,  # query heads per KV head (runtime: fewer compiled variants)
    BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + seq)
    # Split s takes the tiles s, s + num_splits, s + 2 num_splits, ... of the REAL context: the
    # work spreads over every split whatever the grid was sized for (a CUDA graph sizes it for
    # the padded block table), and a split past the context's last tile exits at once.
    tile_step = num_splits * BLOCK_N

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    heads = kvh * GROUP + g
    q_mask = g[:, None] < GROUP
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=q_mask, other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_off = kvh.to(tl.int64) * stride_ch
    for n0 in range(split * BLOCK_N, ctx, tile_step):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < ctx
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        row = block * stride_cb + (pos % BLOCK_SIZE) * stride_ct + head_off
        k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        s = _qk(q, k, IEEE) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, s, v, IEEE)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # an empty split writes 0 with weight exp2(-inf) = 0
    o = acc / l_safe[:, None]
    if SPLIT:
        part = (seq.to(tl.int64) * (GROUP * tl.num_programs(1)) + heads) * num_splits + split
        tl.store(part_o_ptr + part[:, None] * HEAD_DIM + d[None, :], o, mask=q_mask)
        tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=g < GROUP)
    else:
        dst = out_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=q_mask)


@_jit
def _decode_reduce_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, num_splits, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = seq.to(tl.int64) * tl.num_programs(1) + head
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, HEAD_DIM)
    s_mask = s < num_splits
    lse = tl.load(part_lse_ptr + row * num_splits + s, mask=s_mask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    o = tl.load(part_o_ptr + (row * num_splits + s)[:, None] * HEAD_DIM + d[None, :],
                mask=s_mask[:, None], other=0.0)
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(out_ptr + seq.to(tl.int64) * stride_ob + head * stride_oh + d,
             out.to(out_ptr.dtype.element_ty))


# One function on purpose: Triton inlines helpers anyway, and the kernel's loop structure reads as one piece.
@_jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_ptr, context_lens_ptr, out_ptr,
    qk_scale, num_seqs, GROUP,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_cb, stride_ct, stride_ch,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SEQ_PAD: tl.constexpr, IEEE: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)

    # Which sequence and which of its query tiles is this program? (computed here, no host sync)
    si = tl.arange(0, SEQ_PAD)
    s_mask = si < num_seqs
    lo = tl.load(cu_seqlens_ptr + si, mask=s_mask, other=0)
    hi = tl.load(cu_seqlens_ptr + si + 1, mask=s_mask, other=0)
    tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(tiles, 0)
    if tile >= tl.max(ends, 0):
        return  # the grid is an upper bound on the number of tiles
    seq = tl.sum((ends <= tile).to(tl.int32), 0)
    pick = si == seq
    seq_tiles = tl.sum(tl.where(pick, tiles, 0), 0)
    q_start = tl.sum(tl.where(pick, lo, 0), 0)
    q_len = tl.sum(tl.where(pick, hi - lo, 0), 0)
    # Tiles of one sequence run last-first: the heaviest (most keys) start earliest.
    local = seq_tiles - 1 - (tile - (tl.sum(tl.where(pick, ends, 0), 0) - seq_tiles))
    ctx = tl.load(context_lens_ptr + seq)
    first_pos = ctx - q_len + local * BLOCK_M  # absolute position of the tile's first query

    m = local * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    m_valid = m < q_len
    q_rows = (q_start + m).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=m_valid[:, None], other=0.0)
    q_pos = first_pos + tl.arange(0, BLOCK_M)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_off = (head // GROUP).to(tl.int64) * stride_ch
    offs_n = tl.arange(0, BLOCK_N)

    # Key tiles that end at or below first_pos are visible to every query of the tile: no mask.
    full_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N
    for n0 in range(0, full_end, BLOCK_N):
        pos = n0 + offs_n
        block = tl.load(table + pos // BLOCK_SIZE).to(tl.int64)
        row = block * stride_cb + (pos % BLOCK_SIZE) * stride_ct + head_off
        k = tl.load(k_cache_ptr + row[:, None] + d[None, :])
        s = _qk(q, k, IEEE) * qk_scale
        v = tl.load(v_cache_ptr + row[:, None] + d[None, :])
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, s, v, IEEE)

    # The diagonal: causal mask with the prefix offset, and the context's end.
    k_end = tl.minimum(ctx, first_pos + BLOCK_M)
    for n0 in range(full_end, k_end, BLOCK_N):
        pos = n0 + offs_n
        valid = pos < k_end
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        row = block * stride_cb + (pos % BLOCK_SIZE) * stride_ct + head_off
        k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        s = _qk(q, k, IEEE) * qk_scale
        visible = (pos[None, :] <= q_pos[:, None]) & valid[None, :]
        s = tl.where(visible, s, float("-inf"))
        v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, s, v, IEEE)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=m_valid[:, None])


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------


class TritonBackend(AttentionBackend):
    name = "triton"

    def __init__(
        self,
        decode_config: DecodeConfig | None = None,
        prefill_config: PrefillConfig | None = None,
    ) -> None:
        if triton is None:
            raise RuntimeError(
                "TritonBackend needs the 'triton' package (and a CUDA device); "
                "use the torch backend instead"
            )
        self.decode_config = decode_config or DecodeConfig()
        self.prefill_config = prefill_config or PrefillConfig()

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        _check_cache(k_cache, v_cache)
        num_tokens, num_kv_heads, head_dim = k.shape
        if v.shape != k.shape or slot_mapping.shape[0] != num_tokens:
            raise ValueError(
                f"store_kv: K {tuple(k.shape)}, V {tuple(v.shape)}, {slot_mapping.shape[0]} slots"
            )
        if (num_kv_heads, head_dim) != tuple(k_cache.shape[2:]):
            raise ValueError(f"store_kv: K rows {tuple(k.shape[1:])} vs cache {tuple(k_cache.shape)}")
        if num_tokens == 0:
            return
        k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
        _store_kv_kernel[(num_tokens,)](
            k, v, k_cache, v_cache, slot_mapping,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
            BLOCK_H=triton.next_power_of_2(num_kv_heads), num_warps=1 if head_dim <= 64 else 2,
        )

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        return self.decode_with(q, k_cache, v_cache, block_tables, context_lens, scale, None)

    def decode_with(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        num_splits: int | None,
    ) -> torch.Tensor:
        """``decode`` with the split count forced (``None``: chosen from shapes, as ``decode``)."""
        _check_cache(k_cache, v_cache)
        num_seqs, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        group = _group(num_heads, num_kv_heads, head_dim, k_cache)
        q = _last_dim_contiguous(q)
        out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype, device=q.device)
        if num_seqs == 0:
            return out
        cfg = self.decode_config
        # Upper bound on any context, from shapes alone (no sync; graph-capturable).
        num_splits, _ = self.decode_splits(
            num_seqs, num_kv_heads, block_tables.shape[1] * block_size, q.device, num_splits, head_dim
        )
        split = num_splits > 1
        if split:
            part_o = torch.empty((num_seqs, num_heads, num_splits, head_dim),
                                 dtype=torch.float32, device=q.device)
            part_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32,
                                   device=q.device)
        else:
            part_o = part_lse = out  # unused
        _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
            q, k_cache, v_cache, block_tables, context_lens, out, part_o, part_lse,
            scale * LOG2E,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            num_splits, group,
            BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
            BLOCK_SIZE=block_size, BLOCK_N=_block_n(cfg, head_dim), SPLIT=split,
            IEEE=q.dtype == torch.float32,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        if split:
            _decode_reduce_kernel[(num_seqs, num_heads)](
                part_o, part_lse, out, num_splits, out.stride(0), out.stride(1),
                HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(num_splits), num_warps=4,
            )
        return out

    def decode_splits(
        self,
        num_seqs: int,
        num_kv_heads: int,
        max_context: int,
        device: torch.device,
        num_splits: int | None = None,
        head_dim: int = 128,
    ) -> tuple[int, int]:
        """(splits, tokens per split at ``max_context``) of decode for contexts of at most
        ``max_context`` tokens. The kernel interleaves the splits' tiles over the real context.

        ``num_splits=None`` picks enough splits that (sequences x KV heads x splits) fills the
        SMs (``ctas_per_sm``) without splits thinner than ``min_split_tokens``."""
        cfg = self.decode_config
        block_n = _block_n(cfg, head_dim)
        n_tiles = triton.cdiv(max(1, max_context), block_n)
        if num_splits is None:
            num_splits = _auto_splits(num_seqs * num_kv_heads, n_tiles * block_n, cfg, device)
        tiles_per_split = triton.cdiv(n_tiles, max(1, min(num_splits, n_tiles)))
        return triton.cdiv(n_tiles, tiles_per_split), tiles_per_split * block_n

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
        total, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        group = _group(num_heads, num_kv_heads, head_dim, k_cache)
        q = _last_dim_contiguous(q)
        out = torch.empty((total, num_heads, head_dim), dtype=q.dtype, device=q.device)
        num_seqs = cu_seqlens_q.shape[0] - 1
        if total == 0 or num_seqs <= 0:
            return out
        cfg = self.prefill_config
        max_tiles = triton.cdiv(total, cfg.block_m) + num_seqs
        _prefill_kernel[(max_tiles, num_heads)](
            q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out,
            scale * LOG2E, num_seqs, group,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            SEQ_PAD=max(16, triton.next_power_of_2(num_seqs)), IEEE=q.dtype == torch.float32,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        return out


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "caches must be [num_blocks, block_size, num_kv_heads, head_dim] and of one shape, "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")


def _group(num_heads: int, num_kv_heads: int, head_dim: int, k_cache: torch.Tensor) -> int:
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if head_dim != k_cache.shape[3]:
        raise ValueError(f"q head_dim {head_dim} != cache head_dim {k_cache.shape[3]}")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"the Triton kernels need a power-of-two head_dim >= 16, got {head_dim}")
    return num_heads // num_kv_heads


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _auto_splits(programs: int, max_context: int, cfg: DecodeConfig, device: torch.device) -> int:
    """As many context splits as fit (sequences x KV heads x splits) into one wave of the SMs
    (``ctas_per_sm`` resident programs each), none thinner than ``min_split_tokens``."""
    want = (cfg.ctas_per_sm * _num_sms(device)) // programs
    most = max(1, max_context // cfg.min_split_tokens)
    return max(1, min(want, most))


def _block_n(cfg: DecodeConfig, head_dim: int) -> int:
    return cfg.block_n or max(16, min(256, 8192 // head_dim))
