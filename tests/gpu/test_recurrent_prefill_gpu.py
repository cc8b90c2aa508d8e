"""The recurrent layer's Triton prefill scan on a CUDA GPU against the torch ``chunk_prefill``
(the per-sequence ``chunk_scan``) and the token-by-token reference on the same GPU, float32:
batches of up to 16 variable-length sequences, lengths 1 to 8k, heads x 128 x 128, mid-chunk
starts, snapshots; and the layer choosing the kernel on CUDA. Imports only torch, triton, pytest
and ``workers.model``: runs on the bare device image (tests/gpu/run.sh)."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from workers.model import recurrent_triton  # noqa: E402
from workers.model.recurrent import GatedLinearAttention, RecurrentMetadata, chunk_prefill, naive_scan  # noqa: E402

DEV = "cuda"


def _batch(lens: list[int], h: int, dk: int, dv: int, seed: int, decay: float = 1.0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    t = sum(lens)
    q = torch.nn.functional.normalize(torch.randn(t, h, dk, generator=gen, device=DEV), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(t, h, dk, generator=gen, device=DEV), dim=-1)
    v = torch.randn(t, h, dv, generator=gen, device=DEV)
    g = -torch.rand(t, h, generator=gen, device=DEV) * decay
    return q, k, v, g


def _plan(lens: list[int], chunk: int, seed: int) -> tuple[list[int], list[int], list[list[tuple[int, int]]], list[int]]:
    """Slots in random order, starts (zero, chunk multiples, mid-chunk), up to 4 ascending
    snapshot offsets in [1, len] per sequence (some shared) into slots no sequence reads."""
    rng = random.Random(seed)
    n = len(lens)
    slots = rng.sample(range(n + 3), n)
    starts = [rng.choice([0, chunk * rng.randrange(1, 100), rng.randrange(1, 20000)]) for _ in lens]
    dest = iter(range(n + 3, 6 * n + 8))
    snaps = []
    for t_len in lens:
        offs = sorted(rng.choices(range(1, t_len + 1), k=rng.randrange(0, 5)))
        snaps.append([(o, next(dest)) for o in offs])
    cu = [0]
    for t_len in lens:
        cu.append(cu[-1] + t_len)
    return slots, starts, snaps, cu


def _run_both(lens: list[int], chunk: int, h: int, dk: int, dv: int, seed: int,
              precision: str = "ieee") -> tuple[torch.Tensor, ...]:
    q, k, v, g = _batch(lens, h, dk, dv, seed)
    slots, starts, snaps, cu = _plan(lens, chunk, seed)
    states = torch.randn(6 * len(lens) + 8, h, dk, dv, device=DEV)
    for slot, start in zip(slots, starts, strict=True):
        if not start:
            states[slot] = float("nan")  # a sequence starting at position 0 must not read its slot
    got, ref = states.clone(), states.clone()
    o = recurrent_triton.chunk_prefill(q, k, v, g, got, cu, slots, starts, snaps, chunk, precision=precision)
    ref_o = chunk_prefill(q, k, v, g, ref, cu, slots, starts, snaps, chunk)
    written = set(slots) | {d for s in snaps for _, d in s}
    others = torch.tensor([i not in written for i in range(states.shape[0])], device=DEV)
    assert torch.equal(got[others], states[others])  # no other slot is written
    return o, ref_o, got, ref


CASES = [  # (lengths, chunk, heads, d_k, d_v)
    ([1], 64, 8, 128, 128),
    ([1, 2, 63, 64, 65, 127, 129, 1000], 64, 8, 128, 128),
    ([8192], 64, 8, 128, 128),
    ([random.Random(16).randrange(1, 8193) for _ in range(15)] + [1], 64, 8, 128, 128),
    ([300, 5, 1024, 77], 16, 4, 64, 64),
    ([500, 1, 33], 32, 3, 100, 80),
]


@pytest.mark.parametrize("precision", ["ieee", "tf32x3"])
@pytest.mark.parametrize(("lens", "chunk", "h", "dk", "dv"), CASES, ids=[f"{len(c[0])}seq-max{max(c[0])}-c{c[1]}-{c[3]}x{c[4]}" for c in CASES])
def test_prefill_kernel_matches_torch_chunk_scan(lens: list[int], chunk: int, h: int, dk: int, dv: int,
                                                 precision: str) -> None:
    o, ref_o, got, ref = _run_both(lens, chunk, h, dk, dv, seed=sum(lens) + dk, precision=precision)
    torch.testing.assert_close(o, ref_o, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4, equal_nan=True)


@pytest.mark.parametrize("t_len", [1, 200, 2049])
def test_prefill_kernel_matches_naive_scan(t_len: int) -> None:
    """From a nonzero state at a mid-chunk position, with snapshots, against token by token."""
    h, dk, dv, start = 4, 128, 128, 37
    q, k, v, g = _batch([t_len], h, dk, dv, seed=t_len, decay=0.1)
    states = torch.randn(4, h, dk, dv, device=DEV)
    s0 = states[2].clone()
    offs = sorted({1, t_len // 3 + 1, t_len})
    snaps = [[(o, 3 if i == 0 else 0 if i == 1 else 1) for i, o in enumerate(offs)]]
    got = states.clone()
    o = recurrent_triton.chunk_prefill(q, k, v, g, got, [0, t_len], [2], [start], snaps, 64)
    ref_o, ref_s = naive_scan(q, k, v, g, s0)
    torch.testing.assert_close(o, ref_o, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[2], ref_s, rtol=1e-4, atol=1e-4)
    for off, dest in snaps[0]:
        torch.testing.assert_close(got[dest], naive_scan(q[:off], k[:off], v[:off], g[:off], s0)[1], rtol=1e-4, atol=1e-4)


def test_prefill_split_at_a_snapshot_is_bit_identical() -> None:
    """One step with a snapshot at p and two steps cut at p run the same segments: same bits."""
    h, dk, dv = 8, 128, 128
    q, k, v, g = _batch([3000], h, dk, dv, seed=3)
    states = torch.randn(4, h, dk, dv, device=DEV)
    one, two = states.clone(), states.clone()
    o = recurrent_triton.chunk_prefill(q, k, v, g, one, [0, 3000], [1], [100], [[(1000, 3)]], 64)
    o1 = recurrent_triton.chunk_prefill(q, k, v, g, two, [0, 1000], [1], [100], [[]], 64)
    assert torch.equal(two[1], one[3])
    o2 = recurrent_triton.chunk_prefill(q[1000:], k[1000:], v[1000:], g[1000:], two, [0, 2000], [1], [1100], [[]], 64)
    assert torch.equal(torch.cat([o1, o2]), o)
    assert torch.equal(two[1], one[1])


def test_layer_runs_the_triton_scan_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """The recurrent layer's prefill on CUDA launches the kernel, and equals the torch path."""
    torch.manual_seed(0)
    layer = GatedLinearAttention(256, 8, 128, 128, chunk=64, eps=1e-6, layer_index=1).to(DEV)
    with torch.no_grad():
        layer.A_log.normal_()
    x = torch.randn(1300, 256, device=DEV)
    cu, slots, starts = [0, 1000, 1001, 1300], [2, 0, 1], [0, 64, 500]
    snaps = [[(512, 4)], [], [(10, 5), (299, 6)]]
    states = torch.randn(2, 8, 8, 128, 128, device=DEV)
    calls = []
    kernel = recurrent_triton.chunk_prefill
    monkeypatch.setattr(recurrent_triton, "chunk_prefill", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    got = states.clone()
    with torch.no_grad():
        y = layer(x, 1300, cu, RecurrentMetadata(got, slots, starts, snaps))
        want_states = states.clone()
        q, k, v, z, g = layer._project(x)
        ref_o = chunk_prefill(q, k, v, g, want_states[1], cu, slots, starts, snaps, 64)
        o = ref_o * torch.rsqrt(ref_o.pow(2).mean(-1, keepdim=True) + 1e-6) * layer.o_norm
        want_y = layer.out_proj(o.view(1300, -1) * torch.nn.functional.silu(z))
    assert calls == [1]
    torch.testing.assert_close(got, want_states, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y, want_y, rtol=1e-4, atol=1e-4)
