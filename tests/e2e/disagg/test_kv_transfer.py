"""``workers.transfer.kv_transfer`` in one process: the wire format, engine-thread block operations and the
pin taken when a prefill finishes, between real tiny-preset engines (no sockets here; the
processes-and-sockets paths are in ``test_disagg.py`` and ``test_disagg_netns.py``)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import torch

from mesh.core.keys import block_keys, namespace_seed
from workers.config import EngineConfig, get_preset
from workers.engine.block_manager import BlockStored
from workers.engine.llm_engine import LLMEngine
from workers.engine.sequence import SamplingParams
from workers.transfer.block_ops import BlockOps
from workers.transfer.kv_layout import Layout, TransferError, layout_of
from workers.transfer.kv_transfer import Faults, FrameReader, PullRequest, TransferEngine, serve_pull
from workers.transfer.registry import TransferRegistry

BS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
SEED = namespace_seed("tiny")


def _engine(blocks: int = 64) -> LLMEngine:
    return LLMEngine(get_preset("tiny"), EngineConfig(num_kv_blocks=blocks, device="cpu", cpu_threads=1))


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(0, 256, size=n)]


class _Direct:
    """What ``serve_pull`` needs of a ``TransferEngine``, calling ``BlockOps`` in place."""

    def __init__(self, engine: LLMEngine) -> None:
        self.ops = BlockOps(engine)
        self.layout = self.ops.layout

    async def call(self, fn: Any, *args: Any) -> Any:
        return fn(*args)


class _Events:
    def __init__(self) -> None:
        self.batches: list[list[Any]] = []

    def publish(self, events: list[Any]) -> None:
        self.batches.append(list(events))

    def close(self) -> None:
        pass


def _chain(prompt: list[int]) -> tuple[list[int], list[list[int]]]:
    n = (len(prompt) - 1) // BS
    keys = block_keys(prompt[: n * BS], BS, SEED)
    return keys, [prompt[i * BS : (i + 1) * BS] for i in range(n)]


def _export(src: _Direct, engine: LLMEngine, prompt: list[int]) -> tuple[TransferRegistry, Any]:
    """Prefill ``prompt`` on ``engine`` and pin its blocks in a registry (transfer "t")."""
    engine.generate([prompt], ONE)
    keys, blocks = _chain(prompt)
    pinned = src.ops.pin_prefix(keys, blocks, SEED)
    assert len(pinned.block_ids) == len(keys)
    reg = TransferRegistry(src.ops.unpin, ttl_s=60)
    reg.add("t", pinned.block_ids, pinned.keys, ["decode"], now=0.0)
    return reg, pinned


async def _pull(src: _Direct, reg: TransferRegistry, first: int, keys: list[int], faults: Faults | None = None,
                layout: Layout | None = None) -> list[tuple[int, list[int], np.ndarray]]:
    req = PullRequest("t", first, len(keys), layout or src.layout)

    async def frames() -> AsyncIterator[bytes]:
        async for item in serve_pull(src, reg, req, faults or Faults(), chunk_bytes=4 * src.layout.block_bytes):
            yield bytes(item)

    reader = FrameReader(frames(), chunk_bytes=4 * src.layout.block_bytes)
    header = await reader.read_header()
    if "error" in header:
        raise TransferError(header["error"]["status"], header["error"]["code"], header["error"]["message"])
    mismatch = (layout or src.layout).mismatch(Layout.from_dict(header["layout"]))
    if mismatch:
        raise TransferError(409, "kv_layout_mismatch", mismatch)
    return [chunk async for chunk in reader.blocks(keys, src.layout.block_bytes)]


def _import(dst: BlockOps, chunks: list[tuple[int, list[int], np.ndarray]], keys: list[int],
            blocks: list[list[int]], first: int) -> list[int]:
    out: list[int] = []
    for off, ks, data in chunks:
        i = first + off
        out += dst.import_blocks(ks, blocks[i : i + len(ks)], SEED, keys[i - 1] if i else None, data)
    return out


def test_pulled_blocks_decode_to_the_same_greedy_tokens() -> None:
    prompt = _prompt(150)
    ref = _engine().generate([prompt], GREEDY)[0]
    a, b = _engine(), _engine()
    src, dst = _Direct(a), BlockOps(b)
    reg, pinned = _export(src, a, prompt)
    keys, blocks = _chain(prompt)
    chunks = asyncio.run(_pull(src, reg, 0, keys))
    assert sum(len(k) for _, k, _ in chunks) == len(keys) == 9
    assert len(chunks) == 3  # bounded chunks of 4 blocks
    held = _import(dst, chunks, keys, blocks, 0)
    assert dst.leak_check() == {"leaked_blocks": 0, "pinned_blocks": len(keys), "pinned_states": 0}
    out = b.generate([prompt], GREEDY)[0]
    assert out == ref
    assert b.scheduler.stats.prompt_hit_tokens == len(keys) * BS  # only the tail was computed
    dst.unpin(held)
    reg.consumer_done("t", "decode")
    for ops in (dst, src.ops):
        assert ops.leak_check() == {"leaked_blocks": 0, "pinned_blocks": 0, "pinned_states": 0}
    assert a.block_manager.num_used_blocks == 0 and b.block_manager.num_used_blocks == 0
    a.block_manager.check()
    b.block_manager.check()


def test_decode_side_prefix_hit_pulls_only_the_missing_blocks() -> None:
    prompt = _prompt(200, seed=1)
    ref = _engine().generate([prompt], GREEDY)[0]
    a, b = _engine(), _engine()
    b.generate([prompt[:100]], ONE)  # b caches the first 6 blocks already
    src, dst = _Direct(a), BlockOps(b)
    reg, _ = _export(src, a, prompt)
    keys, blocks = _chain(prompt)
    own = dst.pin_prefix(keys, blocks, SEED)
    h = len(own.block_ids)
    assert h == 6
    chunks = asyncio.run(_pull(src, reg, h, keys[h:]))
    held = list(own.block_ids) + _import(dst, chunks, keys, blocks, h)
    assert dst.num_imported == len(keys) - h
    assert b.generate([prompt], GREEDY)[0] == ref
    dst.unpin(held)
    assert dst.leak_check()["leaked_blocks"] == 0 and b.block_manager.num_used_blocks == 0
    b.block_manager.check()


def test_import_is_announced_as_stored_blocks_chained_to_the_local_prefix() -> None:
    prompt = _prompt(120, seed=2)
    a, b = _engine(), _engine()
    b.generate([prompt[:40]], ONE)  # 2 blocks local
    b.publisher = _Events()
    src, dst = _Direct(a), BlockOps(b)
    reg, _ = _export(src, a, prompt)
    keys, blocks = _chain(prompt)
    own = dst.pin_prefix(keys, blocks, SEED)
    held = list(own.block_ids) + _import(dst, asyncio.run(_pull(src, reg, 2, keys[2:])), keys, blocks, 2)
    stored = [e for batch in b.publisher.batches for e in batch if isinstance(e, BlockStored)]
    assert [k for e in stored for k in e.block_hashes] == keys[2:]
    assert stored[0].parent_block_hash == keys[1]
    assert [t for e in stored for t in e.token_ids] == prompt[2 * BS : len(keys) * BS]
    assert set(keys) <= b.block_manager.cached_keys()
    dst.unpin(held)
    b.block_manager.check()


def test_import_without_space_refuses_and_changes_nothing() -> None:
    prompt = _prompt(150, seed=3)
    a, b = _engine(), _engine(blocks=4)
    src, dst = _Direct(a), BlockOps(b)
    reg, _ = _export(src, a, prompt)
    keys, blocks = _chain(prompt)
    chunks = asyncio.run(_pull(src, reg, 0, keys))
    data = np.concatenate([d for _, _, d in chunks])
    before = b.block_manager.cached_keys()
    with pytest.raises(TransferError) as err:
        dst.import_blocks(keys, blocks, SEED, None, data)
    assert err.value.status == 507 and err.value.retryable
    assert b.block_manager.cached_keys() == before and dst.pins == {}
    assert dst.leak_check()["leaked_blocks"] == 0
    b.block_manager.check()


@pytest.mark.parametrize(("fault", "code"), [("corrupt", "kv_transfer_corrupt"), ("truncate", "kv_transfer_truncated")])
def test_corrupt_or_truncated_streams_are_detected(fault: str, code: str) -> None:
    prompt = _prompt(150, seed=4)
    a = _engine()
    src = _Direct(a)
    reg, _ = _export(src, a, prompt)
    keys, _ = _chain(prompt)
    with pytest.raises(TransferError) as err:
        asyncio.run(_pull(src, reg, 0, keys, Faults(**{fault: 1})))
    assert err.value.code == code and err.value.retryable
    assert reg.active == 1  # a failed pull does not release: the decode side may pull again
    assert len(asyncio.run(_pull(src, reg, 0, keys))) == 3  # the fault was one-shot
    reg.cancel("t")
    assert src.ops.leak_check() == {"leaked_blocks": 0, "pinned_blocks": 0, "pinned_states": 0}


def test_wrong_key_in_the_stream_is_refused() -> None:
    prompt = _prompt(100, seed=5)
    a = _engine()
    src = _Direct(a)
    reg, _ = _export(src, a, prompt)
    keys, _ = _chain(prompt)
    with pytest.raises(TransferError) as err:
        asyncio.run(_pull(src, reg, 0, [keys[0] ^ 1] + keys[1:]))
    assert err.value.code == "kv_transfer_corrupt"


def test_layout_mismatch_is_named_field_by_field() -> None:
    a = _engine()
    mine = layout_of(a)
    other = Layout(**{**mine.to_dict(), "dtype": "bfloat16", "block_size": 32})
    text = mine.mismatch(other)
    assert text is not None and "dtype" in text and "block_size" in text and "num_layers" not in text
    assert mine.block_bytes == 2 * 4 * 16 * 2 * 32 * 4
    src = _Direct(a)
    reg, _ = _export(src, a, _prompt(60, seed=6))
    keys, _ = _chain(_prompt(60, seed=6))
    with pytest.raises(TransferError) as err:
        asyncio.run(_pull(src, reg, 0, keys, Faults(layout_override={"head_dim": 64})))
    assert err.value.status == 409 and "head_dim" in err.value.message


def test_late_pull_after_cancel_is_gone() -> None:
    prompt = _prompt(80, seed=7)
    a = _engine()
    src = _Direct(a)
    reg, _ = _export(src, a, prompt)
    keys, _ = _chain(prompt)
    assert reg.cancel("t")
    with pytest.raises(TransferError) as err:
        asyncio.run(_pull(src, reg, 0, keys))
    assert err.value.status == 410 and err.value.code == "kv_transfer_gone"
    assert reg.stats()["transfer_late_pulls"] == 1
    assert src.ops.leak_check() == {"leaked_blocks": 0, "pinned_blocks": 0, "pinned_states": 0}


def test_prefill_blocks_are_pinned_in_the_finishing_step() -> None:
    """On the engine thread: the finished prefill's prompt blocks (all but the last token's) are
    pinned before any later step; an export that is dropped, or aborted, leaves no pin."""
    prompt = _prompt(100, seed=8)

    async def scenario() -> None:
        engine = TransferEngine(_engine())
        engine.start()
        try:
            engine.expect_export("r1", prompt, None)
            async for _ in engine.generate("r1", prompt, ONE):
                pass
            pinned, seed = engine.take_export("r1")
            assert pinned is not None and seed == SEED
            assert list(pinned.keys) == _chain(prompt)[0]  # 6 blocks: (100 - 1) // 16
            state = await engine.call(engine.ops.leak_check)
            assert state == {"leaked_blocks": 0, "pinned_blocks": 6, "pinned_states": 0}
            await engine.call(engine.ops.unpin, pinned.block_ids)
            engine.expect_export("r2", prompt, None)  # dropped after finishing: unpinned
            async for _ in engine.generate("r2", prompt, ONE):
                pass
            engine.drop_export("r2")
            engine.expect_export("r3", prompt, None)  # aborted: never pinned
            gen = engine.generate("r3", prompt, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
            await gen.__anext__()
            await gen.aclose()
            assert engine.take_export("r3") == (None, SEED)
            await asyncio.sleep(0.1)
            state = await engine.call(engine.ops.leak_check)
            assert state == {"leaked_blocks": 0, "pinned_blocks": 0, "pinned_states": 0}
            assert await engine.call(lambda: engine.engine.block_manager.num_used_blocks) == 0
        finally:
            engine.shutdown()

    asyncio.run(scenario())


def test_an_import_cancelled_twice_mid_run_still_hands_its_pins_to_the_hold() -> None:
    """The decode side's engine-thread import may already run when its task is cancelled (client
    gone, shutdown): the pins it takes must still reach the request's ``Hold`` (then released),
    however many cancels arrive, and the cancel must not return before the import ended."""
    from workers.transfer.disagg_server import Hold, settled_import

    src = _engine()
    prompt = _prompt(64, seed=21)
    src.generate([prompt], ONE)
    keys, blocks = _chain(prompt)
    data = BlockOps(src).gather([src.block_manager.cached[k] for k in keys])
    started = threading.Event()

    async def scenario() -> None:
        engine = TransferEngine(_engine())
        engine.start()
        try:
            def slow_import(*args: Any) -> list[int]:  # engine thread
                started.set()
                time.sleep(0.3)
                return engine.ops.import_blocks(*args)

            hold = Hold(engine)
            task = asyncio.ensure_future(settled_import(engine, hold, slow_import, keys, blocks, SEED, None, data))
            while not started.is_set():
                await asyncio.sleep(0.01)
            task.cancel()
            await asyncio.sleep(0.05)
            task.cancel()  # a second cancel (shutdown) while the first one waits
            with pytest.raises(asyncio.CancelledError):
                await task
            assert len(hold.block_ids) == len(keys)  # the import ended and its pins are held
            assert await engine.call(engine.ops.leak_check) == {"leaked_blocks": 0, "pinned_blocks": len(keys), "pinned_states": 0}
            hold.release()
            await asyncio.sleep(0.1)
            assert await engine.call(engine.ops.leak_check) == {"leaked_blocks": 0, "pinned_blocks": 0, "pinned_states": 0}
        finally:
            engine.shutdown()

    asyncio.run(scenario())


def test_a_peer_copy_imports_the_peers_pages_and_stops_at_the_lease_deadline() -> None:
    """``import_from_peer`` (the CUDA IPC path's engine-thread op) run on CPU tensors: the pages
    come straight from the peer engine's cache by its block ids and decode to the same greedy
    tokens; past the lease's deadline it refuses (retryable) and changes nothing."""
    prompt = _prompt(150, seed=5)
    ref = _engine().generate([prompt], GREEDY)[0]
    a, b = _engine(), _engine()
    src, dst = _Direct(a), BlockOps(b)
    _, pinned = _export(src, a, prompt)
    keys, blocks = _chain(prompt)
    peer_kv = a.runner.kv_cache
    with pytest.raises(TransferError) as late:
        dst.import_from_peer(keys, blocks, SEED, None, peer_kv, list(pinned.block_ids), None, time.monotonic() - 1)
    assert (late.value.code, late.value.retryable) == ("kv_lease_expired", True)
    assert dst.leak_check() == {"leaked_blocks": 0, "pinned_blocks": 0, "pinned_states": 0} and b.block_manager.num_used_blocks == 0
    held = dst.import_from_peer(keys, blocks, SEED, None, peer_kv, list(pinned.block_ids), None, time.monotonic() + 60)
    for mine, theirs in zip(held, pinned.block_ids, strict=True):
        assert np.array_equal(b.runner.kv_cache[:, :, mine].numpy(), peer_kv[:, :, theirs].numpy())
    assert b.generate([prompt], GREEDY)[0] == ref
    assert b.scheduler.stats.prompt_hit_tokens == len(keys) * BS
    dst.unpin(held)
    assert dst.leak_check() == {"leaked_blocks": 0, "pinned_blocks": 0, "pinned_states": 0}


def test_a_peer_export_must_describe_this_workers_page_layout() -> None:
    """``workers.transfer.kv_ipc._check_layout`` (no GPU needed): dtype, page shape, contiguity, offset
    and allocation size of a peer export are checked before anything is mapped."""
    from workers.transfer.kv_ipc import _check_layout

    local = _engine().runner.kv_cache
    size = list(local.shape)
    good = {"dtype": str(local.dtype).removeprefix("torch."), "size": [*size[:2], 7, *size[3:]],
            "stride": list(torch.empty([*size[:2], 7, *size[3:]]).stride()), "offset": 0,
            "storage_bytes": 7 * local[:, :, :1].numel() * local.element_size()}
    _check_layout(good, local)  # another block count is fine
    bad = [{**good, "dtype": "bfloat16" if local.dtype == torch.float32 else "float32"},
           {**good, "size": [*size[:2], 7, size[3] * 2, *size[4:]]},
           {**good, "stride": list(reversed(good["stride"]))},
           {**good, "offset": 16},
           {**good, "storage_bytes": good["storage_bytes"] - 1}]
    for export in bad:
        with pytest.raises(ValueError):
            _check_layout(export, local)
