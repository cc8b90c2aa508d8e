"""Several copies of one block hash on an engine (vLLM does not deduplicate blocks), end to end.

vLLM v1 can back one block hash with several physical blocks: serving a block-aligned prompt
again reuses its cached blocks but recomputes the last one into a new block with the same hash.
Every copy is announced by its own BlockStored and every copy's eviction by its own BlockRemoved;
vLLM PR #48933 adds ``remaining_copy_counts`` to BlockRemoved (the copies left after it).

The publisher here is written from the upstream structs alone (msgspec, as vLLM encodes its events,
with PR #48933's field; nothing from ``mesh``) and feeds a real ``KvEventSubscriber`` over real
ZMQ sockets. The last test drives the bundled engine and reads its stream the same way: it must
never store a hash it holds already on that tier.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest
import torch
import zmq
from prometheus_client import CollectorRegistry, generate_latest

from mesh.core.index import PrefixIndex
from mesh.core.keys import block_keys, namespace_seed
from mesh.events.limits import SubscriberLimits
from mesh.events.subscriber import KvEventSubscriber, WorkerEvents
from mesh.events.wire import BlockRemoved as MeshBlockRemoved
from mesh.events.wire import decode_batch
from policies.base import Overlap, Tier
from tests.fakes.upstream_publisher import UpstreamPublisher

MODEL = "dup-model"
SEED = namespace_seed(MODEL)
BS = 4
END_SEQ = (-1).to_bytes(8, "big", signed=True)


# ------------------------------------------------------------------ vLLM's structs (PR #48933)
class VBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # current vLLM: a map with "type"
    pass


class BlockStored(MapEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class BlockRemoved(MapEvent):
    block_hashes: list[bytes]
    medium: str | None
    group_idx: int | None = None
    remaining_copy_counts: Any = None  # list[int] | None upstream; Any: the tests send garbage too


class ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):  # array_like
    pass


class ABlockStored(ArrayEvent, tag="BlockStored"):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class ABlockRemoved(ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[bytes]
    medium: str | None
    group_idx: int | None = None
    remaining_copy_counts: Any = None


def stored(layout: str, hashes: list[bytes], parent: bytes | None, tokens: list[int]) -> Any:
    if layout == "map":
        return BlockStored(hashes, parent, tokens, BS, None, "GPU", None)
    return ABlockStored(hashes, parent, tokens, BS, None, "GPU")


def removed(layout: str, hashes: list[bytes], counts: Any = None) -> Any:
    return (BlockRemoved if layout == "map" else ABlockRemoved)(hashes, "GPU", None, counts)


def digest(label: str) -> bytes:
    return hashlib.sha256(label.encode()).digest()  # vLLM's default block hash: 32 bytes


def low64(h: bytes) -> int:
    return int.from_bytes(h[-8:], "big")


class Publisher(UpstreamPublisher):
    """vLLM's ZmqEventPublisher (``tests.fakes.upstream_publisher``), one batch per ``publish``."""

    def publish(self, *events: Any) -> None:  # type: ignore[override]
        super().publish(VBatch(time.time(), list(events), 0))


# ------------------------------------------------------------------ the stack under test
class Stack:
    def __init__(self, pub: Publisher, sub: KvEventSubscriber, index: PrefixIndex, target: str,
                 registry: CollectorRegistry) -> None:
        self.pub, self.sub, self.index, self.target, self.registry = pub, sub, index, target, registry

    async def send(self, *events: Any) -> None:
        """Publish one batch and wait until the subscriber applied it."""
        self.pub.publish(*events)
        want = self.pub.seq - 1
        await until(lambda: self.sub.health()[self.target].last_seq == want)

    def held(self, tokens: list[int]) -> Overlap | None:
        return self.index.match(block_keys(tokens, BS, SEED)).get(self.target)

    def metric(self, name: str, **labels: str) -> float:
        for line in generate_latest(self.registry).decode().splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
        return 0.0


