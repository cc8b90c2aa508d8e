"""The KV event subscriber over real ZMQ sockets, fed by a vLLM-format publisher written here.

The publisher below is written from REFERENCE.md section 2 alone (it shares no code with the
bundled engine's publisher nor with ``mesh.events.wire``): PUB frames ``[topic, seq, payload]``, a
ROUTER replay socket answering ``[b"", start]`` in either reply layout, every payload layout.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import xxhash
import zmq
from prometheus_client import CollectorRegistry, generate_latest

from mesh.core.index import PrefixIndex
from mesh.core.keys import block_keys, namespace_seed
from mesh.events.subscriber import KvEventSubscriber, WorkerEvents, offset_endpoint
from policies.base import Overlap, Tier

MODEL = "toy"
SEED = namespace_seed(MODEL)
BS = 4
EVENT_LAYOUTS = ["map", "array"]
BATCH_LAYOUTS = ["array3", "array2", "map"]
HASH_MODES = ["uint", "int", "bytes"]


# ------------------------------------------------------------------ the publisher
def _wire_hash(h: int, mode: str, rng: random.Random) -> Any:
    if mode == "int":
        return h - (1 << 64) if h >= 1 << 63 else h
    if mode == "bytes":
        return rng.randbytes(24) + h.to_bytes(8, "big")  # a 32-byte digest whose low 8 bytes are h
    return h


def encode_events(events: list[tuple], ev_layout: str, batch_layout: str, hash_mode: str,
                  rng: random.Random, ts: float | None = None, rank: int | None = 0) -> bytes:
    """Abstract events -> one msgpack payload in the requested layout."""
    ts = time.time() if ts is None else ts
    out = []
    for ev in events:
        kind = ev[0]
        if kind == "stored":
            _, hashes, parent, tokens, medium = ev
            wh = [_wire_hash(h, hash_mode, rng) for h in hashes]
            wp = None if parent is None else _wire_hash(parent, hash_mode, rng)
            if ev_layout == "map":
                d: dict[str, Any] = {"type": "BlockStored", "block_hashes": wh, "parent_block_hash": wp,
                                     "token_ids": tokens, "block_size": BS, "lora_id": None, "medium": medium}
                if rng.random() < 0.5:
                    d.update(lora_name=None, group_idx=0, kv_cache_spec_kind="full_attention", future_field=1)
                out.append(d)
            else:
                arr: list[Any] = ["BlockStored", wh, wp, tokens, BS, None, medium]
                if rng.random() < 0.5:
                    arr += [None, None, 0, "full_attention", None]
                out.append(arr)
        elif kind == "removed":
            _, hashes, medium = ev
            wh = [_wire_hash(h, hash_mode, rng) for h in hashes]
            out.append({"type": "BlockRemoved", "block_hashes": wh, "medium": medium}
                       if ev_layout == "map" else ["BlockRemoved", wh, medium])
        elif kind == "cleared":
            out.append({"type": "AllBlocksCleared"} if ev_layout == "map" else ["AllBlocksCleared"])
        else:
            blob = ev[1] if len(ev) > 1 else 1  # an unknown event type, possibly padded
            out.append({"type": kind, "x": blob} if ev_layout == "map" else [kind, blob])
    if batch_layout == "array3":
        body: Any = [ts, out, rank]
    elif batch_layout == "array2":
        body = [ts, out]
    else:
        body = {"ts": ts, "events": out, "data_parallel_rank": rank}
    return msgspec.msgpack.encode(body)


class Publisher:
    """PUB + ROUTER replay, the replay socket served by its own thread."""

    def __init__(self, pub_port: int | None = None, replay_port: int | None = None, *,
                 topic: bytes = b"kv", keep: int = 10_000, reply_layout: str = "4frame",
                 with_replay: bool = True, sndhwm: int = 1_000_000) -> None:
        self.ctx = zmq.Context()
        self.topic = topic
        self.reply_layout = reply_layout
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, sndhwm)
        self.pub_port = _bind(self.pub, pub_port)
        self.kept: deque[tuple[int, bytes]] = deque(maxlen=keep)
        self.lock = threading.Lock()
        self.seq = 0
        self.replay_port: int | None = None
        self.stop_flag = threading.Event()
        self.thread: threading.Thread | None = None
        if with_replay:
            router = self.ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            self.replay_port = _bind(router, replay_port)
            self.thread = threading.Thread(target=self._serve, args=(router,), daemon=True)
            self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.pub_port}"

    @property
    def replay_endpoint(self) -> str | None:
        return None if self.replay_port is None else f"tcp://127.0.0.1:{self.replay_port}"

    def publish(self, payload: bytes, *, live: bool = True) -> int:
        seq = self.seq
        self.seq += 1
        with self.lock:
            self.kept.append((seq, payload))
        if live:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def send_raw(self, frames: list[bytes]) -> None:
        self.pub.send_multipart(frames)

    def _serve(self, router: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        while not self.stop_flag.is_set():
            if not poller.poll(20):
                continue
            frames = router.recv_multipart()
            if len(frames) != 3:
                continue
            ident, _, start = frames
            first = int.from_bytes(start, "big")
            with self.lock:
                kept = [item for item in self.kept if item[0] >= first]
            for seq, payload in kept:
                if self.reply_layout == "4frame":
                    router.send_multipart([ident, b"", self.topic, seq.to_bytes(8, "big"), payload])
                else:
                    router.send_multipart([ident, b"", seq.to_bytes(8, "big"), payload])
            end = [b"", (-1).to_bytes(8, "big", signed=True), b""]
            router.send_multipart([ident, b""] + ([self.topic] if self.reply_layout == "4frame" else []) + end[1:])
        router.close(linger=0)

    def close(self) -> None:
        self.stop_flag.set()
        if self.thread is not None:
            self.thread.join(2)
        self.pub.close(linger=0)
        self.ctx.term()


def _bind(sock: zmq.Socket, port: int | None) -> int:
    if port is None:
        sock.bind("tcp://127.0.0.1:*")
        return int(sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
    sock.bind(f"tcp://127.0.0.1:{port}")
    return port


# ------------------------------------------------------------------ a toy engine cache
class ToyEngine:
    """A prefix cache with LRU eviction (any block, not only leaves) and a CPU offload tier."""

    def __init__(self, rng: random.Random, gpu_blocks: int = 20, cpu_blocks: int = 12, offload: float = 0.5):
        self.rng = rng
        self.salt = rng.getrandbits(64)
        self.gpu: OrderedDict[tuple[int, ...], int] = OrderedDict()
        self.cpu: OrderedDict[tuple[int, ...], int] = OrderedDict()
        self.gpu_cap, self.cpu_cap, self.offload = gpu_blocks, cpu_blocks, offload

    def ehash(self, prefix: tuple[int, ...]) -> int:
        return xxhash.xxh3_64_intdigest(repr(prefix).encode(), self.salt)

    def serve(self, tokens: list[int]) -> list[tuple]:
        blocks = [tuple(tokens[: (i + 1) * BS]) for i in range(len(tokens) // BS)]
        hit = 0
        while hit < len(blocks) and blocks[hit] in self.gpu:
            self.gpu.move_to_end(blocks[hit])
            hit += 1
        new = blocks[hit:]
        events: list[tuple] = []
        protect = set(blocks)
        while len(self.gpu) + len(new) > self.gpu_cap:
            victim = next(b for b in self.gpu if b not in protect)
            self._evict(victim, events)
        # new blocks are stored in runs: a block still cached past the first miss gets no second
        # copy and no second BlockStored (a store of a held hash is one more copy: mesh/core/index.py)
        parent = self.gpu[blocks[hit - 1]] if hit else None
        start = hit
        for i in range(hit, len(blocks) + 1):
            if i < len(blocks) and blocks[i] not in self.gpu:
                self.gpu[blocks[i]] = self.ehash(blocks[i])
                continue
            if i > start:
                hashes = [self.gpu[b] for b in blocks[start:i]]
                events.append(("stored", hashes, parent, tokens[start * BS : i * BS], "GPU"))
            if i < len(blocks):
                self.gpu.move_to_end(blocks[i])
                parent = self.gpu[blocks[i]]
            start = i + 1
        return events

    def _evict(self, victim: tuple[int, ...], events: list[tuple]) -> None:
        h = self.gpu.pop(victim)
        if self.cpu_cap and victim not in self.cpu and self.rng.random() < self.offload:
            if len(self.cpu) >= self.cpu_cap:
                _, old = self.cpu.popitem(last=False)
                events.append(("removed", [old], "CPU"))
            self.cpu[victim] = h
            events.append(("stored", [h], None, None, "CPU"))  # offload: a tier update, no tokens
        events.append(("removed", [h], "GPU"))

    def tier(self, prefix: tuple[int, ...]) -> Tier | None:
        if prefix in self.gpu:
            return Tier.GPU
        return Tier.CPU if prefix in self.cpu else None

    def expected_keys(self) -> set[int]:
        return {block_keys(list(p), BS, SEED)[-1] for p in set(self.gpu) | set(self.cpu)}


def sessions(rng: random.Random, n: int, turns: int) -> list[list[list[int]]]:
    """Agentic sessions: a shared system prefix, each turn extending the previous prompt."""
    system = [rng.randrange(50) for _ in range(3 * BS)]
    out = []
    for _ in range(n):
        prompt = list(system)
        convo = []
        for _ in range(turns):
            prompt = prompt + [rng.randrange(50) for _ in range(rng.randrange(2, 3 * BS))]
            convo.append(list(prompt))
        out.append(convo)
    return out


# ------------------------------------------------------------------ helpers
async def wait_until(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


async def caught_up(sub: KvEventSubscriber, target: str, pub: Publisher) -> None:
    await wait_until(lambda: sub.health()[target].last_seq == pub.seq - 1 and sub.healthy(target)
                     and sub.settled(target))


async def nudge_until(pub: Publisher, cond: Callable[[], bool], rng: random.Random) -> None:
    """Publish empty batches until ``cond`` holds (a reconnecting SUB misses what was sent)."""
    for _ in range(500):
        if cond():
            return
        pub.publish(encode_events([], "map", "array3", "uint", rng))
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached in time")


async def subscribed(sub: KvEventSubscriber, target: str, pub: Publisher, rng: random.Random) -> None:
    """Publish empty batches until one arrives (the SUB socket has joined)."""
    async def probe() -> bool:
        pub.publish(encode_events([], "map", "array3", "uint", rng))
        await asyncio.sleep(0.02)
        return sub.health()[target].last_seq is not None
    for _ in range(300):
        if await probe():
            return
    raise AssertionError("subscriber never joined")


def check_index(index: PrefixIndex, target: str, engine: ToyEngine, prompts: list[list[int]]) -> None:
    assert index.keys_of(target) == engine.expected_keys()
    for p in prompts:
        keys = block_keys(p, BS, SEED)
        prefixes = [tuple(p[: (i + 1) * BS]) for i in range(len(keys))]
        for k, pre in zip(keys, prefixes):
            assert index.holds(target, k) == engine.tier(pre)
        gpu = total = 0
        for pre in prefixes:
            t = engine.tier(pre)
            if t is None:
                break
            if gpu == total and t is Tier.GPU:
                gpu += 1
            total += 1
        assert index.match(keys).get(target, Overlap()) == Overlap(gpu, total - gpu)


def make_sub(index: PrefixIndex, **kw: Any) -> KvEventSubscriber:
    kw.setdefault("replay_timeout_s", 5.0)  # generous: the test box is shared
    return KvEventSubscriber(index, **kw)


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("ev_layout", EVENT_LAYOUTS)
@pytest.mark.parametrize("batch_layout", BATCH_LAYOUTS)
async def test_every_payload_layout_reaches_the_index(ev_layout: str, batch_layout: str) -> None:
    rng = random.Random(hash((ev_layout, batch_layout)) & 0xFFFF)
    pub = Publisher(reply_layout=rng.choice(["4frame", "3frame"]))
    index = PrefixIndex()
    sub = make_sub(index)
    try:
        (target,) = sub.add_worker(WorkerEvents("w", pub.endpoint, pub.replay_endpoint, model=MODEL, block_size=BS))
        engine = ToyEngine(rng)
        convo = sessions(rng, 2, 4)
        prompts = [p for c in convo for p in c]
        for i, p in enumerate(prompts):  # the first batches go out before the SUB joins: replay
            mode = HASH_MODES[i % 3]
            pub.publish(encode_events(engine.serve(p), ev_layout, batch_layout, mode, rng))
        await caught_up(sub, target, pub)
        check_index(index, target, engine, prompts)
    finally:
        await sub.stop()
        pub.close()


@pytest.mark.parametrize("reply_layout", ["4frame", "3frame"])
async def test_gap_is_repaired_by_replay(reply_layout: str) -> None:
    rng = random.Random(1)
    pub = Publisher(reply_layout=reply_layout)
    index = PrefixIndex()
    sub = make_sub(index)
    try:
        (target,) = sub.add_worker(WorkerEvents("w", pub.endpoint, pub.replay_endpoint, model=MODEL))
        await subscribed(sub, target, pub, rng)
        engine = ToyEngine(rng)
        prompts = [p for c in sessions(rng, 2, 5) for p in c]
        for i, p in enumerate(prompts):
            pub.publish(encode_events(engine.serve(p), "map", "array3", "uint", rng), live=i % 4 != 1)
        await caught_up(sub, target, pub)
        h = sub.health()[target]
        assert h.gaps >= 1 and h.replays.get("ok", 0) >= 2
        assert not h.resets
        check_index(index, target, engine, prompts)
    finally:
        await sub.stop()
        pub.close()


async def test_publisher_restart_resets_and_rebuilds_from_replay() -> None:
    rng = random.Random(2)
    pub = Publisher()
    index = PrefixIndex()
    resets: list[tuple[str, str]] = []
    sub = make_sub(index, on_reset=lambda t, r: resets.append((t, r)))
    try:
        (target,) = sub.add_worker(WorkerEvents("w", pub.endpoint, pub.replay_endpoint, model=MODEL))
        old = ToyEngine(rng)
        prompts = [p for c in sessions(rng, 3, 4) for p in c]
        for p in prompts:
            pub.publish(encode_events(old.serve(p), "array", "array2", "int", rng))
        await caught_up(sub, target, pub)
        ports = pub.pub_port, pub.replay_port
        pub.close()
        pub = Publisher(*ports)  # the engine restarted: seq from 0, a smaller cache
        new = ToyEngine(rng)
        for p in prompts[:3]:
            pub.publish(encode_events(new.serve(p), "map", "map", "bytes", rng))
        await nudge_until(pub, lambda: index.keys_of(target) == new.expected_keys(), rng)
        await caught_up(sub, target, pub)
        check_index(index, target, new, prompts)
        assert sub.health()[target].resets.get("restart") == 1 and resets[0] == (target, "restart")
    finally:
        await sub.stop()
        pub.close()


async def test_a_restart_that_resumes_at_the_next_seq_is_caught_after_the_reconnect() -> None:
    """The hard restart: while the SUB was disconnected the new publisher incarnation sent (and
    kept) as many batches as the old one, so its next live frame carries exactly ``last + 1``. The
    sequence alone cannot tell; the lost connection makes the stream prove continuity first."""
    rng = random.Random(5)
    pub = Publisher()
    index = PrefixIndex()
    sub = make_sub(index)
    try:
        (target,) = sub.add_worker(WorkerEvents("w", pub.endpoint, pub.replay_endpoint, model=MODEL))
        await subscribed(sub, target, pub, rng)
        old = ToyEngine(rng)
        prompts = [p for c in sessions(rng, 3, 4) for p in c]
        for p in prompts:
            pub.publish(encode_events(old.serve(p), "array", "array2", "int", rng))
        await caught_up(sub, target, pub)
        last = sub.health()[target].last_seq
        ports = pub.pub_port, pub.replay_port
        pub.close()
        await wait_until(lambda: sub.health()[target].disconnects == 1)
        assert not sub.healthy(target)  # routing falls back to load while the stream is down
        pub = Publisher(*ports)
        new = ToyEngine(rng)
        for p in prompts[:2]:  # unseen by the subscriber: kept for replay only
            pub.publish(encode_events(new.serve(p), "map", "map", "bytes", rng), live=False)
        while pub.seq <= last:
            pub.publish(encode_events([], "map", "array3", "uint", rng), live=False)
        assert pub.seq == last + 1
        await nudge_until(pub, lambda: sub.health()[target].resets.get("restart") == 1, rng)
        await caught_up(sub, target, pub)
        check_index(index, target, new, prompts)
        assert sub.healthy(target)
    finally:
        await sub.stop()
        pub.close()


async def test_random_workload_with_evictions_gaps_and_ranks_matches_the_true_cache() -> None:
    rng = random.Random(3)
    pubs = _two_rank_publishers()
    base = pubs[0]
    index = PrefixIndex()
    sub = make_sub(index)
    try:
        targets = sub.add_worker(WorkerEvents("w", base.endpoint, base.replay_endpoint, dp_size=2,
                                              model=MODEL, block_size=BS))
        assert targets == ["w@0", "w@1"]
        for r, t in enumerate(targets):
            await subscribed(sub, t, pubs[r], rng)
        engines = [ToyEngine(rng, gpu_blocks=30, cpu_blocks=10), ToyEngine(rng, gpu_blocks=40, cpu_blocks=0)]
        convo = sessions(rng, 6, 8)
        prompts = [p for c in convo for p in c]
        for turn in range(8):
            for c in rng.sample(convo, len(convo)):
                r = rng.randrange(2)
                payload = encode_events(engines[r].serve(c[turn]), rng.choice(EVENT_LAYOUTS),
                                        rng.choice(BATCH_LAYOUTS), rng.choice(HASH_MODES), rng, rank=r)
                pubs[r].publish(payload, live=rng.random() > 0.1)  # ~10% lost on the live path
            await asyncio.sleep(0.01)
        for r in range(2):
            pubs[r].publish(encode_events([], "map", "array3", "uint", rng, rank=r))  # reveals a tail gap
        for r, t in enumerate(targets):
            await caught_up(sub, t, pubs[r])
            check_index(index, t, engines[r], prompts)
            assert not sub.health()[t].resets
        assert sum(sub.health()[t].gaps for t in targets) >= 1
    finally:
        await sub.stop()
        for p in pubs:
            p.close()


def _two_rank_publishers() -> list[Publisher]:
    """Rank 0 on random ports, rank 1 on the next ports (vLLM's layout)."""
    for _ in range(20):
        base = Publisher()
        assert base.replay_port is not None
        try:
            return [base, Publisher(base.pub_port + 1, base.replay_port + 1)]
        except zmq.ZMQError:
            base.close()
    raise AssertionError("no free pair of adjacent ports")


async def test_gap_without_replay_resets_the_target() -> None:
    rng = random.Random(4)
    pub = Publisher(with_replay=False)
    index = PrefixIndex()
    sub = make_sub(index)
    try:
        (target,) = sub.add_worker(WorkerEvents("w", pub.endpoint, None, model=MODEL))
        await subscribed(sub, target, pub, rng)
        engine = ToyEngine(rng)
        prompts = [p for c in sessions(rng, 1, 3) for p in c]
        pub.publish(encode_events(engine.serve(prompts[0]), "map", "array3", "uint", rng))
        await caught_up(sub, target, pub)
        assert index.keys_of(target)
        pub.publish(encode_events(engine.serve(prompts[1]), "map", "array3", "uint", rng), live=False)
        pub.publish(encode_events([], "map", "array3", "uint", rng))
        await caught_up(sub, target, pub)
        assert sub.health()[target].resets == {"gap_no_replay": 1}
        assert index.keys_of(target) == set()  # under-claim, never a stale claim
    finally:
        await sub.stop()
        pub.close()


async def test_garbage_truncated_oversized_and_unknown_frames_are_counted() -> None:
    rng = random.Random(5)
    pub = Publisher()
    index = PrefixIndex()
    flips: list[tuple[str, bool]] = []
    sub = make_sub(index, max_frame_bytes=4096, unhealthy_after_bad_frames=3,
                   on_health=lambda t, ok: flips.append((t, ok)))
    try:
        (target,) = sub.add_worker(WorkerEvents("w", pub.endpoint, pub.replay_endpoint, model=MODEL, block_size=BS))
        await subscribed(sub, target, pub, rng)
        engine = ToyEngine(rng)
        prompts = [p for c in sessions(rng, 1, 4) for p in c]
        pub.publish(encode_events(engine.serve(prompts[0]), "map", "array3", "uint", rng))
        await caught_up(sub, target, pub)
        for frames in ([b"only-one"], [b"a", b"b", b"c", b"d"], [b"kv", b"\x00" * 3, b"x"], []):
            if frames:
                pub.send_raw(frames)
        pub.publish(b"\xc1\xff garbage")  # a real seq with an undecodable payload
        pub.publish(msgspec.msgpack.encode([0.0, [["BlockStored", [1], None, [1, 2], 2]]])[:-3])  # truncated
        pub.publish(b"\x90" + b"\x00" * 5000)  # oversized
        await wait_until(lambda: sub.health()[target].last_seq == pub.seq - 1)
        h = sub.health()[target]
        assert h.dropped == {"malformed": 3, "oversized": 1}
        assert h.decode_errors == 2 and h.resets == {"undecodable": 2, "oversized": 1}
        assert (target, False) in flips  # five bad frames in a row made it unhealthy
        assert index.keys_of(target) == set()
        # unknown events, a token count off the block size and a foreign block size are skipped;
        # then the stream is healthy and useful again
        engine = ToyEngine(rng)
        odd = ["BlockStored", [11], None, [1, 2, 3, 4, 5], BS, None, "GPU"]
        foreign = ["BlockStored", [12], None, [1, 2, 3, 4, 5, 6, 7, 8], 8, None, "GPU"]
        payload = msgspec.msgpack.decode(encode_events([("Heartbeat",), *engine.serve(prompts[2])], "array", "array3",
                                                       "uint", rng))
        payload[1] += [odd, foreign]
        pub.publish(msgspec.msgpack.encode(payload))
        await caught_up(sub, target, pub)
        assert sub.healthy(target) and flips[-1] == (target, True)
        events = sub.health()[target].events
        assert events.get("unknown") == 1 and events.get("invalid") == 1 and events.get("block_size_mismatch") == 1
        check_index(index, target, engine, prompts[2:3])
    finally:
        await sub.stop()
        pub.close()


async def test_flood_with_a_short_replay_buffer_never_over_claims() -> None:
    rng = random.Random(6)
    pub = Publisher(keep=50, sndhwm=100)
    index = PrefixIndex()
    sub = make_sub(index, rcvhwm=100, yield_every=16, max_backlog_frames=100)
    try:
        (target,) = sub.add_worker(WorkerEvents("w", pub.endpoint, pub.replay_endpoint, model=MODEL))
        await subscribed(sub, target, pub, rng)
        engine = ToyEngine(rng, gpu_blocks=40, cpu_blocks=0)
        prompts = [p for c in sessions(rng, 8, 10) for p in c]
        padding = ("Padding", bytes(8192))
        for i in range(3000):  # ~25 MB at once: past the socket buffers and both HWMs
            pub.publish(encode_events([padding, *engine.serve(rng.choice(prompts))], "map", "array3", "uint", rng))
            if i % 1000 == 0:
                await asyncio.sleep(0)
        # the flood's last frames may be dropped too: only a later frame reveals that gap
        await nudge_until(pub, lambda: sub.health()[target].last_seq == pub.seq - 1 and sub.healthy(target), rng)
        assert index.keys_of(target) <= engine.expected_keys()
        h = sub.health()[target]
        # the flood lost batches for good (past the socket's HWM: a gap; past the inbox's budget: a
        # backlog reset): reset
        assert (h.gaps >= 1 or h.resets.get("backlog", 0) >= 1) and sum(h.resets.values()) >= 1
        assert h.events["unknown"] > 0 and sub.healthy(target)
    finally:
        await sub.stop()
        pub.close()


async def test_metrics_are_exported_on_the_given_registry_and_stop_is_clean() -> None:
    rng = random.Random(7)
    pub = Publisher()
    index = PrefixIndex()
    registry = CollectorRegistry()
    sub = make_sub(index, registry=registry)
    (target,) = sub.add_worker(WorkerEvents("w", pub.endpoint, pub.replay_endpoint, model=MODEL))
    await subscribed(sub, target, pub, rng)
    engine = ToyEngine(rng)
    pub.publish(encode_events(engine.serve(list(range(16))), "map", "array3", "uint", rng))
    await caught_up(sub, target, pub)
    text = generate_latest(registry).decode()
    assert 'mesh_kv_events_blocks_total{op="stored",target="w",worker="w"} 4.0' in text
    assert 'mesh_kv_events_healthy{target="w",worker="w"} 1.0' in text
    assert "mesh_kv_events_last_event_age_seconds" in text and "mesh_kv_events_gaps_total" in text
    await sub.remove_worker("w")
    assert index.keys_of(target) == set() and not sub.healthy(target)
    await sub.stop()
    await sub.stop()  # idempotent
    assert b"mesh_kv_events" not in generate_latest(registry)
    pub.close()


async def test_a_stream_silent_past_stale_after_is_unhealthy() -> None:
    rng = random.Random(8)
    pub = Publisher()
    now = [0.0]
    sub = make_sub(PrefixIndex(), stale_after_s=5.0, clock=lambda: now[0])
    try:
        (target,) = sub.add_worker(WorkerEvents("w", pub.endpoint, pub.replay_endpoint, model=MODEL))
        await subscribed(sub, target, pub, rng)
        await caught_up(sub, target, pub)
        now[0] = 4.0
        assert sub.healthy(target)
        now[0] = 60.0
        assert not sub.healthy(target)
    finally:
        await sub.stop()
        pub.close()


def test_rank_endpoints_follow_vllms_port_offset() -> None:
    assert offset_endpoint("tcp://h:5557", 0) == "tcp://h:5557"
    assert offset_endpoint("tcp://h:5557", 3) == "tcp://h:5560"
    assert offset_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    with pytest.raises(ValueError):
        WorkerEvents("w", "tcp://h:1", dp_size=0)


def test_log_limiter_keeps_a_few_lines_per_window_and_counts_the_rest(caplog: pytest.LogCaptureFixture) -> None:
    from mesh.events.subscriber import LogLimiter

    now = [0.0]
    limiter = LogLimiter(burst=3, window_s=60.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="mesh.events.subscriber"):
        for i in range(50):  # a publisher sending garbage: one line per frame without the limit
            limiter.log(logging.WARNING, ("w0", "undecodable"), "kv events %s: seq %d undecodable", "w0", i)
        limiter.log(logging.WARNING, ("w1", "undecodable"), "kv events %s: seq %d undecodable", "w1", 0)
        assert len(caplog.records) == 4  # three of w0's, one of w1's: keys are limited apart
        now[0] = 61.0
        limiter.log(logging.WARNING, ("w0", "undecodable"), "kv events %s: seq %d undecodable", "w0", 50)
    lines = [r.getMessage() for r in caplog.records]
    assert "kv events w0: 47 more 'undecodable' lines left out in the last 61 s" in lines
    assert lines[-1] == "kv events w0: seq 50 undecodable"
