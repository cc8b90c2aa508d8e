"""The floor of a chain of dependent kernels in one CUDA graph: time per kernel for empty-ish
kernels (a 1-element add, a 1-CTA Triton kernel) and for a memory-touching one, at chain
lengths like a decode step's. It bounds what any decode step of K kernels can cost at least.

    python3 bench/graph_floor.py [--json bench/results/graph-floor.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _table import print_table  # noqa: E402


def chain_graph(n: int, op) -> torch.cuda.CUDAGraph:  # type: ignore[no-untyped-def]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            for _ in range(n):
                op()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            op()
    return graph


def time_graph(graph: torch.cuda.CUDAGraph, reps: int = 50) -> float:
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / reps)
    return statistics.median(samples)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="bench/results/graph-floor.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/graph_floor.py needs a CUDA GPU", file=sys.stderr)
        return 2
    tiny = torch.zeros(1, device="cuda")
    act = torch.randn(64, 896, device="cuda", dtype=torch.bfloat16)  # a 0.5B decode activation
    big = torch.randn(64, 4864, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(896, 896, device="cuda", dtype=torch.bfloat16)  # o_proj-sized weight (1.6 MB)
    ops = {
        "1-element add": lambda: tiny.add_(1.0),
        "activation add (64x896 bf16)": lambda: act.mul_(1.0),
        "activation add (64x4864 bf16)": lambda: big.mul_(1.0),
        "GEMM 64x896 @ 896x896 (cuBLAS)": lambda: torch.mm(act, w, out=act),
    }
    rows, out = [], []
    t0 = time.monotonic()
    for name, op in ops.items():
        for n in (50, 268):
            ms = time_graph(chain_graph(n, op))
            us = 1000 * ms / n
            rows.append([name, str(n), f"{ms:.4f}", f"{us:.2f}"])
            out.append({"op": name, "kernels": n, "graph_ms": ms, "us_per_kernel": us})
            print(f"  {name} x{n}: {ms:.4f} ms, {us:.2f} us per kernel", flush=True)
    print_table(f"Dependent kernels in one CUDA graph ({torch.cuda.get_device_name()})",
                ["kernel", "chain", "graph ms", "us per kernel"], rows, left=["kernel"])
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                "rows": out, "wall_s": time.monotonic() - t0}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
