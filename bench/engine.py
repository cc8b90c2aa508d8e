"""End-to-end engine benchmark on a CUDA GPU: decode and prefill throughput against the rooflines.

Measured in one run, on the GPU it runs on:
* the two ceilings: device-to-device copy bandwidth (bytes read + written, 2 GiB buffers) and the
  bf16 matmul rate (8192^3 ``torch.matmul`` on random data);
* decode tokens/s at batch 1..256 (random 512-token prompts, greedy, the Triton backend, CUDA
  graphs, prefix caching on): the whole ``LLMEngine.step`` (scheduler, inputs, graph replay,
  sampling, bookkeeping), and the graph replay alone; each against the bandwidth roofline
  ``bytes / copy ceiling`` with bytes = weights read + K/V read for every context token + K/V
  written for the new token;
* decode at longer contexts (``--long-context``, default 4096 tokens, batches 16 and 64): rows
  marked "long" (agentic sessions decode over 4k-32k contexts; the target row stays the ~600-token
  one);
* prefill tokens/s for one prompt of 1k..32k tokens (chunks of ``--chunk`` tokens), against the
  matmul ceiling with FLOPs = 2 x linear params x tokens + causal attention (2 x L^2 x heads x
  head_dim per layer) + the LM head of the last token.

Targets: decode at batch 64 >= 50% of the bandwidth roofline; 32k prefill >= 40% of
the matmul ceiling. Imports torch, numpy, xxhash and the engine only (rich if present):

    python3 bench/engine.py [--presets qwen2-0.5b,llama3-8b] [--json bench/results/engine.json]
    python bench/engine.py --device cpu        # the tiny preset on CPU (fp32 ceilings)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _table import print_table  # noqa: E402  (bench/ is on sys.path when run as a script)

from workers.config import EngineConfig, ModelConfig, get_preset  # noqa: E402
from workers.engine.llm_engine import LLMEngine  # noqa: E402
from workers.engine.sequence import SamplingParams  # noqa: E402

BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
PROMPT_LENS = [1024, 2048, 4096, 8192, 16384, 32768]


# ---- ceilings ---------------------------------------------------------------------------------------


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _median_ms(fn: Any, reps: int) -> float:
    if not torch.cuda.is_available():  # CPU: the host clock is the device clock
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure_ceilings(device: str) -> dict[str, float]:
    if device == "cpu":  # fp32, sizes a laptop holds: 512 MiB copy, 2048^3 matmul
        src = torch.randn(1 << 27)
        dst = torch.empty_like(src)
        copy_ms = _median_ms(lambda: dst.copy_(src), 5)
        a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
        mm_ms = _median_ms(lambda: a @ b, 5)
        return {"copy_gbs": 2 * 4 * (1 << 27) / copy_ms / 1e6, "matmul_tflops": 2 * 2048**3 / mm_ms / 1e9}
    n = 1 << 30  # 2 GiB of bf16 per buffer
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy_ms = _median_ms(lambda: dst.copy_(src), 20)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    mm_ms = _median_ms(lambda: a @ b, 20)
    return {"copy_gbs": 2 * 2 * n / copy_ms / 1e6, "matmul_tflops": 2 * 8192**3 / mm_ms / 1e9}


# ---- counts -----------------------------------------------------------------------------------------


def weight_bytes_read(cfg: ModelConfig, batch: int, itemsize: int) -> int:
    """Every weight once per step, except the embedding table (only ``batch`` rows) unless tied
    (then it is the LM head and read whole)."""
    total = cfg.num_params() * itemsize
    if not cfg.tie_word_embeddings:
        total -= cfg.vocab_size * cfg.hidden_size * itemsize
        total += batch * cfg.hidden_size * itemsize
    return total


def linear_params(cfg: ModelConfig) -> int:
    h = cfg.hidden_size
    per_layer = h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h + 3 * h * cfg.intermediate_size
    return cfg.num_layers * per_layer


def prefill_flops(cfg: ModelConfig, n: int) -> float:
    attention = 2.0 * n * n * cfg.num_heads * cfg.head_dim * cfg.num_layers  # causal: half of 4 L^2 H D
    return 2.0 * n * linear_params(cfg) + attention + 2.0 * cfg.hidden_size * cfg.vocab_size


# ---- decode -----------------------------------------------------------------------------------------


def kernel_profile(replay: Any, reps: int = 5) -> dict[str, Any]:
    """Kernels of one graph replay (torch profiler): count, total and the top names by time."""
    try:
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return {}
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                replay()
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
        total_us = sum(e.device_time_total for e in events) / reps
        count = sum(e.count for e in events) / reps
        top = sorted(events, key=lambda e: -e.device_time_total)[:8]
        return {"kernels_per_step": count, "kernel_us_per_step": total_us,
                "top": [{"name": e.key[:80], "count": e.count / reps, "us": e.device_time_total / reps} for e in top]}
    except Exception as exc:  # the profiler is a diagnostic: never fail the benchmark on it
        return {"error": repr(exc)}


def bench_decode(engine: LLMEngine, ceil: dict[str, float], batches: list[int], context: int,
                 steps: int, warmup: int, profile_batch: int = 64) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    cfg = engine.model_config
    itemsize = engine.runner.kv_cache.element_size()
    kv_tok = cfg.kv_bytes_per_token(itemsize)
    rng = random.Random(0)
    top = max(batches)
    params = SamplingParams(temperature=0.0, max_tokens=len(batches) * (steps + warmup + 2) + 8, ignore_eos=True)
    ids = [f"d{i}" for i in range(top)]
    for rid in ids:
        engine.add_request(rid, [rng.randrange(cfg.vocab_size) for _ in range(context)], params)
    while any(s.num_completion_tokens == 0 for s in engine.scheduler.all_seqs()):
        engine.step()
    rows = []
    profile: dict[str, Any] = {}
    for b in sorted(batches, reverse=True):
        for rid in ids[b:]:
            engine.abort_request(rid)
        for _ in range(warmup):
            engine.step()
        running = engine.scheduler.running
        if len(running) != b or engine.scheduler.waiting:
            raise RuntimeError(f"expected {b} running decodes, got {len(running)}")
        ctx0 = sum(len(s) for s in running)  # context of the first timed step (all tokens incl. new)
        _sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        step_ms = (time.perf_counter() - t0) * 1e3 / steps
        kv_read = (ctx0 * steps + b * steps * (steps - 1) // 2) * kv_tok / steps
        bytes_step = weight_bytes_read(cfg, b, itemsize) + kv_read + b * kv_tok
        roof_ms = bytes_step / (ceil["copy_gbs"] * 1e6)
        fwd_ms = None
        graph = engine.runner.graphs.get(b)
        if graph is not None:  # the forward alone: replays of this batch's graph, last inputs
            fwd_ms = _median_ms(graph.replay, 20)
        if b == profile_batch and graph is not None:
            profile = kernel_profile(graph.replay)
        rows.append({
            "batch": b, "step_ms": step_ms, "tokens_per_s": b * 1e3 / step_ms, "mean_context": kv_read / kv_tok / b,
            "bytes_per_step": bytes_step, "roofline_ms": roof_ms, "frac_roofline": roof_ms / step_ms,
            "forward_ms": fwd_ms, "forward_frac_roofline": None if fwd_ms is None else roof_ms / fwd_ms,
        })
        print(f"  decode B={b}: {step_ms:.3f} ms/step, {b * 1e3 / step_ms:,.0f} tok/s, "
              f"{100 * roof_ms / step_ms:.1f}% of roofline (forward alone {fwd_ms if fwd_ms is None else round(fwd_ms, 3)} ms)",
              flush=True)
    for rid in ids:
        engine.abort_request(rid)
    engine.step()
    return rows, profile


# ---- prefill ----------------------------------------------------------------------------------------


def _prefill_once(engine: LLMEngine, n: int, rng: random.Random) -> float:
    prompt = [rng.randrange(engine.model_config.vocab_size) for _ in range(n)]
    _sync()
    t0 = time.perf_counter()
    engine.add_request(f"p{rng.random()}", prompt, SamplingParams(temperature=0.0, max_tokens=1))
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - t0


def bench_prefill(engine: LLMEngine, ceil: dict[str, float], lens: list[int], deadline: float) -> list[dict[str, Any]]:
    rng = random.Random(1)
    _prefill_once(engine, min(1024, min(lens)), rng)  # compile
    rows = []
    for n in lens:
        if time.monotonic() > deadline:
            print(f"  prefill {n}: skipped (time budget)")
            continue
        reps = 3 if n <= 8192 else 1
        secs = statistics.median(_prefill_once(engine, n, rng) for _ in range(reps))
        flops = prefill_flops(engine.model_config, n)
        tflops = flops / secs / 1e12
        rows.append({"prompt_tokens": n, "seconds": secs, "tokens_per_s": n / secs, "tflops": tflops,
                     "frac_matmul_peak": tflops / ceil["matmul_tflops"]})
        print(f"  prefill {n}: {secs * 1e3:.1f} ms, {n / secs:,.0f} tok/s, {tflops:.0f} TFLOP/s, "
              f"{100 * tflops / ceil['matmul_tflops']:.1f}% of matmul peak", flush=True)
    return rows


# ---- driver -----------------------------------------------------------------------------------------


def run_preset(name: str, args: argparse.Namespace, ceil: dict[str, float], deadline: float) -> dict[str, Any]:
    cfg = get_preset(name)
    batches = [b for b in args.batches if b <= args.max_batch]
    lens = args.prompt_lens
    steps_total = len(batches) * (args.steps + args.warmup + 2) + 8
    long_batches = [b for b in args.long_batches if b <= args.max_batch] if args.long_context else []
    long_steps = len(long_batches) * (args.steps + args.warmup + 2) + 8
    decode_blocks = max(max(batches) * -(-(args.context + steps_total + 16) // 16),
                        max(long_batches, default=0) * -(-(args.long_context + long_steps + 16) // 16))
    blocks = decode_blocks + -(-(max(lens) + 16) // 16) + 64
    config = EngineConfig(
        device=args.device, attention_backend="triton" if args.device == "cuda" else "torch",
        num_kv_blocks=blocks, max_num_seqs=max(batches),
        max_num_batched_tokens=args.chunk, max_model_len=max(lens) + 64, cuda_graphs=True, seed=0,
    )
    print(f"{name}: {cfg.num_params() / 1e9:.2f}B params, {blocks} KV blocks", flush=True)
    t0 = time.perf_counter()
    engine = LLMEngine(cfg, config)
    init_s = time.perf_counter() - t0
    print(f"  init {init_s:.1f} s ({len(engine.runner.graphs)} decode graphs)", flush=True)
    out: dict[str, Any] = {"params": cfg.num_params(), "num_kv_blocks": blocks, "init_s": init_s,
                           "chunk": args.chunk, "decode_context": args.context}
    out["async_decode"] = engine.async_decode
    out["decode"], out["decode_profile"] = bench_decode(engine, ceil, batches, args.context, args.steps, args.warmup)
    if long_batches:  # agentic sessions decode over 4k-32k contexts: the K/V share of the bytes grows
        print(f"  decode at {args.long_context}-token contexts", flush=True)
        out["decode_long"], _ = bench_decode(engine, ceil, long_batches, args.long_context, args.steps,
                                             args.warmup, profile_batch=-1)
    out["steps_ahead"] = engine.num_steps_ahead
    prof = out["decode_profile"]
    if prof.get("top"):
        print(f"  decode B=64 graph: {prof['kernels_per_step']:.0f} kernels, {prof['kernel_us_per_step']:.0f} us of kernel time; top: "
              + ", ".join(f"{t['name'][:40]} {t['us']:.0f}us x{t['count']:.0f}" for t in prof["top"][:5]), flush=True)
    out["prefill"] = bench_prefill(engine, ceil, lens, deadline)
    out["engine_stats"] = engine.stats()
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def print_tables(result: dict[str, Any]) -> None:
    ceil = result["ceilings"]
    for name, res in result["presets"].items():
        dec = [[str(r["batch"]), f"{r['step_ms']:.3f}", f"{r['tokens_per_s']:,.0f}", f"{r['mean_context']:.0f}",
                f"{r['bytes_per_step'] / 1e9:.2f}", f"{r['roofline_ms']:.3f}", f"{100 * r['frac_roofline']:.1f}",
                "-" if r["forward_ms"] is None else f"{r['forward_ms']:.3f}",
                "-" if r["forward_frac_roofline"] is None else f"{100 * r['forward_frac_roofline']:.1f}"]
               for r in res["decode"]]
        for r in res.get("decode_long", []):
            dec.append([f"{r['batch']} (long)", f"{r['step_ms']:.3f}", f"{r['tokens_per_s']:,.0f}", f"{r['mean_context']:.0f}",
                        f"{r['bytes_per_step'] / 1e9:.2f}", f"{r['roofline_ms']:.3f}", f"{100 * r['frac_roofline']:.1f}",
                        "-" if r["forward_ms"] is None else f"{r['forward_ms']:.3f}",
                        "-" if r["forward_frac_roofline"] is None else f"{100 * r['forward_frac_roofline']:.1f}"])
        pre = [[str(r["prompt_tokens"]), f"{r['seconds'] * 1e3:.1f}", f"{r['tokens_per_s']:,.0f}", f"{r['tflops']:.0f}",
                f"{100 * r['frac_matmul_peak']:.1f}"] for r in res["prefill"]]
        tables = [
            (f"{name} decode (copy ceiling {ceil['copy_gbs']:.0f} GB/s)",
             ["batch", "ms/step", "tok/s", "ctx", "GB/step", "roofline ms", "% roofline", "fwd ms", "fwd % roofline"], dec),
            (f"{name} prefill (matmul ceiling {ceil['matmul_tflops']:.2f} TFLOP/s)",
             ["prompt", "ms", "tok/s", "TFLOP/s", "% matmul peak"], pre),
        ]
        for title, headers, rows in tables:
            print_table(title, headers, rows)
    for line in result["targets"]:
        print(line)


def targets(result: dict[str, Any]) -> list[str]:
    """The issue's targets, for GPU runs (a CPU run has none)."""
    lines: list[str] = []
    if str(result.get("device", "")).startswith("cpu"):
        return lines
    for name, res in result["presets"].items():
        d64 = next((r for r in res["decode"] if r["batch"] == 64), None)
        p32 = next((r for r in res["prefill"] if r["prompt_tokens"] == 32768), None)
        if d64:
            ok = "MET" if d64["frac_roofline"] >= 0.5 else "MISSED"
            lines.append(f"{name}: decode B=64 {100 * d64['frac_roofline']:.1f}% of bandwidth roofline "
                         f"(target 50%): {ok}; forward alone "
                         + ("-" if d64["forward_frac_roofline"] is None else f"{100 * d64['forward_frac_roofline']:.1f}%"))
        if p32:
            ok = "MET" if p32["frac_matmul_peak"] >= 0.4 else "MISSED"
            lines.append(f"{name}: prefill 32k {100 * p32['frac_matmul_peak']:.1f}% of matmul peak (target 40%): {ok}")
    return lines


