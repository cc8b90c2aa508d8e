"""TritonBackend on a CUDA GPU against an fp32 reference computed on the same GPU.

Every case draws fresh random inputs. Cache slots that no context covers hold NaN, outputs are
allocated from memory that was just filled with NaN (so an element the kernel never writes shows
up), and a NaN anywhere fails the case. Imports only torch, triton, pytest and
``workers.model.attention``: this runs on the bare device image (tests/gpu/run.sh).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("triton")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from workers.model.attention import get_backend  # noqa: E402
from workers.model.attention.torch_backend import TorchBackend  # noqa: E402
from workers.model.attention.triton_backend import (  # noqa: E402
    DecodeConfig,
    PrefillConfig,
    TritonBackend,
)

DEV = "cuda"
BF16_TOL = 1e-2


@dataclass(frozen=True)
class Case:
    k_cache: torch.Tensor  # [num_blocks, block_size, kvh, d]; uncovered slots NaN
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, -1 padded
    context_lens: torch.Tensor  # [num_seqs] int32
    q_lens: list[int]


def make_case(
    gen: torch.Generator, ctx_lens: list[int], q_lens: list[int], block_size: int,
    num_kv_heads: int, head_dim: int, dtype: torch.dtype,
) -> Case:
    need = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(need) + 4
    order = torch.randperm(num_blocks, generator=gen).tolist()  # blocks scattered in the pool
    max_blocks = max(need) + 2
    tables = torch.full((len(ctx_lens), max_blocks), -1, dtype=torch.int32)
    covered = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for i, (ctx, n) in enumerate(zip(ctx_lens, need)):
        blocks, order = order[:n], order[n:]
        tables[i, :n] = torch.tensor(blocks, dtype=torch.int32)
        t = torch.arange(ctx)
        covered[torch.tensor(blocks)[t // block_size] * block_size + t % block_size] = True
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = []
    for _ in range(2):
        c = torch.randn(shape, generator=gen).to(dtype)
        c.view(-1, num_kv_heads, head_dim)[~covered] = float("nan")
        caches.append(c.to(DEV))
    return Case(caches[0], caches[1], tables.to(DEV),
                torch.tensor(ctx_lens, dtype=torch.int32, device=DEV), list(q_lens))


def reference(q: torch.Tensor, case: Case, scale: float) -> torch.Tensor:
    """fp32 (no TF32) attention of each new token over its context, query rows in chunks."""
    torch.backends.cuda.matmul.allow_tf32 = False
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = case.k_cache.shape[1], case.k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float32, device=DEV)
    row = 0
    for i, (ctx, q_len) in enumerate(zip(case.context_lens.tolist(), case.q_lens)):
        pos = torch.arange(ctx, device=DEV)
        slots = case.block_tables[i].long()[pos // block_size] * block_size + pos % block_size
        k = case.k_cache.view(-1, num_kv_heads, head_dim)[slots].float()  # [ctx, kvh, d]
        v = case.v_cache.view(-1, num_kv_heads, head_dim)[slots].float()
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, ctx, d]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        chunk = max(1, (1 << 28) // (num_heads * ctx))
        for j0 in range(0, q_len, chunk):
            j1 = min(q_len, j0 + chunk)
            qi = q[row + j0 : row + j1].float().transpose(0, 1)  # [H, n, d]
            s = (qi @ k.transpose(1, 2)) * scale
            q_pos = ctx - q_len + torch.arange(j0, j1, device=DEV)
            s = s.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
            out[row + j0 : row + j1] = (torch.softmax(s, dim=-1) @ v).transpose(0, 1)
        row += q_len
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm())


def poison_allocator(*specs: tuple[tuple[int, ...], torch.dtype]) -> None:
    """Fill and free blocks of these sizes, so that the caching allocator hands the same NaN-filled
    memory to the backend's next ``torch.empty`` of them (output and split-K partials)."""
    held = [torch.full(shape, float("nan"), dtype=dtype, device=DEV) for shape, dtype in specs]
    del held


def check(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str) -> None:
    assert out.shape == ref.shape, what
    assert bool(torch.isfinite(out).all()), f"{what}: NaN/inf in output (unwritten or bad read)"
    err = rel_err(out, ref)
    assert err < tol, f"{what}: relative error {err:.2e} >= {tol}"


