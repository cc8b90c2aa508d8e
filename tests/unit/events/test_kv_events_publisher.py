"""The engine's KV events, read by a subscriber written here from the wire format alone
(pyzmq + a plain msgpack decode, nothing from ``workers.server.kv_events``): the set of blocks it
rebuilds equals the engine's cached set after a random workload with evictions, live and through
replay; its own recomputed block keys equal the engine's hashes."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import msgspec
import pytest
import torch
import zmq

from mesh.core.keys import block_keys, namespace_seed
from tests.procs import free_port
from workers.config import EngineConfig, get_preset
from workers.engine.block_manager import BlockStored
from workers.engine.llm_engine import LLMEngine
from workers.engine.sequence import SamplingParams
from workers.model.decoder import build_model
from workers.server.kv_events import KVEventPublisher

TINY = get_preset("tiny")


# ---- the independent subscriber -------------------------------------------------------------------


def _hash(h: Any) -> int:
    if isinstance(h, bytes):
        return int.from_bytes(h, "big")
    return h & (2**64 - 1)  # i64 -> u64


class Subscriber:
    """Rebuilds a worker's cached blocks from its batches, applied in sequence order."""

    def __init__(self, block_size: int, seed: int) -> None:
        self.block_size, self.seed = block_size, seed
        self.blocks: set[int] = set()
        self.batches: dict[int, bytes] = {}  # seq -> payload, live or replayed
        self.applied = -1
        self.counts = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}

    def receive(self, seq: int, payload: bytes) -> None:
        if seq in self.batches:
            assert self.batches[seq] == payload, "replay and live stream disagree"
        self.batches[seq] = payload
        while self.applied + 1 in self.batches:
            self.applied += 1
            self._apply(msgspec.msgpack.decode(self.batches[self.applied]))

    def _apply(self, batch: Any) -> None:
        events = batch["events"] if isinstance(batch, dict) else batch[1]
        for ev in events:
            kind = ev["type"] if isinstance(ev, dict) else ev[0]
            fields = ev if isinstance(ev, dict) else dict(zip(["block_hashes", "parent_block_hash", "token_ids", "block_size"], ev[1:]))
            self.counts[kind] += 1
            if kind == "BlockStored":
                hashes = [_hash(h) for h in fields["block_hashes"]]
                tokens, bs = fields["token_ids"], fields["block_size"]
                assert bs == self.block_size and len(tokens) == len(hashes) * bs
                parent = fields["parent_block_hash"]
                # The router's own keys, recomputed from the tokens, are the engine's hashes.
                assert block_keys(tokens, bs, self.seed, parent=None if parent is None else _hash(parent)) == hashes
                self.blocks |= set(hashes)
            elif kind == "BlockRemoved":
                self.blocks -= {_hash(h) for h in fields["block_hashes"]}
            elif kind == "AllBlocksCleared":
                self.blocks.clear()