CPU_DEFAULTS = {"presets": "tiny", "batches": [1, 4, 16, 64], "prompt_lens": [256, 1024, 4096], "context": 128,
                "steps": 16, "chunk": 4096, "long_context": 0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: the tiny preset on the torch backend, with CPU ceilings (fp32 copy, matmul)")
    ap.add_argument("--presets", default=None, help="default qwen2-0.5b,llama3-8b (cuda), tiny (cpu)")
    ap.add_argument("--json", default=None, help="default bench/results/engine.json (cuda), engine-cpu.json (cpu)")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=None)
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--prompt-lens", type=lambda s: [int(x) for x in s.split(",")], default=None)
    ap.add_argument("--context", type=int, default=None, help="decode prompt length (default 512; cpu 128)")
    ap.add_argument("--long-context", type=int, default=None,
                    help="also decode at this prompt length (rows marked 'long'; default 4096 on cuda, 0 = off)")
    ap.add_argument("--long-batches", type=lambda s: [int(x) for x in s.split(",")], default=[16, 64])
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps per batch size (default 32)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=None, help="max_num_batched_tokens (prefill chunk; default 16384)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="skip prefill lengths past this")
    args = ap.parse_args()
    gpu_defaults = {"presets": "qwen2-0.5b,llama3-8b", "batches": BATCHES, "prompt_lens": PROMPT_LENS,
                    "context": 512, "steps": 32, "chunk": 16384, "long_context": 4096}
    for key, value in (CPU_DEFAULTS if args.device == "cpu" else gpu_defaults).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.json is None:
        args.json = "bench/results/engine-cpu.json" if args.device == "cpu" else "bench/results/engine.json"
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/engine.py --device cuda needs a CUDA GPU (try --device cpu)", file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.budget_s
    ceil = measure_ceilings(args.device)
    print(f"ceilings: copy {ceil['copy_gbs']:.0f} GB/s, matmul {ceil['matmul_tflops']:.2f} TFLOP/s", flush=True)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else f"cpu ({torch.get_num_threads()} threads)",
        "torch": torch.__version__, "ceilings": ceil, "presets": {}, "args": dict(vars(args)),
    }
    if args.device == "cuda":
        import triton

        result["triton"] = triton.__version__
    path = Path(os.environ.get("BENCH_JSON") or args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    for name in args.presets.split(","):
        try:
            result["presets"][name] = run_preset(name, args, ceil, deadline)
        except Exception as exc:  # report what ran; never lose the other preset's numbers
            print(f"{name}: FAILED {type(exc).__name__}: {exc}", flush=True)
            result.setdefault("errors", {})[name] = repr(exc)
        result["targets"] = targets(result)
        path.write_text(json.dumps(result, indent=1))
    print_tables(result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
