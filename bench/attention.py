"""GPU microbenchmark of the Triton attention kernels against torch SDPA (flash), in one run.

Measures, on the GPU it runs on:
* the two ceilings: device-to-device copy bandwidth (bytes read + written) and bf16 matmul rate
  (8192^3 ``torch.matmul`` on random data);
* paged decode (batch 1..256 x context 1k..32k): achieved HBM GB/s (K+V+q+out bytes) and the
  fraction of the copy ceiling, against SDPA flash on contiguous K/V (the GQA group folded into
  SDPA's query axis, so it also reads each K/V byte once);
* paged prefill (one prompt 1k..32k, a batch, a prefix hit): TFLOP/s (causal FLOPs) and the
  fraction of the matmul ceiling, against SDPA flash with ``is_causal`` on contiguous K/V;
* small sweeps of the launch configs at representative points.

Every timing replays a CUDA graph of the calls (launch overhead out), rotates among input sets
bigger than L2 where one set would fit in it, and takes the median of repeated replays. Each Triton
result is checked against SDPA's (relative error column). Imports only torch, triton, rich and
workers.model.attention, so it runs on a bare CUDA image:

    python3 bench/attention.py [--json bench/results/attention.json] [--budget-s 300] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _table import print_table  # noqa: E402  (bench/ is on sys.path when run as a script)

from workers.model.attention.triton_backend import (  # noqa: E402
    DecodeConfig,
    PrefillConfig,
    TritonBackend,
)

# Llama-3-8B-like attention layer.
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = torch.bfloat16
DEVICE = "cuda"
L2_ROTATE_BYTES = 256 << 20  # rotate input sets until this many bytes are in play
MAX_DECODE_TOKENS = 2 << 20  # skip decode cells with more KV tokens than this (8 GiB per copy)

DECODE_BATCHES = [1, 8, 32, 64, 128, 256]
DECODE_CONTEXTS = [1024, 4096, 16384, 32768]
PREFILL_CASES = [  # (name, [(ctx, new tokens) per sequence])
    ("1k", [(1024, 1024)]),
    ("4k", [(4096, 4096)]),
    ("16k", [(16384, 16384)]),
    ("32k", [(32768, 32768)]),
    ("8x4k", [(4096, 4096)] * 8),
    ("hit 30k+2k", [(32768, 2048)]),  # prefix hit: 30k cached, 2k new
]
DECODE_SWEEP = {
    "c4 (default)": DecodeConfig(),
    "c3": DecodeConfig(64, 4, 3, 3, 256),
    "c5": DecodeConfig(64, 4, 3, 5, 256),
    "c8": DecodeConfig(64, 4, 3, 8, 256),
    "c4 m512": DecodeConfig(64, 4, 3, 4, 512),
}
DECODE_SWEEP_CELLS = [(1, 32768), (4, 16384), (8, 16384), (8, 32768), (16, 8192), (32, 4096)]
PREFILL_SWEEP = {
    "m128n128w8s3 (default)": PrefillConfig(128, 128, 8, 3),
    "m128n64w8s3 (v1)": PrefillConfig(128, 64, 8, 3),
    "m128n128w8s2": PrefillConfig(128, 128, 8, 2),
    "m64n128w4s2": PrefillConfig(64, 128, 4, 2),
    "m128n64w8s4": PrefillConfig(128, 64, 8, 4),
}
PREFILL_SWEEP_CELLS: list[tuple[str, list[tuple[int, int]]]] = []  # run 2 settled these


@dataclass
class Row:
    kind: str
    case: str
    config: str
    triton_ms: float | None = None
    sdpa_ms: float | None = None
    gbs: float | None = None
    tflops: float | None = None
    frac_ceiling: float | None = None
    speedup_vs_sdpa: float | None = None
    rel_err_vs_sdpa: float | None = None
    splits: int | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------------- timing


def time_graph(calls: list[Callable[[], Any]], target_s: float = 0.25) -> float:
    """Median milliseconds per call, replaying one CUDA graph that holds all the calls."""
    for c in calls:  # compile and warm up outside the capture
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    once = max(start.elapsed_time(end), 1e-3)
    reps = int(min(200, max(5, target_s * 1e3 / once)))
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    del graph
    return statistics.median(times)


def time_plain(fn: Callable[[], Any], reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure_ceilings() -> dict[str, float]:
    n = 4 << 30  # 4 GiB each way
    a = torch.randint(0, 255, (n,), dtype=torch.uint8, device=DEVICE)
    b = torch.empty_like(a)
    copy_ms = time_plain(lambda: b.copy_(a))
    del a, b
    m = 8192
    x = torch.randn(m, m, dtype=DTYPE, device=DEVICE)
    y = torch.randn(m, m, dtype=DTYPE, device=DEVICE)
    mm_ms = time_plain(lambda: torch.matmul(x, y))
    del x, y
    torch.cuda.empty_cache()
    return {
        "copy_gbs": 2 * n / copy_ms / 1e6,
        "copy_ms": copy_ms,
        "matmul_tflops": 2 * m**3 / mm_ms / 1e9,
        "matmul_ms": mm_ms,
    }


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


# ------------------------------------------------------------------------------------- decode


@dataclass
class DecodeSet:
    q: torch.Tensor  # [B, H, D]
    k: torch.Tensor  # [B, kvh, ctx, D] contiguous (SDPA)
    v: torch.Tensor
    k_cache: torch.Tensor  # paged copies of k, v in shuffled blocks
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor


def make_decode_set(batch: int, ctx: int, block_size: int) -> DecodeSet:
    kv_shape = (batch, NUM_KV_HEADS, ctx, HEAD_DIM)
    k = torch.randn(kv_shape, dtype=DTYPE, device=DEVICE)
    v = torch.randn(kv_shape, dtype=DTYPE, device=DEVICE)
    nb = ctx // block_size
    tables = torch.randperm(batch * nb, device=DEVICE).view(batch, nb)
    caches = []
    for x in (k, v):
        c = torch.empty((batch * nb, block_size, NUM_KV_HEADS, HEAD_DIM), dtype=DTYPE, device=DEVICE)
        c[tables] = x.transpose(1, 2).reshape(batch, nb, block_size, NUM_KV_HEADS, HEAD_DIM)
        caches.append(c)
    q = torch.randn((batch, NUM_HEADS, HEAD_DIM), dtype=DTYPE, device=DEVICE)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEVICE)
    return DecodeSet(q, k, v, caches[0], caches[1], tables.to(torch.int32), lens)


def sdpa_decode(s: DecodeSet, scale: float) -> torch.Tensor:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b = s.q.shape[0]
    group = NUM_HEADS // NUM_KV_HEADS
    q = s.q.view(b, NUM_KV_HEADS, group, HEAD_DIM)  # group folded into the query axis
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        o = F.scaled_dot_product_attention(q, s.k, s.v, scale=scale)
    return o.reshape(b, NUM_HEADS, HEAD_DIM)


def decode_bytes(batch: int, ctx: int) -> int:
    return 2 * batch * ctx * NUM_KV_HEADS * HEAD_DIM * 2 + 2 * batch * NUM_HEADS * HEAD_DIM * 2


def n_sets(set_bytes: int) -> int:
    return min(64, max(1, math.ceil(L2_ROTATE_BYTES / set_bytes)))


def bench_decode_cell(
    batch: int, ctx: int, configs: dict[str, DecodeConfig], ceil: dict[str, float],
    block_size: int, with_peer: bool,
) -> list[Row]:
    scale = 1 / math.sqrt(HEAD_DIM)
    nbytes = decode_bytes(batch, ctx)
    sets = [make_decode_set(batch, ctx, block_size) for _ in range(n_sets(nbytes))]
    case = f"B={batch} ctx={ctx // 1024}k"
    sdpa_ms, ref = None, None
    peer_err = None
    if with_peer:
        try:
            ref = sdpa_decode(sets[0], scale)
            sdpa_ms = time_graph([lambda s=s: sdpa_decode(s, scale) for s in sets])
        except Exception as e:  # noqa: BLE001  (a peer that cannot run is reported, not fatal)
            peer_err = f"sdpa: {type(e).__name__}: {e}"[:200]
    rows = []
    for name, cfg in configs.items():
        row = Row("decode", case, name, sdpa_ms=sdpa_ms, error=peer_err)
        try:
            be = TritonBackend(decode_config=cfg)

            def call(s: DecodeSet, be: TritonBackend = be) -> torch.Tensor:
                return be.decode(s.q, s.k_cache, s.v_cache, s.block_tables, s.context_lens, scale)

            out = call(sets[0])
            row.splits = be.decode_splits(batch, NUM_KV_HEADS, ctx, sets[0].q.device, None, HEAD_DIM)[0]
            if ref is not None:
                row.rel_err_vs_sdpa = rel_err(out, ref)
            if not bool(torch.isfinite(out).all()):
                raise RuntimeError("non-finite output")
            row.triton_ms = time_graph([lambda s=s: call(s) for s in sets])
            row.gbs = nbytes / row.triton_ms / 1e6
            row.frac_ceiling = row.gbs / ceil["copy_gbs"]
            if sdpa_ms:
                row.speedup_vs_sdpa = sdpa_ms / row.triton_ms
            row.extra["sdpa_gbs"] = nbytes / sdpa_ms / 1e6 if sdpa_ms else None
            row.extra["input_sets"] = len(sets)
        except Exception as e:  # noqa: BLE001
            row.error = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
    del sets
    torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------- engine graph shapes

# The engine's decode graphs: batch 64, contexts around 600 tokens, block tables padded to the
# model's whole length (the split count is sized for that padding). (name, heads, KV heads, dim)
GRAPH_SHAPES = [("qwen2-0.5b", 14, 2, 64), ("llama3-8b", 32, 8, 128)]
GRAPH_TABLE_BLOCKS = 2052  # max_model_len 32832 / 16, as bench/engine.py sizes it
GRAPH_SWEEP = {
    "auto (default)": DecodeConfig(),
    "n64 c4": DecodeConfig(64, 4, 3, 4, 256),
    "n64 c8": DecodeConfig(64, 4, 3, 8, 256),
    "n128 c4": DecodeConfig(128, 4, 3, 4, 256),
    "n128 c8": DecodeConfig(128, 4, 3, 8, 256),
    "n256 c4 w8": DecodeConfig(256, 8, 2, 4, 256),
    "n64 c16": DecodeConfig(64, 4, 3, 16, 64),
    "n32 c8": DecodeConfig(32, 4, 3, 8, 64),
}


def bench_graph_shapes(ceil: dict[str, float], batch: int = 64, mean_ctx: int = 600) -> list[Row]:
    """Decode at the engine's graph shapes (padded tables, real contexts ~``mean_ctx``), each
    config against the torch backend's output; GB/s over the K/V bytes of the real contexts."""
    from workers.model.attention.torch_backend import TorchBackend

    rows: list[Row] = []
    gen = torch.Generator(device="cpu").manual_seed(0)
    for name, heads, kvh, dim in GRAPH_SHAPES:
        ctx = (torch.rand(batch, generator=gen) * mean_ctx + mean_ctx // 2).int().clamp(min=1)
        need = (ctx + 15) // 16
        nbytes = int(ctx.sum()) * kvh * dim * 2 * 2 + 2 * batch * heads * dim * 2
        sets = []
        for _ in range(n_sets(nbytes)):
            total = int(need.sum())
            perm = torch.randperm(total, generator=gen).to(torch.int32)
            tables = torch.zeros(batch, GRAPH_TABLE_BLOCKS, dtype=torch.int32)
            off = 0
            for i, n in enumerate(need.tolist()):
                tables[i, :n] = perm[off : off + n]
                off += n
            kc = torch.randn(total, 16, kvh, dim, dtype=DTYPE, device=DEVICE)
            vc = torch.randn(total, 16, kvh, dim, dtype=DTYPE, device=DEVICE)
            q = torch.randn(batch, heads, dim, dtype=DTYPE, device=DEVICE)
            sets.append((q, kc, vc, tables.to(DEVICE), ctx.to(DEVICE)))
        scale = 1 / math.sqrt(dim)
        ref = TorchBackend().decode(*sets[0], scale)
        for cname, cfg in GRAPH_SWEEP.items():
            row = Row("decode graph", f"{name} B={batch} ctx~{mean_ctx}", cname)
            try:
                be = TritonBackend(decode_config=cfg)
                out = be.decode(*sets[0], scale)
                row.rel_err_vs_sdpa = rel_err(out, ref)
                row.splits = be.decode_splits(batch, kvh, GRAPH_TABLE_BLOCKS * 16, torch.device(DEVICE), None, dim)[0]
                row.triton_ms = time_graph([lambda s=s, be=be: be.decode(*s, scale) for s in sets])
                row.gbs = nbytes / row.triton_ms / 1e6
                row.frac_ceiling = row.gbs / ceil["copy_gbs"]
            except Exception as e:  # noqa: BLE001
                row.error = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
        # The same contexts with tables only as wide as they need (no graph padding).
        row = Row("decode graph", f"{name} B={batch} ctx~{mean_ctx}", "auto, unpadded tables")
        width = int(need.max())
        narrow = [(q, kc, vc, t[:, :width].contiguous(), c) for q, kc, vc, t, c in sets]
        be = TritonBackend()
        row.splits = be.decode_splits(batch, kvh, width * 16, torch.device(DEVICE), None, dim)[0]
        row.triton_ms = time_graph([lambda s=s: be.decode(*s, scale) for s in narrow])
        row.gbs = nbytes / row.triton_ms / 1e6
        row.frac_ceiling = row.gbs / ceil["copy_gbs"]
        rows.append(row)
        del sets, narrow
        torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------- prefill


@dataclass
class PrefillSet:
    q: torch.Tensor  # [total, H, D]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    cu_seqlens: torch.Tensor
    context_lens: torch.Tensor
    peer: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # SDPA q, k, v [B, H, N, D]


def make_prefill_set(seqs: list[tuple[int, int]], block_size: int) -> PrefillSet:
    b = len(seqs)
    ctx = max(c for c, _ in seqs)
    uniform = all(c == n == ctx for c, n in seqs)
    kv_shape = (b, NUM_KV_HEADS, ctx, HEAD_DIM)
    k = torch.randn(kv_shape, dtype=DTYPE, device=DEVICE)
    v = torch.randn(kv_shape, dtype=DTYPE, device=DEVICE)
    nb = -(-ctx // block_size)
    tables = torch.randperm(b * nb, device=DEVICE).view(b, nb)
    caches = []
    for x in (k, v):
        pad = torch.zeros((b, NUM_KV_HEADS, nb * block_size, HEAD_DIM), dtype=DTYPE, device=DEVICE)
        pad[:, :, :ctx] = x
        c = torch.empty((b * nb, block_size, NUM_KV_HEADS, HEAD_DIM), dtype=DTYPE, device=DEVICE)
        c[tables] = pad.transpose(1, 2).reshape(b, nb, block_size, NUM_KV_HEADS, HEAD_DIM)
        caches.append(c)
    q_lens = [n for _, n in seqs]
    q = torch.randn((sum(q_lens), NUM_HEADS, HEAD_DIM), dtype=DTYPE, device=DEVICE)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([c for c, _ in seqs], dtype=torch.int32, device=DEVICE)
    peer = None
    if uniform:  # SDPA needs one shape and top-left causal alignment: misses of equal length only
        group = NUM_HEADS // NUM_KV_HEADS
        pq = q.view(b, ctx, NUM_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
        pk = k.repeat_interleave(group, dim=1).contiguous()  # expanded outside the timing
        pv = v.repeat_interleave(group, dim=1).contiguous()
        peer = (pq, pk, pv)
    del k, v
    return PrefillSet(q, caches[0], caches[1], tables.to(torch.int32), cu, lens, peer)


def sdpa_prefill(p: tuple[torch.Tensor, torch.Tensor, torch.Tensor], scale: float) -> torch.Tensor:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        return F.scaled_dot_product_attention(*p, is_causal=True, scale=scale)


def prefill_flops(seqs: list[tuple[int, int]]) -> float:
    """Causal: new token j of a sequence attends to ctx - n + j + 1 keys; 2 matmuls x 2 FLOPs."""
    pairs = sum(n * (c - n) + n * (n + 1) / 2 for c, n in seqs)
    return 4.0 * HEAD_DIM * NUM_HEADS * pairs


def bench_prefill_cell(
    name: str, seqs: list[tuple[int, int]], configs: dict[str, PrefillConfig],
    ceil: dict[str, float], block_size: int, with_peer: bool,
) -> list[Row]:
    scale = 1 / math.sqrt(HEAD_DIM)
    s = make_prefill_set(seqs, block_size)
    flops = prefill_flops(seqs)
    sdpa_ms, ref, peer_err = None, None, None
    if with_peer and s.peer is not None:
        try:
            b, n = len(seqs), seqs[0][1]
            ref = sdpa_prefill(s.peer, scale).transpose(1, 2).reshape(b * n, NUM_HEADS, HEAD_DIM)
            sdpa_ms = time_graph([lambda: sdpa_prefill(s.peer, scale)])
        except Exception as e:  # noqa: BLE001
            peer_err = f"sdpa: {type(e).__name__}: {e}"[:200]
    rows = []
    for cname, cfg in configs.items():
        row = Row("prefill", name, cname, sdpa_ms=sdpa_ms, error=peer_err)
        try:
            be = TritonBackend(prefill_config=cfg)

            def call(be: TritonBackend = be) -> torch.Tensor:
                return be.prefill(s.q, s.k_cache, s.v_cache, s.block_tables, s.cu_seqlens,
                                  s.context_lens, scale)

            out = call()
            if not bool(torch.isfinite(out).all()):
                raise RuntimeError("non-finite output")
            if ref is not None:
                row.rel_err_vs_sdpa = rel_err(out, ref)
            row.triton_ms = time_graph([call])
            row.tflops = flops / row.triton_ms / 1e9
            row.frac_ceiling = row.tflops / ceil["matmul_tflops"]
            if sdpa_ms:
                row.speedup_vs_sdpa = sdpa_ms / row.triton_ms
                row.extra["sdpa_tflops"] = flops / sdpa_ms / 1e9
        except Exception as e:  # noqa: BLE001
            row.error = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
    del s, ref
    torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------- report


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_tables(rows: list[Row], ceil: dict[str, float]) -> None:
    headers = ["kind", "case", "config", "triton ms", "sdpa ms", "GB/s", "TFLOP/s",
               "% ceiling", "x sdpa", "err", "splits/note"]
    title = (f"attention on {torch.cuda.get_device_name()}: copy ceiling {ceil['copy_gbs']:.0f} GB/s,"
             f" bf16 matmul ceiling {ceil['matmul_tflops']:.0f} TFLOP/s")
    body = []
    for r in rows:
        body.append([
            r.kind, r.case, r.config, fmt(r.triton_ms, ".4f"), fmt(r.sdpa_ms, ".4f"),
            fmt(r.gbs, ".0f"), fmt(r.tflops, ".1f"),
            fmt(None if r.frac_ceiling is None else 100 * r.frac_ceiling, ".1f"),
            fmt(r.speedup_vs_sdpa, ".2f"), fmt(r.rel_err_vs_sdpa, ".1e"),
            (f"splits {r.splits} " if r.splits else "") + (r.error or "")[:60],
        ])
    print_table(title, headers, body, width=170, left=("kind", "case", "config"))


def progress_iter(items: list[Any], label: str):  # type: ignore[no-untyped-def]
    try:
        from rich.progress import track
    except ImportError:
        return items
    return track(items, description=label, transient=False)


@dataclass(frozen=True)
class Budget:
    """The run's wall-clock budget: a cell due after it is skipped and named in the report."""
    t0: float
    seconds: float

    def over(self) -> bool:
        return time.monotonic() - self.t0 > self.seconds


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default="bench/results/attention.json")
    ap.add_argument("--budget-s", type=float, default=300.0, help="skip what is left after this")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="a few cells only")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--graph-shapes", action="store_true",
                    help="only the engine's decode graph shapes (padded tables, ~600-token contexts), all configs")
    return ap.parse_args()


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        print("bench/attention.py needs a CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    torch.backends.cuda.matmul.allow_tf32 = False
    ceil = measure_ceilings()
    print(f"ceilings: copy {ceil['copy_gbs']:.0f} GB/s, bf16 matmul {ceil['matmul_tflops']:.0f} "
          f"TFLOP/s", flush=True)
    if args.graph_shapes:
        return run_graph_shapes(args, ceil)
    budget = Budget(t0, args.budget_s)
    skipped: list[str] = []
    rows = bench_defaults(args, ceil, budget, skipped)
    if not args.no_sweep:
        rows += bench_sweeps(args, ceil, budget, skipped)
    for r in rows:
        if r.config != "default":
            r.kind += " sweep"
    print_report(rows, ceil, skipped, args.budget_s)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "shape": {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                  "dtype": str(DTYPE), "block_size": args.block_size},
        "ceilings": ceil,
        "rows": [asdict(r) for r in rows],
        "skipped": skipped,
        "kernels": kernel_resources(),
        "wall_s": time.monotonic() - t0,
    }
    out = write_result(args.json, result)
    print(f"wrote {out} in {result['wall_s']:.0f}s")
    return 0


