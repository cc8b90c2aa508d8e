"""The engine on the tiny preset (CPU): reuse is real and never changes a token.

Every run checks the block manager's integrity after every step."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence as Seq

import pytest
import torch

from workers.config import EngineConfig, get_preset
from workers.engine.llm_engine import AsyncLLMEngine, LLMEngine
from workers.engine.sequence import SamplingParams
from workers.model.decoder import build_model

TINY = get_preset("tiny")
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_model(TINY, torch.device("cpu"), seed=0)


def _engine(model: torch.nn.Module, **kw: object) -> LLMEngine:
    cfg = dict(device="cpu", num_kv_blocks=512, cpu_threads=1)
    cfg.update(kw)
    return LLMEngine(TINY, EngineConfig(**cfg), eos_token_id=257, model=model)  # type: ignore[arg-type]


def _run(
    engine: LLMEngine,
    prompts: Seq[list[int]],
    params: SamplingParams | list[SamplingParams] = GREEDY,
    arrivals: Seq[int] | None = None,
) -> list[list[int]]:
    """Add request i at step ``arrivals[i]``; step to completion, checking integrity each step."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    arrivals = arrivals or [0] * len(prompts)
    out: dict[str, list[int]] = {}
    step = 0
    pending = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    while pending or engine.has_unfinished():
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            engine.add_request(f"r{i}", list(prompts[i]), plist[i])
            out[f"r{i}"] = []
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        engine.block_manager.check(engine.scheduler.all_seqs())
        step += 1
    return [out[f"r{i}"] for i in range(len(prompts))]


def _prompts(n: int, rng: random.Random, families: int = 3, shared: int = 40) -> list[list[int]]:
    heads = [[rng.randrange(256) for _ in range(shared)] for _ in range(families)]
    return [heads[i % families][: rng.randrange(8, shared + 1)] + [rng.randrange(256) for _ in range(rng.randrange(1, 60))]
            for i in range(n)]


def test_greedy_output_identical_with_prefix_caching_on_and_off(model: torch.nn.Module) -> None:
    rng = random.Random(1)
    prompts = _prompts(14, rng)
    prompts += prompts[:4]  # exact repeats: hits up to the last block
    arrivals = [rng.randrange(0, 30) for _ in prompts]
    reference = _run(_engine(model, enable_prefix_caching=False), prompts, arrivals=[0] * len(prompts))
    configs = [
        dict(enable_prefix_caching=False, max_num_batched_tokens=64, chunked_prefill_size=24),
        dict(enable_prefix_caching=True),
        dict(enable_prefix_caching=True, max_num_batched_tokens=40, chunked_prefill_size=7),
        dict(enable_prefix_caching=True, max_num_batched_tokens=256, chunked_prefill_size=16, max_num_seqs=3),
        dict(enable_prefix_caching=True, block_size=8, num_kv_blocks=40),  # tight: evicts, preempts
    ]
    hits = 0
    for cfg in configs:
        engine = _engine(model, **cfg)
        assert _run(engine, prompts, arrivals=arrivals) == reference, cfg
        hits += engine.stats()["prefix_cache_hits"]
    assert hits > 0


def test_same_long_prompt_twice_computes_only_the_suffix(model: torch.nn.Module) -> None:
    engine = _engine(model, max_num_batched_tokens=128)  # chunked prefill too
    prompt = [random.Random(2).randrange(256) for _ in range(501)]
    outs = []
    for _ in range(2):
        before = engine.stats()
        engine.add_request(f"q{len(outs)}", prompt, GREEDY)
        cached, tokens = None, []
        while engine.has_unfinished():
            for o in engine.step():
                tokens += o.new_token_ids
                cached = o.num_cached_tokens
        after = engine.stats()
        outs.append((cached, after["prefill_computed_tokens"] - before["prefill_computed_tokens"],
                     after["prompt_cached_tokens"] - before["prompt_cached_tokens"], tokens))
    (c1, computed1, counted1, t1), (c2, computed2, counted2, t2) = outs
    assert (c1, computed1, counted1) == (0, 501, 0)
    assert c2 == counted2 == 496  # every full block but none holding the last prompt token
    assert computed2 == 501 - 496
    assert t1 == t2


def test_multi_turn_reuses_every_full_block_including_generated(model: torch.nn.Module) -> None:
    engine = _engine(model)
    rng = random.Random(3)
    history = [rng.randrange(256) for _ in range(70)]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    previous_len = 0
    for turn in range(3):
        engine.add_request(f"t{turn}", history, params)
        out, cached = [], None
        while engine.has_unfinished():
            for o in engine.step():
                out += o.new_token_ids
                cached = o.num_cached_tokens
        if turn:
            # Everything of the previous turn whose K/V was computed: all but its last token.
            assert cached == (previous_len - 1) // 16 * 16
        previous_len = len(history) + len(out)
        history = history + out + [rng.randrange(256) for _ in range(20)]


