"""Workers whose publishers connect to the gateway (llm-d's layout): one bound SUB socket, frames
told apart by topic, each topic a stream of its own. Real ZMQ sockets: vLLM-style publishers
(``tests/fakes/kv_publisher.py`` with ``connect``: a PUB that connects, a ROUTER replay socket)
against the subscriber on a real loop, and the gateway's real lifespan (``mesh.events.ingest``),
checked against toy engine caches (``tests/support/kv_events.py``).
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from mesh.cluster.registry import RegistryError, WorkerRegistry
from mesh.config import ConfigError, MeshConfig, WorkerConfig, parse_config
from mesh.core.index import PrefixIndex
from mesh.events.limits import SubscriberLimits
from mesh.events.subscriber import KvEventSubscriber, WorkerEvents
from mesh.gateway.app import Gateway, create_app
from tests.fakes.kv_publisher import BS, MODEL, Publisher, encode_events
from tests.procs import free_port
from tests.support.kv_events import ToyEngine, caught_up, check_index, sessions, wait_until


def prompts_of(rng: random.Random) -> list[list[int]]:
    return [p for c in sessions(rng, 2, 4) for p in c]


def serve_all(pub: Publisher, engine: ToyEngine, prompts: list[list[int]], rng: random.Random,
              *, live: Any = lambda i: True) -> None:
    for i, p in enumerate(prompts):
        pub.publish(encode_events(engine.serve(p), "map", "array3", "uint", rng), live=live(i))


async def bound_sub(**kw: Any) -> KvEventSubscriber:
    sub = KvEventSubscriber(PrefixIndex(), SubscriberLimits(replay_timeout_s=5.0), bind="tcp://127.0.0.1:*", **kw)
    await sub.start()
    assert sub.bound_address is not None and sub.bound_address.startswith("tcp://127.0.0.1:")
    return sub


async def test_two_connecting_publishers_fill_the_index_exactly() -> None:
    """Worker a is named by llm-d's topic kv@a@MODEL, worker b by its configured topic; both
    publishers count seqs from 0 and published before the gateway subscribed (the replay has it)."""
    rng = random.Random(11)
    sub = await bound_sub()
    assert sub.bound_address is not None
    pubs = {"a": Publisher(connect=sub.bound_address, topic=f"kv@a@{MODEL}".encode()),
            "b": Publisher(connect=sub.bound_address, topic=b"pod-b")}
    engines = {w: ToyEngine(random.Random(w)) for w in pubs}
    prompts = {w: prompts_of(rng) for w in pubs}
    try:
        for w, pub in pubs.items():
            serve_all(pub, engines[w], prompts[w][:3], rng, live=lambda i: False)  # before the gateway listens
        (ta,) = sub.add_worker(WorkerEvents("a", None, pubs["a"].replay_endpoint, model=MODEL, block_size=BS))
        (tb,) = sub.add_worker(WorkerEvents("b", None, pubs["b"].replay_endpoint, model=MODEL, block_size=BS,
                                            topic="pod-b"))
        for w, pub in pubs.items():
            serve_all(pub, engines[w], prompts[w][3:], rng)
        for w, target in (("a", ta), ("b", tb)):
            await caught_up(sub, target, pubs[w])
        for w, target in (("a", ta), ("b", tb)):
            check_index(sub.index, target, engines[w], prompts[w])
            h = sub.health()[target]
            assert h.bound and h.connected and not h.resets and h.endpoint == sub.bound_address
        assert sub.unknown_topics() == {}
    finally:
        await sub.stop()
        for pub in pubs.values():
            pub.close()


async def test_a_topic_naming_no_worker_is_counted_warned_and_not_applied(caplog: pytest.LogCaptureFixture) -> None:
    """Frames of topics close to a worker's (kv@ab@..., a2) reach no worker: the index holds
    exactly worker a's blocks, the topics are counted by name and warned about."""
    rng = random.Random(12)
    registry = CollectorRegistry()
    sub = await bound_sub(registry=registry)
    assert sub.bound_address is not None
    known = Publisher(connect=sub.bound_address, topic=b"kv@a@toy")
    ghosts = [Publisher(connect=sub.bound_address, topic=t, with_replay=False) for t in (b"kv@ab@toy", b"a2")]
    engine, prompts = ToyEngine(rng), prompts_of(rng)
    try:
        (ta,) = sub.add_worker(WorkerEvents("a", None, known.replay_endpoint, model=MODEL, block_size=BS))
        await wait_until(lambda: sub.healthy(ta))  # its replay answered
        with caplog.at_level(logging.WARNING, logger="mesh.events.subscriber"):
            for _ in range(100):  # the connecting PUBs join after a while: publish until both got through
                for g in ghosts:
                    g.publish(encode_events(ToyEngine(rng).serve(prompts[0]), "map", "array3", "uint", rng))
                await asyncio.sleep(0.02)
                if set(sub.unknown_topics()) == {"kv@ab@toy", "a2"}:
                    break
            serve_all(known, engine, prompts, rng)
            await caught_up(sub, ta, known)
        assert set(sub.unknown_topics()) == {"kv@ab@toy", "a2"}
        check_index(sub.index, ta, engine, prompts)  # nothing of the ghosts credited to a
        assert set(sub.index.targets()) <= {ta}
        warned = [r.getMessage() for r in caplog.records if "names no worker" in r.getMessage()]
        assert any("'kv@ab@toy'" in m for m in warned) and any("'a2'" in m for m in warned)
        assert len(warned) <= 2 * 5  # rate-limited: a few lines per topic, the rest counted
        text = generate_latest(registry).decode()
        assert 'mesh_kv_events_unknown_topic_frames_total{topic="kv@ab@toy"}' in text
    finally:
        await sub.stop()
        for pub in [known, *ghosts]:
            pub.close()


