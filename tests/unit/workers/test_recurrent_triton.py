"""The recurrent layer's Triton kernels on the CPU under the Triton interpreter
(``TRITON_INTERPRET=1``, set here before the kernels are built): the chunked prefill scan over a
batch of variable-length sequences against the token-by-token reference and the torch
``chunk_prefill``, and the decode step against ``decode_step``. The test extra installs triton
(``tests/conftest.py`` sets the variable first); ``tests/gpu`` runs the same kernels compiled."""

from __future__ import annotations

import importlib
import os
import random

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # read when triton builds a kernel: triton's own too, at its import
triton = pytest.importorskip("triton")

from workers.model import recurrent_triton  # noqa: E402
from workers.model.recurrent import chunk_prefill, decode_step, naive_scan  # noqa: E402

if type(triton.language.sum).__name__ != "InterpretedFunction":
    pytest.skip("triton was imported before TRITON_INTERPRET was set: run this module with TRITON_INTERPRET=1",
                allow_module_level=True)
if type(recurrent_triton._decode_kernel).__name__ != "InterpretedFunction":  # built before the variable was set
    importlib.reload(recurrent_triton)


def _batch(lens: list[int], h: int, dk: int, dv: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q = torch.nn.functional.normalize(torch.randn(t, h, dk, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(t, h, dk, generator=gen), dim=-1)
    v = torch.randn(t, h, dv, generator=gen)
    g = -torch.rand(t, h, generator=gen) * 0.5
    return q, k, v, g


def _plan(lens: list[int], chunk: int, seed: int) -> tuple[list[int], list[int], list[int], list[list[tuple[int, int]]]]:
    """Slots, starts (zero, a chunk multiple, or in mid-chunk), snapshots (ascending offsets in
    [1, len], some shared) into destination slots no sequence reads."""
    rng = random.Random(seed)
    n = len(lens)
    slots = rng.sample(range(n + 2), n)
    starts = [rng.choice([0, chunk * rng.randrange(1, 4), rng.randrange(1, 200)]) for _ in lens]
    dest = iter(range(n + 2, 10 * n + 40))
    snaps = []
    for t_len in lens:
        offs = sorted(rng.choices(range(1, t_len + 1), k=rng.randrange(0, 4)))
        snaps.append([(o, next(dest)) for o in offs])
    return slots, starts, snaps, [0, *torch.tensor(lens).cumsum(0).tolist()]


def _check(lens: list[int], chunk: int, h: int, dk: int, dv: int, seed: int) -> None:
    q, k, v, g = _batch(lens, h, dk, dv, seed)
    slots, starts, snaps, cu = _plan(lens, chunk, seed)
    states = torch.randn(10 * len(lens) + 40, h, dk, dv, generator=torch.Generator().manual_seed(seed + 1))
    for slot, start in zip(slots, starts, strict=True):
        if not start:
            states[slot] = float("nan")  # a sequence starting at position 0 must not read its slot
    got, ref = states.clone(), states.clone()
    o = recurrent_triton.chunk_prefill(q, k, v, g, got, cu, slots, starts, snaps, chunk)
    ref_o = chunk_prefill(q, k, v, g, ref, cu, slots, starts, snaps, chunk)
    torch.testing.assert_close(o, ref_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5, equal_nan=True)
    for i, slot in enumerate(slots):  # and the token-by-token recurrence
        lo, hi = cu[i], cu[i + 1]
        s0 = states[slot] if starts[i] else torch.zeros_like(states[slot])
        nv_o, nv_s = naive_scan(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], s0)
        torch.testing.assert_close(o[lo:hi], nv_o, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got[slot], nv_s, rtol=1e-4, atol=1e-4)
        for off, dest in snaps[i]:
            want = naive_scan(q[lo:lo + off], k[lo:lo + off], v[lo:lo + off], g[lo:lo + off], s0)[1]
            torch.testing.assert_close(got[dest], want, rtol=1e-4, atol=1e-4)
    written = set(slots) | {d for s in snaps for _, d in s}
    for slot in set(range(states.shape[0])) - written:
        assert torch.equal(got[slot], states[slot])  # no other slot is written


@pytest.mark.parametrize("chunk", [1, 4, 16, 64])
def test_prefill_kernel_matches_torch_and_naive(chunk: int) -> None:
    """Lengths 1 to 150 (fewer segments under the slow interpreter: up to 10 chunks per sequence below chunk 16):
    within one chunk, across several boundaries, starting mid-chunk."""
    rng = random.Random(chunk)
    lens = [1, chunk, chunk + 1, *[rng.randrange(1, min(150, 10 * chunk)) for _ in range(3)]]
    _check(lens, chunk, h=3, dk=8, dv=5, seed=chunk)


def test_prefill_kernel_tiles_odd_head_dims() -> None:
    """d_k and d_v that are not powers of two, d_v over two tiles."""
    _check([1, 33, 70], 16, h=2, dk=20, dv=40, seed=5)


def test_prefill_snapshots_at_offset_zero_and_shared_offsets() -> None:
    q, k, v, g = _batch([9], 2, 8, 8, seed=3)
    states = torch.randn(5, 2, 8, 8)
    got, ref = states.clone(), states.clone()
    snaps = [[(0, 1), (4, 2), (4, 3), (9, 4)]]
    o = recurrent_triton.chunk_prefill(q, k, v, g, got, [0, 9], [0], [7], snaps, 4)
    ref_o = chunk_prefill(q, k, v, g, ref, [0, 9], [0], [7], snaps, 4)
    torch.testing.assert_close(o, ref_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], states[0])  # offset 0: the initial state
    torch.testing.assert_close(got[4], got[0])  # offset = length: the final state


