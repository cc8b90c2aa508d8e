"""Triton kernel of the recurrent layer's decode step (``workers.model.recurrent.decode_step``).

One program per (sequence, head, d_v tile): it reads the sequence's state tile ``S[slot, h, :,
tile]`` in place from the state tensor, applies ``S = exp(g) S + k^T v``, writes it back and
stores ``o = q S`` for the tile. The state never leaves its slot (no gather/scatter copies);
float32 throughout, as the torch reference. Tested against the reference in
``tests/gpu/test_recurrent_gpu.py`` (and under ``TRITON_INTERPRET=1`` where triton is installed).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference serves
    triton = None
    tl = None


def available() -> bool:
    return triton is not None


def _jit(fn):  # type: ignore[no-untyped-def]
    return triton.jit(fn) if triton is not None else fn


@_jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, s_ptr, slot_ptr, o_ptr,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_gb,
    stride_ss, stride_sh, stride_sk, stride_ob, stride_oh,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    tile = tl.program_id(2)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    rk = tl.arange(0, BK)
    rv = tile * BV + tl.arange(0, BV)
    mk, mv = rk < DK, rv < DV
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + rk, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b * stride_kb + h * stride_kh + rk, mask=mk, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + b * stride_vb + h * stride_vh + rv, mask=mv, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + b * stride_gb + h).to(tl.float32)
    s_off = slot * stride_ss + h * stride_sh + rk[:, None] * stride_sk + rv[None, :]
    m2 = mk[:, None] & mv[None, :]
    s = tl.load(s_ptr + s_off, mask=m2, other=0.0)
    s = s * tl.exp(g) + k[:, None] * v[None, :]
    tl.store(s_ptr + s_off, s, mask=m2)
    o = tl.sum(q[:, None] * s, axis=0)
    tl.store(o_ptr + b * stride_ob + h * stride_oh + rv, o, mask=mv)


def decode_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, states: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """q, k [B, H, dk], v [B, H, dv], g [B, H]; ``states`` [slots, H, dk, dv] float32 (contiguous
    in its last dim), updated in place at rows ``slots`` [B]; returns o [B, H, dv] float32."""
    bsz, heads, dk = q.shape
    dv = v.shape[-1]
    if states.dtype != torch.float32 or states.stride(-1) != 1:
        raise ValueError("states must be float32 with a contiguous last dim")
    q, k, v, g = (t.contiguous() for t in (q, k, v, g))
    o = torch.empty(bsz, heads, dv, dtype=torch.float32, device=q.device)
    if bsz == 0:
        return o
    bk = triton.next_power_of_2(dk)
    bv = min(triton.next_power_of_2(dv), max(16, 4096 // bk))
    grid = (bsz, heads, triton.cdiv(dv, bv))
    _decode_kernel[grid](
        q, k, v, g, states, slots.to(torch.int64).contiguous(), o,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0),
        states.stride(0), states.stride(1), states.stride(2), o.stride(0), o.stride(1),
        DK=dk, DV=dv, BK=bk, BV=bv,
    )
    return o
