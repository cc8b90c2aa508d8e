"""Decode-sized GEMMs (M = batch rows, the 0.5B preset's four weight shapes) in a chain of 50
inside one CUDA graph: cuBLAS through torch (both BLAS back ends) against a plain Triton GEMM
(no split-K) at a few tile shapes. The 0.5B decode step is a chain of such kernels, so their
latency, not their bytes, sets its speed (bench/graph_floor.py gives the empty-kernel floor).

    python3 bench/small_gemm.py [--m 64] [--json bench/results/small-gemm.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _table import print_table  # noqa: E402
from graph_floor import chain_graph, time_graph  # noqa: E402

SHAPES = {"qkv 896->1152": (896, 1152), "o 896->896": (896, 896), "gate_up 896->9728": (896, 9728),
          "down 4864->896": (4864, 896)}


@triton.jit
def _gemm(x_ptr, w_ptr, y_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[M, N] = x[M, K] @ w[N, K]^T (w row-major as nn.Linear keeps it)."""
    pid_n = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        kk = k + rk
        x = tl.load(x_ptr + rm[:, None] * K + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        w = tl.load(w_ptr + rn[None, :] * K + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        acc += tl.dot(x, w)
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16), mask=(rm[:, None] < M) & (rn[None, :] < N))


def triton_gemm(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, bn: int, bk: int, warps: int, stages: int) -> None:
    m, k = x.shape
    n = w.shape[0]
    _gemm[(triton.cdiv(n, bn),)](x, w, y, m, n, k, BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=bn,
                                  BLOCK_K=bk, num_warps=warps, num_stages=stages)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=64)
    ap.add_argument("--json", default="bench/results/small-gemm.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/small_gemm.py needs a CUDA GPU", file=sys.stderr)
        return 2
    rows, out = [], []
    for name, (k, n) in SHAPES.items():
        x = torch.randn(args.m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        y = torch.empty(args.m, n, device="cuda", dtype=torch.bfloat16)
        ref = torch.nn.functional.linear(x, w)
        bytes_us = (w.numel() * 2) / 4.2e6  # at ~4.2 TB/s
        cases = {}
        for lib in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(lib)
            cases[f"torch {lib}"] = lambda: torch.mm(x, w.t(), out=y)
        torch.backends.cuda.preferred_blas_library("cublas")
        for bn, bk, warps, stages in ((32, 128, 4, 3), (64, 128, 4, 3), (64, 64, 4, 4), (128, 64, 8, 3), (32, 256, 4, 2)):
            cases[f"triton n{bn} k{bk} w{warps} s{stages}"] = (
                lambda bn=bn, bk=bk, warps=warps, stages=stages: triton_gemm(x, w, y, bn, bk, warps, stages))
        for case, op in cases.items():
            try:
                if case.startswith("torch"):
                    torch.backends.cuda.preferred_blas_library(case.split()[1])
                op()
                torch.cuda.synchronize()
                err = ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                us = 1000 * time_graph(chain_graph(50, op)) / 50
            except Exception as exc:  # a tile shape that does not compile: record and go on
                rows.append([name, case, "error", str(exc)[:40], ""])
                continue
            finally:
                torch.backends.cuda.preferred_blas_library("cublas")
            rows.append([name, case, f"{us:.2f}", f"{bytes_us:.2f}", f"{err:.1e}"])
            out.append({"shape": name, "case": case, "us": us, "bytes_us": bytes_us, "rel_err": err})
            print(f"  {name} {case}: {us:.2f} us (bytes {bytes_us:.2f} us) err {err:.1e}", flush=True)
    print_table(f"M={args.m} GEMMs, per kernel in a chain of 50 in one CUDA graph ({torch.cuda.get_device_name()})",
                ["shape", "kernel", "us", "bytes us", "rel err"], rows, left=["shape", "kernel"])
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"device": torch.cuda.get_device_name(), "m": args.m, "rows": out}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