async def test_a_gap_on_one_topic_is_repaired_by_that_workers_replay_only() -> None:
    rng = random.Random(13)
    sub = await bound_sub()
    assert sub.bound_address is not None
    pubs = {w: Publisher(connect=sub.bound_address, topic=f"kv@{w}@toy".encode()) for w in ("a", "b")}
    engines = {w: ToyEngine(random.Random(w)) for w in pubs}
    prompts = {w: prompts_of(rng) for w in pubs}
    try:
        targets = {w: sub.add_worker(WorkerEvents(w, None, pub.replay_endpoint, model=MODEL, block_size=BS))[0]
                   for w, pub in pubs.items()}
        for w, pub in pubs.items():  # the first live batch of each, once it gets through
            await _joined(sub, targets[w], pub, rng)
        serve_all(pubs["a"], engines["a"], prompts["a"], rng, live=lambda i: i % 3 != 1)  # a loses every third
        serve_all(pubs["b"], engines["b"], prompts["b"], rng)
        for w, pub in pubs.items():
            await caught_up(sub, targets[w], pub)
        ha, hb = sub.health()[targets["a"]], sub.health()[targets["b"]]
        assert ha.gaps >= 1 and ha.replays["ok"] >= 1 + ha.gaps  # the first replay, then one per gap
        assert hb.gaps == 0 and hb.replays == {"ok": 1}  # b's own first replay only
        assert not ha.resets and not hb.resets
        for w in pubs:
            check_index(sub.index, targets[w], engines[w], prompts[w])
    finally:
        await sub.stop()
        for pub in pubs.values():
            pub.close()


async def test_a_gap_without_a_replay_endpoint_resets_that_worker_only() -> None:
    rng = random.Random(14)
    sub = await bound_sub()
    assert sub.bound_address is not None
    pubs = {w: Publisher(connect=sub.bound_address, topic=w.encode(), with_replay=False) for w in ("a", "b")}
    engines = {w: ToyEngine(random.Random(w)) for w in pubs}
    try:
        targets = {w: sub.add_worker(WorkerEvents(w, None, None, model=MODEL, block_size=BS))[0] for w in pubs}
        for w, pub in pubs.items():
            await _joined(sub, targets[w], pub, rng)
        serve_all(pubs["a"], engines["a"], prompts_of(rng), rng, live=lambda i: i != 2)
        serve_all(pubs["b"], engines["b"], prompts_of(rng), rng)
        for w, pub in pubs.items():
            await caught_up(sub, targets[w], pub)
        assert sub.health()[targets["a"]].resets == {"gap_no_replay": 1}
        assert not sub.health()[targets["b"]].resets
        assert sub.index.keys_of(targets["a"]) <= engines["a"].expected_keys()  # may miss, never claims
        assert sub.index.keys_of(targets["b"]) == engines["b"].expected_keys()
    finally:
        await sub.stop()
        for pub in pubs.values():
            pub.close()


