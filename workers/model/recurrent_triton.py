"""Triton kernels of the recurrent layer (``workers.model.recurrent``): the decode step and the
chunked prefill scan, float32 state and accumulation as the torch reference.

Decode (``decode_step``): one program per (sequence, head, d_v tile) reads the sequence's state
tile ``S[slot, h, :, tile]`` in place from the state tensor, applies ``S = exp(g) S + k^T v``,
writes it back and stores ``o = q S`` for the tile.

Prefill (``chunk_prefill``, the interface of ``recurrent.chunk_prefill``): a batch of
variable-length sequences (``cu_seqlens``) cut into the segments of the torch ``chunk_scan``
(boundaries at absolute multiples of the chunk and at snapshot offsets; the host builds the
table), each segment in closed form (b: the segment's cumsum of g, L its last token):

    o   = ((q k^T) * exp(b_t - b_s) [s <= t]) v  +  (q S) * exp(b_t)
    S  <- exp(b_L) S + (k * exp(b_L - b_s))^T v

Pass 1 (``_prefill_state_kernel``), one program per (sequence, head, d_k x d_v tile), walks the
sequence's segments in order with its state tile in registers: it reads the initial state from
the sequence's slot (zero where the sequence starts at position 0), stores the state each
segment starts from into ``h[segment]``, each snapshot the step plans into its destination slot
when a segment ends at its offset, and the final state back into the slot. Pass 2
(``_prefill_output_kernel``), one program per (segment, head, d_v tiles), computes the outputs
of every segment at once from ``h``. Programs of different sequences run at once, so a step's
destination slots must be distinct from every slot another sequence of the step reads (the slot
layout of ``workers.engine.state_checkpoints`` guarantees it).

The states never leave their slots (no gather/scatter copies). Tested against the torch
reference in ``tests/gpu/test_recurrent_gpu.py`` and ``tests/gpu/test_recurrent_prefill_gpu.py``,
and under ``TRITON_INTERPRET=1`` in ``tests/unit/workers/test_recurrent_triton.py``.
"""

from __future__ import annotations

import numpy as np
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


SNAP_END = 2**62  # the sentinel after a sequence's last snapshot offset


