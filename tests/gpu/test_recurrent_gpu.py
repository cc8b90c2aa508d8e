"""The recurrent layer's Triton decode kernel on a CUDA GPU against the torch reference
(``workers.model.recurrent.decode_step``) computed on the same GPU, float32. Imports only torch,
triton, pytest and ``workers.model``: runs on the bare device image (tests/gpu/run.sh)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from workers.model import recurrent_triton  # noqa: E402
from workers.model.recurrent import decode_step, naive_scan  # noqa: E402

DEV = "cuda"


def _case(b: int, h: int, dk: int, dv: int, slots: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(b, h, dk, generator=gen, device=DEV), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(b, h, dk, generator=gen, device=DEV), dim=-1)
    v = torch.randn(b, h, dv, generator=gen, device=DEV)
    g = -torch.rand(b, h, generator=gen, device=DEV)
    states = torch.randn(slots, h, dk, dv, generator=gen, device=DEV)
    perm = torch.randperm(slots, generator=gen, device=DEV)[:b]
    return q, k, v, g, states, perm


@pytest.mark.parametrize(("b", "h", "dk", "dv"), [(1, 4, 32, 32), (7, 3, 64, 48), (64, 16, 128, 128), (5, 2, 100, 80)])
def test_decode_kernel_matches_torch(b: int, h: int, dk: int, dv: int) -> None:
    q, k, v, g, states, slots = _case(b, h, dk, dv, slots=b + 9, seed=b * 31 + dk)
    ref_o, ref_s = decode_step(q, k, v, g, states[slots])
    got = states.clone()
    o = recurrent_triton.decode_step(q, k, v, g, got, slots)
    torch.testing.assert_close(o, ref_o, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[slots], ref_s, rtol=1e-5, atol=1e-5)
    others = torch.ones(states.shape[0], dtype=torch.bool, device=DEV)
    others[slots] = False
    assert torch.equal(got[others], states[others])  # no other slot is written


def test_many_decode_steps_match_naive_scan() -> None:
    """200 kernel steps carry the state as the token-by-token reference does."""
    t, h, dk, dv = 200, 4, 64, 64
    gen = torch.Generator(device=DEV).manual_seed(7)
    q = torch.nn.functional.normalize(torch.randn(t, h, dk, generator=gen, device=DEV), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(t, h, dk, generator=gen, device=DEV), dim=-1)
    v = torch.randn(t, h, dv, generator=gen, device=DEV)
    g = -torch.rand(t, h, generator=gen, device=DEV) * 0.1
    ref_o, ref_s = naive_scan(q, k, v, g, torch.zeros(h, dk, dv, device=DEV))
    states = torch.zeros(3, h, dk, dv, device=DEV)
    slot = torch.tensor([2], device=DEV)
    outs = [recurrent_triton.decode_step(q[i : i + 1], k[i : i + 1], v[i : i + 1], g[i : i + 1], states, slot)
            for i in range(t)]
    torch.testing.assert_close(torch.cat(outs), ref_o, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(states[2], ref_s, rtol=1e-4, atol=1e-4)