def run_graph_shapes(args: argparse.Namespace, ceil: dict[str, float]) -> int:
    """``--graph-shapes``: only ``bench_graph_shapes``, its table and its JSON."""
    rows = bench_graph_shapes(ceil)
    print_tables(rows, ceil)
    out = write_result(args.json, {"device": torch.cuda.get_device_name(), "ceilings": ceil,
                                   "rows": [asdict(r) for r in rows]})
    print(f"wrote {out}")
    return 0


def bench_defaults(args: argparse.Namespace, ceil: dict[str, float], budget: Budget,
                   skipped: list[str]) -> list[Row]:
    """The default decode and prefill configs over the grid, each against SDPA."""
    rows: list[Row] = []
    bs = args.block_size
    default_d = {"default": DecodeConfig()}
    default_p = {"default": PrefillConfig()}
    batches = [1, 64] if args.quick else DECODE_BATCHES
    contexts = [4096, 32768] if args.quick else DECODE_CONTEXTS
    cells = [(b, c) for b in batches for c in contexts if b * c <= MAX_DECODE_TOKENS]
    for b, c in progress_iter(cells, "decode"):
        if budget.over():
            skipped.append(f"decode B={b} ctx={c}")
            continue
        rows += bench_decode_cell(b, c, default_d, ceil, bs, with_peer=True)
    pcases = PREFILL_CASES[:2] if args.quick else PREFILL_CASES
    for name, seqs in progress_iter(pcases, "prefill"):
        if budget.over():
            skipped.append(f"prefill {name}")
            continue
        rows += bench_prefill_cell(name, seqs, default_p, ceil, bs, with_peer=True)
    return rows