def test_prefill_rejects_unordered_snapshots() -> None:
    q, k, v, g = _batch([9], 2, 8, 8, seed=3)
    with pytest.raises(ValueError, match="ascend"):
        recurrent_triton.chunk_prefill(q, k, v, g, torch.zeros(4, 2, 8, 8), [0, 9], [0], [0], [[(5, 1), (2, 2)]], 4)
    with pytest.raises(ValueError, match="ascend"):
        recurrent_triton.chunk_prefill(q, k, v, g, torch.zeros(4, 2, 8, 8), [0, 9], [0], [0], [[(10, 1)]], 4)


def test_prefill_with_no_sequences_returns_empty() -> None:
    q, k, v, g = _batch([3], 2, 8, 8, seed=0)
    o = recurrent_triton.chunk_prefill(q, k, v, g, torch.zeros(2, 2, 8, 8), [0, 3], [], [], [], 4)
    assert o.shape == (0, 2, 8)


def test_decode_kernel_matches_torch() -> None:
    gen = torch.Generator().manual_seed(1)
    b, h, dk, dv = 3, 2, 20, 40
    q = torch.nn.functional.normalize(torch.randn(b, h, dk, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(b, h, dk, generator=gen), dim=-1)
    v, g = torch.randn(b, h, dv, generator=gen), -torch.rand(b, h, generator=gen)
    states = torch.randn(6, h, dk, dv, generator=gen)
    slots = torch.tensor([4, 0, 2])
    ref_o, ref_s = decode_step(q, k, v, g, states[slots])
    got = states.clone()
    o = recurrent_triton.decode_step(q, k, v, g, got, slots)
    torch.testing.assert_close(o, ref_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[slots], ref_s, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[[1, 3, 5]], states[[1, 3, 5]], rtol=0, atol=0)


def test_prefill_split_at_a_snapshot_is_bit_identical() -> None:
    """One step with a snapshot at p and two steps cut at p run the same segments (boundaries at
    absolute chunk multiples and at p): the same bits, the property checkpoints rely on."""
    q, k, v, g = _batch([50], 2, 8, 8, seed=9)
    states = torch.randn(4, 2, 8, 8)
    one, two = states.clone(), states.clone()
    o = recurrent_triton.chunk_prefill(q, k, v, g, one, [0, 50], [1], [5], [[(19, 3)]], 16)
    o1 = recurrent_triton.chunk_prefill(q, k, v, g, two, [0, 19], [1], [5], [[]], 16)
    assert torch.equal(two[1], one[3])
    o2 = recurrent_triton.chunk_prefill(q[19:], k[19:], v[19:], g[19:], two, [0, 31], [1], [24], [[]], 16)
    assert torch.equal(torch.cat([o1, o2]), o)
    assert torch.equal(two[1], one[1])


def test_prefill_segments_are_chunk_scans() -> None:
    """The kernel's segment table (built for a whole batch at once) cuts every sequence where
    ``chunk_scan`` does: at absolute chunk multiples, at snapshot offsets inside it, at its end."""
    rng = random.Random(0)
    for _ in range(200):
        n, chunk = rng.randrange(1, 6), rng.choice([1, 4, 16, 64])
        lens = [rng.choice([0, 1, rng.randrange(1, 300)]) for _ in range(n)]
        starts = [rng.choice([0, chunk * rng.randrange(1, 5), rng.randrange(1, 500)]) for _ in range(n)]
        snaps = [[(o, 9) for o in sorted(rng.choices(range(t + 1), k=rng.randrange(0, 4)))] for t in lens]
        cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
        seqs, segs, _, _, _ = recurrent_triton._prefill_tables(cu, starts, list(range(n)), snaps, chunk,
                                                               torch.device("cpu"))
        seq_rows, seg_rows = seqs.view(n, 4).tolist(), segs.view(-1, 3).tolist()
        for i, t_len in enumerate(lens):
            cuts = {o for o, _ in snaps[i] if 0 < o < t_len} | set(range((-starts[i]) % chunk or chunk, t_len, chunk))
            bounds = [0, *sorted(cuts), t_len] if t_len else [0]
            first, count = seq_rows[i][:2]
            assert seg_rows[first:first + count] == [[cu[i] + a, b - a, b] for a, b in zip(bounds, bounds[1:])]


def test_prefill_kernel_tiles_per_program() -> None:
    """Pass 2 with several d_v tiles per program (the last one partly past d_v) and other state
    tiles in pass 1 computes the same outputs and states."""
    lens = [1, 40, 23]
    q, k, v, g = _batch(lens, 2, 16, 40, seed=4)
    slots, starts, snaps, cu = _plan(lens, 16, 4)
    states = torch.randn(80, 2, 16, 40)
    base, tiled = states.clone(), states.clone()
    o = recurrent_triton.chunk_prefill(q, k, v, g, base, cu, slots, starts, snaps, 16)
    o2 = recurrent_triton.chunk_prefill(q, k, v, g, tiled, cu, slots, starts, snaps, 16, tiles=(16, 32, 4, 16, 2, 4))
    torch.testing.assert_close(o2, o, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(tiled, base, rtol=1e-6, atol=1e-6)
