"""The CPU offload tier on a CUDA GPU: greedy output equals offload off and no prefix caching
under a GPU pool too small to keep the prefixes (Triton attention, CUDA graphs); the host pool is
pinned; saves and restores queue on the stream without a host sync; restored pages are
bit-exact copies of the evicted ones (bf16); many save/evict/restore rounds never change a token.

Token equality against recomputation runs in float32, as the engine's other GPU tests do: in
bf16 a recomputed prefix (another batch shape) may round differently and flip a random model's
greedy choice; restored pages are compared bit for bit instead.

Imports only torch, triton, numpy, xxhash and the engine (no zmq, msgspec or fastapi)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from mesh.core.keys import block_keys, namespace_seed  # noqa: E402
from workers.config import EngineConfig, get_preset  # noqa: E402
from workers.engine.llm_engine import LLMEngine  # noqa: E402
from workers.engine.sequence import SamplingParams, Sequence  # noqa: E402
from workers.model.decoder import build_model  # noqa: E402

CUDA = torch.device("cuda")
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _engine(preset: Any, model: torch.nn.Module, **kw: Any) -> LLMEngine:
    cfg: dict[str, Any] = dict(device="cuda", num_kv_blocks=48, block_size=16, max_num_seqs=8)
    cfg.update(kw)
    return LLMEngine(preset, EngineConfig(**cfg), eos_token_id=None, model=model)


def _run(engine: LLMEngine, prompts: list[list[int]], arrivals: list[int]) -> list[list[int]]:
    out: dict[str, list[int]] = {}
    order = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    step = 0
    while order or engine.has_unfinished():
        while order and arrivals[order[0]] <= step:
            i = order.pop(0)
            engine.add_request(f"r{i}-{id(out)}", prompts[i], GREEDY)
            out[f"r{i}-{id(out)}"] = []
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        engine.block_manager.check(engine.scheduler.all_seqs())
        step += 1
    return [out[f"r{i}-{id(out)}"] for i in range(len(prompts))]


def _prompts(rng: random.Random, vocab: int, n: int) -> list[list[int]]:
    heads = [[rng.randrange(vocab) for _ in range(300)] for _ in range(3)]
    return [heads[i % 3][: rng.randrange(64, 301)] + [rng.randrange(vocab) for _ in range(rng.randrange(1, 80))]
            for i in range(n)]


def test_greedy_output_identical_with_offload_on_and_off() -> None:
    preset = get_preset("tiny")
    model = build_model(preset, CUDA, seed=0)
    rng = random.Random(2)
    prompts = _prompts(rng, preset.vocab_size, 24)
    prompts += prompts[:8]
    arrivals = [rng.randrange(0, 60) for _ in prompts]
    reference = _run(_engine(preset, model, enable_prefix_caching=False, num_kv_blocks=512), prompts, arrivals)
    off = _engine(preset, model)
    assert _run(off, prompts, arrivals) == reference
    for cpu_blocks in (512, 24):  # roomy, and a CPU tier that evicts too
        on = _engine(preset, model, cpu_offload_blocks=cpu_blocks)
        assert on.cpu_cache is not None and on.cpu_cache.pages.is_pinned()
        assert _run(on, prompts, arrivals) == reference
        s = on.stats()
        assert s["cpu_blocks_restored"] > 0 and s["prefill_computed_tokens"] < off.stats()["prefill_computed_tokens"]
        assert on.runner.num_graph_replays > 0  # decode replays CUDA graphs after restores


def test_saves_and_restores_are_exact_and_never_sync_the_host() -> None:
    preset = get_preset("tiny", dtype="bfloat16")
    engine = _engine(preset, build_model(preset, CUDA, seed=0), num_kv_blocks=64, cpu_offload_blocks=128)
    bm, kv = engine.block_manager, engine.runner.kv_cache
    rng = random.Random(4)
    prompt = [rng.randrange(preset.vocab_size) for _ in range(16 * 40 + 3)]
    engine.generate([prompt], GREEDY)
    hit = engine.generate([prompt], GREEDY)[0]  # a GPU hit: the reference for the restored run
    keys = block_keys(prompt[: 16 * 40], 16, namespace_seed("tiny"))
    original = {k: kv[:, :, bm.cached[k]].clone() for k in keys}

    assert bm.evict_free() >= 40 and not any(k in bm.cached for k in keys)
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing call below raises
    try:
        assert engine.run_swaps() == 40  # queued GPU -> pinned host copies
    finally:
        torch.cuda.set_sync_debug_mode("default")
    kv[:, :, : bm.num_blocks].fill_(float("nan"))  # the GPU copies are gone for good

    seq = Sequence("probe", prompt, GREEDY, 16, namespace_seed("tiny"))
    assert bm.can_allocate(seq) and bm.allocate(seq) == 16 * 40
    torch.cuda.set_sync_debug_mode("error")
    try:
        assert engine.run_swaps() == 40  # queued pinned host -> GPU copies
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.equal(kv[:, :, bm.cached[k]], original[k]) for k in keys)  # bit-exact, re-registered
    bm.free_seq(seq)
    assert engine.generate([prompt], GREEDY)[0] == hit  # same pages, same suffix computation
    assert engine.stats()["cpu_blocks_restored"] == 40


def test_many_rounds_of_save_evict_restore_never_change_a_token() -> None:
    preset = get_preset("tiny")
    model = build_model(preset, CUDA, seed=0)
    rng = random.Random(6)
    pool = _prompts(rng, preset.vocab_size, 40)
    reference = _engine(preset, model, enable_prefix_caching=False, num_kv_blocks=1024).generate(pool, GREEDY)
    engine = _engine(preset, model, num_kv_blocks=64, cpu_offload_blocks=96)
    for _round in range(8):
        picks = [rng.randrange(len(pool)) for _ in range(64)]
        got = _run(engine, [pool[i] for i in picks], [rng.randrange(0, 120) for _ in picks])
        assert got == [reference[i] for i in picks]
    s = engine.stats()
    assert s["cpu_blocks_restored"] > 200 and s["cpu_blocks_evicted"] > 0 and s["cpu_blocks_saved"] > 200