def bench_sweeps(args: argparse.Namespace, ceil: dict[str, float], budget: Budget,
                 skipped: list[str]) -> list[Row]:
    """The launch-config sweeps at their representative cells, without the SDPA peer."""
    rows: list[Row] = []
    bs = args.block_size
    for b, c in progress_iter(DECODE_SWEEP_CELLS, "decode sweep"):
        if budget.over():
            skipped.append(f"decode sweep B={b} ctx={c}")
            continue
        rows += bench_decode_cell(b, c, DECODE_SWEEP, ceil, bs, with_peer=False)
    for name, seqs in progress_iter(PREFILL_SWEEP_CELLS, "prefill sweep"):
        if budget.over():
            skipped.append(f"prefill sweep {name}")
            continue
        rows += bench_prefill_cell(name, seqs, PREFILL_SWEEP, ceil, bs, with_peer=False)
    return rows


def print_report(rows: list[Row], ceil: dict[str, float], skipped: list[str], budget_s: float) -> None:
    """The kernels' resources, the sweep table, the default table and what the budget skipped."""
    for k in kernel_resources():
        print("kernel", {key: val for key, val in k.items() if key != "constants"})
    print_tables([r for r in rows if r.config != "default"], ceil)
    print_tables([r for r in rows if r.config == "default"], ceil)
    if skipped:
        print(f"skipped (budget {budget_s:.0f}s): {', '.join(skipped)}")


