"""L2 prefetch on a side stream inside the decode CUDA graph (workers/prefetch.py): does it cut
the 0.5B decode step? One run, one GPU:

1. the upper bound: one gate_up GEMM (M = 64, the 17.4 MB weight) cold (L2 flushed), right after
   a prefetch of its weight (each mode), and warm (run twice);
2. the decode forward graph (model + LM head, the engine's own model, KV cache and Triton
   backend; B rows of ``--context`` tokens on random block tables, slots -1 so replays write
   nothing) captured with the prefetcher off and in each variant (mode x distance x CTAs x K/V);
   replays timed interleaved in rounds (median per variant), logits checked bit-equal to "off".

    python3 bench/prefetch_l2.py [--preset qwen2-0.5b] [--batches 1,64] [--context 600]
                                 [--json bench/results/prefetch-l2.json] [--quick]

Roofline as bench/engine.py: (weights read + K/V read) / copy ceiling (measured here).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _table import print_table  # noqa: E402
from workers.config import EngineConfig, get_preset  # noqa: E402
from workers.layers import AttentionMetadata  # noqa: E402
from workers.model_runner import ModelRunner  # noqa: E402
from workers.prefetch import L2Prefetcher, PrefetchConfig, layer_weight_bytes, worth_it  # noqa: E402

VARIANTS = [
    PrefetchConfig("line_el", 2, 16),
    PrefetchConfig("line_el", 1, 16),
    PrefetchConfig("line_el", 2, 8),
    PrefetchConfig("line_el", 2, 32),
    PrefetchConfig("line_el", 2, 66),
    PrefetchConfig("line", 2, 16),
    PrefetchConfig("bulk", 2, 4),
    PrefetchConfig("bulk", 2, 16),
    PrefetchConfig("bulk", 1, 16),
    PrefetchConfig("line_el", 2, 16, kv="qkv"),
    PrefetchConfig("line_el", 2, 16, kv="down"),
    PrefetchConfig("bulk", 2, 16, kv="down"),
    PrefetchConfig("bulk", 2, 16, kv="down", kv_budget_bytes=32 << 20),
]
QUICK = [VARIANTS[0], VARIANTS[6], VARIANTS[7], VARIANTS[10], VARIANTS[11]]


def label(cfg: PrefetchConfig | None) -> str:
    if cfg is None:
        return "off"
    kv = "" if cfg.kv == "off" else f" kv@{cfg.kv}/{cfg.kv_budget_bytes >> 20}MB"
    return f"{cfg.mode} d{cfg.distance} c{cfg.ctas}{kv}"


def copy_ceiling_gbs() -> float:
    n = 1 << 30
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    dst.copy_(src)
    ms = timed(lambda: dst.copy_(src), 1, 10)
    del src, dst
    return 2 * 2 * n / ms / 1e6


def timed(fn: Any, inner: int, reps: int) -> float:
    """Median ms per call over ``reps`` CUDA-event timings of ``inner`` back-to-back calls."""
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / inner)
    return statistics.median(out)


# ---- 1. one GEMM: cold, prefetched, warm ----------------------------------------------------------


def gemm_bound(runner: ModelRunner) -> list[dict[str, Any]]:
    lin = runner.model.model.layers[0].mlp.gate_up_proj
    x = torch.randn(64, lin.in_features, device="cuda", dtype=lin.weight.dtype)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    rows = []

    def one(prep: Any) -> float:
        times = []
        for _ in range(30):
            flush.add_(1)  # 256 MB through L2: evicts the weight
            if prep is not None:
                prep()
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            lin(x)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        return statistics.median(times)

    rows.append({"case": "cold (L2 flushed)", "us": one(None)})
    rows.append({"case": "warm (same GEMM just before)", "us": one(lambda: lin(x))})
    for mode in ("line_el", "line", "bulk"):
        for ctas in (8, 32):
            pf = L2Prefetcher(runner.model, runner.kv_caches, PrefetchConfig(mode, 1, ctas))
            w = pf._weights[(0, "gate_up_proj")]
            rows.append({"case": f"after prefetch {mode} c{ctas}", "us": one(lambda: pf._launch((0, "gate_up_proj")))})
            # the prefetch kernel itself (it returns once its prefetches are issued)
            rows.append({"case": f"  prefetch kernel {mode} c{ctas} (issue time, {w.numel() >> 20} MB)",
                         "us": 1e3 * timed(lambda: pf._launch((0, "gate_up_proj")), 20, 5)})
            pf.remove()
    del flush
    return rows


# ---- 2. the decode graph ----------------------------------------------------------------------------


class Step:
    """Static inputs of a B-row decode step over ``context`` tokens per row."""

    def __init__(self, runner: ModelRunner, b: int, context: int, gen: torch.Generator) -> None:
        bs = runner.block_size
        nb = -(-context // bs)
        perm = torch.randperm(runner.num_blocks, generator=gen)[: b * nb]
        self.tables = perm.view(b, nb).to(torch.int32).cuda()
        self.ctx = torch.full((b,), context, dtype=torch.int32, device="cuda")
        self.ids = torch.randint(0, runner.model_config.vocab_size, (b,), generator=gen).cuda()
        self.pos = torch.full((b,), context - 1, dtype=torch.int64, device="cuda")
        self.slots = torch.full((b,), -1, dtype=torch.int64, device="cuda")  # replays write nothing
        self.meta = AttentionMetadata(self.slots, 0, decode_block_tables=self.tables, decode_context_lens=self.ctx)


def capture(runner: ModelRunner, step: Step, cfg: PrefetchConfig | None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, int]:
    model = runner.model
    run = lambda: model.lm_head(model(step.ids, step.pos, runner.kv_caches, step.meta, runner.backend))  # noqa: E731
    pf = L2Prefetcher(model, runner.kv_caches, cfg) if cfg is not None else None
    try:
        if pf is not None:
            pf.armed = True
        run()  # warm-up: Triton compiles outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        launches0 = pf.num_launches if pf else 0
        with torch.cuda.graph(graph, stream=torch.cuda.Stream()):
            logits = run()
        torch.cuda.synchronize()
        launches = (pf.num_launches - launches0) if pf else 0
    finally:
        if pf is not None:
            pf.armed = False
            pf.remove()
    return graph, logits, launches


def bench_graphs(runner: ModelRunner, batches: list[int], context: int, variants: list[PrefetchConfig | None],
                 rounds: int, inner: int, roof_ms: dict[int, float]) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for b in batches:
        step = Step(runner, b, context, gen)
        graphs = []
        for cfg in variants:
            g, logits, launches = capture(runner, step, cfg)
            g.replay()
            torch.cuda.synchronize()
            graphs.append((cfg, g, logits, launches))
        ref = graphs[0][2].clone()
        times: dict[int, list[float]] = {i: [] for i in range(len(graphs))}
        for _ in range(rounds):  # interleaved: drift hits every variant alike
            for i, (_, g, _, _) in enumerate(graphs):
                times[i].append(timed(g.replay, inner, 1))
        base = statistics.median(times[0])
        for i, (cfg, g, logits, launches) in enumerate(graphs):
            g.replay()
            torch.cuda.synchronize()
            ms = statistics.median(times[i])
            rows.append({"batch": b, "variant": label(cfg), "ms": ms, "speedup": base / ms,
                         "frac_roofline": roof_ms[b] / ms, "prefetch_launches": launches,
                         "bit_equal": bool(torch.equal(logits, ref)), "spread_ms": max(times[i]) - min(times[i])})
            r = rows[-1]
            print(f"  B={b} {r['variant']:<32} {ms:.4f} ms  x{r['speedup']:.3f}  {100 * r['frac_roofline']:.1f}%  "
                  f"launches {launches}  equal {r['bit_equal']}", flush=True)
        del graphs
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen2-0.5b")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64])
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--inner", type=int, default=50)
    ap.add_argument("--quick", action="store_true", help="five variants only")
    ap.add_argument("--json", default="bench/results/prefetch-l2.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/prefetch_l2.py needs a CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    ceil = copy_ceiling_gbs()
    mc = get_preset(args.preset)
    blocks = max(args.batches) * (-(-args.context // 16)) + 64
    ec = EngineConfig(device="cuda", attention_backend="triton", num_kv_blocks=blocks, max_num_seqs=max(args.batches),
                      max_model_len=args.context + 64, cuda_graphs=False, seed=0)
    runner = ModelRunner(mc, ec)
    with torch.no_grad():
        runner.kv_cache.normal_(0.0, 1.0)
    itemsize = runner.kv_cache.element_size()
    wbytes = mc.num_params() * itemsize  # tied LM head: the embedding is read whole
    roof_ms = {b: (wbytes + b * args.context * mc.kv_bytes_per_token(itemsize)) / (ceil * 1e6) for b in args.batches}
    lw = layer_weight_bytes(runner.model)
    print(f"{args.preset}: copy ceiling {ceil:.0f} GB/s; layer weights {lw / 1e6:.1f} MB (prefetch worth it: "
          f"{worth_it(lw)}); roofline " + ", ".join(f"B={b} {roof_ms[b]:.3f} ms" for b in args.batches), flush=True)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "preset": args.preset, "context": args.context, "copy_gbs": ceil, "roofline_ms": roof_ms}
    path = Path(os.environ.get("BENCH_JSON") or args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.inference_mode():
        try:
            result["gemm"] = gemm_bound(runner)
        except Exception as exc:  # the bound is a diagnostic: keep going to the graphs
            result["gemm_error"] = repr(exc)
            print(f"gemm bound FAILED: {exc!r}", flush=True)
        for r in result.get("gemm", []):
            print(f"  gate_up GEMM M=64 {r['case']}: {r['us']:.2f} us", flush=True)
        path.write_text(json.dumps(result, indent=1))
        variants: list[PrefetchConfig | None] = [None] + (QUICK if args.quick else VARIANTS)
        result["graphs"] = bench_graphs(runner, args.batches, args.context, variants, args.rounds, args.inner, roof_ms)
    result["wall_s"] = time.monotonic() - t0
    path.write_text(json.dumps(result, indent=1))
    print_table(f"{args.preset} gate_up GEMM (M=64): cold / prefetched / warm", ["case", "us"],
                [[r["case"], f"{r['us']:.2f}"] for r in result.get("gemm", [])], left=["case"])
    print_table(f"{args.preset} decode forward graph, ctx {args.context} (copy ceiling {ceil:.0f} GB/s)",
                ["B", "variant", "ms", "vs off", "% roofline", "launches", "bit-equal"],
                [[str(r["batch"]), r["variant"], f"{r['ms']:.4f}", f"{r['speedup']:.3f}", f"{100 * r['frac_roofline']:.1f}",
                  str(r["prefetch_launches"]), str(r["bit_equal"])] for r in result["graphs"]], left=["variant"])
    print(f"wrote {path} ({result['wall_s']:.0f} s)")
    return 0 if all(r["bit_equal"] for r in result["graphs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
