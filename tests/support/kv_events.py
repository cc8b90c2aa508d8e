"""The oracle and the waits of the KV event subscriber's tests: ``ToyEngine``, a prefix cache with
LRU eviction and a CPU offload tier that says which events a request makes and what it then
holds; agentic sessions to feed it; waits on a subscriber fed by ``tests.fakes.kv_publisher``; and
``check_index``, which asserts that the index holds exactly what the engine holds."""

from __future__ import annotations

import asyncio
import random
from collections import OrderedDict
from collections.abc import Callable

import xxhash

from mesh.core.index import PrefixIndex
from mesh.core.keys import block_keys
from mesh.events.subscriber import KvEventSubscriber
from policies.base import Overlap, Tier
from tests.fakes.kv_publisher import BS, SEED, Publisher, encode_events


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
