"""Small-batch linear layers with their neighbours folded in (Triton, CUDA).

At decode batch sizes a 896-wide layer's GEMMs, RMSNorms, SiLU and residual adds are each a
latency-bound launch that runs 2-10x its bytes (workers/NOTES.md, run 3). ``fused_linear`` does a
whole sub-layer in one launch:

    out = epilogue(prologue(x) @ weight.T)
    prologue: optional RMSNorm of each row of x (HF's rounding points)
    epilogue: optional bias, optional SwiGLU (weight rows = [gate | up]), optional residual add

and spreads the weight over the GPU with split-K: programs of one output tile each reduce a
slice of K into a workspace, and the last one to finish (an atomic ticket per tile) sums the
slices in a fixed order and runs the epilogue. Results are deterministic, and every rounding
point is HF's: ``bf16(acc)`` before a residual add, ``bf16(silu(bf16(gate))) * bf16(up)``.

Ownership and invariants:
- One workspace per device (fp32 partial sums + one int32 ticket per output tile). Tickets are
  zero between launches: the last program of a tile resets its ticket. Launches on one stream
  never overlap, so they share it; the engine runs its model on one stream.
- The workspace only grows outside CUDA graph capture (a captured graph keeps pointing at the
  buffer it saw). During capture a launch that would need more splits than the workspace holds
  runs without split-K instead (correct, slower); the engine's eager warm-up at the largest
  graph size sizes it first.
- ``residual`` may be ``out`` (in-place update of the residual stream): each element is read and
  written by the one program that owns its tile.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs never call into this module
    triton = None
    tl = None

# Most tokens a fused launch serves: above it cuBLAS GEMMs win (prefill shapes).
MAX_FUSED_TOKENS = 256


def _jit(fn):  # type: ignore[no-untyped-def]
    return triton.jit(fn) if triton is not None else fn


@_jit
def _fused_linear_kernel(
    x_ptr, w_ptr, out_ptr, bias_ptr, res_ptr, nw_ptr, ws_ptr, ticket_ptr, stats_ptr,
    M, N, K, eps, stride_xm, stride_wn, stride_om, stride_rm, k_per_split, split_k, stats_tiles,
    NORM: tl.constexpr, GLU: tl.constexpr, BIAS: tl.constexpr, RESIDUAL: tl.constexpr,
    STATS_OUT: tl.constexpr, STATS_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    dt = x_ptr.dtype.element_ty
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn

    if NORM:  # row statistics: the per-tile sums of squares the stream's last writer left
        t = tl.arange(0, STATS_BLOCK)
        parts = tl.load(stats_ptr + t[:, None] * M + rm[None, :],
                        mask=(t < stats_tiles)[:, None] & m_ok[None, :], other=0.0)
        rstd = tl.rsqrt(tl.sum(parts, 0) / K + eps)

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k in range(k_lo, k_hi, BLOCK_K):
        kk = k + rk
        k_ok = kk < k_hi
        a = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if NORM:  # HF: weight * bf16(x * rstd), rounded again
            nw = tl.load(nw_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
            a = ((a.to(tl.float32) * rstd[:, None]).to(dt).to(tl.float32) * nw[None, :]).to(dt)
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(w), acc)
        if GLU:  # the up rows sit N rows below the gate rows
            w2 = tl.load(w_rows + N * stride_wn + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc_up = tl.dot(a, tl.trans(w2), acc_up)

    tile_mask = m_ok[:, None] & n_ok[None, :]
    if split_k == 1:
        _epilogue(acc, acc_up, rm, rn, N, M, pid_n, tile_mask, out_ptr, bias_ptr, res_ptr, stats_ptr,
                  stride_om, stride_rm, GLU, BIAS, RESIDUAL, STATS_OUT)
    else:
        # Workspace layout: [split_k, 2 (gate, up), M, N] fp32.
        part = ws_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :]
        plane = M * N
        tl.store(part + (pid_k * 2) * plane, acc, mask=tile_mask)
        if GLU:
            tl.store(part + (pid_k * 2 + 1) * plane, acc_up, mask=tile_mask)
        tl.debug_barrier()  # every thread's partial is written before the ticket releases it
        tile = pid_m * tl.num_programs(0) + pid_n
        ticket = tl.atomic_add(ticket_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if ticket == split_k - 1:  # the last split of this tile: reduce in split order
            tl.debug_barrier()
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(split_k):
                acc += tl.load(part + (s * 2) * plane, mask=tile_mask, other=0.0, cache_modifier=".cg")
                if GLU:
                    acc_up += tl.load(part + (s * 2 + 1) * plane, mask=tile_mask, other=0.0,
                                      cache_modifier=".cg")
            tl.atomic_xchg(ticket_ptr + tile, 0)  # ready for the next launch
            _epilogue(acc, acc_up, rm, rn, N, M, pid_n, tile_mask, out_ptr, bias_ptr, res_ptr, stats_ptr,
                      stride_om, stride_rm, GLU, BIAS, RESIDUAL, STATS_OUT)


@_jit
def _epilogue(acc, acc_up, rm, rn, N, M, pid_n, tile_mask, out_ptr, bias_ptr, res_ptr, stats_ptr,
              stride_om, stride_rm, GLU: tl.constexpr, BIAS: tl.constexpr, RESIDUAL: tl.constexpr,
              STATS_OUT: tl.constexpr):
    dt = out_ptr.dtype.element_ty
    if BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    y = acc.to(dt).to(tl.float32)
    if GLU:
        act = (y / (1.0 + tl.exp(-y))).to(dt).to(tl.float32)
        y = act * acc_up.to(dt).to(tl.float32)
    if RESIDUAL:
        r = tl.load(res_ptr + rm.to(tl.int64)[:, None] * stride_rm + rn[None, :], mask=tile_mask, other=0.0)
        y = y.to(dt).to(tl.float32) + r.to(tl.float32)
    y = y.to(dt)
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :], y, mask=tile_mask)
    if STATS_OUT:  # this tile's share of each row's sum of squares (the next norm prologue reads it)
        yf = tl.where(tile_mask, y.to(tl.float32), 0.0)
        tl.store(stats_ptr + pid_n * M + rm, tl.sum(yf * yf, 1), mask=rm < M)


@_jit
def _row_sumsq_kernel(x_ptr, stats_ptr, K, stride_xm, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_xm + cols, mask=cols < K, other=0.0).to(tl.float32)
    tl.store(stats_ptr + row, tl.sum(x * x, 0))


@dataclass(frozen=True)
class Plan:
    """Tile sizes and split-K of one launch."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    k_per_split: int
    num_warps: int = 4
    num_stages: int = 4

    def grid(self, m: int, n: int) -> tuple[int, int, int]:
        return (-(-n // self.block_n), -(-m // self.block_m), self.split_k)


# Split-K only pays where K is long: each split writes and reads back an M x N fp32 partial,
# which at K = 896 and M = 64 costs more bytes than the weight slice it saves (measured).
SPLIT_MIN_K = 2048
MIN_BLOCK_N = 16


def plan(m: int, n: int, k: int, num_sms: int, max_split: int = 16) -> Plan:
    """One M tile when it fits (the weight is read once), narrow N tiles until every SM streams,
    split-K only for long K."""
    block_m = min(128, max(16, _next_pow2(m)))
    block_k = 128 if k >= 128 else max(16, _next_pow2(k))
    m_tiles = -(-m // block_m)
    block_n = 64
    while block_n > MIN_BLOCK_N and m_tiles * -(-n // block_n) < num_sms:
        block_n //= 2
    tiles = m_tiles * -(-n // block_n)
    k_blocks = -(-k // block_k)
    split = 1 if k < SPLIT_MIN_K else max(1, min(max_split, (2 * num_sms) // tiles, k_blocks // 2))
    per = -(-k_blocks // split) * block_k
    return Plan(block_m, block_n, block_k, -(-k // per), per, 8 if block_m >= 128 else 4)


def _next_pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


class _Workspace:
    """Per-device partial sums and tickets (see the module docstring for the invariants)."""

    def __init__(self) -> None:
        self.partials: dict[torch.device, torch.Tensor] = {}
        self.tickets: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device, floats: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Buffers holding at least the given sizes; None when they would have to grow during
        a graph capture."""
        ws, tk = self.partials.get(device), self.tickets.get(device)
        if ws is not None and tk is not None and ws.numel() >= floats and tk.numel() >= tiles:
            return ws, tk
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        floats = max(floats, ws.numel() if ws is not None else 0)
        tiles = max(tiles, tk.numel() if tk is not None else 0)
        self.partials[device] = torch.empty(floats, dtype=torch.float32, device=device)
        self.tickets[device] = torch.zeros(tiles, dtype=torch.int32, device=device)
        return self.partials[device], self.tickets[device]


_WORKSPACE = _Workspace()
_NUM_SMS: dict[torch.device, int] = {}


def _num_sms(device: torch.device) -> int:
    if device not in _NUM_SMS:  # the interpreter (CPU tensors) plans for a small GPU
        cuda = device.type == "cuda"
        _NUM_SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 8
    return _NUM_SMS[device]


class ResidualStream:
    """The residual stream of one forward pass ([tokens, hidden], updated in place) and the sum
    of squares of each row, split by column tile.

    Invariant: ``stats[:tiles]`` sum to each row's sum of squares of ``h`` as it is now. Every
    launch that writes ``h`` (``add_linear``) rewrites them from its epilogue, so a norm prologue
    (``norm_linear``) reads [tiles, rows] floats instead of making a pass over the rows.
    """

    def __init__(self, h: torch.Tensor, plan_for: Plan | None = None) -> None:
        self.h = h
        m, k = h.shape
        self.stats = torch.empty((-(-k // MIN_BLOCK_N), max(m, 1)), dtype=torch.float32, device=h.device)
        self.tiles = 1
        self._plan = plan_for
        if m:
            _row_sumsq_kernel[(m,)](h, self.stats, k, h.stride(0), BLOCK=_next_pow2(k), num_warps=4)

    def norm_linear(self, weight: torch.Tensor, norm_weight: torch.Tensor, eps: float, *,
                    bias: torch.Tensor | None = None, glu: bool = False) -> torch.Tensor:
        """``linear(rmsnorm(h) * norm_weight)`` (+bias; SwiGLU of [gate | up] rows with ``glu``)."""
        return _launch(self.h, weight, bias=bias, norm=(norm_weight, eps, self.stats, self.tiles), glu=glu,
                       split_plan=self._plan)

    def add_linear(self, x: torch.Tensor, weight: torch.Tensor) -> None:
        """``h += x @ weight.T`` (rounded as HF: ``bf16(bf16(x @ w.T) + h)``)."""
        self.tiles = _launch(x, weight, residual=self.h, out=self.h, stats_out=self.stats, split_plan=self._plan)


def fused_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    glu: bool = False,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    split_plan: Plan | None = None,
) -> torch.Tensor:
    """``epilogue(x @ weight.T)`` in one launch: +bias, SwiGLU (``glu``: weight is [2N, K], gate
    rows first), +residual (``out`` may be ``residual``). The RMSNorm prologue needs the row
    statistics a ``ResidualStream`` keeps."""
    if out is None:
        rows = weight.shape[0] // 2 if glu else weight.shape[0]
        out = torch.empty((x.shape[0], rows), dtype=x.dtype, device=x.device)
    _launch(x, weight, bias=bias, glu=glu, residual=residual, out=out, split_plan=split_plan)
    return out


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    norm: tuple[torch.Tensor, float, torch.Tensor, int] | None = None,
    glu: bool = False,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    stats_out: torch.Tensor | None = None,
    split_plan: Plan | None = None,
) -> torch.Tensor | int:
    """One kernel launch; returns the output (``out`` is None) or, with ``stats_out``, the
    number of column tiles whose row statistics it wrote."""
    m, k = x.shape
    n = weight.shape[0] // 2 if glu else weight.shape[0]
    norm_weight, eps, stats_in, stats_tiles = norm if norm is not None else (None, 0.0, None, 0)
    _check(x, weight, k, glu, bias, norm_weight, residual, out, m, n)
    result = out if out is not None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    p = split_plan or plan(m, n, k, _num_sms(x.device))
    grid = p.grid(m, n)
    ws = tickets = x  # placeholders: never touched without split-K
    if p.split_k > 1:
        buffers = _WORKSPACE.get(x.device, p.split_k * 2 * m * n, grid[0] * grid[1])
        if buffers is None:
            p = Plan(p.block_m, p.block_n, p.block_k, 1, k, p.num_warps, p.num_stages)
            grid = p.grid(m, n)
        else:
            ws, tickets = buffers
    if m:
        stats = stats_out if stats_out is not None else stats_in
        _fused_linear_kernel[grid](
            x, weight, result, bias if bias is not None else x, residual if residual is not None else x,
            norm_weight if norm_weight is not None else x, ws, tickets, stats if stats is not None else x,
            m, n, k, eps, x.stride(0), weight.stride(0), result.stride(0),
            residual.stride(0) if residual is not None else 0, p.k_per_split, p.split_k, stats_tiles,
            NORM=norm is not None, GLU=glu, BIAS=bias is not None, RESIDUAL=residual is not None,
            STATS_OUT=stats_out is not None, STATS_BLOCK=max(2, _next_pow2(stats_tiles)),
            BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_K=p.block_k,
            num_warps=p.num_warps, num_stages=p.num_stages,
        )
    return grid[0] if stats_out is not None else result


def _check(
    x: torch.Tensor, weight: torch.Tensor, k: int, glu: bool, bias: torch.Tensor | None,
    norm_weight: torch.Tensor | None, residual: torch.Tensor | None, out: torch.Tensor | None,
    m: int, n: int,
) -> None:
    if weight.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"fused_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} disagree")
    if glu and (weight.shape[0] % 2 or bias is not None):
        raise ValueError("fused_linear: glu needs [gate | up] weight rows and no bias")
    if norm_weight is not None and norm_weight.shape != (k,):
        raise ValueError(f"fused_linear: norm weight {tuple(norm_weight.shape)} is not [{k}]")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"fused_linear: bias {tuple(bias.shape)} is not [{n}]")
    for name, t in (("residual", residual), ("out", out)):
        if t is not None and (t.shape != (m, n) or t.stride(1) != 1):
            raise ValueError(f"fused_linear: {name} {tuple(t.shape)} is not [{m}, {n}] rows")
