"""Replay timing over real ZMQ sockets: a replay waits while batches keep coming (each wait bounded
by ``replay_timeout_s``, the whole by ``max_replay_s``), and a stream is trusted only once its
replay completed: a failed one leaves it untrusted until a retry from the whole buffer completes.
The publisher's replay socket answers slowly (``tests/fakes/kv_publisher.py``, ``replay_delay_s``).
"""

from __future__ import annotations

import random

from mesh.core.index import PrefixIndex
from mesh.events.limits import SubscriberLimits
from mesh.events.subscriber import KvEventSubscriber, WorkerEvents
from tests.fakes.kv_publisher import BS, MODEL, Publisher, encode_events
from tests.support.kv_events import ToyEngine, caught_up, check_index, sessions, wait_until

BATCHES = 40
DELAY_S = 0.05  # per replayed batch: the whole buffer takes 2 s, four times the idle timeout below


def fill(pub: Publisher, rng: random.Random) -> tuple[ToyEngine, list[list[int]]]:
    """BATCHES batches kept by the publisher's replay buffer only (sent before anyone listened)."""
    engine = ToyEngine(rng)
    prompts = [p for c in sessions(rng, 4, 5) for p in c]
    for i in range(BATCHES):
        events = engine.serve(prompts[i]) if i < len(prompts) else []
        pub.publish(encode_events(events, "map", "array3", "uint", rng), live=False)
    return engine, prompts[:BATCHES]


def last_seq(sub: KvEventSubscriber, target: str) -> int | None:
    h = sub.health().get(target)  # (gone while the subscriber stops)
    return None if h is None else h.last_seq


async def test_a_replay_longer_than_the_idle_timeout_completes_and_only_then_is_trusted() -> None:
    rng = random.Random(21)
    pub = Publisher(replay_delay_s=DELAY_S)
    engine, prompts = fill(pub, rng)
    flips: list[tuple[bool, int | None]] = []  # each health report, with the last seq applied then
    index = PrefixIndex()
    sub = KvEventSubscriber(index, SubscriberLimits(replay_timeout_s=0.5, replay_total_s=30.0), on_health=lambda t, ok: flips.append((ok, last_seq(sub, t))))
    try:
        (target,) = sub.add_worker(WorkerEvents("w", pub.endpoint, pub.replay_endpoint, model=MODEL, block_size=BS))
        await caught_up(sub, target, pub)
        h = sub.health()[target]
        assert h.replays == {"ok": 1} and not h.resets
        assert [seq for ok, seq in flips if ok] == [BATCHES - 1]  # trusted once, with the whole buffer applied
        check_index(index, target, engine, prompts)
    finally:
        await sub.stop()
        pub.close()


async def test_a_replay_past_max_replay_s_leaves_the_stream_untrusted_until_a_retry_completes() -> None:
    rng = random.Random(22)
    pub = Publisher(replay_delay_s=DELAY_S)
    engine, prompts = fill(pub, rng)
    flips: list[tuple[bool, int | None]] = []
    index = PrefixIndex()
    sub = KvEventSubscriber(index, SubscriberLimits(replay_timeout_s=0.5, replay_total_s=0.8, replay_retry_s=0.3), on_health=lambda t, ok: flips.append((ok, last_seq(sub, t))))
    try:
        (target,) = sub.add_worker(WorkerEvents("w", pub.endpoint, pub.replay_endpoint, model=MODEL, block_size=BS))
        await wait_until(lambda: sub.health()[target].replays.get("failed", 0) >= 1)
        assert not sub.healthy(target)  # the replay failed: nothing to trust yet
        assert not any(ok for ok, _ in flips)
        pub.replay_delay_s = 0.0  # the publisher answers promptly again: the retry completes
        await caught_up(sub, target, pub)
        h = sub.health()[target]
        assert h.replays["ok"] == 1 and h.resets.get("replay_retry") == 1
        assert [seq for ok, seq in flips if ok] == [BATCHES - 1]
        check_index(index, target, engine, prompts)
    finally:
        await sub.stop()
        pub.close()
