"""The recurrent layer's three forms agree: chunked prefill and batched decode against the
token-by-token reference (float32), for several chunk sizes, start offsets and snapshots."""

from __future__ import annotations

import pytest
import torch

from workers.model.recurrent import chunk_prefill, chunk_scan, decode_step, naive_scan


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


def test_chunk_prefill_runs_each_sequence_against_its_slot() -> None:
    """A batch of three prefill sequences against one state tensor: each starts from its slot
    (from zero at position 0), ends there, and writes its snapshots; no other slot changes."""
    lens, starts, slots = [1, 20, 37], [0, 5, 13], [3, 0, 5]
    snaps = [[], [(7, 7), (16, 8)], [(3, 9), (3, 6)]]
    q, k, v, g, _ = _inputs(sum(lens), seed=2)
    states = torch.randn(10, 3, 8, 5)
    states[3] = float("nan")  # starts at 0: never read
    got = states.clone()
    cu = [0, 1, 21, 58]
    o = chunk_prefill(q, k, v, g, got, cu, slots, starts, snaps, 8)
    for i, slot in enumerate(slots):
        lo, hi = cu[i], cu[i + 1]
        s0 = states[slot] if starts[i] else torch.zeros_like(states[slot])
        ref_o, ref_s = naive_scan(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], s0)
        torch.testing.assert_close(o[lo:hi], ref_o, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got[slot], ref_s, rtol=1e-4, atol=1e-4)
        for off, dest in snaps[i]:
            want = naive_scan(q[lo:lo + off], k[lo:lo + off], v[lo:lo + off], g[lo:lo + off], s0)[1]
            torch.testing.assert_close(got[dest], want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got[[1, 2, 4]], states[[1, 2, 4]])
