"""KV event ingestion from a hostile or broken publisher, over real ZMQ sockets (the independent
publisher of tests/fakes/kv_publisher.py): the stream must keep running, memory must stay bounded,
and the index must hold exactly what the publisher's valid events say."""

from __future__ import annotations

import asyncio
import random
import threading
import tracemalloc

import msgspec
import zmq

from mesh.core.index import PrefixIndex
from mesh.core.keys import block_keys, namespace_seed
from mesh.events.limits import SubscriberLimits
from mesh.events.subscriber import _MAX_SEEDS, KvEventSubscriber, WorkerEvents
from policies.base import Overlap
from tests.fakes.kv_publisher import BS, MODEL, SEED, Publisher, encode_events
from tests.support.kv_events import ToyEngine, caught_up, check_index, nudge_until, sessions, subscribed, wait_until


def _stored(h: int, tokens: list[int], lora: str | None = None) -> dict:
    return {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": None, "token_ids": tokens,
            "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": lora}


async def test_a_replay_endpoint_zmq_refuses_is_a_failed_replay_not_a_dead_stream() -> None:
    """A replay socket whose connect is refused fails that replay only: the stream task goes on
    reading live batches, so the worker's index fills and is trusted, not empty for good."""
    rng = random.Random(7)
    pub = Publisher(with_replay=False)
    index = PrefixIndex()
    sub = KvEventSubscriber(index, SubscriberLimits(replay_timeout_s=0.5))
    bad_replay = "ipc:///tmp/" + "r" * 200  # longer than a unix socket path may be: ZMQ refuses it
    try:
        (target,) = sub.add_worker(WorkerEvents("w", pub.endpoint, bad_replay, model=MODEL, block_size=BS))
        await subscribed(sub, target, pub, rng)
        tokens = [rng.randrange(50) for _ in range(2 * BS)]
        keys = block_keys(tokens, BS, SEED)
        pub.publish(msgspec.msgpack.encode([1e12, [_stored(11, tokens[:BS])], 0]))
        await caught_up(sub, target, pub)
        assert index.match(keys) == {target: Overlap(1, 0)}
        assert sub.health()[target].running and sub.health()[target].replays.get("failed", 0) >= 1
    finally:
        await sub.stop()
        pub.close()


