"""CPU offload: time to restore an N-token prefix from the CPU tier vs recomputing it (and vs a
GPU hit), N = 1k..32k; and the tax of offload on traffic with zero reuse.

Per prompt length N (a prompt of N + 1 tokens: N reusable, one always computed), the time to the
first token of one request alone (``max_tokens=1``, synced), median of a few runs:
* recompute: both tiers reset, the whole prompt prefilled (the peer: what offload saves);
* GPU hit: the prefix cached on the GPU (the floor);
* restore: every free cached block evicted to the CPU tier first (``BlockManager.evict_free``,
  the GPU -> CPU save timed separately), then the prompt: N tokens copied back into fresh GPU
  blocks, re-registered, the last token computed.
Shared/REFERENCE.md: reloading a 32k-token prefix took ~0.32 s, recomputing it ~2.5 s (8x).

Zero-reuse tax: unique prompts through a GPU pool that evicts at every admission (so offload
saves every evicted block and nothing is ever restored), offload off vs on, three alternating
runs each; plus the device time of the copies alone (CUDA events around each ``run_swaps``):
they run on the compute stream, so they are the part of the tax that noise cannot hide.

Imports torch, numpy, xxhash and the engine only (rich if present):

    python3 bench/offload.py [--preset llama3-8b] [--lens 1024,2048,4096,8192,16384,32768]
    python bench/offload.py --device cpu        # the tiny preset, 256..4096 tokens
"""

from __future__ import annotations

import argparse
import gc
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
from workers.model.decoder import DTYPES, build_model  # noqa: E402

ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
REFERENCE = {"tokens": 32768, "restore_s": 0.32, "recompute_s": 2.5}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def first_token(engine: LLMEngine, prompt: list[int]) -> tuple[float, int, int]:
    """Seconds to the first token of ``prompt`` alone, the token, and its cached tokens."""
    _sync()
    t0 = time.perf_counter()
    engine.add_request(f"b{time.monotonic_ns()}", prompt, ONE)
    token = cached = -1
    while engine.has_unfinished():
        for o in engine.step():
            token, cached = o.new_token_ids[0], o.num_cached_tokens
    _sync()
    return time.perf_counter() - t0, token, cached


def save_all(engine: LLMEngine) -> tuple[float, int]:
    """Evict every free cached block to the CPU tier; seconds of the (synced) copies, blocks."""
    _sync()
    t0 = time.perf_counter()
    engine.block_manager.evict_free()
    n = engine.run_swaps(sync=True)
    return time.perf_counter() - t0, n


def bench_length(engine: LLMEngine, n: int, reps: int, rng: random.Random) -> dict[str, Any]:
    prompt = [rng.randrange(engine.model_config.vocab_size) for _ in range(n + 1)]
    recompute = []
    for _ in range(reps):
        engine.reset_prefix_cache()  # both tiers
        secs, token, cached = first_token(engine, prompt)
        recompute.append(secs)
    gpu_hit = [first_token(engine, prompt)[0] for _ in range(reps)]
    save_s, saved = save_all(engine)  # the first eviction copies; later ones find the keys on the CPU
    restore, tokens, hits = [], set(), set()
    for _ in range(reps):
        save_all(engine)
        secs, tok, cached = first_token(engine, prompt)
        restore.append(secs)
        tokens.add(tok)
        hits.add(cached)
    kv_bytes = n * engine.model_config.kv_bytes_per_token(DTYPES[engine.model_config.dtype].itemsize)
    r, c = statistics.median(restore), statistics.median(recompute)
    return {"tokens": n, "recompute_s": c, "gpu_hit_s": statistics.median(gpu_hit), "restore_s": r,
            "save_s": save_s, "saved_blocks": saved, "speedup": c / r, "kv_bytes": kv_bytes,
            "restore_gb_s": kv_bytes / r / 1e9, "save_gb_s": kv_bytes / save_s / 1e9 if save_s else None,
            "restored_cached_tokens": sorted(hits), "same_token": tokens == {token}}


