"""Checks of ``workers.fused_linear`` shared by the CPU test (Triton's interpreter, in a
subprocess: ``TRITON_INTERPRET=1`` must be set before Triton is imported) and the GPU test.

``python -m tests.fused_checks [cpu|cuda]`` runs them all and prints one line per check.
"""

from __future__ import annotations

import sys

import torch

from workers import fused_linear as fl

# (m, n, k, glu, bias, norm, residual, split_k): ragged tiles, every prologue/epilogue, split-K.
CASES = [
    (1, 40, 96, False, False, False, False, 1),
    (5, 40, 200, False, True, True, False, 3),
    (6, 48, 200, False, False, False, True, 3),
    (20, 24, 300, True, False, True, False, 2),
    (3, 64, 256, True, False, True, False, 1),
    (17, 33, 130, False, False, False, True, 4),
]


def reference(x, w, bias=None, norm_weight=None, eps=1e-6, glu=False, residual=None):  # type: ignore[no-untyped-def]
    """The unfused computation with HF's rounding points, in fp32 math."""
    dt = x.dtype
    if norm_weight is not None:
        xf = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        x = (norm_weight.float() * xf.to(dt).float()).to(dt)
    y = x.float() @ w.float().T
    if bias is not None:
        y = y + bias.float()
    y = y.to(dt)
    if glu:
        g, u = y.float().chunk(2, -1)
        y = ((g / (1 + torch.exp(-g))).to(dt).float() * u).to(dt)
    if residual is not None:
        y = (y.float() + residual.float()).to(dt)
    return y


def _plan(m: int, k: int, split: int, block: int = 32) -> fl.Plan:
    blocks = -(-k // block)
    per = -(-blocks // split) * block
    return fl.Plan(16, 16, block, -(-k // per), per, 4, 2)


def check_cases(device: str, dtype: torch.dtype) -> list[str]:
    """Every case against the reference (one ulp of the output dtype: split-K sums in another
    order), bit-identical on a rerun, tickets back to zero. Norm cases go through a
    ``ResidualStream``; residual cases add into one and then normalize it, which checks that the
    row statistics the epilogue left are those of the updated rows."""
    gen = torch.Generator().manual_seed(0)
    lines = []
    for m, n, k, glu, use_bias, norm, use_res, split in CASES:
        x = torch.randn(m, k, generator=gen).to(device, dtype)
        w = (torch.randn(2 * n if glu else n, k, generator=gen) / k**0.5).to(device, dtype)
        bias = torch.randn(n, generator=gen).to(device, dtype) if use_bias else None
        nw = (torch.rand(k, generator=gen) + 0.5).to(device, dtype) if norm else None
        p = _plan(m, k, split)
        if use_res:  # h += x @ w.T, then the next norm sees the new rows (no bias, glu or norm here)
            h0 = torch.randn(m, n, generator=gen).to(device, dtype)
            w_next = (torch.randn(24, n, generator=gen) / n**0.5).to(device, dtype)
            nw_next = (torch.rand(n, generator=gen) + 0.5).to(device, dtype)
            want_h = reference(x, w, residual=h0)
            want = reference(want_h, w_next, norm_weight=nw_next)

            def run() -> torch.Tensor:
                stream = fl.ResidualStream(h0.clone(), p)
                stream.add_linear(x, w)
                if _ulps(stream.h, want_h) > 1.0:
                    raise AssertionError(f"case {(m, n, k, split)}: residual add {_ulps(stream.h, want_h):.1f} ulps off")
                return stream.norm_linear(w_next, nw_next, 1e-6)
        elif norm:
            def run() -> torch.Tensor:
                return fl.ResidualStream(x.clone(), p).norm_linear(w, nw, 1e-6, bias=bias, glu=glu)
            want = reference(x, w, bias, nw, glu=glu)
        else:
            def run() -> torch.Tensor:
                return fl.fused_linear(x, w, bias=bias, glu=glu, split_plan=p)
            want = reference(x, w, bias, glu=glu)
        got, again = run(), run()
        err = _ulps(got, want)
        if err > 1.0:
            raise AssertionError(f"case {(m, n, k, glu, split)}: {err:.1f} ulps from the reference")
        if not torch.equal(got, again):
            raise AssertionError(f"case {(m, n, k, glu, split)}: two runs differ (not deterministic)")
        tickets = fl._WORKSPACE.tickets.get(torch.device(device))
        if tickets is not None and int(tickets.abs().sum()) != 0:
            raise AssertionError("tickets not reset to zero after the launches")
        lines.append(f"case m={m} n={n} k={k} glu={glu} split={p.split_k}: {err:.2f} ulps")
    return lines


def _ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest error in units of the output dtype's spacing at the reference's magnitude."""
    eps = torch.finfo(want.dtype).eps
    scale = want.float().abs().clamp_min(1.0) * eps
    return float(((got.float() - want.float()).abs() / scale).max())


def check_model(device: str, dtype: torch.dtype, preset: str = "tiny") -> str:
    """A decode-shaped batch through the fused forward equals the layer-by-layer forward."""
    from dataclasses import replace

    from workers.attention.base import get_backend
    from workers.config import get_preset
    from workers.layers import AttentionMetadata
    from workers.model import build_model

    cfg = replace(get_preset(preset), dtype={torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype])
    dev = torch.device(device)
    model = build_model(cfg, dev, seed=0)
    backend = get_backend(dev, "triton" if dev.type == "cuda" else "torch")
    blocks, bs, batch = 8, 16, 6
    kv = [(torch.randn(blocks, bs, cfg.num_kv_heads, cfg.head_dim, device=dev).to(dtype) * 0.5,
           torch.randn(blocks, bs, cfg.num_kv_heads, cfg.head_dim, device=dev).to(dtype) * 0.5)
          for _ in range(cfg.num_layers)]
    ctx = torch.tensor([1, 5, 17, 30, 64, 100], dtype=torch.int32, device=dev)
    tables = torch.arange(batch * 7, dtype=torch.int32, device=dev).view(batch, 7) % blocks
    positions = (ctx - 1).long()
    slots = (tables.gather(1, (positions // bs).view(-1, 1).int()).view(-1).long() * bs + positions % bs)
    meta = AttentionMetadata(slot_mapping=slots, num_prefill_tokens=0,
                             decode_block_tables=tables, decode_context_lens=ctx)
    ids = torch.tensor([3, 1, 4, 1, 5, 9], device=dev)
    caches = [(k.clone(), v.clone()) for k, v in kv]
    want = model(ids, positions, caches, meta, backend)
    model.fused_small_batches = True
    caches = [(k.clone(), v.clone()) for k, v in kv]
    got = model(ids, positions, caches, meta, backend)
    err = float((got.float() - want.float()).abs().max())
    same = torch.equal(model.compute_logits(got).argmax(-1), model.compute_logits(want).argmax(-1))
    if err > 0.05 * float(want.float().abs().max()) or not same:
        raise AssertionError(f"fused forward differs: max err {err:.4f}, same greedy tokens: {same}")
    return f"model {preset} {dtype}: max err {err:.4f}, same greedy tokens"


def main(device: str) -> int:
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    for line in check_cases(device, dtype):
        print(line, flush=True)
    print(check_model(device, dtype), flush=True)
    print("fused checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "cpu"))