async def test_a_new_lora_name_per_event_does_not_grow_memory_for_good() -> None:
    """Distinct lora_names of BlockStored events (a new one per event) are not each cached as a
    namespace seed forever: memory stays bounded."""
    rng = random.Random(8)
    pub = Publisher()
    index = PrefixIndex()
    sub = KvEventSubscriber(index, SubscriberLimits(replay_timeout_s=5.0))
    try:
        (target,) = sub.add_worker(WorkerEvents("w", pub.endpoint, pub.replay_endpoint, model=MODEL, block_size=BS))
        await subscribed(sub, target, pub, rng)
        per_batch, batches = 200, (_MAX_SEEDS * 3 // 2) // 200 + 1
        tokens = [1] * BS
        for b in range(batches):
            evs = [_stored(b * per_batch + i, tokens, f"lora-{b}-{i}-" + "x" * 200) for i in range(per_batch)]
            pub.publish(msgspec.msgpack.encode([1e12 + b, evs, 0]))
        await caught_up(sub, target, pub)
        assert sub.health()[target].events["stored"] == batches * per_batch
        assert len(sub._seeds) <= _MAX_SEEDS
        last = f"lora-{batches - 1}-{per_batch - 1}-" + "x" * 200  # still keyed in its own namespace
        assert index.match(block_keys(tokens, BS, namespace_seed(MODEL, last))) == {target: Overlap(1, 0)}
    finally:
        await sub.stop()
        pub.close()


async def test_large_frames_give_the_loop_a_turn_between_them() -> None:
    """A slice ends after 64 frames or 256 KiB of payload, whichever comes first, so 64 large
    frames of many small events (~0.3 s each on a busy core) cannot hold the gateway's loop, and
    every request, ~20 s, as slices counted in frames alone would. Checked on a replay (its frames
    are all in hand, so the slices do not depend on network timing): another task sees the batches
    arrive one by one, and the index ends exactly as the events say."""
    pub = Publisher()
    index = PrefixIndex()
    sub = KvEventSubscriber(index, SubscriberLimits(replay_timeout_s=10.0))
    n_frames, per_frame = 6, 8000  # ~300 KiB each
    chains = []
    for f in range(n_frames):
        evs = []
        for i in range(per_frame):
            tokens = [f, i % 50, i // 50, 7][: BS] + [0] * (BS - 4)
            evs.append(_stored(f * per_frame + i, tokens))
            chains.append(tokens)
        pub.publish(msgspec.msgpack.encode([1e12 + f, evs, 0]), live=False)  # kept for replay only
    seen: set[int] = set()
    try:
        (target,) = sub.add_worker(WorkerEvents("w", pub.endpoint, pub.replay_endpoint, model=MODEL, block_size=BS))
        h = sub.health()[target]

        async def watch() -> None:
            while h.batches < n_frames:
                seen.add(h.batches)
                await asyncio.sleep(0)

        await asyncio.wait_for(watch(), 60)
        assert seen & set(range(1, n_frames)), f"the loop got no turn between large frames (saw {sorted(seen)})"
        assert h.events["stored"] == n_frames * per_frame
        assert index.keys_of(target) == {block_keys(t, BS, SEED)[0] for t in chains}
    finally:
        await sub.stop()
        pub.close()


async def test_a_restarted_publisher_that_stays_idle_is_not_trusted_with_its_old_blocks() -> None:
    """A reconnected SUB does not make the stream healthy: continuity is proven only by the next
    frame, so a worker that restarted (its cache empty) and sent nothing yet is not credited the
    blocks of its previous incarnation. It is untrusted (routing by load) until a frame arrives,
    and that frame resets and rebuilds its entries."""
    rng = random.Random(10)
    pub = Publisher()
    index = PrefixIndex()
    sub = KvEventSubscriber(index, SubscriberLimits(replay_timeout_s=5.0))
    try:
        (target,) = sub.add_worker(WorkerEvents("w", pub.endpoint, pub.replay_endpoint, model=MODEL, block_size=BS))
        await subscribed(sub, target, pub, rng)
        old = ToyEngine(rng)
        prompts = [p for c in sessions(rng, 2, 3) for p in c]
        for p in prompts:
            pub.publish(encode_events(old.serve(p), "map", "array3", "uint", rng))
        await caught_up(sub, target, pub)
        assert index.keys_of(target) == old.expected_keys() != set()
        ports = pub.pub_port, pub.replay_port
        pub.close()
        h = sub.health()[target]
        await wait_until(lambda: h.disconnects == 1)
        pub = Publisher(*ports)  # restarted: an empty cache, nothing published yet
        await wait_until(lambda: h.connected)
        assert not sub.healthy(target)  # its index entries still name the old incarnation's blocks
        new = ToyEngine(rng)
        await nudge_until(pub, lambda: sub.healthy(target), rng)
        pub.publish(encode_events(new.serve(prompts[0]), "map", "array3", "uint", rng))
        await caught_up(sub, target, pub)
        check_index(index, target, new, prompts)
    finally:
        await sub.stop()
        pub.close()


def _garbage(rng: random.Random) -> object:
    """One event a broken publisher might send amid valid ones (each must change nothing)."""
    h = rng.getrandbits(64)
    ok = {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": None, "token_ids": [1] * BS, "block_size": BS}
    return rng.choice([
        {**ok, "block_hashes": [1.5]}, {**ok, "block_hashes": [[1, 2]]}, {**ok, "token_ids": [-1] * BS},
        {**ok, "token_ids": [1.5] * BS}, {**ok, "token_ids": [2**40] * BS}, {**ok, "token_ids": [1] * (BS + 1)},
        {**ok, "token_ids": [1] * (2 * BS), "block_size": 2 * BS}, {**ok, "parent_block_hash": rng.getrandbits(64)},
        {**ok, "medium": "DISK"}, {**ok, "group_idx": 3}, {**ok, "kv_cache_spec_kind": "sliding_window"},
        {**ok, "token_ids": None},  # a tier update of a block never stored
        {"type": "BlockRemoved", "block_hashes": [rng.getrandbits(64), -5, b"\0\0\1"], "medium": "GPU"},
        {"type": "BlockRemoved", "block_hashes": [rng.getrandbits(64)], "medium": "CPU"},
        {"type": "BlockRemoved", "block_hashes": "nope"}, {"type": "Nope", "x": [1]}, ["BlockStored"], 42, {"type": 5},
    ])


async def test_garbage_events_amid_valid_ones_leave_the_index_exactly_right() -> None:
    rng = random.Random(11)
    pub = Publisher()
    index = PrefixIndex()
    sub = KvEventSubscriber(index, SubscriberLimits(replay_timeout_s=5.0))
    try:
        (target,) = sub.add_worker(WorkerEvents("w", pub.endpoint, pub.replay_endpoint, model=MODEL, block_size=BS))
        await subscribed(sub, target, pub, rng)
        engine = ToyEngine(rng)
        prompts = [p for c in sessions(rng, 4, 5) for p in c]
        for i, p in enumerate(prompts):
            body = msgspec.msgpack.decode(encode_events(engine.serve(p), "map", "array3", ["uint", "int", "bytes"][i % 3], rng))
            for _ in range(3):
                body[1].insert(rng.randrange(len(body[1]) + 1), _garbage(rng))
            pub.publish(msgspec.msgpack.encode(body))
        await caught_up(sub, target, pub)
        check_index(index, target, engine, prompts)
        events = sub.health()[target].events
        assert events.get("malformed", 0) + events.get("invalid", 0) + events.get("filtered", 0) > 0
    finally:
        await sub.stop()
        pub.close()


async def test_a_giant_replayed_frame_is_refused_by_the_socket_not_received_whole() -> None:
    """A replay socket's frame is not received whole before its size is checked (a 2 GB one would
    be): the replay socket refuses a frame over max(4 * max_frame_bytes, 64 MiB): that replay
    fails (and the stream resets on the next gap, as an oversized batch would); live batches go on."""
    rng = random.Random(12)
    pub = Publisher()
    pub.publish(b"\x90" * (65 << 20), live=False)  # allocated before tracing starts
    index = PrefixIndex()
    sub = KvEventSubscriber(index, SubscriberLimits(max_frame_bytes=4096, replay_timeout_s=1.0))
    tracemalloc.start()
    try:
        (target,) = sub.add_worker(WorkerEvents("w", pub.endpoint, pub.replay_endpoint, model=MODEL, block_size=BS))
        h = sub.health()[target]
        await wait_until(lambda: h.replays.get("failed", 0) >= 1 or h.replays.get("ok", 0) >= 1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    try:
        assert peak < 32 << 20, f"the giant replayed frame was received ({peak >> 20} MiB traced)"
        assert h.replays == {"failed": 1} and h.running
        engine = ToyEngine(rng)
        prompt = sessions(rng, 1, 1)[0][0]
        pub.publish(encode_events(engine.serve(prompt), "map", "array3", "uint", rng))
        await nudge_until(pub, lambda: index.keys_of(target) == engine.expected_keys() and sub.healthy(target), rng)
        check_index(index, target, engine, [prompt])
    finally:
        await sub.stop()
        pub.close()


async def test_a_replay_over_its_byte_budget_fails_instead_of_growing() -> None:
    """A replay is bounded in bytes, not only in batches (200,000, of any size): one over its byte
    budget fails."""
    rng = random.Random(13)
    pub = Publisher()
    for i in range(40):  # 40 batches of ~100 KiB, kept for replay only
        evs = [_stored(i * 1000 + j, [1] * BS) for j in range(1500)]
        pub.publish(msgspec.msgpack.encode([1e12 + i, evs, 0]), live=False)
    index = PrefixIndex()
    sub = KvEventSubscriber(index, SubscriberLimits(max_replay_bytes=1 << 20, replay_timeout_s=5.0))
    try:
        (target,) = sub.add_worker(WorkerEvents("w", pub.endpoint, pub.replay_endpoint, model=MODEL, block_size=BS))
        h = sub.health()[target]
        await wait_until(lambda: h.replays.get("failed", 0) >= 1)
        assert h.batches == 0 and index.keys_of(target) == set()
        await subscribed(sub, target, pub, rng)  # live batches still flow
    finally:
        await sub.stop()
        pub.close()


class _ScriptedReplay:
    """A replay ROUTER that answers its first requests from a script, then with every frame of
    ``frames`` from the asked start (the live publisher's own buffer)."""

    def __init__(self, port: int, script: list[list[tuple[int, bytes]]], frames: list[tuple[int, bytes]]) -> None:
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(f"tcp://127.0.0.1:{port}")
        self.script, self.frames, self.stop_flag = list(script), frames, threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop_flag.is_set():
            if not self.router.poll(20):
                continue
            ident, _, start = self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            answer = self.script.pop(0) if self.script else [f for f in list(self.frames) if f[0] >= first]
            for seq, payload in answer:
                self.router.send_multipart([ident, b"", b"kv", seq.to_bytes(8, "big"), payload])
            self.router.send_multipart([ident, b"", b"kv", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self.stop_flag.set()
        self.thread.join(2)
        self.router.close(linger=0)
        self.ctx.term()


async def test_a_restart_that_overtakes_the_old_seq_between_two_replays_is_called_a_restart() -> None:
    """After a reconnect the stream asks the replay for ``last`` on; a new incarnation still short of
    ``last`` answers nothing, then, asked for everything, may have passed ``last`` meanwhile: the
    reset is labelled ``restart`` (mesh_kv_events_resets), not ``gap_lost`` (a race that
    test_subscriber's restart test meets under load)."""
    rng = random.Random(14)
    pub = Publisher()
    index = PrefixIndex()
    sub = KvEventSubscriber(index, SubscriberLimits(replay_timeout_s=5.0))
    replay: _ScriptedReplay | None = None
    try:
        (target,) = sub.add_worker(WorkerEvents("w", pub.endpoint, pub.replay_endpoint, model=MODEL, block_size=BS))
        await subscribed(sub, target, pub, rng)
        old = ToyEngine(rng)
        prompts = [p for c in sessions(rng, 2, 3) for p in c]
        for p in prompts:
            pub.publish(encode_events(old.serve(p), "map", "array3", "uint", rng))
        await caught_up(sub, target, pub)
        h = sub.health()[target]
        last = h.last_seq
        ports = pub.pub_port, pub.replay_port
        pub.close()
        await wait_until(lambda: h.disconnects == 1)
        pub = Publisher(ports[0], with_replay=False)  # the new incarnation: seq from 0
        new = ToyEngine(rng)
        for p in prompts[:2]:
            pub.publish(encode_events(new.serve(p), "map", "array3", "uint", rng), live=False)
        while pub.seq <= last + 1:  # it passes the old last seq...
            pub.publish(encode_events([], "map", "array3", "uint", rng), live=False)
        kept = list(pub.kept)
        # ...between the stream's two replay requests: nothing from `last` on, then everything
        replay = _ScriptedReplay(ports[1], [[], kept], pub.kept)  # type: ignore[arg-type]
        await nudge_until(pub, lambda: bool(h.resets), rng)
        assert h.resets == {"restart": 1}
        await caught_up(sub, target, pub)
        check_index(index, target, new, prompts)
    finally:
        await sub.stop()
        pub.close()
        if replay is not None:
            replay.close()