def bench_restore(model: torch.nn.Module, cfg: ModelConfig, args: argparse.Namespace) -> list[dict[str, Any]]:
    bs = args.block_size
    blocks = -(-(max(args.lens) + 2) // bs) + 16
    engine = LLMEngine(cfg, EngineConfig(
        device=args.device, block_size=bs, num_kv_blocks=blocks, cpu_offload_blocks=blocks, max_num_seqs=1,
        max_num_batched_tokens=args.chunk, max_model_len=max(args.lens) + 64, seed=0,
    ), model=model)
    rng = random.Random(1)
    first_token(engine, [rng.randrange(cfg.vocab_size) for _ in range(min(args.lens) + 1)])  # compile, warm
    rows, deadline = [], time.monotonic() + args.budget_s
    for n in args.lens:
        if time.monotonic() > deadline:
            print(f"  {n} tokens: skipped (time budget)", flush=True)
            continue
        row = bench_length(engine, n, 3 if n <= 8192 else 2, rng)
        rows.append(row)
        print(f"  {n:>6} tokens: recompute {row['recompute_s'] * 1e3:8.1f} ms, restore {row['restore_s'] * 1e3:7.1f} ms "
              f"({row['speedup']:.1f}x), GPU hit {row['gpu_hit_s'] * 1e3:6.1f} ms, save {row['save_s'] * 1e3:6.1f} ms",
              flush=True)
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


class SwapTimer:
    """Device time of the engine's page copies (CUDA events around each ``run_swaps`` that has
    work; host time on a CPU device): the part of a step the offload tier adds."""

    def __init__(self, engine: LLMEngine) -> None:
        self.spans: list[Any] = []
        self.host = 0.0
        run = engine.run_swaps

        def timed(sync: bool = False) -> int:
            if not engine.block_manager.swaps:
                return run(sync)
            if not torch.cuda.is_available():
                t0 = time.perf_counter()
                n = run(sync)
                self.host += time.perf_counter() - t0
                return n
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            n = run(sync)
            end.record()
            self.spans.append((start, end))
            return n

        engine.run_swaps = timed  # type: ignore[method-assign]

    def seconds(self) -> float:
        _sync()
        return self.host + sum(s.elapsed_time(e) for s, e in self.spans) / 1e3


def _zero_reuse_run(model: torch.nn.Module, cfg: ModelConfig, args: argparse.Namespace, offload: bool,
                    prompts: list[list[int]], out_tokens: int) -> tuple[float, dict[str, float]]:
    bs = args.block_size
    per = -(-(len(prompts[0]) + out_tokens) // bs)
    engine = LLMEngine(cfg, EngineConfig(
        device=args.device, block_size=bs, num_kv_blocks=8 * per, max_num_seqs=8,
        cpu_offload_blocks=16 * per if offload else 0, max_num_batched_tokens=args.chunk,
        max_model_len=len(prompts[0]) + out_tokens + 16, seed=0,
    ), model=model)
    params = SamplingParams(temperature=0.0, max_tokens=out_tokens, ignore_eos=True)
    engine.generate(prompts[:2], params)  # warm (graphs, kernels); its blocks are evicted like the rest
    timer = SwapTimer(engine)
    _sync()
    t0 = time.perf_counter()
    engine.generate(prompts[2:], params)
    _sync()
    secs = time.perf_counter() - t0
    stats = {**engine.stats(), "swap_s": timer.seconds()}
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return secs, stats


def bench_tax(model: torch.nn.Module, cfg: ModelConfig, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(2)
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(args.tax_len)] for _ in range(args.tax_prompts + 2)]
    times: dict[bool, list[float]] = {False: [], True: []}
    saved, swap = 0.0, []
    for offload in (False, True) * 3:  # alternating: drift hits both sides alike
        secs, stats = _zero_reuse_run(model, cfg, args, offload, prompts, 16)
        times[offload].append(secs)
        if offload:
            saved = stats["cpu_blocks_saved"]
            swap.append(stats["swap_s"])
            if stats["cpu_blocks_restored"]:
                raise RuntimeError("zero-reuse traffic restored blocks: the prompts are not unique")
    off, on = statistics.median(times[False]), statistics.median(times[True])
    tokens = args.tax_prompts * (args.tax_len + 16)
    row = {"prompts": args.tax_prompts, "prompt_tokens": args.tax_len, "output_tokens": 16, "off_s": off, "on_s": on,
           "off_tok_s": tokens / off, "on_tok_s": tokens / on, "tax": on / off - 1, "blocks_saved": saved,
           "swap_s": statistics.median(swap), "swap_share": statistics.median(swap) / on,
           "runs": {"off": times[False], "on": times[True]}}
    print(f"  zero reuse: off {off:.2f} s, on {on:.2f} s ({100 * row['tax']:+.1f}% wall), {saved:.0f} blocks saved, "
          f"copies {row['swap_s'] * 1e3:.1f} ms = {100 * row['swap_share']:.1f}% of the run", flush=True)
    return row


def print_tables(result: dict[str, Any]) -> None:
    headers = ["tokens", "recompute ms", "restore ms", "recompute/restore", "GPU hit ms", "save ms", "restore GB/s",
               "same token"]
    rows = [[f"{r['tokens']}", f"{r['recompute_s'] * 1e3:.1f}", f"{r['restore_s'] * 1e3:.1f}", f"{r['speedup']:.2f}x",
             f"{r['gpu_hit_s'] * 1e3:.1f}", f"{r['save_s'] * 1e3:.1f}", f"{r['restore_gb_s']:.2f}", str(r["same_token"])]
            for r in result["restore"]]
    title = f"CPU offload on {result['device']} ({result['preset']}, {result['dtype']}, block {result['block_size']})"
    print_table(title, headers, rows)
    tax = result["zero_reuse_tax"]
    print(f"zero-reuse tax: {100 * tax['tax']:+.1f}% wall time ({tax['off_tok_s']:,.0f} -> {tax['on_tok_s']:,.0f} tok/s, "
          f"{tax['blocks_saved']:.0f} blocks saved, nothing restored); the copies themselves "
          f"{tax['swap_s'] * 1e3:.1f} ms = {100 * tax['swap_share']:.1f}% of the run (the tax's floor)")
    ref = next((r for r in result["restore"] if r["tokens"] == REFERENCE["tokens"]), None)
    if ref:
        print(f"32k: restore {ref['restore_s']:.3f} s vs recompute {ref['recompute_s']:.3f} s ({ref['speedup']:.1f}x); "
              f"reference (REFERENCE.md): {REFERENCE['restore_s']} s vs {REFERENCE['recompute_s']} s (7.8x)")


CPU_DEFAULTS = {"preset": "tiny", "lens": [256, 512, 1024, 2048, 4096], "chunk": 2048, "tax_len": 256,
                "tax_prompts": 32}
CUDA_DEFAULTS = {"preset": "llama3-8b", "lens": [1024, 2048, 4096, 8192, 16384, 32768], "chunk": 16384,
                 "tax_len": 2048, "tax_prompts": 48}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--preset", default=None, help="default llama3-8b (cuda), tiny (cpu)")
    ap.add_argument("--dtype", default=None, help="override the preset's dtype")
    ap.add_argument("--lens", type=lambda s: [int(x) for x in s.split(",")], default=None)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=None, help="max_num_batched_tokens (prefill chunk)")
    ap.add_argument("--tax-len", type=int, default=None, help="zero-reuse prompt length")
    ap.add_argument("--tax-prompts", type=int, default=None)
    ap.add_argument("--budget-s", type=float, default=300.0, help="skip lengths past this")
    ap.add_argument("--json", default=None, help="default bench/results/offload.json (cuda), offload-cpu.json (cpu)")
    args = ap.parse_args()
    defaults = CPU_DEFAULTS if args.device == "cpu" else CUDA_DEFAULTS
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.json is None:
        args.json = "bench/results/offload-cpu.json" if args.device == "cpu" else "bench/results/offload.json"
    if args.device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    cfg = get_preset(args.preset, **({"dtype": args.dtype} if args.dtype else {}))
    device = torch.device(args.device)
    model = build_model(cfg, device, seed=0)
    name = torch.cuda.get_device_name(device) if args.device == "cuda" else "cpu"
    print(f"{args.preset} on {name}: {cfg.kv_bytes_per_token(DTYPES[cfg.dtype].itemsize)} KV bytes/token", flush=True)
    result: dict[str, Any] = {
        "device": name, "preset": args.preset, "dtype": cfg.dtype, "block_size": args.block_size, "chunk": args.chunk,
        "torch": torch.__version__, "reference": REFERENCE,
        "restore": bench_restore(model, cfg, args),
        "zero_reuse_tax": bench_tax(model, cfg, args),
    }
    print_tables(result)
    path = Path(os.environ.get("BENCH_JSON") or args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