def _random_shape(rng: random.Random) -> tuple[int, int, int, int]:
    block_size = rng.choice([16, 64])
    head_dim = rng.choice([64, 128])
    num_kv_heads = rng.choice([1, 2, 8])
    group = rng.choice([1, 4, 8])
    return block_size, num_kv_heads * group, num_kv_heads, head_dim


def _ctx(rng: random.Random, longest: int) -> int:
    """Context lengths spread over scales (log-uniform), partial blocks included."""
    return max(1, int(math.exp(rng.uniform(0, math.log(longest)))))


# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_store_kv_writes_mapped_slots_only(seed: int) -> None:
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    block_size, _, kvh, d = _random_shape(rng)
    dtype = rng.choice([torch.bfloat16, torch.float16])
    num_blocks, n = 40, rng.randint(1, 300)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n]
    slots[torch.rand(n, generator=gen) < 0.2] = -1
    fused = torch.randn(n, 3, kvh, d, generator=gen).to(dtype).to(DEV)  # K/V rows strided
    k, v = fused[:, 0], fused[:, 2]
    k_cache = torch.full((num_blocks, block_size, kvh, d), float("nan"), dtype=dtype, device=DEV)
    v_cache = k_cache.clone()
    TritonBackend().store_kv(k, v, k_cache, v_cache, slots.to(DEV))
    keep = slots >= 0
    flat_k, flat_v = k_cache.view(-1, kvh, d).cpu(), v_cache.view(-1, kvh, d).cpu()
    assert torch.equal(flat_k[slots[keep]], k.cpu()[keep])
    assert torch.equal(flat_v[slots[keep]], v.cpu()[keep])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[keep]] = False
    assert bool(flat_k[untouched].isnan().all()) and bool(flat_v[untouched].isnan().all())


DECODE_FIXED = [
    # (block_size, num_heads, num_kv_heads, head_dim, context lens)
    (16, 32, 8, 128, [32768]),  # batch 1, longest context: split-K must fill the GPU
    (64, 32, 8, 128, [32768, 1, 17, 4095]),
    (16, 64, 8, 128, [1000] * 64),  # batch 64, GQA 8
    (64, 8, 8, 64, [5, 64, 65, 129, 3000]),  # MHA, exact and partial blocks
    (16, 4, 1, 128, [777, 12345]),  # MQA-like, GQA 4
]


@pytest.mark.parametrize("spec", DECODE_FIXED, ids=lambda s: f"bs{s[0]}-h{s[1]}-kv{s[2]}-d{s[3]}-b{len(s[4])}")
def test_decode_fixed_shapes(spec) -> None:
    block_size, num_heads, kvh, d, ctx = spec
    gen = torch.Generator().manual_seed(len(ctx) * 7 + d)
    case = make_case(gen, ctx, [1] * len(ctx), block_size, kvh, d, torch.bfloat16)
    q = torch.randn(len(ctx), num_heads, d, generator=gen).to(torch.bfloat16).to(DEV)
    scale = 1 / math.sqrt(d)
    poison_allocator((tuple(q.shape), q.dtype))
    out = TritonBackend().decode(q, case.k_cache, case.v_cache, case.block_tables,
                                 case.context_lens, scale)
    check(out, reference(q, case, scale), BF16_TOL, f"decode {spec[:4]}")


@pytest.mark.parametrize("seed", range(16))
def test_decode_random_shapes(seed: int) -> None:
    rng, gen = random.Random(100 + seed), torch.Generator().manual_seed(100 + seed)
    block_size, num_heads, kvh, d = _random_shape(rng)
    batch = rng.choice([1, 2, 5, 16, 33])
    ctx = [_ctx(rng, 32768 if batch <= 2 else 4096) for _ in range(batch)]
    dtype = rng.choice([torch.bfloat16, torch.bfloat16, torch.float16])
    case = make_case(gen, ctx, [1] * batch, block_size, kvh, d, dtype)
    q = torch.randn(batch, num_heads, d, generator=gen).to(dtype).to(DEV)
    scale = rng.uniform(0.5, 1.5) / math.sqrt(d)
    splits = rng.choice([None, None, 1, 3, 16])
    poison_allocator((tuple(q.shape), dtype), ((batch, num_heads, 64, d), torch.float32))
    out = TritonBackend().decode_with(q, case.k_cache, case.v_cache, case.block_tables,
                                      case.context_lens, scale, splits)
    check(out, reference(q, case, scale), BF16_TOL, f"decode bs{block_size} h{num_heads} "
          f"kv{kvh} d{d} ctx{ctx[:4]} splits {splits}")


