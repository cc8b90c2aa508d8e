"""A persistent decode-layer kernel for qwen2-0.5b-shaped layers: the prototype's measurement.

One launch runs every layer: all SMs hold one program each, every sub-layer's work is spread over
them, and a grid-wide barrier (an atomic counter in global memory) separates the phases:

  1. RMSNorm (each program computes the row statistics itself) + qkv + bias
  2. o_proj + residual add (attention stands in: o_proj reads the q rows, as bench/pdl_layer.py)
  3. RMSNorm + gate_up + SiLU * up
  4. down, split over K into fp32 partials
  5. the partials summed (fixed order) + residual add

HF's rounding points throughout. Compared in the same run with today's cuBLAS + Triton chain
(bench/pdl_layer.py's ``cublas`` variant) on 24 layers with their own weights, in a CUDA graph.

    python3 bench/megakernel.py [--json bench/results/megakernel.json]
    TRITON_INTERPRET=1 python bench/megakernel.py --check-only   # on the CPU (fp16, one launch per phase)
    python bench/megakernel.py --compile-only   # no GPU needed: sm_90 shared memory and PTX per config

(The interpreter needs numpy < 2.4: newer numpy refuses ``int()`` of the 1-element arrays it
passes to ``range``.)
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import pdl_layer as base  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from _table import print_table  # noqa: E402

H, I, NQ, NQKV, EPS = base.H, base.I, base.NQ, base.NQKV, base.EPS
N_PHASES = 5


@triton.jit
def _grid_sync(bar_ptr, target):
    """Wait until ``target`` arrivals: every program of the grid has reached this point as often."""
    tl.debug_barrier()  # this program's stores are issued before its arrival is released
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _prefetch_tiles(w_ptr, first, n_tiles, n_progs, row_stride, col0,
                    ROWS: tl.constexpr, COLS: tl.constexpr, LINES: tl.constexpr, USE: tl.constexpr):
    """Pull into L2 the weight tiles this program will read next: rows [t * ROWS, (t + 1) * ROWS)
    x columns [col0, col0 + COLS) for t = first, first + n_progs, ...; one prefetch per 128 bytes."""
    if USE:
        r = tl.arange(0, ROWS)[:, None]
        line = tl.arange(0, LINES)[None, :]
        for t in range(first, n_tiles, n_progs):
            ptrs = w_ptr + (t * ROWS + r).to(tl.int64) * row_stride + col0 + tl.minimum(line * 64, COLS - 1)
            tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                                      dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _inv_rms(x_ptr, M, eps, HID: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    m = tl.arange(0, BM)
    ss = tl.zeros([BM], dtype=tl.float32)
    for k0 in range(0, HID, BK):
        k = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + m[:, None] * HID + k[None, :], mask=m[:, None] < M, other=0.0,
                    cache_modifier=".cg").to(tl.float32)
        ss += tl.sum(x * x, 1)
    return tl.rsqrt(ss / HID + eps)


@triton.jit
def _normed(x_ptr, ln_ptr, inv, M, k0, HID: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """Columns [k0, k0 + BK) of rmsnorm(x) * ln, rounded as HF rounds them."""
    m = tl.arange(0, BM)
    k = k0 + tl.arange(0, BK)
    x = tl.load(x_ptr + m[:, None] * HID + k[None, :], mask=m[:, None] < M, other=0.0,
                cache_modifier=".cg").to(tl.float32)
    xn = (x * inv[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(ln_ptr + k).to(tl.float32)
    return (xn * w[None, :]).to(x_ptr.dtype.element_ty)


@triton.jit
def _phase_qkv(res_ptr, ln_ptr, w_ptr, b_ptr, qkv_ptr, inv, M, pid, n_progs,
               HID: tl.constexpr, NOUT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    m = tl.arange(0, BM)
    for tile in range(pid, NOUT // BN, n_progs):
        n = tile * BN + tl.arange(0, BN)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, HID, BK):
            a = _normed(res_ptr, ln_ptr, inv, M, k0, HID, BM, BK)
            w = tl.load(w_ptr + n[:, None] * HID + (k0 + tl.arange(0, BK))[None, :])
            acc = tl.dot(a, tl.trans(w), acc)
        acc += tl.load(b_ptr + n).to(tl.float32)[None, :]
        tl.store(qkv_ptr + m[:, None] * NOUT + n[None, :], acc.to(qkv_ptr.dtype.element_ty), mask=m[:, None] < M)


@triton.jit
def _phase_o(qkv_ptr, w_ptr, res_ptr, M, pid, n_progs,
             HID: tl.constexpr, KQ: tl.constexpr, STRIDE_Q: tl.constexpr,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    m = tl.arange(0, BM)
    for tile in range(pid, HID // BN, n_progs):
        n = tile * BN + tl.arange(0, BN)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, KQ, BK):
            k = k0 + tl.arange(0, BK)
            a = tl.load(qkv_ptr + m[:, None] * STRIDE_Q + k[None, :], mask=m[:, None] < M, other=0.0,
                        cache_modifier=".cg")
            w = tl.load(w_ptr + n[:, None] * KQ + k[None, :])
            acc = tl.dot(a, tl.trans(w), acc)
        at = res_ptr + m[:, None] * HID + n[None, :]
        r = tl.load(at, mask=m[:, None] < M, other=0.0, cache_modifier=".cg").to(tl.float32)
        o = acc.to(res_ptr.dtype.element_ty).to(tl.float32)
        tl.store(at, (o + r).to(res_ptr.dtype.element_ty), mask=m[:, None] < M)


@triton.jit
def _phase_gate_up(res_ptr, ln_ptr, w_ptr, act_ptr, M, eps, pid, n_progs,
                   HID: tl.constexpr, INTER: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    m = tl.arange(0, BM)
    inv = _inv_rms(res_ptr, M, eps, HID, BM, BK)
    for tile in range(pid, INTER // BN, n_progs):
        n = tile * BN + tl.arange(0, BN)
        g = tl.zeros([BM, BN], dtype=tl.float32)
        u = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, HID, BK):
            a = _normed(res_ptr, ln_ptr, inv, M, k0, HID, BM, BK)
            k = k0 + tl.arange(0, BK)
            wg = tl.load(w_ptr + n[:, None] * HID + k[None, :])
            wu = tl.load(w_ptr + (INTER + n)[:, None] * HID + k[None, :])
            g = tl.dot(a, tl.trans(wg), g)
            u = tl.dot(a, tl.trans(wu), u)
        g = g.to(act_ptr.dtype.element_ty).to(tl.float32)
        u = u.to(act_ptr.dtype.element_ty).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(act_ptr.dtype.element_ty).to(tl.float32)
        tl.store(act_ptr + m[:, None] * INTER + n[None, :], (act * u).to(act_ptr.dtype.element_ty),
                 mask=m[:, None] < M)


@triton.jit
def _phase_down(act_ptr, w_ptr, part_ptr, M, pid, n_progs,
                HID: tl.constexpr, INTER: tl.constexpr, SPLIT: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    m = tl.arange(0, BM)
    k_len: tl.constexpr = INTER // SPLIT
    for item in range(pid, (HID // BN) * SPLIT, n_progs):
        tile = item // SPLIT
        s = item % SPLIT
        n = tile * BN + tl.arange(0, BN)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, k_len, BK):
            k = s * k_len + k0 + tl.arange(0, BK)
            a = tl.load(act_ptr + m[:, None] * INTER + k[None, :], mask=m[:, None] < M, other=0.0,
                        cache_modifier=".cg")
            w = tl.load(w_ptr + n[:, None] * INTER + k[None, :])
            acc = tl.dot(a, tl.trans(w), acc)
        tl.store(part_ptr + s * BM * HID + m[:, None] * HID + n[None, :], acc)


@triton.jit
def _phase_residual(part_ptr, res_ptr, stats_ptr, M, eps, pid, n_progs,
                    HID: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr, BLOCK: tl.constexpr):
    """Rows are owned whole here, so the next layer's RMSNorm statistics are written too."""
    cols = tl.arange(0, BLOCK)
    mask = cols < HID
    for row in range(pid, M, n_progs):
        d = tl.load(part_ptr + row * HID + cols, mask=mask, other=0.0, cache_modifier=".cg")
        for s in tl.static_range(1, SPLIT):
            d += tl.load(part_ptr + s * BM * HID + row * HID + cols, mask=mask, other=0.0, cache_modifier=".cg")
        r = tl.load(res_ptr + row * HID + cols, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        out = (d.to(res_ptr.dtype.element_ty).to(tl.float32) + r).to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * HID + cols, out, mask=mask)
        of = out.to(tl.float32)
        tl.store(stats_ptr + row, tl.rsqrt(tl.sum(of * of, 0) / HID + eps))


