"""The engine on a CUDA GPU: the fused kernels equal their torch twins, greedy output is the same
on the torch and Triton attention backends (and with and without CUDA graphs), and a prefix hit
runs the Triton prefill kernel over the cached context (no fallback).

Imports only torch, triton, numpy, xxhash and the engine (no zmq, msgspec or fastapi)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from workers.config import EngineConfig, get_preset  # noqa: E402
from workers.engine.llm_engine import LLMEngine  # noqa: E402
from workers.engine.sequence import SamplingParams  # noqa: E402
from workers.model import kernels  # noqa: E402
from workers.model.attention.torch_backend import TorchBackend  # noqa: E402
from workers.model.attention.triton_backend import TritonBackend  # noqa: E402
from workers.model.decoder import build_model  # noqa: E402
from workers.model.layers import RotaryEmbedding, add_rmsnorm_ref, silu_mul_ref  # noqa: E402

CUDA = torch.device("cuda")
TINY = get_preset("tiny")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("hidden", [128, 896, 4096])
def test_fused_kernels_match_their_torch_twins(dtype: torch.dtype, tol: float, hidden: int) -> None:
    g = torch.Generator(device=CUDA).manual_seed(hidden)
    x = torch.randn(37, hidden, device=CUDA, generator=g).to(dtype)
    r = torch.randn(37, hidden, device=CUDA, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, device=CUDA, generator=g)).to(dtype)
    for residual in (None, r):
        out, res = kernels.add_rmsnorm(x, residual, w, 1e-6)
        ref_out, ref_res = add_rmsnorm_ref(x, residual, w, 1e-6)
        assert _rel(out, ref_out) < tol and _rel(res, ref_res) < tol
    gate_up = torch.randn(37, 2 * hidden, device=CUDA, generator=g).to(dtype)
    assert _rel(kernels.silu_mul(gate_up), silu_mul_ref(gate_up)) < tol

    heads, kv_heads, head_dim = 8, 2, 64
    rope = RotaryEmbedding(head_dim, 4096, 10000.0).to(CUDA)
    qkv = torch.randn(37, (heads + 2 * kv_heads) * head_dim, device=CUDA, generator=g).to(dtype)
    positions = torch.randint(0, 4096, (37,), device=CUDA, generator=g)
    q, k, v = rope.split_qkv(positions, qkv.clone(), heads, kv_heads, head_dim)  # fused, in place
    qs, ks, vs = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q_ref, k_ref = rope(positions, qs.reshape(37, heads, head_dim), ks.reshape(37, kv_heads, head_dim))
    assert _rel(q, q_ref) < tol and _rel(k, k_ref) < tol
    assert torch.equal(v, vs.reshape(37, kv_heads, head_dim))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(14, 2, 64), (32, 8, 128), (4, 4, 64)])
def test_rope_store_kv_equals_rope_then_store(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> None:
    """The fused launch writes exactly what rope_inplace + TritonBackend.store_kv write: the same
    rotated q rows, the same cache bytes, and no slot that was not mapped (slot -1 included)."""
    g = torch.Generator(device=CUDA).manual_seed(heads * head_dim)
    n, blocks, bs = 53, 20, 16
    rope = RotaryEmbedding(head_dim, 4096, 10000.0).to(CUDA)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, device=CUDA, generator=g).to(dtype)
    positions = torch.randint(0, 4096, (n,), device=CUDA, generator=g)
    slots = torch.randperm(blocks * bs, device=CUDA, generator=g)[:n]
    slots[::7] = -1
    caches = [torch.full((blocks, bs, kv_heads, head_dim), float("nan"), dtype=dtype, device=CUDA) for _ in range(4)]
    ref = qkv.clone()
    q_ref, k_ref, v_ref = rope.split_qkv(positions, ref, heads, kv_heads, head_dim)
    TritonBackend().store_kv(k_ref, v_ref, caches[0], caches[1], slots)
    fused = qkv.clone()
    kernels.rope_store_kv(fused, positions, rope.cos, rope.sin, caches[2], caches[3], slots, heads, kv_heads, head_dim)
    q_size = heads * head_dim
    assert torch.equal(fused[:, :q_size], ref[:, :q_size])
    for a, b in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    assert int((~caches[2].isnan()).view(blocks * bs, -1).all(1).sum()) == int((slots >= 0).sum())


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    heads = [[rng.randrange(256) for _ in range(48)] for _ in range(3)]
    return [heads[i % 3][: rng.randrange(16, 49)] + [rng.randrange(256) for _ in range(rng.randrange(1, 50))] for i in range(n)]


def _generate(engine: LLMEngine, prompts: list[list[int]], arrivals: list[int]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    out: dict[str, list[int]] = {}
    pending = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    step = 0
    while pending or engine.has_unfinished():
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            engine.add_request(f"r{i}", prompts[i], params)
            out[f"r{i}"] = []
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        engine.block_manager.check(engine.scheduler.all_seqs())
        step += 1
    return [out[f"r{i}"] for i in range(len(prompts))]


def test_greedy_output_equal_on_torch_and_triton_backends_with_and_without_graphs() -> None:
    model = build_model(TINY, CUDA, seed=0)  # float32: the backends agree to rounding
    prompts = _prompts(24, seed=1)
    prompts += prompts[:6]  # repeats: prefix hits
    arrivals = [random.Random(2).randrange(0, 20) for _ in prompts]
    runs = {}
    for backend, graphs in (("torch", False), ("triton", False), ("triton", True)):
        cfg = EngineConfig(device="cuda", attention_backend=backend, cuda_graphs=graphs, num_kv_blocks=64,
                           max_num_batched_tokens=96, chunked_prefill_size=40, max_model_len=1024)
        engine = LLMEngine(TINY, cfg, eos_token_id=257, model=model)
        runs[(backend, graphs)] = _generate(engine, prompts, arrivals)
        assert engine.stats()["prefix_cache_hits"] > 0
        if graphs:
            assert engine.runner.graphs and engine.runner.num_graph_replays > 0
    assert runs[("torch", False)] == runs[("triton", False)] == runs[("triton", True)]


def test_async_decode_equals_sync_decode() -> None:
    """Decode steps scheduled ahead (inputs gathered on the device) give the synchronous engine's
    tokens: with arrivals, preemptions (a small pool), length limits, and stop tokens that finish
    a request while its next step is already on the device."""
    model = build_model(TINY, CUDA, seed=0)
    prompts = _prompts(20, seed=7)
    rng = random.Random(8)
    arrivals = [rng.randrange(0, 30) for _ in prompts]
    max_tokens = [rng.randrange(1, 40) for _ in prompts]

    def run(async_decode: bool, stops: dict[int, int]) -> tuple[list[list[int]], LLMEngine]:
        cfg = EngineConfig(device="cuda", cuda_graphs=True, num_kv_blocks=24, max_num_batched_tokens=96,
                           chunked_prefill_size=40, max_model_len=1024)
        engine = LLMEngine(TINY, cfg, eos_token_id=257, model=model, async_decode=async_decode)
        assert engine.async_decode is async_decode
        out: dict[str, list[int]] = {}
        pending = sorted(range(len(prompts)), key=lambda i: arrivals[i])
        step = 0
        while pending or engine.has_unfinished():
            while pending and arrivals[pending[0]] <= step:
                i = pending.pop(0)
                stop = (stops[i],) if i in stops else ()
                engine.add_request(f"r{i}", prompts[i], SamplingParams(
                    temperature=0.0, max_tokens=max_tokens[i], ignore_eos=True, stop_token_ids=stop))
                out[f"r{i}"] = []
            for o in engine.step():
                out[o.request_id] += o.new_token_ids
            engine.block_manager.check(engine.scheduler.all_seqs())
            step += 1
        assert engine.block_manager.num_used_blocks == 0
        return [out[f"r{i}"] for i in range(len(prompts))], engine

    plain, _ = run(False, {})
    stops = {i: toks[len(toks) // 2] for i, toks in enumerate(plain) if len(toks) >= 6 and i % 3 == 0}
    assert stops
    sync, sync_engine = run(False, stops)
    ahead, async_engine = run(True, stops)
    assert ahead == sync
    assert async_engine.num_steps_ahead > 0 and sync_engine.num_steps_ahead == 0
    assert sync_engine.stats()["preemptions"] > 0


def test_bf16_logits_agree_across_backends() -> None:
    cfg_model = replace(get_preset("qwen2-0.5b"), num_layers=4, max_position_embeddings=4096)
    model = build_model(cfg_model, CUDA, seed=3)
    prompts = _prompts(8, seed=4)
    logits = {}
    for backend in ("torch", "triton"):
        engine = LLMEngine(cfg_model, EngineConfig(device="cuda", attention_backend=backend, num_kv_blocks=256,
                                                   cuda_graphs=False), model=model)
        runner = engine.runner
        captured: list[torch.Tensor] = []
        sample = runner.sampler.__class__.__call__

        def spy(self, lg, seqs, _s=sample):  # type: ignore[no-untyped-def]
            captured.append(lg.detach().clone())
            return _s(self, lg, seqs)

        runner.sampler.__class__.__call__ = spy
        try:
            engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        finally:
            runner.sampler.__class__.__call__ = sample
        logits[backend] = torch.cat(captured)
    assert _rel(logits["triton"], logits["torch"]) < 2e-2


def test_prefix_hit_runs_the_triton_prefill_kernel_over_cached_context(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int]] = []  # (new tokens, context) of each prefill sequence
    prefill = TritonBackend.prefill

    def counting(self, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale):  # type: ignore[no-untyped-def]
        cu, ctx = cu_seqlens_q.tolist(), context_lens.tolist()
        calls.extend((cu[i + 1] - cu[i], ctx[i]) for i in range(len(ctx)))
        return prefill(self, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale)

    def forbidden(*_a, **_k):  # type: ignore[no-untyped-def]
        raise AssertionError("fell back to the torch backend")

    monkeypatch.setattr(TritonBackend, "prefill", counting)
    monkeypatch.setattr(TorchBackend, "prefill", forbidden)
    monkeypatch.setattr(TorchBackend, "decode", forbidden)
    engine = LLMEngine(TINY, EngineConfig(device="cuda", num_kv_blocks=128, max_model_len=2048), eos_token_id=257)
    assert isinstance(engine.runner.backend, TritonBackend)
    prompt = [random.Random(5).randrange(256) for _ in range(700)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = engine.generate([prompt], params)
    calls.clear()
    engine.add_request("again", prompt, params)
    second, cached = [], None
    while engine.has_unfinished():
        for o in engine.step():
            second += o.new_token_ids
            cached = o.num_cached_tokens
    assert cached == 688 and second == first[0]
    assert (12, 700) in calls  # the 12 uncached tokens attended over 688 cached ones, in Triton