@pytest.mark.parametrize("splits", [None, 7, 128])
def test_decode_padded_tables_short_contexts(splits: int | None) -> None:
    """The CUDA-graph shape: block tables padded far past the real contexts (the split count is
    sized for the padding), so most splits see no tile of their sequence and must weigh 0."""
    gen = torch.Generator().manual_seed(13 + (splits or 0))
    rng = random.Random(13)
    ctx = [rng.randint(1, 1200) for _ in range(64)]
    case = make_case(gen, ctx, [1] * 64, 16, 2, 64, torch.bfloat16)
    pad = torch.full((64, 2052), -1, dtype=torch.int32, device=DEV)
    pad[:, : case.block_tables.shape[1]] = case.block_tables
    case = Case(case.k_cache, case.v_cache, pad, case.context_lens, case.q_lens)
    q = torch.randn(64, 14, 64, generator=gen).to(torch.bfloat16).to(DEV)
    backend = TritonBackend()
    n = backend.decode_splits(64, 2, 2052 * 16, q.device, splits, head_dim=64)[0]
    assert n > 1  # the split path is the one under test
    poison_allocator((tuple(q.shape), q.dtype), ((64, 14, n, 64), torch.float32))
    out = backend.decode_with(q, case.k_cache, case.v_cache, case.block_tables,
                              case.context_lens, 0.125, splits)
    check(out, reference(q, case, 0.125), BF16_TOL, f"padded tables, {n} splits")


PREFILL_FIXED = [
    # (block_size, num_heads, num_kv_heads, head_dim, [(ctx, q_len), ...])
    (16, 32, 8, 128, [(32768, 32768)]),  # a whole 32k prompt
    (64, 32, 8, 128, [(32768, 1024)]),  # prefix hit: 31k cached, 1k new
    (16, 16, 2, 64, [(5000, 5000), (4000, 3), (1, 1), (130, 70), (2048, 2048)]),  # batch mix
    (64, 8, 8, 128, [(100, 100), (64, 1), (65, 65), (1000, 999)]),
]


@pytest.mark.parametrize("spec", PREFILL_FIXED, ids=lambda s: f"bs{s[0]}-h{s[1]}-kv{s[2]}-d{s[3]}-n{len(s[4])}")
def test_prefill_fixed_shapes(spec) -> None:
    block_size, num_heads, kvh, d, seqs = spec
    gen = torch.Generator().manual_seed(len(seqs) * 13 + d)
    _run_prefill(gen, block_size, num_heads, kvh, d, seqs, torch.bfloat16, 1 / math.sqrt(d), None)


@pytest.mark.parametrize("seed", range(16))
def test_prefill_random_shapes(seed: int) -> None:
    rng, gen = random.Random(200 + seed), torch.Generator().manual_seed(200 + seed)
    block_size, num_heads, kvh, d = _random_shape(rng)
    n = rng.choice([1, 2, 3, 6])
    seqs = []
    for _ in range(n):
        ctx = _ctx(rng, 16384 if n <= 2 else 3000)
        q_len = rng.choice([ctx, ctx, rng.randint(1, ctx), 1])  # misses, prefix hits, one token
        seqs.append((ctx, q_len))
    dtype = rng.choice([torch.bfloat16, torch.bfloat16, torch.float16])
    config = rng.choice([None, PrefillConfig(64, 64, 4, 3), PrefillConfig(128, 64, 8, 3),
                         PrefillConfig(128, 128, 8, 2)])
    _run_prefill(gen, block_size, num_heads, kvh, d, seqs, dtype,
                 rng.uniform(0.5, 1.5) / math.sqrt(d), config)