@_jit
def _prefill_state_kernel(
    k_ptr, v_ptr, g_ptr, s_ptr, h_ptr, seq_ptr, seg_ptr, snap_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_ss, stride_sh, stride_sk,
    stride_hs, stride_hh, stride_hk, snap_w,
    DK: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Pass 1, one program per (sequence, head, d_k x d_v tile): the state along the sequence's
    segments; ``h[seg]`` gets the state each segment starts from, snapshots and the final state
    go to their slots."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    tiles_v = tl.cdiv(DV, BV)
    rk = (tl.program_id(2) // tiles_v) * BK + tl.arange(0, BK)
    rv = (tl.program_id(2) % tiles_v) * BV + tl.arange(0, BV)
    rt = tl.arange(0, BT)
    mk, mv = rk < DK, rv < DV
    m2 = mk[:, None] & mv[None, :]
    seg0 = tl.load(seq_ptr + n * 4)  # first segment, segments, slot, absolute start position
    nseg = tl.load(seq_ptr + n * 4 + 1)
    slot = tl.load(seq_ptr + n * 4 + 2)
    start = tl.load(seq_ptr + n * 4 + 3)
    s_tile = s_ptr + h * stride_sh + rk[:, None] * stride_sk + rv[None, :]
    h_tile = h_ptr + h * stride_hh + rk[:, None] * stride_hk + rv[None, :]
    s = tl.where(start > 0, tl.load(s_tile + slot * stride_ss, mask=m2, other=0.0), 0.0)  # start 0: zero
    snaps = snap_ptr + n * snap_w * 2  # row n: offsets (ascending, then SNAP_END), then their slots
    j = tl.zeros([], tl.int64)
    nxt = tl.load(snaps)
    while nxt == 0:  # snapshots at offset 0: the initial state
        tl.store(s_tile + tl.load(snaps + snap_w + j) * stride_ss, s, mask=m2)
        j += 1
        nxt = tl.load(snaps + j)
    for i in range(seg0, seg0 + nseg):
        row = tl.load(seg_ptr + i * 3)  # first token row, tokens, offset of its end in the sequence
        rows = row + rt
        valid = rt < tl.load(seg_ptr + i * 3 + 1)
        end = tl.load(seg_ptr + i * 3 + 2)
        tl.store(h_tile + i * stride_hs, s, mask=m2)
        k = tl.load(k_ptr + rows[:, None] * stride_kt + h * stride_kh + rk[None, :], mask=valid[:, None] & mk[None, :],
                    other=0.0)
        v = tl.load(v_ptr + rows[:, None] * stride_vt + h * stride_vh + rv[None, :], mask=valid[:, None] & mv[None, :],
                    other=0.0)
        g = tl.load(g_ptr + rows * stride_gt + h, mask=valid, other=0.0)  # a pad: no decay
        b = tl.cumsum(g, axis=0)
        b_last = tl.sum(g, axis=0)
        kd = k * tl.exp(b_last - b)[:, None]
        s = s * tl.exp(b_last) + tl.dot(tl.trans(kd), v, input_precision=PRECISION)
        while nxt == end:  # snapshots at this segment's end (several may share an offset)
            tl.store(s_tile + tl.load(snaps + snap_w + j) * stride_ss, s, mask=m2)
            j += 1
            nxt = tl.load(snaps + j)
    tl.store(s_tile + slot * stride_ss, s, mask=m2)


@_jit
def _prefill_output_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, h_ptr, o_ptr, seg_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_ot, stride_oh,
    stride_hs, stride_hh, stride_hk,
    DK: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    TILES: tl.constexpr, PRECISION: tl.constexpr,
):
    """Pass 2, one program per (segment, head, ``TILES`` d_v tiles): the segment's outputs,
    intra-segment attention with decay weights (``q k^T`` once for its tiles) plus its start
    state ``h[seg]`` read by every token."""
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    rt = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    mk = rk < DK
    rows = tl.load(seg_ptr + i * 3) + rt
    valid = rt < tl.load(seg_ptr + i * 3 + 1)
    mq = valid[:, None] & mk[None, :]
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + rk[None, :], mask=mq, other=0.0)
    k = tl.load(k_ptr + rows[:, None] * stride_kt + h * stride_kh + rk[None, :], mask=mq, other=0.0)
    g = tl.load(g_ptr + rows * stride_gt + h, mask=valid, other=0.0)
    b = tl.cumsum(g, axis=0)
    decay = tl.exp(tl.where(rt[:, None] >= rt[None, :], b[:, None] - b[None, :], float("-inf")))
    w = tl.dot(q, tl.trans(k), input_precision=PRECISION) * decay
    for t in tl.static_range(TILES):
        rv = (tl.program_id(2) * TILES + t) * BV + tl.arange(0, BV)
        mv = rv < DV
        mo = valid[:, None] & mv[None, :]
        v = tl.load(v_ptr + rows[:, None] * stride_vt + h * stride_vh + rv[None, :], mask=mo, other=0.0)
        s = tl.load(h_ptr + i * stride_hs + h * stride_hh + rk[:, None] * stride_hk + rv[None, :],
                    mask=mk[:, None] & mv[None, :], other=0.0)
        o = tl.dot(w, v, input_precision=PRECISION) + tl.dot(q, s, input_precision=PRECISION) * tl.exp(b)[:, None]
        tl.store(o_ptr + rows[:, None] * stride_ot + h * stride_oh + rv[None, :], o, mask=mo)