async def _joined(sub: KvEventSubscriber, target: str, pub: Publisher, rng: random.Random) -> None:
    """Publish empty batches until one arrives (the connecting PUB has joined)."""
    for _ in range(300):
        pub.publish(encode_events([], "map", "array3", "uint", rng))
        await asyncio.sleep(0.02)
        if sub.health()[target].last_seq is not None:
            await caught_up(sub, target, pub)
            return
    raise AssertionError("publisher never joined")


async def test_the_gateway_binds_kv_events_bind_and_feeds_two_connecting_workers() -> None:
    """The config's kv_events.bind and workers without an endpoint, through the gateway's real
    lifespan: both targets' indexes fill exactly and are trusted."""
    rng = random.Random(15)
    port = free_port()
    pubs = {w: Publisher(connect=f"tcp://127.0.0.1:{port}", topic=f"kv@{w}@{MODEL}".encode()) for w in ("a", "b")}
    engines = {w: ToyEngine(random.Random(w)) for w in pubs}
    prompts = {w: prompts_of(rng) for w in pubs}
    config = parse_config({
        "kv_events": {"bind": f"tcp://*:{port}", "replay_idle_timeout_s": 5.0},
        "workers": [{"name": w, "url": "http://127.0.0.1:9", "models": [MODEL], "block_size": BS,
                     "kv_events": {"replay_endpoint": pub.replay_endpoint}} for w, pub in pubs.items()],
    })
    app = create_app(config)
    gateway: Gateway = app.state.gateway
    try:
        async with app.router.lifespan_context(app):
            sub = gateway.ingest.subscriber
            assert sub is not None
            for w, pub in pubs.items():
                serve_all(pub, engines[w], prompts[w], rng)
            for w, pub in pubs.items():
                await caught_up(sub, w, pub)
                check_index(gateway.index, w, engines[w], prompts[w])
            assert all(gateway.registry.targets[w].index_healthy for w in pubs)
            assert gateway.registry.workers["a"].events_state() == "live"
    finally:
        for pub in pubs.values():
            pub.close()


@pytest.mark.parametrize(("doc", "wanted"), [
    ({"workers": [{"name": "a", "url": "http://10.0.0.5:8000", "kv_events": {}}]}, "kv_events.bind is not set"),
    ({"kv_events": {"bind": "tcp://*:5557"},
      "workers": [{"name": "a", "url": "http://10.0.0.5:8000", "dp_size": 2, "kv_events": {}}]}, "needs dp_size 1"),
    ({"kv_events": {"bind": "tcp://*:5557"},
      "workers": [{"name": "a", "url": "http://10.0.0.5:8000", "kv_events": {"topic": "t"}},
                  {"name": "b", "url": "http://10.0.0.5:8001", "kv_events": {"topic": "t"}}]}, "both named by topic"),
    ({"kv_events": {"bind": "tcp://gateway"}}, "kv_events.bind"),
])
def test_a_bound_endpoint_config_that_cannot_work_is_refused(doc: dict[str, Any], wanted: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(doc)
    assert any(wanted in e for e in info.value.errors), info.value.errors


def test_a_worker_added_for_a_bound_endpoint_the_gateway_lacks_is_a_400() -> None:
    registry = WorkerRegistry(MeshConfig())
    with pytest.raises(RegistryError) as info:
        registry.add(WorkerConfig(name="a", url="http://10.0.0.5:8000", kv_events={}))  # type: ignore[arg-type]
    assert info.value.status == 400 and "kv_events.bind is not set" in str(info.value)
    assert "a" not in registry.workers
