"""mesh.events.ingest in-process: the gateway's subscriber follows the registry (real ZMQ sockets).

The vLLM-format publisher is the independent one of ``tests/fakes/kv_publisher.py``. Workers have no
HTTP server here (ingestion does not depend on health); the gateway runs its real lifespan.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Any

from mesh.config import WorkerConfig, parse_config
from mesh.core.keys import block_keys, namespace_seed
from mesh.gateway.app import Gateway, create_app
from tests.fakes.kv_publisher import BS, MODEL, Publisher, encode_events

RNG = random.Random(3)


def stored(tokens: list[int], model: str = MODEL) -> tuple[bytes, list[int]]:
    """A BlockStored payload for ``tokens`` whose engine hashes are the router keys; and the keys."""
    keys = block_keys(tokens, BS, namespace_seed(model))
    return encode_events([("stored", keys, None, tokens, "GPU")], "map", "array3", "uint", RNG), keys


def worker(name: str, pub: Publisher | None, models: list[str] | None = None) -> dict[str, Any]:
    cfg: dict[str, Any] = {"name": name, "url": "http://127.0.0.1:9", "block_size": BS}
    if models is not None:
        cfg["models"] = models
    if pub is not None:
        cfg["kv_events"] = {"endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint, "topic": "kv"}
    return cfg


async def until(cond: Callable[[], Any], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.02)


def depth(gateway: Gateway, keys: list[int], target: str) -> int:
    ov = gateway.index.match(keys).get(target)
    return ov.blocks if ov else 0


def streams(gateway: Gateway) -> str:
    return "\n".join(line for line in gateway.metrics.render().decode().splitlines()
                     if line.startswith("mesh_kv_events_healthy{"))


async def test_workers_are_subscribed_at_start_and_at_runtime_and_removal_drops_them() -> None:
    pubs = [Publisher(), Publisher()]
    try:
        payload_a, keys_a = stored(list(range(1, 13)))
        pubs[0].publish(payload_a, live=False)  # before the gateway starts: only the replay has it
        app = create_app(parse_config({"workers": [worker("a", pubs[0], [MODEL]), worker("b", None, [MODEL])]}))
        gateway: Gateway = app.state.gateway
        async with app.router.lifespan_context(app):
            await until(lambda: depth(gateway, keys_a, "a") == 3)
            targets = gateway.registry.targets
            await until(lambda: targets["a"].index_healthy)
            assert targets["b"].index_healthy  # no events configured: nothing to distrust
            assert 'target="a"' in streams(gateway) and 'target="b"' not in streams(gateway)

            gateway.registry.add(WorkerConfig.model_validate(worker("c", pubs[1], [MODEL])), "admin")
            await until(lambda: 'target="c"' in streams(gateway))
            payload_c, keys_c = stored(list(range(50, 58)))
            await until(lambda: (pubs[1].publish(payload_c), depth(gateway, keys_c, "c") == 2)[1])

            gateway.registry.remove("a")
            assert depth(gateway, keys_a, "a") == 0  # at once, before the stream has stopped
            await until(lambda: 'target="a"' not in streams(gateway))
            assert depth(gateway, keys_c, "c") == 2
        assert gateway.ingest.subscriber is None and "mesh_kv_events" not in gateway.metrics.render().decode()
    finally:
        for p in pubs:
            p.close()


async def test_a_worker_is_subscribed_once_its_model_is_discovered_and_keyed_by_it() -> None:
    pub = Publisher()
    try:
        payload, keys = stored(list(range(100, 108)), model="served-name")
        pub.publish(payload, live=False)
        app = create_app(parse_config({"workers": [worker("w", pub)]}))  # models: discovered
        gateway: Gateway = app.state.gateway
        async with app.router.lifespan_context(app):
            w = gateway.registry.workers["w"]
            await asyncio.sleep(0.3)
            assert not w.targets[0].index_healthy and "mesh_kv_events" not in streams(gateway)
            w.discovered_models = frozenset({"served-name"})  # what a health round's discovery does
            gateway.registry.version += 1
            await until(lambda: depth(gateway, keys, "w") == 2)
            assert w.targets[0].index_healthy
            # a request naming that model is keyed in the same namespace: it matches the indexed blocks
            body = b'{"model": "served-name", "prompt": [100, 101, 102, 103, 104, 105, 106, 107, 108]}'
            parsed = await gateway.prompts.process(body, "completion", None)
            assert list(parsed.info.block_keys) == keys and depth(gateway, list(parsed.info.block_keys), "w") == 2
    finally:
        pub.close()


async def test_speculative_entries_end_at_the_first_decision_past_their_deadline() -> None:
    app = create_app(parse_config({"workers": [worker("w", None, [MODEL])]}))
    gateway: Gateway = app.state.gateway
    keys = block_keys(list(range(8)), BS, namespace_seed(MODEL))
    async with app.router.lifespan_context(app):
        gateway.index.store_speculative("w", keys, time.monotonic() + 0.2)
        assert depth(gateway, keys, "w") == 2
        await asyncio.sleep(0.3)
        assert depth(gateway, keys, "w") == 2  # no timer ends them: the index holds them until read
        gateway.router.view(time.monotonic())  # what every decision and preview starts with
        assert depth(gateway, keys, "w") == 0