def write_result(json_arg: str, result: dict[str, Any]) -> Path:
    """Write ``result`` to ``$BENCH_JSON``, else to ``--json``; the path written."""
    out = Path(os.environ.get("BENCH_JSON") or json_arg)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return out


def kernel_resources() -> list[dict[str, Any]]:
    """Registers, spills and shared memory of every compiled variant of the attention kernels."""
    from workers.model.attention import triton_backend as tb

    found = []
    for name in ("_decode_kernel", "_decode_reduce_kernel", "_prefill_kernel", "_store_kv_kernel"):
        fn = getattr(tb, name)
        try:
            for caches in fn.device_caches.values():
                for key, kernel in caches[0].items():
                    kernel._init_handles()
                    found.append({
                        "kernel": name, "num_warps": kernel.metadata.num_warps,
                        "num_stages": kernel.metadata.num_stages, "regs": kernel.n_regs,
                        "spills": kernel.n_spills, "shared": kernel.metadata.shared,
                        "constants": str(getattr(kernel, "constants", ""))[:200],
                    })
        except Exception as e:  # noqa: BLE001  (internal API; report, never fail the run)
            found.append({"kernel": name, "error": f"{type(e).__name__}: {e}"[:200]})
    return found


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


if __name__ == "__main__":
    raise SystemExit(main())