@triton.jit
def _decode_layers_kernel(
    res_ptr, qkv_ptr, act_ptr, part_ptr, stats_ptr, bar_ptr,
    w_qkv, b_qkv, w_o, w_gu, w_down, ln1, ln2,
    M, eps, layer_lo, layer_hi, first_layer,
    HID: tl.constexpr, INTER: tl.constexpr, NQKV_: tl.constexpr, NQ_: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BN_DOWN: tl.constexpr, BK_DOWN: tl.constexpr,
    SPLIT: tl.constexpr, ONLY_PHASE: tl.constexpr, SYNC: tl.constexpr, PREFETCH: tl.constexpr,
    STATS: tl.constexpr,
):
    """``res`` (the residual stream, [M, HID]) through layers [layer_lo, layer_hi). ONLY_PHASE < 0:
    all phases, barriers between them (needs every program resident); k >= 0: phase k alone, no
    barrier (the CPU interpreter, which runs programs one after another). SYNC=False drops the
    barriers of an all-phase run: wrong results, for timing what the barriers cost."""
    pid = tl.program_id(0)
    n_progs = tl.num_programs(0)
    arrivals = 0
    k_len: tl.constexpr = INTER // SPLIT
    _prefetch_tiles(w_qkv + layer_lo * NQKV_ * HID, pid, NQKV_ // BN, n_progs, HID, 0, BN, HID, 16, PREFETCH)
    m = tl.arange(0, BM)
    for layer in range(layer_lo, layer_hi):
        li = layer  # the largest stacked offset (gate_up, 24 layers) is 2.1e8: int32 holds it
        if ONLY_PHASE < 0 or ONLY_PHASE == 0:
            _prefetch_tiles(w_o + li * HID * NQ_, pid, HID // BN, n_progs, NQ_, 0, BN, NQ_, 16, PREFETCH)
            if STATS and layer > first_layer:  # written by the previous layer's residual phase
                inv = tl.load(stats_ptr + m, cache_modifier=".cg")
            else:
                inv = _inv_rms(res_ptr, M, eps, HID, BM, BK)
            _phase_qkv(res_ptr, ln1 + li * HID, w_qkv + li * NQKV_ * HID, b_qkv + li * NQKV_, qkv_ptr, inv, M,
                       pid, n_progs, HID, NQKV_, BM, BN, BK)
        if ONLY_PHASE < 0 and SYNC:
            arrivals += n_progs
            _grid_sync(bar_ptr, arrivals)
        if ONLY_PHASE < 0 or ONLY_PHASE == 1:
            gu = w_gu + li * 2 * INTER * HID
            _prefetch_tiles(gu, pid, INTER // BN, n_progs, HID, 0, BN, HID, 16, PREFETCH)
            _prefetch_tiles(gu + INTER * HID, pid, INTER // BN, n_progs, HID, 0, BN, HID, 16, PREFETCH)
            _phase_o(qkv_ptr, w_o + li * HID * NQ_, res_ptr, M, pid, n_progs, HID, NQ_, NQKV_, BM, BN, BK)
        if ONLY_PHASE < 0 and SYNC:
            arrivals += n_progs
            _grid_sync(bar_ptr, arrivals)
        if ONLY_PHASE < 0 or ONLY_PHASE == 2:
            for item in range(pid, (HID // BN_DOWN) * SPLIT, n_progs):  # this program's down items
                _prefetch_tiles(w_down + li * HID * INTER, item // SPLIT, item // SPLIT + 1, 1, INTER,
                                (item % SPLIT) * k_len, BN_DOWN, k_len, 32, PREFETCH)
            _phase_gate_up(res_ptr, ln2 + li * HID, w_gu + li * 2 * INTER * HID, act_ptr, M, eps, pid, n_progs,
                           HID, INTER, BM, BN, BK)
        if ONLY_PHASE < 0 and SYNC:
            arrivals += n_progs
            _grid_sync(bar_ptr, arrivals)
        if ONLY_PHASE < 0 or ONLY_PHASE == 3:
            if layer + 1 < layer_hi:
                _prefetch_tiles(w_qkv + (li + 1) * NQKV_ * HID, pid, NQKV_ // BN, n_progs, HID, 0, BN, HID, 16,
                                PREFETCH)
            _phase_down(act_ptr, w_down + li * HID * INTER, part_ptr, M, pid, n_progs, HID, INTER, SPLIT,
                        BM, BN_DOWN, BK_DOWN)
        if ONLY_PHASE < 0 and SYNC:
            arrivals += n_progs
            _grid_sync(bar_ptr, arrivals)
        if ONLY_PHASE < 0 or ONLY_PHASE == 4:
            _phase_residual(part_ptr, res_ptr, stats_ptr, M, eps, pid, n_progs, HID, SPLIT, BM, 1024)
        if ONLY_PHASE < 0 and SYNC:
            arrivals += n_progs
            _grid_sync(bar_ptr, arrivals)


@dataclass(frozen=True)
class Config:
    bn: int = 16
    bk: int = 128
    bn_down: int = 32
    bk_down: int = 64
    split: int = 4
    warps: int = 4
    stages: int = 3
    prefetch: bool = True
    stats: bool = True
    progs: int = 0  # 0: one per SM

    def __post_init__(self) -> None:
        k_len = I // self.split
        if I % self.split or k_len % self.bk_down or H % self.bk or H % self.bn or (2 * I) % self.bn:
            raise ValueError(f"{self}: the tiles must divide the layer (no masks on K in the prototype)")

    @property
    def name(self) -> str:
        return (f"mega n{self.bn} k{self.bk} down n{self.bn_down} k{self.bk_down} split{self.split} "
                f"w{self.warps} st{self.stages}" + (f" p{self.progs}" if self.progs else "")
                + (" +L2" if self.prefetch else "") + (" +stats" if self.stats else ""))


class Mega:
    """Stacked weights and buffers; ``step()`` runs all layers from the same input."""

    def __init__(self, cfg: Config, layers: list[base.Weights], m: int, device: str, per_phase: bool) -> None:
        self.cfg, self.m, self.n_layers, self.per_phase = cfg, m, len(layers), per_phase
        stack = {f: torch.stack([getattr(L, f) for L in layers]).contiguous() for f in
                 ("qkv", "bias", "o", "gate_up", "down", "ln1", "ln2")}
        self.w = stack
        dt = layers[0].qkv.dtype
        g = torch.Generator().manual_seed(1)
        self.x0 = torch.randn(m, H, generator=g).to(device=device, dtype=dt)
        self.res0 = torch.randn(m, H, generator=torch.Generator().manual_seed(2)).to(device=device, dtype=dt)
        self.bm = max(16, triton.next_power_of_2(m))
        self.res = torch.empty(m, H, device=device, dtype=dt)
        self.qkv = torch.empty(m, NQKV, device=device, dtype=dt)
        self.act = torch.empty(m, I, device=device, dtype=dt)
        self.parts = torch.empty(cfg.split, self.bm, H, device=device, dtype=torch.float32)
        self.bar = torch.zeros(1, device=device, dtype=torch.int32)
        self.stats = torch.empty(self.bm, device=device, dtype=torch.float32)
        props = torch.cuda.get_device_properties(device) if device == "cuda" else None
        self.progs = cfg.progs or (props.multi_processor_count if props else 8)

    def step(self) -> torch.Tensor:
        # The layer's input is x0 + res0 (the stand-in's first residual add, as pdl_layer does).
        torch.add(self.x0, self.res0, out=self.res)
        self.bar.zero_()
        phases = range(N_PHASES) if self.per_phase else (-1,)
        for lo in range(self.n_layers) if self.per_phase else (0,):
            hi = lo + 1 if self.per_phase else self.n_layers
            for p in phases:
                self._launch(lo, hi, p)
        return self.res.float()

    def timing_step(self, phase: int, sync: bool) -> None:
        """All layers in one launch of one phase (or all phases without barriers): timing only."""
        self.bar.zero_()
        self._launch(0, self.n_layers, phase, sync)

    def _launch(self, lo: int, hi: int, phase: int, sync: bool = True) -> None:
        c, w = self.cfg, self.w
        _decode_layers_kernel[(self.progs,)](
            self.res, self.qkv, self.act, self.parts, self.stats, self.bar,
            w["qkv"], w["bias"], w["o"], w["gate_up"], w["down"], w["ln1"], w["ln2"],
            self.m, EPS, lo, hi, 0,
            HID=H, INTER=I, NQKV_=NQKV, NQ_=NQ, BM=self.bm, BN=c.bn, BK=c.bk, BN_DOWN=c.bn_down,
            BK_DOWN=c.bk_down, SPLIT=c.split, ONLY_PHASE=phase, SYNC=sync, PREFETCH=c.prefetch and not base.INTERPRET, STATS=c.stats,
            num_warps=c.warps, num_stages=c.stages,
        )


CONFIGS = [
    Config(),  # v2: L2 prefetch of the next phase's tiles, row statistics, 3 stages
    Config(prefetch=False, stats=False),  # v1 at 3 stages (run 7: 55.0 us)
    Config(prefetch=False),
    Config(stats=False),
    Config(stages=2),
    Config(stages=4),
    Config(warps=8),
    Config(bn_down=16),
]


def two_layers_ref(probe: base.Runner, layers: list[base.Weights]) -> torch.Tensor:
    """Layer 1 after layer 0, both in plain torch (``base.reference_layer`` chained)."""
    first = base.reference_layer(probe, layers[0]).to(probe.x0.dtype)
    second = base.Runner(probe.v, layers[1:2], probe.m, str(first.device))
    second.x0 = torch.zeros_like(first)
    second.res0 = first
    return base.reference_layer(second, layers[1])


ARG_TYPES = {"res_ptr": "*bf16", "qkv_ptr": "*bf16", "act_ptr": "*bf16", "part_ptr": "*fp32", "stats_ptr": "*fp32",
             "bar_ptr": "*i32", "w_qkv": "*bf16", "b_qkv": "*bf16", "w_o": "*bf16", "w_gu": "*bf16",
             "w_down": "*bf16", "ln1": "*bf16", "ln2": "*bf16", "M": "i32", "eps": "fp32", "layer_lo": "i32",
             "layer_hi": "i32", "first_layer": "i32"}


def compile_only() -> int:
    """Compile every config for sm_90 on this machine (no GPU): shared memory, grid-barrier and
    prefetch instructions in the PTX. Catches configs that cannot launch before a device call."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _decode_layers_kernel
    rows = []
    for cfg in CONFIGS:
        consts = dict(HID=H, INTER=I, NQKV_=NQKV, NQ_=NQ, BM=64, BN=cfg.bn, BK=cfg.bk, BN_DOWN=cfg.bn_down,
                      BK_DOWN=cfg.bk_down, SPLIT=cfg.split, ONLY_PHASE=-1, SYNC=True, PREFETCH=cfg.prefetch,
                      STATS=cfg.stats)
        sig = {k: ARG_TYPES.get(k, "constexpr") for k in fn.arg_names}
        src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
        try:
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": cfg.warps, "num_stages": cfg.stages})
        except Exception as exc:  # noqa: BLE001 - a config that does not compile is a row, not a crash
            rows.append([cfg.name, "error", str(exc)[:60], ""])
            continue
        ptx = k.asm["ptx"]
        rows.append([cfg.name, f"{k.metadata.shared:,}", str(ptx.count("ld.global.gpu.acquire")),
                     str(ptx.count("prefetch.global.L2"))])
    print_table("megakernel configs compiled for sm_90 (no GPU)",
                ["config", "shared bytes", "acquire loads", "L2 prefetches"], rows, left=["config"])
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="bench/results/megakernel.json")
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90 here, no GPU")
    ap.add_argument("--m", type=int, default=64)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--check-only", action="store_true")
    args = ap.parse_args()
    if args.compile_only:
        return compile_only()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    layers = base.make_weights(args.layers, device)
    probe = base.Runner(base.VARIANTS[1], layers[:1], args.m, device)
    ref_one = base.reference_layer(probe, layers[0])
    rows, out = [], []
    if device == "cuda" and not args.check_only:
        ms = base.time_graph(base.Runner(base.VARIANTS[0], layers, args.m, device).step)
        rows.append(["cublas + Triton norm/SiLU (today)", f"{1000 * ms / args.layers:.1f}", "-"])
        out.append({"variant": "cublas", "us_per_layer": 1000 * ms / args.layers})
    for cfg in CONFIGS[:1] if args.check_only else CONFIGS:
        try:
            one = Mega(cfg, layers[:1], args.m, device, per_phase=device == "cpu")
            err = ((one.step() - ref_one).abs().max() / ref_one.abs().max()).item()
            # Two layers (the second reads the row statistics the first wrote): one launch with
            # barriers against one launch per phase (the interpreter: both per phase).
            two = Mega(cfg, layers[:2], args.m, device, per_phase=device == "cpu").step()
            per = Mega(cfg, layers[:2], args.m, device, per_phase=True).step()
            two_ref = two_layers_ref(probe, layers[:2])
            err = max(err, ((two - two_ref).abs().max() / two_ref.abs().max()).item(),
                      ((per - two_ref).abs().max() / two_ref.abs().max()).item())
            if args.check_only:
                rows.append([cfg.name, "-", f"{err:.1e}"])
                continue
            full = Mega(cfg, layers, args.m, device, per_phase=False)
            ms = base.time_graph(full.step)
        except Exception as exc:  # a config that does not compile: record it and go on
            rows.append([cfg.name, "error", str(exc)[:60]])
            out.append({"variant": cfg.name, "error": str(exc)[:400]})
            print(f"  {cfg.name}: {exc}", flush=True)
            continue
        us = 1000 * ms / args.layers
        rows.append([cfg.name, f"{us:.1f}", f"{err:.1e}"])
        if cfg == CONFIGS[0]:  # what the barriers cost
            for p, pname in [(-1, "all phases, no barriers")]:
                t = base.time_graph(lambda p=p: full.timing_step(p, sync=False))
                rows.append([f"  {pname}", f"{1000 * t / args.layers:.1f}", "timing only"])
                out.append({"variant": f"{cfg.name}: {pname}", "us_per_layer": 1000 * t / args.layers})
        out.append({"variant": cfg.name, "us_per_layer": us, "rel_err": err, **cfg.__dict__})
        print(f"  {cfg.name}: {us:.1f} us/layer, err {err:.1e}", flush=True)
    print_table(f"qwen2-0.5b decode layer w/o attention, M={args.m}, {args.layers} layers, one persistent kernel",
                ["variant", "us / layer", "rel err"], rows, left=["variant"])
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                                "m": args.m, "layers": args.layers, "rows": out}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