async def until(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    pub = Publisher()
    index = PrefixIndex()
    registry = CollectorRegistry()
    sub = KvEventSubscriber(index, SubscriberLimits(replay_timeout_s=5.0), registry=registry)
    try:
        (target,) = sub.add_worker(WorkerEvents("w", pub.endpoint, pub.replay_endpoint,
                                                model=MODEL, block_size=BS))
        yield Stack(pub, sub, index, target, registry)
    finally:
        await sub.stop()
        pub.close()


PROMPT = list(range(100, 100 + 3 * BS))  # block-aligned: 3 blocks
TURN = list(range(200, 200 + BS))  # the session's next block
LATER = list(range(300, 300 + BS))
H = [digest(f"prompt-{i}") for i in range(3)]
H_TURN, H_LATER = digest("turn"), digest("later")


async def two_copies_of_the_last_block(s: Stack, layout: str) -> None:
    await s.send(stored(layout, H, None, PROMPT))  # request 1
    # request 2, the same prompt: blocks 0 and 1 reused, the last one recomputed into a new block
    await s.send(stored(layout, [H[2]], H[1], PROMPT[2 * BS :]))
    assert s.index.engine_copies(s.target) == {low64(H[2]): 2}
    assert s.held(PROMPT) == Overlap(3, 0)


async def after_the_first_copy_goes(s: Stack, layout: str) -> None:
    assert s.held(PROMPT) == Overlap(3, 0)  # the other copy still serves the whole prefix
    assert block_keys(PROMPT, BS, SEED)[-1] in s.index.keys_of(s.target)
    await s.send(stored(layout, [H_TURN], H[2], TURN))  # the session continues below that hash
    assert s.held(PROMPT + TURN) == Overlap(4, 0)  # indexed: its parent hash is still known


async def after_the_last_copy_goes(s: Stack, layout: str) -> None:
    assert s.held(PROMPT + TURN) == Overlap(2, 0)
    assert low64(H[2]) not in s.index.engine_map(s.target)
    h = s.sub.health()[s.target]
    skipped = h.blocks.get("skipped", 0)
    await s.send(stored(layout, [H_LATER], H[2], LATER))  # below a hash the engine no longer holds
    assert h.blocks.get("skipped", 0) == skipped + 1
    assert s.index.engine_copies(s.target) == {}


# ------------------------------------------------------------------ (a) (b) (c) over ZMQ
@pytest.mark.parametrize("layout", ["map", "array"])
async def test_a_block_stored_twice_stays_held_until_both_copies_are_removed(stack: Stack, layout: str) -> None:
    await two_copies_of_the_last_block(stack, layout)
    await stack.send(removed(layout, [H[2]]))
    await after_the_first_copy_goes(stack, layout)
    await stack.send(removed(layout, [H[2]]))
    await after_the_last_copy_goes(stack, layout)


@pytest.mark.parametrize("layout", ["map", "array"])
async def test_remaining_copy_counts_keep_a_block_until_they_reach_zero(stack: Stack, layout: str) -> None:
    await two_copies_of_the_last_block(stack, layout)
    await stack.send(removed(layout, [H[2]], [1]))
    await after_the_first_copy_goes(stack, layout)
    await stack.send(removed(layout, [H[2]], [0]))
    await after_the_last_copy_goes(stack, layout)
    # the engine's count is its word even where the index saw one store only
    await stack.send(stored(layout, [H_LATER], None, LATER))
    await stack.send(removed(layout, [H_LATER], [1]))
    assert stack.held(LATER) == Overlap(1, 0)
    await stack.send(removed(layout, [H_LATER], [0]))
    assert stack.held(LATER) is None
    assert stack.sub.health()[stack.target].events.get("bad_copy_counts", 0) == 0


BAD_COUNTS = {  # two malformed fields each; a non-array in the positional slot is an older tail
    "wrong_length+negative": ([1, 1], [-1]),
    "float+bool": ([1.5], [True]),
    "string+nil_items": (["1"], [None]),
    "not_an_array": ("nope", {"n": 1}),  # map layout only
}


@pytest.mark.parametrize("layout, garbage", [(lay, g) for lay in ("map", "array") for g in BAD_COUNTS
                                             if lay == "map" or g != "not_an_array"])
async def test_malformed_copy_counts_are_counted_and_the_removal_applies_as_without_them(
        stack: Stack, layout: str, garbage: str) -> None:
    first, second = BAD_COUNTS[garbage]
    await two_copies_of_the_last_block(stack, layout)
    await stack.send(removed(layout, [H[2]], first))  # one copy goes, as without counts
    await after_the_first_copy_goes(stack, layout)
    await stack.send(removed(layout, [H[2]], second))
    await after_the_last_copy_goes(stack, layout)
    h = stack.sub.health()[stack.target]
    assert h.events.get("bad_copy_counts") == 2 and h.events.get("removed") == 2
    assert stack.metric("mesh_kv_events_events_total", type="bad_copy_counts") == 2
    assert not h.resets and not h.decode_errors and stack.sub.healthy(stack.target)
    await stack.send(stored(layout, [digest("after")], None, LATER))  # the stream keeps running
    assert stack.held(LATER) == Overlap(1, 0)


# ------------------------------------------------------------------ the decoder
@pytest.mark.parametrize("ev, counts, bad", [
    (["BlockRemoved", [1, 2], "GPU", 0, [1, 0]], (1, 0), False),
    (["BlockRemoved", [1, 2], "GPU", None, None], None, False),
    (["BlockRemoved", [1, 2], "GPU", 0, "full_attention"], None, False),  # an older tail: a kind
    (["BlockRemoved", [1, 2], "GPU", 0, {"x": 1}], None, False),  # not an array: an older tail
    (["BlockRemoved", [1, 2], "GPU", 0, None, 128], None, False),  # an older tail: kind, window
    (["BlockRemoved", [1, 2]], None, False),
    (["BlockRemoved", [1, 2], "GPU", 0, [1]], None, True),
    (["BlockRemoved", [1], "GPU", 0, [2**64 - 1]], (2**64 - 1,), False),
    ({"type": "BlockRemoved", "block_hashes": [7], "medium": None, "remaining_copy_counts": [3]}, (3,), False),
    ({"type": "BlockRemoved", "block_hashes": [7], "medium": None, "remaining_copy_counts": None}, None, False),
    ({"type": "BlockRemoved", "block_hashes": [7], "medium": None, "remaining_copy_counts": 3}, None, True),
    ({"type": "BlockRemoved", "block_hashes": [7], "medium": None, "remaining_copy_counts": [None]}, None, True),
], ids=lambda x: None)
def test_decoder_reads_remaining_copy_counts_from_both_layouts(ev: Any, counts: Any, bad: bool) -> None:
    batch = decode_batch(msgspec.msgpack.encode([0.0, [ev], 0]))
    assert not isinstance(batch, Exception) and batch.malformed == 0, batch
    (got,) = batch.events  # type: ignore[union-attr]
    assert isinstance(got, MeshBlockRemoved)
    assert got.remaining_copy_counts == counts and got.bad_copy_counts is bad
    assert got.block_hashes == (ev[1] if isinstance(ev, list) else ev["block_hashes"])


# ------------------------------------------------------------------ index rules, by hand
def test_the_cpu_tier_counts_its_own_copies_and_a_gpu_removal_leaves_them() -> None:
    """The offloading connector's overlapping chunks store a block twice on the CPU tier; a GPU
    copy is counted apart (one GPU removal takes the GPU block, the CPU copies stay)."""
    index = PrefixIndex()
    tokens = list(range(2 * BS))
    keys = block_keys(tokens, BS, SEED)
    index.apply_stored("w", [1, 2], None, tokens, BS, SEED)
    index.apply_stored("w", [1, 2], None, None, BS, SEED, Tier.CPU)  # chunk A, by hash
    index.apply_stored("w", [2], None, None, BS, SEED, Tier.CPU)  # chunk B overlaps block 2
    assert index.engine_copies("w", Tier.CPU) == {2: 2} and index.engine_copies("w") == {}
    index.apply_removed("w", [1, 2], Tier.GPU)
    assert index.match(keys) == {"w": Overlap(0, 2)}
    index.apply_removed("w", [2], Tier.CPU)  # chunk B goes: block 2 is still in chunk A
    assert index.match(keys) == {"w": Overlap(0, 2)}
    index.apply_removed("w", [1, 2], Tier.CPU)
    assert index.match(keys) == {} and index.engine_map("w") == {}


def test_a_rename_a_reset_and_a_clear_drop_every_copy() -> None:
    index = PrefixIndex()
    root, old, new = list(range(90, 90 + BS)), list(range(BS)), list(range(50, 50 + BS))
    rkey = block_keys(root, BS, SEED)[0]
    index.apply_stored("w", [8], None, root, BS, SEED)
    for _ in range(3):  # below a parent: vLLM's recomputed last block, a copy each time
        index.apply_stored("w", [9], 8, old, BS, SEED)
    assert index.engine_copies("w") == {9: 3}
    index.apply_stored("w", [9], 8, new, BS, SEED)  # the hash names other content now
    assert index.match(block_keys(root + old, BS, SEED)) == {"w": Overlap(1, 0)}
    assert index.engine_copies("w") == {}
    index.apply_stored("w", [9], 8, new, BS, SEED)
    index.apply_removed("w", [9], None)  # every tier, every copy
    assert index.match(block_keys(root + new, BS, SEED)) == {"w": Overlap(1, 0)}
    index.apply_stored("w", [9], 8, new, BS, SEED)
    index.apply_stored("w", [9], 8, new, BS, SEED)
    index.apply_cleared("w")
    index.apply_stored("w", [8], None, root, BS, SEED)
    index.apply_stored("w", [9], 8, new, BS, SEED)
    assert index.engine_copies("w") == {}  # a fresh start: one copy
    index.apply_removed("w", [9])
    assert index.match(block_keys(root + new, BS, SEED)) == {"w": Overlap(1, 0)}
    assert index.stats()["engine_copies"] == 0 and rkey in index.keys_of("w")


def test_a_store_from_the_root_of_held_blocks_is_a_report_not_a_copy() -> None:
    """vLLM's ``kv_cache_report_mode: "full"`` announces each prefix hit again from the root: the
    engine holds one copy, and one removal takes the block away."""
    index = PrefixIndex()
    tokens = list(range(3 * BS))
    index.apply_stored("w", [1, 2, 3], None, tokens, BS, SEED)
    for _ in range(3):
        index.apply_stored("w", [1, 2], None, tokens[: 2 * BS], BS, SEED)
    assert index.engine_copies("w") == {}
    index.apply_stored("w", [3], 2, tokens[2 * BS :], BS, SEED)  # the recomputed last block: a copy
    assert index.engine_copies("w") == {3: 2}
    index.apply_removed("w", [3, 2, 1])
    assert index.match(block_keys(tokens, BS, SEED)) == {}
    index.apply_removed("w", [3])
    assert index.engine_map("w") == {} and index.stats()["engine_copies"] == 0


def test_a_key_budget_never_counts_a_copy_it_cannot_see() -> None:
    """A node the budget evicted lost its tier bits: a store of its hash again is counted as the
    first copy, so the index forgets the block one removal early (never keeps it too long)."""
    index = PrefixIndex(max_keys=2)
    a, b = list(range(BS)), list(range(10, 10 + 2 * BS))
    index.apply_stored("w", [1], None, a, BS, SEED)
    index.apply_stored("w", [2, 3], None, b, BS, SEED)  # evicts block a's node, its hash stays mapped
    assert index.holds("w", block_keys(a, BS, SEED)[0]) is None and 1 in index.engine_map("w")
    index.apply_stored("w", [1], None, a, BS, SEED)  # a second copy on the engine, unseen
    assert index.engine_copies("w") == {}
    index.apply_removed("w", [1])
    assert index.holds("w", block_keys(a, BS, SEED)[0]) is None


# ------------------------------------------------------------------ (d) the bundled engine
def _replay_all(ctx: zmq.Context, endpoint: str) -> list[bytes]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        out = []
        while True:
            assert dealer.poll(5000), "no replay answer"
            _, _topic, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                return out
            out.append(payload)
    finally:
        dealer.close(linger=0)


def test_the_bundled_engine_never_stores_a_hash_it_holds_on_that_tier() -> None:
    """Block-aligned prompts served again (the case where vLLM makes a second copy), shared
    heads, evictions and CPU offload: read from its replay socket with a plain msgpack decode,
    every BlockStored names hashes not held on that tier, so Mesh counts no copy for it."""
    from tests.procs import free_port
    from workers.config import EngineConfig, get_preset
    from workers.engine.llm_engine import LLMEngine
    from workers.engine.sequence import SamplingParams
    from workers.model.decoder import build_model

    tiny = get_preset("tiny")
    pub_port, replay_port = free_port(), free_port()
    cfg = EngineConfig(device="cpu", num_kv_blocks=24, cpu_offload_blocks=12, cpu_threads=1,
                       max_num_batched_tokens=128, kv_events_endpoint=f"tcp://*:{pub_port}",
                       kv_events_replay_endpoint=f"tcp://*:{replay_port}")
    engine = LLMEngine(tiny, cfg, eos_token_id=257, model=build_model(tiny, torch.device("cpu"), seed=0))
    ctx = zmq.Context()
    rng = random.Random(5)
    try:
        heads = [[rng.randrange(256) for _ in range(64)] for _ in range(3)]
        for i in range(36):
            head = heads[rng.randrange(3)]
            prompt = head[: 16 * rng.randint(1, 4)] if i % 2 else head[: rng.randrange(10, 64)] + [rng.randrange(256)]
            engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=rng.randrange(1, 6),
                                                             ignore_eos=True))
            if i % 3 == 0:
                engine.step()
        while engine.has_unfinished():
            engine.step()
        for _ in range(500):
            if engine.publisher.num_published + engine.publisher.num_dropped == engine.publisher.last_seq + 1:
                break
            time.sleep(0.01)
        payloads = _replay_all(ctx, f"tcp://127.0.0.1:{replay_port}")
        assert len(payloads) == engine.publisher.last_seq + 1
        held: dict[str, set[int]] = {"GPU": set(), "CPU": set()}
        kinds = {"BlockStored": 0, "BlockRemoved": 0}
        for payload in payloads:
            for ev in msgspec.msgpack.decode(payload)[1]:  # [ts, events, rank], events as maps
                kind = ev["type"]
                if kind == "AllBlocksCleared":
                    held = {"GPU": set(), "CPU": set()}
                    continue
                kinds[kind] += 1
                tier = held[ev.get("medium") or "GPU"]
                hashes = [h & (2**64 - 1) for h in ev["block_hashes"]]
                if kind == "BlockStored":
                    again = tier.intersection(hashes)
                    assert not again, f"stored again while held on {ev.get('medium')}: {again}"
                    tier.update(hashes)
                else:
                    assert tier.issuperset(hashes), "removed a hash it did not hold"
                    tier.difference_update(hashes)
        assert kinds["BlockRemoved"] > 0 and held["CPU"]  # evictions and offload happened
        assert held["GPU"] == engine.block_manager.cached_keys()
        index = PrefixIndex()  # and Mesh, fed the same stream, counts no copy
        for payload in payloads:
            for ev in decode_batch(payload).events:  # type: ignore[union-attr]
                tier = Tier.CPU if ev.medium == "CPU" else Tier.GPU
                if isinstance(ev, MeshBlockRemoved):
                    index.apply_removed("w", ev.block_hashes, tier, ev.remaining_copy_counts)
                elif hasattr(ev, "token_ids"):
                    index.apply_stored("w", ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size,
                                       namespace_seed("tiny"), tier)
        assert index.stats()["engine_copies"] == 0
        assert set(index.engine_map("w")) == held["GPU"] | held["CPU"]
    finally:
        engine.close()
        ctx.term()
