"""A hybrid model's KV transfer in one process (``workers.transfer.kv_transfer``, ``block_ops``)
between real ``tiny-hybrid`` engines: the recurrent state at the end of the transferred blocks
travels as a second pool of the stream, is filed as a checkpoint on the decode side, and the
decode resumes there exactly. The processes-and-sockets paths are in ``test_disagg_hybrid.py``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import torch

from mesh.core.keys import block_keys, namespace_seed
from workers.config import EngineConfig, get_preset
from workers.engine.llm_engine import LLMEngine
from workers.engine.sequence import SamplingParams
from workers.model.decoder import build_model
from workers.transfer.block_ops import BlockOps, PinnedPrefix
from workers.transfer.kv_layout import Layout, StateLayout, TransferError, layout_of
from workers.transfer.kv_transfer import Faults, FrameReader, PullRequest, TransferEngine, serve_pull
from workers.transfer.registry import TransferRegistry

HYB = get_preset("tiny-hybrid")
BS = 16
SEED = namespace_seed("tiny-hybrid")
ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
NO_PINS = {"leaked_blocks": 0, "pinned_blocks": 0, "pinned_states": 0}


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_model(HYB, torch.device("cpu"), seed=0)


def _engine(model: torch.nn.Module, **kw: Any) -> LLMEngine:
    cfg: dict[str, Any] = dict(device="cpu", num_kv_blocks=128, cpu_threads=1, block_size=BS)
    cfg.update(kw)
    return LLMEngine(HYB, EngineConfig(**cfg), eos_token_id=257, model=model)


def _prompt(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(1, 500, size=n)]


def _chain(prompt: list[int]) -> tuple[list[int], list[list[int]]]:
    n = (len(prompt) - 1) // BS
    return block_keys(prompt[: n * BS], BS, SEED), [prompt[i * BS : (i + 1) * BS] for i in range(n)]


class _Direct:
    """What ``serve_pull`` needs of a ``TransferEngine``, calling ``BlockOps`` in place."""

    def __init__(self, engine: LLMEngine) -> None:
        self.ops = BlockOps(engine)
        self.layout = self.ops.layout

    async def call(self, fn: Any, *args: Any) -> Any:
        return fn(*args)


def _export(src: _Direct, engine: LLMEngine, prompt: list[int]) -> tuple[TransferRegistry, PinnedPrefix]:
    """Prefill ``prompt`` and register its pinned blocks and state as transfer "t"."""
    engine.generate([prompt], ONE)
    keys, blocks = _chain(prompt)
    pinned = src.ops.pin_export(keys, blocks, SEED)
    reg = TransferRegistry(src.ops.unpin, ttl_s=60, unpin_state=src.ops.unpin_state)
    reg.add("t", pinned.block_ids, pinned.keys, ["decode"], now=0.0, state_key=pinned.state_key)
    return reg, pinned


async def _pull(src: _Direct, reg: TransferRegistry, keys: list[int], state: bool = True,
                faults: Faults | None = None) -> tuple[list[np.ndarray], np.ndarray | None]:
    """One pull of every block of "t" (and its state), read as the decode side reads it."""
    req = PullRequest("t", 0, len(keys), src.layout, state)

    async def frames() -> AsyncIterator[bytes]:
        async for item in serve_pull(src, reg, req, faults or Faults()):
            yield bytes(item)

    reader = FrameReader(frames())
    header = await reader.read_header()
    if "error" in header:
        raise TransferError(header["error"]["status"], header["error"]["code"], header["error"]["message"])
    assert header["state_bytes"] == (src.layout.state_bytes if state else 0)
    pages = [data async for _, _, data in reader.blocks(keys, src.layout.block_bytes, trailer=False)]
    data = await reader.read_state(keys[-1], src.layout.state_bytes) if state else None
    await reader.read_trailer(len(keys))
    return pages, data


def _install(dst: BlockOps, prompt: list[int], pages: list[np.ndarray], state: np.ndarray) -> list[int]:
    keys, blocks = _chain(prompt)
    held = dst.import_blocks(keys, blocks, SEED, None, np.concatenate(pages))
    n = len(keys)
    assert dst.import_state(keys[-1], keys[-2] if n > 1 else None, blocks[-1], n - 1, None, state) == keys[-1]
    return held


@pytest.mark.parametrize("length", [33, 48, 64, 65, 100])
def test_the_transferred_state_resumes_the_decode_exactly(model: torch.nn.Module, length: int) -> None:
    prompt = _prompt(length, seed=length)
    ref = _engine(model).generate([prompt], GREEDY)[0]
    a, b = _engine(model, state_checkpoint_prompt_end=True), _engine(model)
    src, dst = _Direct(a), BlockOps(b)
    reg, pinned = _export(src, a, prompt)
    keys, _ = _chain(prompt)
    assert pinned.keys == tuple(keys) and pinned.state_key == keys[-1]
    assert src.ops.leak_check() == {**NO_PINS, "pinned_blocks": len(keys), "pinned_states": 1}
    pages, state = asyncio.run(_pull(src, reg, keys))
    assert state is not None and state.nbytes == layout_of(a).state_bytes == 2 * 4 * 32 * 32 * 4
    held = _install(dst, prompt, pages, state)
    assert dst.leak_check() == {**NO_PINS, "pinned_blocks": len(keys), "pinned_states": 1}
    assert b.generate([prompt], GREEDY)[0] == ref
    assert b.scheduler.stats.prompt_hit_tokens == len(keys) * BS  # resumed at the transferred state
    dst.unpin(held)
    dst.unpin_state(keys[-1])
    assert reg.consumer_done("t", "decode")
    assert src.ops.leak_check() == dst.leak_check() == NO_PINS
    for e in (a, b):
        e.block_manager.check(e.scheduler.all_seqs())  # raises on a broken invariant (pins included)


def test_a_zeroed_state_changes_the_output(model: torch.nn.Module) -> None:
    """The control of the test above: the state really carries the prefix."""
    prompt = _prompt(100, seed=100)
    ref = _engine(model).generate([prompt], GREEDY)[0]
    a, b = _engine(model, state_checkpoint_prompt_end=True), _engine(model)
    src, dst = _Direct(a), BlockOps(b)
    reg, _ = _export(src, a, prompt)
    keys, _ = _chain(prompt)
    pages, state = asyncio.run(_pull(src, reg, keys))
    assert state is not None
    _install(dst, prompt, pages, np.zeros_like(state))
    assert b.generate([prompt], GREEDY)[0] != ref


def test_a_prefill_is_cut_back_to_its_deepest_checkpoint(model: torch.nn.Module) -> None:
    """Without a checkpoint at the prompt's end (not a prefill worker's engine) the transfer ends
    at the deepest block holding one; with no checkpoint at all nothing is pinned."""
    prompt = _prompt(96, seed=7)  # 5 blocks offered; checkpoints at 32 and 64 (interval), 96 (end of turn)
    a = _engine(model, state_checkpoint_interval=32)
    src = _Direct(a)
    a.generate([prompt], ONE)
    keys, blocks = _chain(prompt)
    pinned = src.ops.pin_export(keys, blocks, SEED)
    assert pinned.keys == tuple(keys[:4]) and pinned.state_key == keys[3]
    assert src.ops.leak_check() == {**NO_PINS, "pinned_blocks": 4, "pinned_states": 1}
    src.ops.unpin(pinned.block_ids)
    src.ops.unpin_state(keys[3])
    none = _engine(model, num_state_checkpoints=0)
    none.generate([prompt], ONE)
    assert BlockOps(none).pin_export(keys, blocks, SEED) == PinnedPrefix((), (), ())
    assert BlockOps(none).leak_check() == NO_PINS


def test_a_pinned_checkpoint_outlives_lru_eviction(model: torch.nn.Module) -> None:
    """A transfer's checkpoint stays while pinned though newer ones evict every other; with the
    whole pool pinned no checkpoint is taken (and none is overwritten); a pinned checkpoint
    refuses a prefix-cache reset as a pinned block does."""
    a = _engine(model, state_checkpoint_prompt_end=True, num_state_checkpoints=2)
    src = _Direct(a)
    first = _prompt(40, seed=8)
    reg, pinned = _export(src, a, first)
    before = a.runner.states[:, a.block_manager.states.slot_of(pinned.state_key)].clone()
    for seed in range(9, 13):
        a.generate([_prompt(40, seed=seed)], ONE)
    assert pinned.state_key in a.block_manager.states and a.block_manager.states.num_evicted >= 3
    assert torch.equal(a.runner.states[:, a.block_manager.states.slot_of(pinned.state_key)], before)
    other = a.block_manager.states
    (free_key,) = [k for k in other.pool if k != pinned.state_key]
    other.pin(free_key)
    saved = other.num_saved
    a.generate([_prompt(40, seed=20)], ONE)
    assert other.num_saved == saved and set(other.pool) == {pinned.state_key, free_key}
    reg.cancel("t")
    assert a.block_manager.num_used_blocks == 0 and not a.reset_prefix_cache()  # a checkpoint is still pinned
    other.unpin(free_key)
    assert src.ops.leak_check() == NO_PINS and a.reset_prefix_cache() and not other.pool


def test_state_pulls_and_imports_refuse_what_they_cannot_serve(model: torch.nn.Module) -> None:
    a, b = _engine(model, state_checkpoint_prompt_end=True), _engine(model, num_state_checkpoints=1)
    src, dst = _Direct(a), BlockOps(b)
    prompt = _prompt(80, seed=14)
    reg, pinned = _export(src, a, prompt)
    keys, blocks = _chain(prompt)
    for fault, code in (("corrupt", "kv_transfer_corrupt"), ("truncate", "kv_transfer_truncated")):
        with pytest.raises(TransferError) as err:  # a state-only pull: the fault hits the state frame
            asyncio.run(_state_only(src, reg, keys[-1], fault))
        assert (err.value.code, err.value.retryable) == (code, True)
    pages, state = asyncio.run(_pull(src, reg, keys))
    assert state is not None
    with pytest.raises(TransferError) as orphan:  # its block is not cached here
        dst.import_state(keys[-1], keys[-2], blocks[-1], len(keys) - 1, None, state)
    assert orphan.value.code == "kv_state_orphan" and not b.block_manager.states.pool
    held = dst.import_blocks(keys, blocks, SEED, None, np.concatenate(pages))
    with pytest.raises(TransferError) as size:
        dst.import_state(keys[-1], keys[-2], blocks[-1], len(keys) - 1, None, state[:-4])
    assert size.value.code == "kv_layout_mismatch"
    dst.import_state(keys[-2], keys[-3], blocks[-2], len(keys) - 2, None, state)  # fills the one slot, pinned
    with pytest.raises(TransferError) as full:
        dst.import_state(keys[-1], keys[-2], blocks[-1], len(keys) - 1, None, state)
    assert (full.value.status, full.value.retryable) == (507, True) and keys[-1] not in b.block_manager.states
    dst.unpin_state(keys[-2])
    dst.unpin(held)
    assert dst.leak_check() == NO_PINS
    reg.cancel("t")
    plain = TransferRegistry(src.ops.unpin, ttl_s=60)
    plain.add("t", (), (), ["decode"], now=0.0)
    with pytest.raises(TransferError) as missing:
        asyncio.run(_pull(src, plain, []))
    assert missing.value.code == "kv_state_missing"
    with pytest.raises(ValueError):  # a state is the last block's, on a registry that can unpin it
        plain.add("u", pinned.block_ids, pinned.keys, ["decode"], now=0.0, state_key=keys[-1])
    assert src.ops.leak_check() == NO_PINS


async def _state_only(src: _Direct, reg: TransferRegistry, key: int, fault: str) -> None:
    req = PullRequest("t", 0, 0, src.layout, True)

    async def frames() -> AsyncIterator[bytes]:
        async for item in serve_pull(src, reg, req, Faults(**{fault: 1})):
            yield bytes(item)

    reader = FrameReader(frames())
    await reader.read_header()
    await reader.read_state(key, src.layout.state_bytes)
    await reader.read_trailer(0)


def test_state_layouts_are_compared_by_geometry_and_dtype(model: torch.nn.Module) -> None:
    mine = layout_of(_engine(model))
    assert mine.state == StateLayout("float32", 2, 4, 32, 32) and Layout.from_dict(mine.to_dict()) == mine
    plain = Layout(**{**mine.to_dict(), "state": None})
    text = mine.mismatch(plain)
    assert text is not None and "no recurrent state (an attention-only model) there" in text
    for other in ({"key_dim": 64}, {"dtype": "bfloat16"}, {"num_layers": 3}, {"state_layout": "head,layer/v2"}):
        theirs = Layout.from_dict({**mine.to_dict(), "state": {**mine.to_dict()["state"], **other}})
        assert mine.mismatch(theirs) is not None and "state: recurrent state" in str(mine.mismatch(theirs))
    with pytest.raises(TransferError):
        Layout.from_dict({**mine.to_dict(), "state": {"dtype": "float32"}})


def test_a_prefill_engine_pins_blocks_and_state_in_the_finishing_step(model: torch.nn.Module) -> None:
    """``TransferEngine`` on a hybrid prefill engine: the export pins the blocks and the state
    checkpoint at their end; a dropped export unpins both."""
    prompt = _prompt(64, seed=15)

    async def scenario() -> None:
        engine = TransferEngine(_engine(model, state_checkpoint_prompt_end=True))
        engine.start()
        try:
            for rid in ("r1", "r2"):
                engine.expect_export(rid, prompt, None)
                async for _ in engine.generate(rid, prompt, ONE):
                    pass
            pinned, _ = engine.take_export("r1")
            keys, _ = _chain(prompt)
            assert pinned is not None and pinned.keys == tuple(keys) and pinned.state_key == keys[-1]
            assert await engine.call(engine.ops.leak_check) == {**NO_PINS, "pinned_blocks": 6, "pinned_states": 2}
            engine.drop_export("r2")
            await engine.call(engine.ops.unpin, pinned.block_ids)
            await engine.call(engine.ops.unpin_state, keys[-1])
            assert await engine.call(engine.ops.leak_check) == NO_PINS
        finally:
            engine.shutdown()

    asyncio.run(scenario())
