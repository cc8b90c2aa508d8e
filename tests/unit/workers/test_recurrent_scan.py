"""The recurrent layer's three forms agree: chunked prefill and batched decode against the
token-by-token reference (float32), for several chunk sizes, start offsets and snapshots."""

from __future__ import annotations

import pytest
import torch

from workers.model.recurrent import chunk_scan, decode_step, naive_scan


def _inputs(t: int, h: int = 3, dk: int = 8, dv: int = 5, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(t, h, dk, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(t, h, dk, generator=gen), dim=-1)
    v = torch.randn(t, h, dv, generator=gen)
    g = -torch.rand(t, h, generator=gen) * 0.3  # log decay in (-0.3, 0]
    s0 = torch.randn(h, dk, dv, generator=gen)
    return q, k, v, g, s0


@pytest.mark.parametrize("chunk", [1, 4, 16, 64])
@pytest.mark.parametrize("start", [0, 3, 16])
def test_chunk_scan_matches_naive(chunk: int, start: int) -> None:
    q, k, v, g, s0 = _inputs(45)
    ref_o, ref_s = naive_scan(q, k, v, g, s0)
    o, s, snaps = chunk_scan(q, k, v, g, s0, chunk=chunk, start=start, snap_at=[7, 16, 45])
    torch.testing.assert_close(o, ref_o, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s, ref_s, rtol=1e-4, atol=1e-4)
    for off, st in zip([7, 16, 45], snaps, strict=True):
        torch.testing.assert_close(st, naive_scan(q[:off], k[:off], v[:off], g[:off], s0)[1], rtol=1e-4, atol=1e-4)


def test_split_prefill_then_decode_matches_naive() -> None:
    """A prefill cut in two steps, then token-by-token decodes (batched with another sequence)
    carry the state exactly as one pass does."""
    q, k, v, g, s0 = _inputs(40, seed=1)
    ref_o, ref_s = naive_scan(q, k, v, g, s0)
    o1, s, _ = chunk_scan(q[:13], k[:13], v[:13], g[:13], s0, chunk=8, start=0)
    o2, s, _ = chunk_scan(q[13:30], k[13:30], v[13:30], g[13:30], s, chunk=8, start=13)
    outs = [o1, o2]
    other = torch.randn_like(s0)
    for t in range(30, 40):
        batch = torch.stack([other, s])
        o, new = decode_step(torch.stack([q[t], q[t]]), torch.stack([k[t], k[t]]), torch.stack([v[t], v[t]]),
                             torch.stack([g[t], g[t]]), batch)
        s = new[1]
        outs.append(o[1:])
    torch.testing.assert_close(torch.cat(outs), ref_o, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s, ref_s, rtol=1e-4, atol=1e-4)
