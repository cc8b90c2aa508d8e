"""Prefill -> decode KV transfer on CUDA: the blocks a prefill engine computed on the GPU are
gathered to the host, framed and verified exactly as on the wire (``FrameReader``: keys, xxh3),
imported into a second engine's paged cache on the GPU (the second GPU when there are two), and
the second engine decodes greedily.

- tiny preset, float32: the disaggregated output equals one mixed engine's, token for token, with
  and without prefix hits on the decode side;
- llama3-1b shape (random weights), bfloat16, Triton attention + CUDA graphs: the imported pages
  are bit-identical to the source pages, and the decode equals the prefill engine's own
  prefix-hit continuation (the same numbers, computed on another engine and GPU).
- When fastapi/uvicorn/httpx are installed: two ``mesh worker`` processes on the GPU(s) and the
  gateway relay, greedy-equal to a mixed worker.
- Hybrid models (recurrent layers; docs/hybrid.md): the transfer also carries the recurrent state
  at the end of the blocks, bit-identical on the destination. tiny-hybrid (float32): equal to a
  mixed engine with and without a decode-side prefix; hybrid-0.5b's shape (bfloat16, random
  weights): equal to the prefill engine's own continuation from its checkpoint; tiny-hybrid
  worker processes behind the relay.

Imports only torch, numpy, xxhash and the engine for the first two (no zmq, msgspec, fastapi).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from mesh.core.keys import block_keys, namespace_seed  # noqa: E402
from workers.config import EngineConfig, get_preset  # noqa: E402
from workers.engine.llm_engine import LLMEngine  # noqa: E402
from workers.engine.sequence import SamplingParams  # noqa: E402
from workers.transfer.block_ops import BlockOps  # noqa: E402
from workers.transfer.kv_transfer import Faults, FrameReader, PullRequest, serve_pull  # noqa: E402
from workers.transfer.registry import TransferRegistry  # noqa: E402

BS = 16
DEVICES = ["cuda:0", "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"]


class _Direct:
    def __init__(self, engine: LLMEngine) -> None:
        self.ops = BlockOps(engine)
        self.layout = self.ops.layout

    async def call(self, fn, *args):  # type: ignore[no-untyped-def]
        return fn(*args)


def _engine(preset: str, device: str, dtype: str | None = None, blocks: int = 2048, **config: Any) -> LLMEngine:
    mc = get_preset(preset, **({"dtype": dtype} if dtype else {}))
    return LLMEngine(mc, EngineConfig(num_kv_blocks=blocks, device=device, max_num_batched_tokens=4096, **config))


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, min(vocab, 250)) for _ in range(n)]


def _transfer(src_engine: LLMEngine, dst_engine: LLMEngine, prompt: list[int], model: str) -> tuple[BlockOps, list[int]]:
    """Prefill on ``src``, move the prompt's full blocks (all but the last token's) through the
    wire format into ``dst`` (and, on a hybrid model, the recurrent state at their end, filed as
    a checkpoint: bit-identical, left unpinned); returns the decode side's ``BlockOps`` and its
    pinned block ids."""
    src, dst = _Direct(src_engine), BlockOps(dst_engine)
    seed = namespace_seed(model)
    n = (len(prompt) - 1) // BS
    keys = block_keys(prompt[: n * BS], BS, seed)
    blocks = [prompt[i * BS : (i + 1) * BS] for i in range(n)]
    src_engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    pinned = src.ops.pin_export(keys, blocks, seed)
    assert len(pinned.block_ids) == n
    hybrid = src.layout.state is not None
    reg = TransferRegistry(src.ops.unpin, ttl_s=60, unpin_state=src.ops.unpin_state)
    reg.add("t", pinned.block_ids, pinned.keys, ["decode"], now=0.0, state_key=pinned.state_key)
    own = dst.pin_prefix(keys, blocks, seed)
    h = len(own.block_ids)
    held = list(own.block_ids)

    async def pull() -> None:
        req = PullRequest("t", h, n - h, src.layout, hybrid)

        async def frames() -> AsyncIterator[bytes]:
            async for item in serve_pull(src, reg, req, Faults()):
                yield bytes(item)

        reader = FrameReader(frames())
        await reader.read_header()
        async for off, ks, data in reader.blocks(keys[h:], src.layout.block_bytes, trailer=not hybrid):
            i = h + off
            held.extend(dst.import_blocks(ks, blocks[i : i + len(ks)], seed, keys[i - 1] if i else None, data))
        if hybrid:
            state = await reader.read_state(keys[-1], src.layout.state_bytes)
            await reader.read_trailer(n - h)
            dst.import_state(keys[-1], keys[-2] if n > 1 else None, blocks[-1], n - 1, None, state)
            dst.unpin_state(keys[-1])  # filed as a checkpoint: the decode's admission resumes there

    asyncio.run(pull())
    if hybrid:  # the state at the end of the blocks, bit-identical on the destination
        a_st, b_st = src_engine.block_manager.states, dst_engine.block_manager.states
        assert a_st is not None and b_st is not None and src_engine.runner.states is not None
        assert dst_engine.runner.states is not None
        sa = src_engine.runner.states[:, a_st.slot_of(keys[-1])].cpu()
        sb = dst_engine.runner.states[:, b_st.slot_of(keys[-1])].cpu()
        assert torch.equal(sa.view(torch.uint8), sb.view(torch.uint8))
    if n > h:  # bit-identical pages on the destination
        a = src_engine.runner.kv_cache[:, :, list(pinned.block_ids[h:])].cpu()
        b = dst_engine.runner.kv_cache[:, :, held[h:]].cpu()
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    reg.consumer_done("t", "decode")
    assert src.ops.leak_check() == {"leaked_blocks": 0, "pinned_blocks": 0, "pinned_states": 0}
    return dst, held


@pytest.mark.parametrize("decode_prefix_tokens", [0, 300])
def test_tiny_fp32_disaggregated_equals_mixed(decode_prefix_tokens: int) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    prompt = _prompt(700, seed=decode_prefix_tokens, vocab=512)
    mixed = _engine("tiny", DEVICES[0])
    ref = mixed.generate([prompt], greedy)[0]
    prefill, decode = _engine("tiny", DEVICES[0]), _engine("tiny", DEVICES[1])
    if decode_prefix_tokens:
        decode.generate([prompt[:decode_prefix_tokens]], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    ops, held = _transfer(prefill, decode, prompt, "tiny")
    out = decode.generate([prompt], greedy)[0]
    assert out == ref
    ops.unpin(held)
    assert ops.leak_check() == {"leaked_blocks": 0, "pinned_blocks": 0, "pinned_states": 0}
    assert decode.block_manager.num_used_blocks == 0
    decode.block_manager.check()


def test_llama_shape_bf16_transfer_is_exact_on_the_gpu() -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompt = _prompt(3000, seed=7, vocab=128256)
    prefill, decode = _engine("llama3-1b", DEVICES[0], blocks=1024), _engine("llama3-1b", DEVICES[1], blocks=1024)
    ops, held = _transfer(prefill, decode, prompt, "llama3-1b")
    out = decode.generate([prompt], greedy)[0]
    ops.unpin(held)
    # The prefill engine's own continuation from the same cached prefix: the same computation.
    same = prefill.generate([prompt], greedy)[0]
    assert prefill.scheduler.stats.prompt_hit_tokens >= (len(prompt) - 1) // BS * BS
    assert out == same
    assert decode.runner.backend.name == "triton"


def test_worker_processes_on_the_gpu_relay_greedy_equal(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    pytest.importorskip("fastapi")
    from tests.disagg_cluster import Cluster, completion, direct, prompt_tokens, relay
    from tests.procs import ProcessGroup

    group = ProcessGroup(tmp_path)
    try:
        c = Cluster(group)
        c.start("p0", "prefill", "--device", DEVICES[0], "--gpu-memory-utilization", "0.3", faults=False)
        c.start("d0", "decode", "--device", DEVICES[1], "--gpu-memory-utilization", "0.3", faults=False)
        c.start("m", "mixed", "--device", DEVICES[0], "--gpu-memory-utilization", "0.3", faults=False)
        c.wait()
        router = c.router()
        for seed in (1, 2):
            body = completion(prompt_tokens(1500, seed=seed), 32, stream=bool(seed % 2))
            got = asyncio.run(relay(router, body))
            assert got.text == direct(c.workers["m"].url, body)[0]
    finally:
        group.stop_all()


@pytest.mark.parametrize("decode_prefix_tokens", [0, 300])
def test_tiny_hybrid_fp32_disaggregated_equals_mixed(decode_prefix_tokens: int) -> None:
    """Blocks and recurrent state from one GPU to the other: the decode resumes at the transferred
    prefix (hit tokens) and its greedy output equals a mixed engine's."""
    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    prompt = _prompt(700, seed=40 + decode_prefix_tokens, vocab=512)
    ref = _engine("tiny-hybrid", DEVICES[0]).generate([prompt], greedy)[0]
    prefill = _engine("tiny-hybrid", DEVICES[0], state_checkpoint_prompt_end=True)
    decode = _engine("tiny-hybrid", DEVICES[1])
    if decode_prefix_tokens:
        decode.generate([prompt[:decode_prefix_tokens]], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    hits = decode.scheduler.stats.prompt_hit_tokens
    ops, held = _transfer(prefill, decode, prompt, "tiny-hybrid")
    out = decode.generate([prompt], greedy)[0]
    assert decode.scheduler.stats.prompt_hit_tokens - hits == (len(prompt) - 1) // BS * BS
    assert out == ref
    ops.unpin(held)
    assert ops.leak_check() == {"leaked_blocks": 0, "pinned_blocks": 0, "pinned_states": 0}
    decode.block_manager.check()


def test_hybrid_shape_bf16_transfer_resumes_exactly_on_the_gpu() -> None:
    """hybrid-0.5b's shape (random weights, bfloat16 pages, float32 state): the decode on the
    other GPU equals the prefill engine's own continuation from its prompt-end checkpoint."""
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompt = _prompt(2000, seed=41, vocab=151936)
    prefill = _engine("hybrid-0.5b", DEVICES[0], blocks=512, state_checkpoint_prompt_end=True)
    decode = _engine("hybrid-0.5b", DEVICES[1], blocks=512)
    ops, held = _transfer(prefill, decode, prompt, "hybrid-0.5b")
    out = decode.generate([prompt], greedy)[0]
    ops.unpin(held)
    hits = prefill.scheduler.stats.prompt_hit_tokens
    same = prefill.generate([prompt], greedy)[0]  # resumes at its own checkpoint: the same computation
    assert prefill.scheduler.stats.prompt_hit_tokens - hits == (len(prompt) - 1) // BS * BS
    assert out == same


def test_hybrid_worker_processes_on_the_gpu_relay_greedy_equal(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    pytest.importorskip("fastapi")
    from tests.disagg_cluster import Cluster, completion, direct, prompt_tokens, relay, status
    from tests.procs import ProcessGroup

    group = ProcessGroup(tmp_path)
    try:
        c = Cluster(group, model="tiny-hybrid")
        c.start("p0", "prefill", "--device", DEVICES[0], "--gpu-memory-utilization", "0.3", faults=False)
        c.start("d0", "decode", "--device", DEVICES[1], "--gpu-memory-utilization", "0.3", faults=False)
        c.start("m", "mixed", "--device", DEVICES[0], "--gpu-memory-utilization", "0.3", faults=False)
        c.wait()
        router = c.router()
        for seed in (1, 2):
            body = completion(prompt_tokens(1500, seed=seed), 32, stream=bool(seed % 2), model="tiny-hybrid")
            got = asyncio.run(relay(router, body))
            assert got.text == direct(c.workers["m"].url, body)[0]
        assert status(c.workers["d0"].url)["decode_states_pulled"] == 2
    finally:
        group.stop_all()
