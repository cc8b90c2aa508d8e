"""The KV event receiver process (``mesh.events.child``, ``mesh.events.process``): what it hands
the loop applies exactly what in-process ingestion applies, and its lifecycle (a killed child is
restarted loudly and its streams reset and rebuilt; the child ends with the gateway)."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mesh.core.index import PrefixIndex
from mesh.core.keys import block_keys
from mesh.events.apply import Seeds, apply_batch, apply_ops
from mesh.events.health import LogLimiter, StreamHealth
from mesh.events.limits import SubscriberLimits
from mesh.events.prepare import Preparer
from mesh.events.stream import Stream, digest
from mesh.events.subscriber import KvEventSubscriber, WorkerEvents
from mesh.events.wire import decode_lazy
from tests.fakes.kv_publisher import BS, EVENT_LAYOUTS, HASH_MODES, MODEL, SEED, Publisher, encode_events
from tests.support.kv_events import ToyEngine, caught_up, check_index, nudge_until, sessions, subscribed, wait_until

ROOT = Path(__file__).resolve().parents[3]


def _payloads(rng: random.Random, n_sessions: int = 3, turns: int = 5) -> tuple[ToyEngine, list[list[int]], list[bytes]]:
    """A random event stream, one frame a prompt: sessions through a toy engine (stores with
    parents, evictions, offloads as tier updates), every event layout and hash encoding."""
    engine = ToyEngine(rng, gpu_blocks=14, cpu_blocks=6)
    prompts = [p for c in sessions(rng, n_sessions, turns) for p in c]
    out = [encode_events(engine.serve(p), rng.choice(EVENT_LAYOUTS), "array3", HASH_MODES[i % 3], rng)
           for i, p in enumerate(prompts)]
    return engine, prompts, out


def _stream() -> Stream:
    return Stream(WorkerEvents("w", "tcp://127.0.0.1:1", model=MODEL, block_size=BS),
                  StreamHealth("w", "w", 0, "tcp://127.0.0.1:1", None))


def _state(index: PrefixIndex, keys: list[int]) -> tuple[object, ...]:
    return (sorted(index.keys_of("w")), [index.holds("w", k) for k in keys], index.match(keys))


@pytest.mark.parametrize("poisoned", [False, True])
async def test_prepared_frames_apply_exactly_what_in_process_ingestion_applies(poisoned: bool) -> None:
    """Per frame, the loop's two paths (decode and key here; prepared there) leave equal indexes
    and equal counters. Poisoned: the preparer's hints hold a wrong key for every engine hash (a
    stale hint), which the index must notice (``keyed_from``) and key the store itself."""
    rng = random.Random(21 + poisoned)
    engine, prompts, payloads = _payloads(rng)
    here, there = PrefixIndex(), PrefixIndex()
    s_here, s_there = _stream(), _stream()
    seeds, logs = Seeds(), LogLimiter()
    preparer = Preparer(MODEL, BS, 16 << 20)
    for seq, payload in enumerate(payloads):
        batch = decode_lazy(payload)
        assert not isinstance(batch, Exception)
        await apply_batch(here, s_here, batch, seeds, logs)  # type: ignore[arg-type]
        prepared = preparer.prepare([b"", seq.to_bytes(8, "big"), payload])
        assert prepared.error is None and prepared.seq == seq and prepared.digest == digest(payload)
        if poisoned:
            preparer.hints = {h: k ^ 1 for h, k in preparer.hints.items()}
        await apply_ops(there, s_there, prepared.ops, Seeds(), logs)
        keys = block_keys(prompts[seq], BS, SEED)
        assert _state(here, keys) == _state(there, keys), f"frame {seq}"
    assert s_here.health.events == s_there.health.events and s_here.health.blocks == s_there.health.blocks
    check_index(there, "w", engine, prompts)
    assert s_there.health.events.get("stored", 0) > len(prompts)  # a stream of substance


async def test_a_killed_receiver_process_is_restarted_loudly_and_its_streams_rebuilt(
        caplog: pytest.LogCaptureFixture) -> None:
    rng = random.Random(22)
    pub = Publisher()
    sub = KvEventSubscriber(PrefixIndex(), SubscriberLimits(replay_timeout_s=5.0), process=True)
    engine = ToyEngine(rng)
    prompts = [p for c in sessions(rng, 2, 4) for p in c]
    try:
        await sub.start()
        (target,) = sub.add_worker(WorkerEvents("w", pub.endpoint, pub.replay_endpoint, model=MODEL, block_size=BS))
        await subscribed(sub, target, pub, rng)
        for p in prompts[:4]:
            pub.publish(encode_events(engine.serve(p), "map", "array3", "uint", rng))
        await caught_up(sub, target, pub)
        first = sub.receiver_pid
        assert first is not None
        with caplog.at_level(logging.ERROR, logger="mesh.events.subscriber"):
            os.kill(first, signal.SIGKILL)
            await wait_until(lambda: sub.health()[target].resets.get("receiver_lost", 0) == 1)
            await wait_until(lambda: sub.receiver_pid not in (None, first))
        assert any("receiver process" in r.getMessage() and "exited" in r.getMessage() for r in caplog.records)
        second = sub.receiver_pid
        await wait_until(lambda: sub.health()[target].replays.get("ok", 0) >= 2 and not sub.health()[target].recovering)
        await _live(sub, target, pub, rng)  # the new child's SUB socket joined
        for p in prompts[4:]:
            pub.publish(encode_events(engine.serve(p), "map", "array3", "uint", rng))
        await caught_up(sub, target, pub)
        check_index(sub.index, target, engine, prompts)  # rebuilt: the replay had it all
        assert sub.healthy(target)
    finally:
        await sub.stop()
        pub.close()
    assert sub.receiver_pid is None and second is not None and not _alive(second)  # a clean stop ends the child


async def test_a_restarted_receiver_process_binds_the_gateways_endpoint_again() -> None:
    """The bound socket (its port left to ZMQ) is bound again, at the same port, by the new child:
    a connecting publisher is heard from again, its stream rebuilt from replay."""
    rng = random.Random(24)
    sub = KvEventSubscriber(PrefixIndex(), SubscriberLimits(replay_timeout_s=5.0), bind="tcp://127.0.0.1:*", process=True)
    await sub.start()
    assert sub.bound_address is not None
    pub = Publisher(connect=sub.bound_address, topic=b"kv@a@toy")
    engine = ToyEngine(rng)
    prompts = [p for c in sessions(rng, 2, 3) for p in c]
    try:
        (target,) = sub.add_worker(WorkerEvents("a", None, pub.replay_endpoint, model=MODEL, block_size=BS))
        await nudge_until(pub, lambda: sub.health()[target].last_seq == pub.seq - 1 and sub.healthy(target), rng)
        first = sub.receiver_pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        await wait_until(lambda: sub.health()[target].resets.get("receiver_lost", 0) == 1)
        await wait_until(lambda: sub.receiver_pid not in (None, first) and sub.health()[target].replays.get("ok", 0) >= 2
                         and not sub.health()[target].recovering)
        await _live(sub, target, pub, rng)
        for p in prompts:
            pub.publish(encode_events(engine.serve(p), "map", "array3", "uint", rng))
        await caught_up(sub, target, pub)
        check_index(sub.index, target, engine, prompts)
    finally:
        await sub.stop()
        pub.close()


async def _live(sub: KvEventSubscriber, target: str, pub: Publisher, rng: random.Random) -> None:
    """Publish empty batches until one is applied after it was published (a live one: the replay
    after the loss is over, so a batch that arrives joins live, or by the gap it shows)."""
    for _ in range(300):
        pub.publish(encode_events([], "map", "array3", "uint", rng))
        await asyncio.sleep(0.02)
        if sub.health()[target].last_seq == pub.seq - 1 and sub.healthy(target):
            return
    raise AssertionError("the new receiver process never received a live batch")


_GATEWAY = textwrap.dedent("""
    import asyncio, sys
    from mesh.core.index import PrefixIndex
    from mesh.events.subscriber import KvEventSubscriber, WorkerEvents

    async def main():
        sub = KvEventSubscriber(PrefixIndex(), process=True)
        await sub.start()
        sub.add_worker(WorkerEvents("w", "tcp://127.0.0.1:9", model="m"))
        print(sub.receiver_pid, flush=True)
        await asyncio.sleep(60)

    asyncio.run(main())
""")


def test_the_receiver_process_exits_with_the_gateway() -> None:
    """A gateway killed outright (no shutdown ran) leaves no receiver process behind."""
    gateway = subprocess.Popen([sys.executable, "-c", _GATEWAY], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                               env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        assert gateway.stdout is not None
        child = int(gateway.stdout.readline())
        assert _alive(child)
        gateway.kill()
        gateway.wait(10)
        deadline = time.monotonic() + 5.0
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child)
    finally:
        gateway.kill()


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not reaped by its reparented parent yet, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_stores_are_keyed_in_the_child_when_their_parent_is_known_there() -> None:
    """The split does its job: a chain's stores arrive keyed (the loop hashes none of them)."""
    rng = random.Random(23)
    _, _, payloads = _payloads(rng, 1, 4)
    preparer = Preparer(MODEL, BS, 16 << 20)
    stores = [op for seq, p in enumerate(payloads)
              for op in preparer.prepare([b"", seq.to_bytes(8, "big"), p]).ops if op[0] == 0 and op[1][2]]
    assert stores and all(op[3] is not None for op in stores)