def _run_prefill(gen, block_size, num_heads, kvh, d, seqs, dtype, scale, config) -> None:
    ctx, q_lens = [c for c, _ in seqs], [n for _, n in seqs]
    case = make_case(gen, ctx, q_lens, block_size, kvh, d, dtype)
    q = torch.randn(sum(q_lens), num_heads, d, generator=gen).to(dtype).to(DEV)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    poison_allocator((tuple(q.shape), dtype))
    out = TritonBackend(prefill_config=config).prefill(
        q, case.k_cache, case.v_cache, case.block_tables, cu, case.context_lens, scale)
    check(out, reference(q, case, scale), BF16_TOL,
          f"prefill bs{block_size} h{num_heads} kv{kvh} d{d} seqs{seqs[:4]} {config}")


def test_prefix_hit_matches_full_prefill() -> None:
    """The tail of a prompt prefilled over its cached prefix equals those rows of a full prefill."""
    gen = torch.Generator().manual_seed(9)
    ctx, tail = 3000, 777
    case = make_case(gen, [ctx], [ctx], 16, 4, 128, torch.bfloat16)
    q = torch.randn(ctx, 16, 128, generator=gen).to(torch.bfloat16).to(DEV)
    backend = TritonBackend()
    full = backend.prefill(q, case.k_cache, case.v_cache, case.block_tables,
                           torch.tensor([0, ctx], dtype=torch.int32, device=DEV),
                           case.context_lens, 0.09)
    hit = backend.prefill(q[ctx - tail:].clone(), case.k_cache, case.v_cache, case.block_tables,
                          torch.tensor([0, tail], dtype=torch.int32, device=DEV),
                          case.context_lens, 0.09)
    assert bool(torch.isfinite(hit).all())
    assert rel_err(hit, full[ctx - tail:].float()) < 1e-2


def test_decode_matches_one_token_prefill() -> None:
    gen = torch.Generator().manual_seed(10)
    ctx = [1, 300, 5000, 20000]
    case = make_case(gen, ctx, [1] * 4, 64, 8, 128, torch.bfloat16)
    q = torch.randn(4, 32, 128, generator=gen).to(torch.bfloat16).to(DEV)
    backend = TritonBackend()
    dec = backend.decode(q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.1)
    pre = backend.prefill(q, case.k_cache, case.v_cache, case.block_tables,
                          torch.arange(5, dtype=torch.int32, device=DEV), case.context_lens, 0.1)
    assert rel_err(dec, pre.float()) < 1e-2


def test_torch_backend_on_cuda_matches_reference() -> None:
    """The torch backend (the fallback) also runs on CUDA tensors."""
    gen = torch.Generator().manual_seed(11)
    seqs = [(300, 300), (1000, 20), (77, 1)]
    case = make_case(gen, [c for c, _ in seqs], [n for _, n in seqs], 16, 2, 64, torch.bfloat16)
    q = torch.randn(321, 8, 64, generator=gen).to(torch.bfloat16).to(DEV)
    cu = torch.tensor([0, 300, 320, 321], dtype=torch.int32, device=DEV)
    out = TorchBackend().prefill(q, case.k_cache, case.v_cache, case.block_tables, cu,
                                 case.context_lens, 0.125)
    check(out, reference(q, case, 0.125), BF16_TOL, "torch backend prefill on cuda")


def test_get_backend_picks_triton_on_cuda() -> None:
    assert isinstance(get_backend("cuda"), TritonBackend)


def test_decode_is_graph_capturable() -> None:
    """No host sync in decode: it captures into a CUDA graph and replays with new data."""
    gen = torch.Generator().manual_seed(12)
    ctx = [100, 2000, 9000]
    case = make_case(gen, ctx, [1] * 3, 16, 8, 128, torch.bfloat16)
    q = torch.randn(3, 32, 128, generator=gen).to(torch.bfloat16).to(DEV)
    backend = TritonBackend(DecodeConfig())
    backend.decode(q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.1)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.decode(q, case.k_cache, case.v_cache, case.block_tables,
                             case.context_lens, 0.1)
    q.copy_(torch.randn(3, 32, 128, generator=gen).to(torch.bfloat16).to(DEV))
    graph.replay()
    torch.cuda.synchronize()
    check(out, reference(q, case, 0.1), BF16_TOL, "graph replay")
