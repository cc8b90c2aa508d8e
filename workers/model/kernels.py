"""Fused elementwise kernels for CUDA (Triton): residual add + RMSNorm, in-place RoPE on the
packed qkv rows, SiLU(gate) * up. One launch each instead of the 7-20 small kernels eager torch
issues per op; at decode batch sizes those launches, not bytes, would set the step time.

Each op has a torch twin in ``workers.model.layers`` with the same rounding points (HF's): the twin is
what runs on CPU and what the GPU tests hold these kernels to. ``enabled(x)`` decides per call.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch twins serve
    triton = None
    tl = None


def enabled(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


def _jit(fn):  # type: ignore[no-untyped-def]
    return triton.jit(fn) if triton is not None else fn


@_jit
def _add_rmsnorm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, res_ptr, n_cols, eps,
    stride_x, stride_r, stride_o, stride_res,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(res_ptr.dtype.element_ty)  # the residual is kept in the model dtype (HF)
        tl.store(res_ptr + row * stride_res + cols, s, mask=mask)
        x = s.to(tl.float32)
    var = tl.sum(x * x, 0) / n_cols
    xn = (x * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (xn * w).to(out_ptr.dtype.element_ty), mask=mask)


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rmsnorm(x + residual) * weight, x + residual)``; rows of ``x`` are tokens."""
    rows, cols = x.shape
    out = torch.empty_like(x)
    res = torch.empty_like(x) if residual is not None else x
    if rows:
        r = residual if residual is not None else x
        _add_rmsnorm_kernel[(rows,)](
            x, r, weight, out, res, cols, eps, x.stride(0), r.stride(0), out.stride(0), res.stride(0),
            HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(cols),
            num_warps=8 if cols >= 4096 else 4,
        )
    return out, res


@_jit
def _rope_kernel(
    qkv_ptr, pos_ptr, cos_ptr, sin_ptr, stride_t, n_heads,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    j = tl.arange(0, HALF)[None, :]
    mask = h < n_heads
    base = qkv_ptr + t * stride_t + h * (2 * HALF)
    x1 = tl.load(base + j, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + j, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + pos * HALF + j)
    s = tl.load(sin_ptr + pos * HALF + j)
    tl.store(base + j, (x1 * c - x2 * s).to(qkv_ptr.dtype.element_ty), mask=mask)
    tl.store(base + HALF + j, (x2 * c + x1 * s).to(qkv_ptr.dtype.element_ty), mask=mask)


def rope_supported(head_dim: int) -> bool:
    half = head_dim // 2
    return half >= 1 and half & (half - 1) == 0


def rope_inplace(
    qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int, head_dim: int
) -> None:
    """Rotate the first ``n_heads`` heads of each row of ``qkv`` (all q heads, then all k heads:
    they are contiguous in the packed layout) in place; cos/sin are [max_pos, head_dim / 2] fp32."""
    if qkv.shape[0]:
        _rope_kernel[(qkv.shape[0],)](
            qkv, positions, cos, sin, qkv.stride(0), n_heads,
            HALF=head_dim // 2, BLOCK_H=triton.next_power_of_2(n_heads), num_warps=4,
        )


@_jit
def _rope_store_kv_kernel(
    qkv_ptr, pos_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_t,
    n_q, NUM_KV: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr,
):
    """One token: rotate its q heads in place, rotate its k heads into its cache slot, copy its
    v heads there (``_rope_kernel`` + the attention backend's KV store in one launch)."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)  # -1: rotate q, store nothing
    row = qkv_ptr + t * stride_t
    h = tl.arange(0, BLOCK_H)[:, None]
    j = tl.arange(0, HALF)[None, :]
    rot = h < n_q + NUM_KV
    x1 = tl.load(row + h * (2 * HALF) + j, mask=rot, other=0.0).to(tl.float32)
    x2 = tl.load(row + h * (2 * HALF) + HALF + j, mask=rot, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + pos * HALF + j)
    s = tl.load(sin_ptr + pos * HALF + j)
    # The rotated rows are rounded to the activations' dtype first, as the unfused path stores them.
    o1 = (x1 * c - x2 * s).to(qkv_ptr.dtype.element_ty)
    o2 = (x2 * c + x1 * s).to(qkv_ptr.dtype.element_ty)
    is_q = h < n_q
    tl.store(row + h * (2 * HALF) + j, o1, mask=is_q)
    tl.store(row + h * (2 * HALF) + HALF + j, o2, mask=is_q)
    dst = slot * (NUM_KV * 2 * HALF) + (h - n_q) * (2 * HALF)
    is_k = (h >= n_q) & rot & (slot >= 0)
    tl.store(k_cache_ptr + dst + j, o1.to(k_cache_ptr.dtype.element_ty), mask=is_k)
    tl.store(k_cache_ptr + dst + HALF + j, o2.to(k_cache_ptr.dtype.element_ty), mask=is_k)
    hv = tl.arange(0, BLOCK_KV)[:, None]
    d = tl.arange(0, 2 * HALF)[None, :]
    is_v = (hv < NUM_KV) & (slot >= 0)
    v = tl.load(row + (n_q + NUM_KV) * (2 * HALF) + hv * (2 * HALF) + d, mask=is_v)
    tl.store(v_cache_ptr + slot * (NUM_KV * 2 * HALF) + hv * (2 * HALF) + d,
             v.to(v_cache_ptr.dtype.element_ty), mask=is_v)


def rope_store_kv(
    qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    n_heads: int, n_kv_heads: int, head_dim: int,
) -> None:
    """``rope_inplace`` of the q heads, and the rotated k heads and the v heads of each row of
    packed ``qkv`` written into the paged caches ([blocks, block_size, kv_heads, head_dim],
    contiguous) at ``slot_mapping`` (-1: not stored). The k heads in ``qkv`` are left unrotated."""
    if qkv.shape[1] != (n_heads + 2 * n_kv_heads) * head_dim or qkv.stride(1) != 1:
        raise ValueError(f"rope_store_kv: qkv {tuple(qkv.shape)} is not packed q|k|v rows")
    if k_cache.shape != v_cache.shape or tuple(k_cache.shape[2:]) != (n_kv_heads, head_dim) or not (
            k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"rope_store_kv: caches {tuple(k_cache.shape)} do not hold {n_kv_heads}x{head_dim} rows")
    if qkv.shape[0]:
        _rope_store_kv_kernel[(qkv.shape[0],)](
            qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, qkv.stride(0), n_heads,
            NUM_KV=n_kv_heads, HALF=head_dim // 2, BLOCK_H=triton.next_power_of_2(n_heads + n_kv_heads),
            BLOCK_KV=triton.next_power_of_2(n_kv_heads), num_warps=4,
        )


@_jit
def _silu_mul_kernel(x_ptr, out_ptr, n, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < n
    g = tl.load(x_ptr + row * stride_x + col, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + n + col, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + col, (act * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for rows ``[gate | up]``."""
    rows, two_n = gate_up.shape
    n = two_n // 2
    out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = 1024
        _silu_mul_kernel[(rows, triton.cdiv(n, block))](
            gate_up, out, n, gate_up.stride(0), out.stride(0), BLOCK=block, num_warps=4
        )
    return out
