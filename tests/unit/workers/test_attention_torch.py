"""TorchBackend against a naive float64 reference that walks the paged cache token by token.

Every case draws fresh random data; slots that no sequence's context covers (unused blocks, the
tail of a partial last block) are poisoned with NaN, so reading one shows up as NaN output.
"""

from __future__ import annotations

import math
import random
import zlib
from dataclasses import dataclass

import pytest
import torch

from workers.model.attention import get_backend
from workers.model.attention.torch_backend import TorchBackend


@dataclass(frozen=True)
class PagedCase:
    k_cache: torch.Tensor  # [num_blocks, block_size, kvh, d]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, -1 padded
    context_lens: list[int]
    q_lens: list[int]


def make_case(
    rng: random.Random,
    gen: torch.Generator,
    ctx_lens: list[int],
    q_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> PagedCase:
    """Random paged cache: blocks handed out in shuffled order, uncovered slots set to NaN."""
    need = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(need) + 3  # a few blocks nobody owns
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    max_blocks = max(need) + rng.randint(0, 2)
    tables = torch.full((len(ctx_lens), max_blocks), -1, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    for i, (ctx, n) in enumerate(zip(ctx_lens, need)):
        blocks, ids = ids[:n], ids[n:]
        tables[i, :n] = torch.tensor(blocks, dtype=torch.int32)
        for t in range(ctx):
            slot_block, off = blocks[t // block_size], t % block_size
            k_cache[slot_block, off] = torch.randn(num_kv_heads, head_dim, generator=gen).to(dtype)
            v_cache[slot_block, off] = torch.randn(num_kv_heads, head_dim, generator=gen).to(dtype)
    return PagedCase(k_cache, v_cache, tables, list(ctx_lens), list(q_lens))


def naive_attention(
    q: torch.Tensor,  # [total_q, H, d]
    case: PagedCase,
    scale: float,
) -> torch.Tensor:
    """float64, one query token and one key position at a time, slots looked up by hand."""
    num_heads = q.shape[1]
    block_size, num_kv_heads = case.k_cache.shape[1], case.k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    row = 0
    for i, (ctx, q_len) in enumerate(zip(case.context_lens, case.q_lens)):
        table = case.block_tables[i].tolist()
        for j in range(q_len):
            pos = ctx - q_len + j
            keys, vals = [], []
            for t in range(pos + 1):
                block, off = table[t // block_size], t % block_size
                keys.append(case.k_cache[block, off].double())
                vals.append(case.v_cache[block, off].double())
            k = torch.stack(keys)  # [pos + 1, kvh, d]
            v = torch.stack(vals)
            for h in range(num_heads):
                kvh = h // group
                scores = (k[:, kvh] @ q[row, h].double()) * scale
                p = torch.softmax(scores, dim=0)
                out[row, h] = p @ v[:, kvh]
            row += 1
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def tolerance(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]


# (block_size, num_heads, num_kv_heads, head_dim, [(ctx_len, q_len), ...])
PREFILL_CASES = [
    (4, 4, 4, 16, [(7, 7)]),  # one sequence, partial last block, MHA
    (16, 8, 2, 32, [(40, 40), (33, 5), (16, 16)]),  # GQA 4, prefix hit, exact block
    (8, 8, 1, 16, [(1, 1), (25, 24), (64, 1)]),  # MQA, tiny, one new token over a long prefix
    (16, 12, 4, 64, [(70, 30), (9, 9), (48, 47), (17, 1)]),  # GQA 3, mixed batch
    (1, 4, 2, 8, [(5, 3), (6, 6)]),  # block_size 1
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec", PREFILL_CASES, ids=lambda s: f"bs{s[0]}-h{s[1]}-kv{s[2]}-d{s[3]}")
def test_prefill_matches_naive_reference(spec, dtype) -> None:
    block_size, num_heads, num_kv_heads, head_dim, seqs = spec
    rng, gen = random.Random(zlib.crc32(str(spec).encode())), torch.Generator().manual_seed(len(seqs))
    ctx_lens, q_lens = [c for c, _ in seqs], [n for _, n in seqs]
    case = make_case(rng, gen, ctx_lens, q_lens, block_size, num_kv_heads, head_dim, dtype)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    scale = 1.0 / math.sqrt(head_dim)
    out = TorchBackend().prefill(
        q, case.k_cache, case.v_cache, case.block_tables, cu,
        torch.tensor(ctx_lens, dtype=torch.int32), scale,
    )
    ref = naive_attention(q, case, scale)
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.isfinite(out).all(), "read a NaN-poisoned slot outside some context"
    assert rel_err(out, ref) < tolerance(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "spec",
    [
        (16, 8, 2, 32, [40, 33, 16, 1]),
        (4, 4, 4, 16, [7, 9, 3]),
        (8, 16, 2, 64, [100]),  # GQA 8
        (16, 6, 3, 16, [17, 47, 2, 64, 31]),
    ],
    ids=lambda s: f"bs{s[0]}-h{s[1]}-kv{s[2]}-d{s[3]}",
)
def test_decode_matches_naive_reference(spec, dtype) -> None:
    block_size, num_heads, num_kv_heads, head_dim, ctx_lens = spec
    rng, gen = random.Random(len(ctx_lens)), torch.Generator().manual_seed(sum(ctx_lens))
    q_lens = [1] * len(ctx_lens)
    case = make_case(rng, gen, ctx_lens, q_lens, block_size, num_kv_heads, head_dim, dtype)
    q = torch.randn(len(ctx_lens), num_heads, head_dim, generator=gen).to(dtype)
    scale = 0.7 / math.sqrt(head_dim)
    out = TorchBackend().decode(
        q, case.k_cache, case.v_cache, case.block_tables,
        torch.tensor(ctx_lens, dtype=torch.int32), scale,
    )
    assert torch.isfinite(out).all(), "read a NaN-poisoned slot outside some context"
    assert rel_err(out, naive_attention(q, case, scale)) < tolerance(dtype)


def test_random_mixed_batches_match_reference() -> None:
    """Random shapes: any block size, GQA ratio, prefix length and batch mix."""
    rng, gen = random.Random(7), torch.Generator().manual_seed(7)
    backend = TorchBackend()
    for _ in range(6):
        block_size = rng.choice([2, 4, 16])
        num_kv_heads = rng.choice([1, 2])
        num_heads = num_kv_heads * rng.choice([1, 2, 4])
        head_dim = rng.choice([8, 16])
        ctx_lens = [rng.randint(1, 50) for _ in range(rng.randint(1, 4))]
        q_lens = [rng.randint(1, c) for c in ctx_lens]
        case = make_case(rng, gen, ctx_lens, q_lens, block_size, num_kv_heads, head_dim, torch.float32)
        q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen)
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        out = backend.prefill(
            q, case.k_cache, case.v_cache, case.block_tables, cu,
            torch.tensor(ctx_lens, dtype=torch.int32), 0.3,
        )
        assert rel_err(out, naive_attention(q, case, 0.3)) < 1e-5


def test_prefix_hit_equals_full_prefill_rows() -> None:
    """A prefix hit (only the last tokens new) gives the same rows as prefilling everything."""
    rng, gen = random.Random(3), torch.Generator().manual_seed(3)
    case = make_case(rng, gen, [37], [37], 8, 2, 16, torch.float32)
    q = torch.randn(37, 4, 16, generator=gen)
    backend, ctx = TorchBackend(), torch.tensor([37], dtype=torch.int32)
    full = backend.prefill(
        q, case.k_cache, case.v_cache, case.block_tables,
        torch.tensor([0, 37], dtype=torch.int32), ctx, 0.25,
    )
    tail = backend.prefill(
        q[30:].clone(), case.k_cache, case.v_cache, case.block_tables,
        torch.tensor([0, 7], dtype=torch.int32), ctx, 0.25,
    )
    torch.testing.assert_close(tail, full[30:], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_only_mapped_slots(dtype) -> None:
    gen = torch.Generator().manual_seed(11)
    num_blocks, block_size, kvh, d = 6, 4, 2, 8
    poison = -12345.0
    k_cache = torch.full((num_blocks, block_size, kvh, d), poison, dtype=dtype)
    v_cache = torch.full_like(k_cache, poison)
    # K and V as slices of one fused projection: row-strided, not contiguous.
    kv = torch.randn(9, 2, kvh, d, generator=gen).to(dtype)
    k, v = kv[:, 0], kv[:, 1]
    slots = torch.tensor([5, -1, 0, 23, 7, -1, 12, 1, 18], dtype=torch.int64)
    TorchBackend().store_kv(k, v, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, kvh, d), v_cache.view(-1, kvh, d)
    written = set()
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], k[row]) and torch.equal(flat_v[slot], v[row])
            written.add(slot)
    untouched = [s for s in range(num_blocks * block_size) if s not in written]
    assert (flat_k[untouched] == poison).all() and (flat_v[untouched] == poison).all()


def test_store_kv_rejects_mismatched_slot_count() -> None:
    cache = torch.zeros(2, 4, 1, 8)
    with pytest.raises(ValueError, match="slots"):
        TorchBackend().store_kv(torch.zeros(3, 1, 8), torch.zeros(3, 1, 8), cache, cache.clone(),
                                torch.tensor([0, 1], dtype=torch.int64))


def test_get_backend_picks_torch_on_cpu() -> None:
    assert isinstance(get_backend("cpu"), TorchBackend)
    assert get_backend("cpu", "torch").name == "torch"
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend("cpu", "nope")
