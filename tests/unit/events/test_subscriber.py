"""The KV event subscriber over real ZMQ sockets, fed by a vLLM-format publisher written from
REFERENCE.md section 2 alone (``tests/fakes/kv_publisher.py``: PUB frames ``[topic, seq, payload]``,
a ROUTER replay socket answering ``[b"", start]`` in either reply layout, every payload layout),
checked against a toy engine cache (``tests/support/kv_events.py``).
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

import msgspec
import pytest
import zmq
from prometheus_client import CollectorRegistry, generate_latest

from mesh.core.index import PrefixIndex
from mesh.events.inbox import DISCONNECTED
from mesh.events.limits import SubscriberLimits
from mesh.events.process import unpack
from mesh.events.stream import split_frame
from mesh.events.subscriber import KvEventSubscriber, WorkerEvents, offset_endpoint
from tests.fakes.kv_publisher import BATCH_LAYOUTS, BS, EVENT_LAYOUTS, HASH_MODES, MODEL, Publisher, encode_events
from tests.support.kv_events import ToyEngine, caught_up, check_index, nudge_until, sessions, subscribed, wait_until


def make_sub(index: PrefixIndex, limits: SubscriberLimits | None = None, **wiring: Any) -> KvEventSubscriber:
    # a generous replay timeout by default: the test box is shared
    return KvEventSubscriber(index, limits or SubscriberLimits(replay_timeout_s=5.0), **wiring)


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


@pytest.mark.parametrize("process", [False, True])
async def test_frames_received_before_a_disconnect_are_applied_before_the_stream_is_lost(process: bool) -> None:
    """The publisher sends frames and goes away while the stream task is held back with them
    queued in the inbox: each is applied as the continuation it is, and only then is the stream
    lost (untrusted, its next frame to prove continuity). A disconnect that overtook them reset
    the stream (``stream_lost``, no replay socket) and dropped the blocks applied before."""
    rng = random.Random(12)
    pub = Publisher(with_replay=False)
    index = PrefixIndex()
    sub = make_sub(index, process=process)
    gate, held = asyncio.Event(), asyncio.Event()
    seen: list[int | str] = []
    on_live = sub._on_live

    armed = False

    async def gated(stream: Any, item: Any) -> None:  # once armed, the stream task waits at its next frame
        if armed and not held.is_set():
            held.set()
            await gate.wait()
        seen.append(_seq_of(item, process))
        await on_live(stream, item)

    sub._on_live = gated  # type: ignore[method-assign]
    try:
        await sub.start()
        (target,) = sub.add_worker(WorkerEvents("w", pub.endpoint, None, model=MODEL, block_size=BS))
        await subscribed(sub, target, pub, rng)
        engine = ToyEngine(rng)
        prompts = [p for c in sessions(rng, 2, 4) for p in c]
        for p in prompts[:3]:
            pub.publish(encode_events(engine.serve(p), "map", "array3", "uint", rng))
        await caught_up(sub, target, pub)
        armed, seen[:] = True, []
        first = pub.seq
        for p in prompts[3:]:
            pub.publish(encode_events(engine.serve(p), "map", "array3", "uint", rng))
        inbox = sub._streams[target].inbox
        assert inbox is not None
        await wait_until(lambda: held.is_set() and inbox.backlog == pub.seq - first - 1)  # all received
        pub.close()
        h = sub.health()[target]
        await wait_until(lambda: h.disconnects == 1)
        assert not sub.healthy(target)  # unhealthy at once
        gate.set()
        await wait_until(lambda: sub.settled(target))  # (the marker was put before ``disconnects`` moved)
        assert h.resets == {} and h.last_seq == pub.seq - 1  # no spurious reset (``stream_lost``)
        assert seen == [*range(first, pub.seq), "lost"]  # every frame, then the lost connection
        check_index(index, target, engine, prompts)
        assert sub._streams[target].lost and not sub.healthy(target)
    finally:
        await sub.stop()
        pub.close()


def _seq_of(item: Any, process: bool) -> int | str:
    """A frame's seq as the stream task meets it, or ``"lost"`` for the lost connection's marker."""
    if process:
        seq = unpack(item).seq
        return "lost" if seq < -1 else seq
    if item is DISCONNECTED:
        return "lost"
    parsed = split_frame(item)
    assert parsed is not None
    return parsed[0]


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
    sub = make_sub(index, SubscriberLimits(replay_timeout_s=5.0, max_frame_bytes=4096, unhealthy_after_bad_frames=3),
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
    sub = make_sub(index, SubscriberLimits(replay_timeout_s=5.0, rcvhwm=100, yield_every=16, max_backlog_frames=100))
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
    sub = make_sub(PrefixIndex(), SubscriberLimits(replay_timeout_s=5.0, stale_after_s=5.0), clock=lambda: now[0])
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
