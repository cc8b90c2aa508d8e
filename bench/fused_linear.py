"""The decode sub-layers of a preset, fused (``workers.fused_linear``) vs unfused (cuBLAS GEMMs +
the Triton RMSNorm / SiLU kernels), on a CUDA GPU.

One "layer" here is every launch of a decoder layer except attention: RMSNorm + qkv (+bias),
o_proj + residual, RMSNorm + gate_up + SiLU*up, down + residual. Each variant runs ``--layers``
such layers (distinct weights, so nothing stays in L2) inside one CUDA graph, replayed; the table
gives microseconds per layer, the byte floor (weights once / copy ceiling) and the ratio.

    python3 bench/fused_linear.py [--presets qwen2-0.5b,llama3-8b] [--tokens 1,16,64,128,256]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _table import print_table  # noqa: E402
from workers import kernels  # noqa: E402
from workers import fused_linear as fl  # noqa: E402
from workers.config import ModelConfig, get_preset  # noqa: E402


def _layer_weights(cfg: ModelConfig, layers: int) -> list[dict[str, torch.Tensor]]:
    h, i, qkv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size + 2 * cfg.kv_size
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16) * 0.02  # noqa: E731
    return [{"qkv": mk(qkv, h), "qkv_b": mk(qkv) if cfg.qkv_bias else None, "o": mk(h, cfg.q_size),
             "gu": mk(2 * i, h), "d": mk(h, i), "ln1": 1 + mk(h), "ln2": 1 + mk(h)} for _ in range(layers)]


def _unfused(ws: list[dict[str, torch.Tensor]], x: torch.Tensor, attn_out: torch.Tensor, eps: float) -> None:
    residual = None
    for w in ws:
        hn, residual = kernels.add_rmsnorm(x, residual, w["ln1"], eps)
        torch.nn.functional.linear(hn, w["qkv"], w["qkv_b"])
        o = torch.nn.functional.linear(attn_out, w["o"])
        hn, residual = kernels.add_rmsnorm(o, residual, w["ln2"], eps)
        x = torch.nn.functional.linear(kernels.silu_mul(torch.nn.functional.linear(hn, w["gu"])), w["d"])


def _fused(ws: list[dict[str, torch.Tensor]], h: torch.Tensor, attn_out: torch.Tensor, eps: float) -> None:
    stream = fl.ResidualStream(h)
    for w in ws:
        stream.norm_linear(w["qkv"], w["ln1"], eps, bias=w["qkv_b"])
        stream.add_linear(attn_out, w["o"])
        act = stream.norm_linear(w["gu"], w["ln2"], eps, glu=True)
        stream.add_linear(act, w["d"])


def _graph_us(fn: Any, reps: int = 20) -> float:
    fn()  # compile / size the workspace outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _copy_gbs() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    end.synchronize()
    return 2 * 10 * a.numel() / (start.elapsed_time(end) * 1e-3) / 1e9


def run(preset: str, tokens: list[int], layers: int, copy_gbs: float) -> list[dict[str, Any]]:
    cfg = get_preset(preset)
    ws = _layer_weights(cfg, layers)
    layer_bytes = sum(t.numel() * 2 for t in ws[0].values() if t is not None)
    floor_us = layer_bytes / (copy_gbs * 1e3)
    rows = []
    for m in tokens:
        x = torch.randn(m, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        attn = torch.randn(m, cfg.q_size, device="cuda", dtype=torch.bfloat16)
        h = x.clone()
        unfused = _graph_us(lambda: _unfused(ws, x, attn, cfg.rms_norm_eps)) / layers  # noqa: B023
        fused = _graph_us(lambda: _fused(ws, h, attn, cfg.rms_norm_eps)) / layers  # noqa: B023
        rows.append({"preset": preset, "tokens": m, "unfused_us": unfused, "fused_us": fused,
                     "speedup": unfused / fused, "floor_us": floor_us, "fused_x_floor": fused / floor_us})
        print(f"{preset} M={m}: unfused {unfused:.1f} us/layer, fused {fused:.1f} (floor {floor_us:.1f})", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="qwen2-0.5b,llama3-8b")
    ap.add_argument("--tokens", type=lambda s: [int(v) for v in s.split(",")], default=[1, 16, 64, 128, 256])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--json", default="bench/results/fused_linear.json")
    args = ap.parse_args()
    copy_gbs = _copy_gbs()
    rows = [r for p in args.presets.split(",") for r in run(p, args.tokens, args.layers, copy_gbs)]
    print_table(f"Decode sub-layers per layer (us), {torch.cuda.get_device_name()}, copy {copy_gbs:,.0f} GB/s",
                ["preset", "tokens", "unfused (cuBLAS)", "fused", "speedup", "byte floor", "fused / floor"],
                [[r["preset"], str(r["tokens"]), f"{r['unfused_us']:.1f}", f"{r['fused_us']:.1f}",
                  f"{r['speedup']:.2f}x", f"{r['floor_us']:.1f}", f"{r['fused_x_floor']:.2f}"] for r in rows],
                left=["preset"])
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"copy_gbs": copy_gbs, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