def test_stress_of_sharing_freeing_reviving_never_returns_wrong_tokens(model: torch.nn.Module) -> None:
    rng = random.Random(4)
    prompts = _prompts(40, rng, families=4, shared=48)
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 24), ignore_eos=True) for _ in prompts]
    arrivals = [rng.randrange(0, 80) for _ in prompts]
    reference = _run(_engine(model, enable_prefix_caching=False), prompts, params)
    engine = _engine(model, num_kv_blocks=28, max_num_batched_tokens=96, chunked_prefill_size=32)
    assert _run(engine, prompts, params, arrivals) == reference
    st = engine.stats()
    # The run went through every path it claims to test.
    assert st["blocks_evicted"] > 0 and st["blocks_revived"] > 0 and st["preemptions"] > 0
    assert st["prefix_cache_hits"] > 0 and st["kv_blocks_used"] == 0


def test_more_requests_than_blocks_queue_and_complete(model: torch.nn.Module) -> None:
    engine = _engine(model, num_kv_blocks=12, max_num_seqs=64)
    rng = random.Random(5)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(20, 60))] for _ in range(30)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    most_running, outs = 0, {f"r{i}": 0 for i in range(30)}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] += len(o.new_token_ids)
        most_running = max(most_running, len(engine.scheduler.running))
        assert engine.block_manager.num_used_blocks <= 12
    assert all(n == 20 for n in outs.values())
    assert most_running < 30  # they had to queue


def test_abort_frees_blocks_of_running_and_waiting_requests(model: torch.nn.Module) -> None:
    engine = _engine(model, num_kv_blocks=12, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    engine.add_request("a", list(range(100)), params)
    engine.add_request("b", list(range(100, 200)), params)  # waits: a holds most blocks
    for _ in range(3):
        engine.step()
    assert engine.block_manager.num_used_blocks > 0 and len(engine.scheduler.waiting) == 1
    assert engine.abort_request("a") and engine.abort_request("b")
    outs = engine.step()
    assert {(o.request_id, o.finished, o.finish_reason) for o in outs} == {("a", True, "abort"), ("b", True, "abort")}
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished()
    engine.block_manager.check([])


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([], GREEDY, "empty"),
        ([1, 2, 512], GREEDY, "out of vocabulary"),
        ([1] * 8000, SamplingParams(max_tokens=500), "maximum context length"),
        ([1] * 100, SamplingParams(max_tokens=8000), "capacity"),
        ([1, 2], SamplingParams(max_tokens=0), "max_tokens"),
        ([1, 2], SamplingParams(top_p=0.0), "top_p"),
    ],
)
def test_bad_requests_are_refused_with_a_message(model: torch.nn.Module, prompt, params, message) -> None:  # type: ignore[no-untyped-def]
    engine = _engine(model, num_kv_blocks=64)
    with pytest.raises(ValueError, match=message):
        engine.add_request("x", prompt, params)
    assert not engine.has_unfinished()


def test_seeded_sampling_is_reproducible_across_batch_mixes(model: torch.nn.Module) -> None:
    rng = random.Random(6)
    prompts = _prompts(6, rng)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_tokens=10, seed=1234, ignore_eos=True)
    alone = _run(_engine(model), prompts[:1], seeded)
    mixed = _run(_engine(model), prompts, [seeded] + [SamplingParams(temperature=1.0, max_tokens=10)] * 5)
    assert mixed[0] == alone[0]
    top1 = _run(_engine(model), prompts[:2], SamplingParams(temperature=1.0, top_k=1, max_tokens=10, ignore_eos=True))
    assert top1 == _run(_engine(model), prompts[:2], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    assert all(0 <= t < TINY.vocab_size for out in mixed for t in out)


async def test_async_engine_streams_and_frees_blocks_when_the_client_goes_away(model: torch.nn.Module) -> None:
    engine = AsyncLLMEngine(_engine(model, num_kv_blocks=64))
    engine.start()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        got = [o async for o in engine.generate("full", list(range(40)), params)]
        assert sum(len(o.new_token_ids) for o in got) == 8 and got[-1].finish_reason == "length"
        stream = engine.generate("gone", list(range(40)), SamplingParams(max_tokens=900, ignore_eos=True))
        async for o in stream:
            if o.num_output_tokens >= 3:
                break
        await stream.aclose()  # what a disconnect does to the server's iterator
        for _ in range(200):
            if engine.engine.block_manager.num_used_blocks == 0 and not engine.engine.has_unfinished():
                break
            await asyncio.sleep(0.01)
        assert engine.engine.block_manager.num_used_blocks == 0
    finally:
        engine.shutdown()