def _segments(lens: np.ndarray, starts: np.ndarray, offs: list[list[int]], chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """The segments of ``chunk_scan`` for every sequence at once, as (sequence, end offset)
    sorted: ends at absolute multiples of ``chunk``, at the snapshot offsets inside a sequence
    and at its end (none for an empty sequence)."""
    first = (-starts) % chunk
    first[first == 0] = chunk
    count = np.maximum(0, -(-(lens - first) // chunk))  # chunk multiples strictly inside
    seq = np.repeat(np.arange(len(lens)), count)
    step = np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)
    inner = [(i, o) for i, row in enumerate(offs) for o in row if 0 < o < lens[i]]
    nonempty = np.flatnonzero(lens > 0)
    seq = np.concatenate([seq, [i for i, _ in inner], nonempty]).astype(np.int64)
    end = np.concatenate([first[seq[: len(step)]] + step * chunk, [o for _, o in inner], lens[nonempty]])
    pairs = np.unique(np.stack([seq, end.astype(np.int64)], axis=1), axis=0)  # sorted by sequence, then end
    return pairs[:, 0], pairs[:, 1]


def _prefill_tables(cu_seqlens: list[int], starts: list[int], slots: list[int],
                    snaps: list[list[tuple[int, int]]], chunk: int, device: torch.device,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """One host-to-device copy: per sequence (first segment, segments, slot, start); per segment
    (first token row, tokens, end offset in its sequence); per sequence its snapshot offsets
    (ascending, ``SNAP_END`` after the last) followed by their destination slots."""
    n = len(slots)
    cu = np.asarray(cu_seqlens[: n + 1], dtype=np.int64)
    lens, start = np.diff(cu), np.asarray(starts, dtype=np.int64)
    offs = [[o for o, _ in row] for row in snaps] if snaps else [[] for _ in slots]
    for i, row in enumerate(offs):
        if row != sorted(row) or any(not 0 <= o <= lens[i] for o in row):
            raise ValueError(f"snapshot offsets of sequence {i} must ascend within [0, {lens[i]}]: {row}")
    seq, end = _segments(lens, start, offs, chunk)
    count = np.bincount(seq, minlength=n)
    first = np.cumsum(count) - count
    begin = np.where(np.arange(len(seq)) == first[seq], 0, np.roll(end, 1))  # a sequence's first starts at 0
    segs = np.stack([cu[seq] + begin, end - begin, end], axis=1)
    width = 1 + max(map(len, offs), default=0)
    table = np.full((n, 2, width), SNAP_END, dtype=np.int64)
    for i, row in enumerate(offs):
        table[i, 0, : len(row)] = row
        table[i, 1, : len(row)] = [d for _, d in snaps[i]]
    seqs = np.stack([first, count, np.asarray(slots, dtype=np.int64), start], axis=1)
    packed = torch.from_numpy(np.concatenate([seqs.ravel(), segs.ravel(), table.ravel()]).astype(np.int64))
    packed = packed.to(device, non_blocking=True)
    a, b = 4 * n, 4 * n + segs.size
    return packed[:a], packed[a:b], packed[b:], width, len(seq)


def chunk_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, states: torch.Tensor,
    cu_seqlens: list[int], slots: list[int], starts: list[int], snaps: list[list[tuple[int, int]]], chunk: int,
    *, tiles: tuple[int, int, int, int, int, int] | None = None, precision: str = "ieee",
) -> torch.Tensor:
    """``recurrent.chunk_prefill`` in two launches: q, k [T, H, dk], v [T, H, dv], g [T, H];
    ``states`` [slots, H, dk, dv] float32 (contiguous in its last dim), read and written in
    place; returns o [cu_seqlens[len(slots)], H, dv] float32. Pass 1 walks each sequence's
    segments with the state (parallel over sequences, heads and state tiles) and keeps each
    segment's start state in a buffer of segments x heads x d_k x d_v float32; pass 2 computes
    every segment's outputs at once. ``tiles`` overrides (pass 1 d_k tile, d_v tile, warps,
    pass 2 d_v tile, d_v tiles per program, warps), ``precision`` the dots' input precision (the
    benchmark's sweep)."""
    dk, dv = q.shape[-1], v.shape[-1]
    heads = q.shape[1]
    if states.dtype != torch.float32 or states.stride(-1) != 1:
        raise ValueError("states must be float32 with a contiguous last dim")
    total = cu_seqlens[len(slots)] if slots else 0
    q, k, v, g = (t.float() if t.stride(-1) == 1 else t.float().contiguous() for t in (q, k, v, g))
    o = torch.empty(total, heads, dv, dtype=torch.float32, device=q.device)
    if not slots:
        return o
    seqs, segs, table, width, num = _prefill_tables(cu_seqlens, starts, slots, snaps, chunk, q.device)
    hbuf = torch.empty(max(num, 1), heads, dk, dv, dtype=torch.float32, device=q.device)
    bk = max(16, triton.next_power_of_2(dk))
    bt = max(16, triton.next_power_of_2(chunk))
    sk, sv, sw, ov, ot, ow = tiles or (min(bk, 64), max(16, min(triton.next_power_of_2(dv), 64)), 4,
                                       max(16, min(triton.next_power_of_2(dv), 32)), 1, 8)
    _prefill_state_kernel[(len(slots), heads, triton.cdiv(dk, sk) * triton.cdiv(dv, sv))](
        k, v, g, states, hbuf, seqs, segs, table,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0),
        states.stride(0), states.stride(1), states.stride(2), hbuf.stride(0), hbuf.stride(1), hbuf.stride(2), width,
        DK=dk, DV=dv, BT=bt, BK=sk, BV=sv, PRECISION=precision, num_warps=sw,
    )
    if num:
        _prefill_output_kernel[(num, heads, triton.cdiv(triton.cdiv(dv, ov), ot))](
            q, k, v, g, hbuf, o, segs,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0),
            o.stride(0), o.stride(1), hbuf.stride(0), hbuf.stride(1), hbuf.stride(2),
            DK=dk, DV=dv, BT=bt, BK=bk, BV=ov, TILES=ot, PRECISION=precision, num_warps=ow,
        )
    return o