def _replay(ctx: zmq.Context, endpoint: str, start: int) -> list[tuple[int, bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert dealer.poll(5000), "no replay answer"
            frames = dealer.recv_multipart()
            empty, _topic, seq_b, payload = frames
            assert empty == b""
            seq = int.from_bytes(seq_b, "big", signed=True)
            if seq == -1:
                assert payload == b""
                return out
            out.append((seq, payload))
    finally:
        dealer.close(linger=0)


class LiveReader(threading.Thread):
    def __init__(self, ctx: zmq.Context, endpoint: str, sub: Subscriber) -> None:
        super().__init__(daemon=True)
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.sub, self.stop, self.lock, self.live = sub, threading.Event(), threading.Lock(), 0

    def run(self) -> None:
        while not self.stop.is_set():
            if self.sock.poll(20):
                _topic, seq_b, payload = self.sock.recv_multipart()
                with self.lock:
                    self.sub.receive(int.from_bytes(seq_b, "big"), payload)
                    self.live += 1
        self.sock.close(linger=0)


# ---- tests ------------------------------------------------------------------------------------------


def _workload(engine: LLMEngine, rng: random.Random, n: int) -> None:
    heads = [[rng.randrange(256) for _ in range(64)] for _ in range(4)]
    for i in range(n):
        prompt = heads[rng.randrange(4)][: rng.randrange(10, 64)] + [rng.randrange(256) for _ in range(rng.randrange(1, 40))]
        engine.add_request(f"w{rng.random()}", prompt, SamplingParams(temperature=0, max_tokens=rng.randrange(1, 20), ignore_eos=True))
        if i % 3 == 0:
            engine.step()
    while engine.has_unfinished():
        engine.step()


def _settle(engine: LLMEngine, sub: Subscriber, reader: LiveReader | None, ctx: zmq.Context, replay: str) -> None:
    """Every published batch applied: wait for the publisher to flush, then fill gaps by replay."""
    pub = engine.publisher
    last = pub.last_seq
    for _ in range(500):
        if pub.num_published + pub.num_dropped == last + 1:
            break
        time.sleep(0.01)
    for _ in range(100):  # the tail of the live stream may still be in flight
        if reader is None or sub.applied >= last:
            break
        time.sleep(0.01)
    if sub.applied < last:
        lock = reader.lock if reader else threading.Lock()
        for seq, payload in _replay(ctx, replay, sub.applied + 1):
            with lock:
                sub.receive(seq, payload)
    assert sub.applied == last


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_model(TINY, torch.device("cpu"), seed=0)


def test_subscriber_rebuilds_the_cached_set_live_and_after_replay(model: torch.nn.Module) -> None:
    pub_port, replay_port = free_port(), free_port()
    cfg = EngineConfig(device="cpu", num_kv_blocks=24, cpu_threads=1, max_num_batched_tokens=128,
                       kv_events_endpoint=f"tcp://*:{pub_port}", kv_events_replay_endpoint=f"tcp://*:{replay_port}")
    engine = LLMEngine(TINY, cfg, eos_token_id=257, model=model)
    ctx = zmq.Context()
    replay = f"tcp://127.0.0.1:{replay_port}"
    seed = namespace_seed("tiny")
    early = Subscriber(16, seed)
    reader = LiveReader(ctx, f"tcp://127.0.0.1:{pub_port}", early)
    reader.start()
    try:
        rng = random.Random(7)
        _workload(engine, rng, 30)
        _settle(engine, early, reader, ctx, replay)
        with reader.lock:
            assert early.blocks == engine.block_manager.cached_keys()
            assert early.counts["BlockRemoved"] > 0 and reader.live > 0  # evictions; the live path works

        # A subscriber that joins late rebuilds everything from replay alone.
        late = Subscriber(16, seed)
        for seq, payload in _replay(ctx, replay, 0):
            late.receive(seq, payload)
        assert late.blocks == engine.block_manager.cached_keys()

        # Reset: AllBlocksCleared; then more work, still in agreement.
        assert engine.reset_prefix_cache()
        _workload(engine, rng, 12)
        _settle(engine, early, reader, ctx, replay)
        with reader.lock:
            assert early.counts["AllBlocksCleared"] == 1
            assert early.blocks == engine.block_manager.cached_keys() and early.blocks
    finally:
        reader.stop.set()
        reader.join()
        engine.close()
        ctx.term()


def test_full_queue_drops_oldest_without_blocking_and_leaves_a_visible_gap() -> None:
    pub_port, replay_port = free_port(), free_port()
    pub = KVEventPublisher(f"tcp://*:{pub_port}", f"tcp://*:{replay_port}", max_queue_size=3)
    gate = threading.Event()
    send = pub._send_queued

    def gated(sock: Any) -> int:  # the publisher thread stalls (a slow network, say)
        gate.wait()
        return send(sock)

    pub._send_queued = gated  # type: ignore[method-assign]
    time.sleep(0.05)  # let the thread reach the gate
    event = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[0] * 4, block_size=4)
    seqs = [pub.publish([event]) for _ in range(10)]  # returns at once although nothing is sent
    assert seqs == list(range(10)) and pub.num_dropped == 7
    gate.set()
    for _ in range(500):
        if pub.num_published == 3:
            break
        time.sleep(0.01)
    ctx = zmq.Context()
    try:
        got = _replay(ctx, f"tcp://127.0.0.1:{replay_port}", 0)
        assert [s for s, _ in got] == [7, 8, 9]  # seqs 0-6 are a gap a subscriber can see
        assert [s for s, _ in _replay(ctx, f"tcp://127.0.0.1:{replay_port}", 9)] == [9]
        ts, events, rank = msgspec.msgpack.decode(got[0][1])
        assert isinstance(ts, float) and rank == 0
        assert events == [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [0] * 4,
                           "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None}]
    finally:
        pub.close()
        ctx.term()


def test_bind_failure_is_reported() -> None:
    port = free_port()
    first = KVEventPublisher(f"tcp://*:{port}")
    try:
        with pytest.raises(ValueError, match="cannot bind"):
            KVEventPublisher(f"tcp://*:{port}")
    finally:
        first.close()
