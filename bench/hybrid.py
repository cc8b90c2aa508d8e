"""Hybrid models on a CUDA GPU: what recurrent-state checkpoints cost and what they buy.

Measured on the ``hybrid-0.5b`` preset (qwen2-0.5b's shape, three recurrent layers to one
full-attention layer, bf16 weights, float32 states), in one run:

* zero-reuse traffic (distinct random prompts, every request at once, greedy, ignore_eos): wall
  time to finish all with checkpoints off, at the default interval (512 tokens) and with a
  checkpoint at every block (the unconditional policy's upper bound), alternating repetitions;
* a resumed turn's time to first token against recomputing it: turn 1 is a ``ctx``-token prompt,
  turn 2 is turn 1's prompt and reply plus 2 new tokens; resumed = on the engine that ran turn 1
  (attention blocks and its end-of-turn checkpoint), recomputed = a fresh engine without a prefix
  cache; at 8k and 32k contexts;
* the recurrent decode step: the Triton kernel against the torch reference at batch 64;
* the recurrent prefill scan (``--parts prefill``): the Triton ``chunk_prefill`` against the
  torch one (a ``chunk_scan`` per sequence) on batches of 1 to 16 sequences up to 8k tokens,
  from nonzero states at mid-chunk positions, with a snapshot per sequence; and a sweep of the
  kernel's tiles, warps and dot precision.

    python3 bench/hybrid.py [--json bench/results/hybrid.json] [--quick] [--parts kernel,prefill,zero,resume]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _table import print_table  # noqa: E402  (bench/ is on sys.path when run as a script)

from workers.config import EngineConfig, get_preset  # noqa: E402
from workers.engine.llm_engine import LLMEngine  # noqa: E402
from workers.engine.sequence import SamplingParams  # noqa: E402
from workers.model import recurrent_triton  # noqa: E402
from workers.model.decoder import build_model  # noqa: E402
from workers.model.recurrent import chunk_prefill, decode_step  # noqa: E402

PRESET = "hybrid-0.5b"


def _engine(model: Any, **kw: Any) -> LLMEngine:
    cfg: dict[str, Any] = dict(device="cuda", max_num_seqs=64, num_kv_blocks=8192, block_size=16)
    cfg.update(kw)
    return LLMEngine(get_preset(PRESET), EngineConfig(**cfg), eos_token_id=None, model=model)


def _run_all(engine: LLMEngine, prompts: list[list[int]], out: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.generate(prompts, params)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def zero_reuse(model: Any, n: int, prompt: int, out: int, reps: int, only: set[str] | None = None) -> dict[str, Any]:
    modes = {"off": dict(num_state_checkpoints=0), "interval_512": dict(state_checkpoint_interval=512),
             "every_block": dict(state_checkpoint_interval=16)}
    modes = {m: kw for m, kw in modes.items() if only is None or m in only}
    engines = {m: _engine(model, **kw) for m, kw in modes.items()}
    rng = random.Random(0)
    times: dict[str, list[float]] = {m: [] for m in modes}
    for eng in engines.values():  # warm up (Triton compiles, allocator) at the measured shapes
        _run_all(eng, [[rng.randrange(150000) for _ in range(prompt)] for _ in range(n)], 4)
    for _ in range(reps):
        for m, eng in engines.items():  # fresh prompts every run: nothing to reuse
            prompts = [[rng.randrange(150000) for _ in range(prompt)] for _ in range(n)]
            times[m].append(_run_all(eng, prompts, out))
    saved = {m: eng.stats()["state_checkpoints_saved"] for m, eng in engines.items()}
    med = {m: statistics.median(v) for m, v in times.items()}
    return {"requests": n, "prompt": prompt, "output": out, "seconds": times, "median_s": med,
            "vs_off": {m: med[m] / med["off"] - 1 for m in modes}, "checkpoints_saved": saved,
            "tokens_per_s": {m: n * (prompt + out) / med[m] for m in modes}}


def _ttft(engine: LLMEngine, prompt: list[int]) -> tuple[float, int, int]:
    st = engine.stats()
    before = st["prefill_computed_tokens"] + st["decode_computed_tokens"]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.add_request(f"t-{time.monotonic_ns()}", prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    cached = 0
    while engine.has_unfinished():
        for o in engine.step():
            cached = o.num_cached_tokens
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    st = engine.stats()
    return dt, cached, int(st["prefill_computed_tokens"] + st["decode_computed_tokens"] - before)


def resumed_turn(model: Any, ctx: int) -> dict[str, Any]:
    rng = random.Random(ctx)
    first = [rng.randrange(150000) for _ in range(ctx - 64)]
    warm = _engine(model, num_kv_blocks=ctx // 16 * 3)
    reply = warm.generate([first], SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))[0]
    follow = first + reply + [rng.randrange(150000) for _ in range(2)]
    resumed_s, cached, computed = _ttft(warm, follow)
    cold = _engine(model, num_kv_blocks=ctx // 16 * 3, enable_prefix_caching=False)
    _ttft(cold, [rng.randrange(150000) for _ in range(256)])  # warm up the cold engine's kernels
    recompute_s, _, recomputed = _ttft(cold, follow)
    return {"context": len(follow), "resumed_s": resumed_s, "recompute_s": recompute_s,
            "speedup": recompute_s / resumed_s, "cached_tokens": cached, "computed_resumed": computed,
            "computed_recompute": recomputed}


def decode_kernel(b: int = 64, reps: int = 200) -> dict[str, Any]:
    cfg = get_preset(PRESET)
    h, dk, dv = cfg.linear_num_heads, cfg.linear_key_dim, cfg.linear_value_dim
    dev = "cuda"
    q = torch.nn.functional.normalize(torch.randn(b, h, dk, device=dev), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(b, h, dk, device=dev), dim=-1)
    v, g = torch.randn(b, h, dv, device=dev), -torch.rand(b, h, device=dev)
    states = torch.randn(3 * b, h, dk, dv, device=dev)
    slots = torch.randperm(3 * b, device=dev)[:b]

    def torch_ref() -> None:
        o, s = decode_step(q, k, v, g, states.index_select(0, slots))
        states.index_copy_(0, slots, s)

    def triton_step() -> None:
        recurrent_triton.decode_step(q, k, v, g, states, slots)

    out = {}
    for name, fn in (("torch_us", torch_ref), ("triton_us", triton_step)):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        out[name] = (time.perf_counter() - t0) / reps * 1e6
    state_bytes = 2 * b * h * dk * dv * 4  # read + write
    out["triton_GBps"] = state_bytes / (out["triton_us"] * 1e-6) / 1e9
    return {"batch": b, "heads": h, "d_k": dk, "d_v": dv, **out}


PREFILL_CASES = {  # name: sequence lengths of one step
    "1x1024": [1024], "1x8192": [8192], "4x2048": [2048] * 4, "16x1024": [1024] * 16,
    "16 mixed 1-8k": [random.Random(16).randrange(1, 8193) for _ in range(16)], "64x128": [128] * 64,
}
# swept: (pass 1 d_k tile, d_v tile, warps, pass 2 d_v tile, d_v tiles per program, warps), dot precision
PREFILL_TILES = [((64, 64, 4, 32, 1, 8), "ieee"), ((32, 64, 4, 32, 1, 8), "ieee"), ((64, 32, 4, 32, 1, 8), "ieee"),
                 ((64, 64, 4, 32, 2, 8), "ieee"), ((64, 64, 4, 32, 4, 8), "ieee"), ((64, 64, 4, 32, 4, 4), "ieee"),
                 ((64, 64, 4, 32, 1, 8), "tf32x3"), ((32, 64, 4, 32, 4, 8), "tf32x3"),
                 ((64, 64, 4, 32, 4, 8), "tf32x3")]


def _time_cuda(fn: Any, reps: int) -> float:
    """Median of ``reps`` timed calls in microseconds (CUDA events), after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def prefill_kernel(reps: int = 10) -> list[dict[str, Any]]:
    cfg = get_preset(PRESET)
    h, dk, dv, chunk = cfg.linear_num_heads, cfg.linear_key_dim, cfg.linear_value_dim, cfg.linear_chunk
    rows = []
    for name, lens in PREFILL_CASES.items():
        n, t = len(lens), sum(lens)
        q = torch.nn.functional.normalize(torch.randn(t, h, dk, device="cuda"), dim=-1)
        k = torch.nn.functional.normalize(torch.randn(t, h, dk, device="cuda"), dim=-1)
        v, g = torch.randn(t, h, dv, device="cuda"), -torch.rand(t, h, device="cuda")
        states = torch.randn(3 * n, h, dk, dv, device="cuda")
        cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
        slots, starts = list(range(n)), [100 + 7 * i for i in range(n)]
        snaps = [[(t_len // 2, n + i)] if t_len > 1 else [] for i, t_len in enumerate(lens)]
        args = (q, k, v, g, states, cu, slots, starts, snaps, chunk)
        row: dict[str, Any] = {"case": name, "sequences": n, "tokens": t,
                               "torch_us": _time_cuda(lambda: chunk_prefill(*args), max(3, reps // 3))}
        row["triton_us"] = _time_cuda(lambda: recurrent_triton.chunk_prefill(*args), reps)
        row["tiles_us"] = {"_".join(map(str, tiles)) + f"_{prec}": _time_cuda(
            lambda t=tiles, p=prec: recurrent_triton.chunk_prefill(*args, tiles=t, precision=p), reps)
            for tiles, prec in PREFILL_TILES}
        row["speedup"] = row["torch_us"] / row["triton_us"]
        row["triton_Mtok_s"] = t / row["triton_us"]
        row["best_tile"] = min(row["tiles_us"], key=row["tiles_us"].get)
        rows.append(row)
    print_table(f"recurrent prefill scan, {h} heads x {dk} x {dv}, chunk {chunk}: Triton vs torch",
                ["case", "tokens", "torch us", "triton us", "speedup", "Mtok/s", "best tile (us)"],
                [[r["case"], str(r["tokens"]), f"{r['torch_us']:.0f}", f"{r['triton_us']:.0f}", f"{r['speedup']:.1f}x",
                  f"{r['triton_Mtok_s']:.2f}", f"{r['best_tile']} ({r['tiles_us'][r['best_tile']]:.0f})"]
                 for r in rows], left=("case",))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="fewer requests and repetitions, 8k context only")
    ap.add_argument("--parts", default="kernel,prefill,zero,resume",
                    help="which measurements (kernel, prefill, zero, resume)")
    ap.add_argument("--reps", type=int, default=3, help="alternating repetitions of the zero-reuse runs")
    ap.add_argument("--modes", default="off,interval_512,every_block", help="zero-reuse modes to run")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = build_model(get_preset(PRESET), torch.device("cuda"), seed=0)
    res: dict[str, Any] = {"preset": PRESET, "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    parts = set(args.parts.split(","))
    if "kernel" in parts:
        res["decode_kernel"] = decode_kernel()
        print(json.dumps(res["decode_kernel"]), flush=True)
    if "prefill" in parts:
        res["prefill_kernel"] = prefill_kernel()
        print(json.dumps(res["prefill_kernel"]), flush=True)
    if "zero" in parts:
        res["zero_reuse"] = zero_reuse(model, 16 if args.quick else 32, 1024, 128, 2 if args.quick else args.reps,
                                       set(args.modes.split(",")))
        print(json.dumps(res["zero_reuse"]), flush=True)
    if "resume" in parts:
        res["resumed_turn"] = [resumed_turn(model, c) for c in ((8192,) if args.quick else (8192, 32768))]
        print(json.dumps(res["resumed_turn"]), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
