"""SGLang's own radix cache and KV event publisher into Mesh's subscriber and index.

The engine side is SGLang's code from the pinned wheel (``tests/fakes/sglang_engine.py``, a
process): its ``RadixCache`` splits, page-aligns and LRU-evicts, its ``KVCacheEventRecorder``
emits (and coalesces) the events with namespaced hashes and ``cache_salt``, its
``ZmqEventPublisher`` puts ``[ts, events, attn_dp_rank]`` batches on real sockets. Mesh's side is
the real ``KvEventSubscriber`` and ``PrefixIndex``: after each step the index must hold exactly
the router keys of the pages SGLang's tree holds, on the tier that holds them (a host write-back
is ``CPU_PINNED`` on the wire).
"""

from __future__ import annotations

import random
from contextlib import AbstractAsyncContextManager
from typing import Any

import pytest

from mesh.core.keys import block_keys, namespace_seed
from policies.base import Tier
from tests.support.upstream_driver import Driver, Stack
from tests.support.upstream_driver import stack as upstream_stack

MODEL = "upstream-sglang"


def stack(driver: Driver, page: int, capacity: int) -> AbstractAsyncContextManager[Stack]:
    return upstream_stack(driver, {"page_size": page, "capacity": capacity},
                          block_size=page, model=MODEL)


def check(s: Stack) -> list[dict[str, Any]]:
    """The index holds exactly the tree's pages (and the host's), each on its tier."""
    blocks = s.check_keys()
    for b in blocks:
        key = block_keys(b["tokens"], s.block_size, namespace_seed(MODEL, None, b["salt"]))[-1]
        assert s.index.holds(s.targets[0], key) is (Tier.GPU if b["tier"] == "GPU" else Tier.CPU), b
    return blocks


def _prompts(rng: random.Random, page: int, n: int) -> list[tuple[list[int], str | None]]:
    """Sessions over shared prefixes (radix splits mid-node), some under a cache salt."""
    system = [rng.randrange(500) for _ in range(3 * page)]
    convos: list[list[int]] = [list(system) for _ in range(4)]
    out: list[tuple[list[int], str | None]] = []
    for i in range(n):
        c = convos[i % 4]
        c += [rng.randrange(500) for _ in range(rng.randrange(1, 3 * page + 2))]
        out.append((list(c), "tenant" if i % 4 == 3 else None))
        if rng.random() < 0.3:  # a branch off an earlier point of the session: the tree splits
            cut = rng.randrange(1, len(c))
            out.append((c[:cut] + [rng.randrange(500) for _ in range(2 * page)], None))
    return out


@pytest.mark.parametrize("page", [1, 4, 16])
async def test_sglang_radix_cache_inserts_and_evictions_leave_the_index_equal_to_the_tree(
        sglang_driver: Driver, page: int) -> None:
    rng = random.Random(page)
    async with stack(sglang_driver, page, capacity=24 * page) as s:
        for tokens, salt in _prompts(rng, page, 16):
            await s.serve(tokens, salt=salt)
            check(s)
        h = s.sub.health()[s.targets[0]]
        assert h.events.get("removed", 0) > 0 and not h.resets and h.events.get("filtered", 0) == 0
        assert any(b["salt"] for b in s.truth())


async def test_sglang_host_write_back_is_the_cpu_tier_and_outlives_the_gpu_eviction(sglang_driver: Driver) -> None:
    page = 4
    kept = list(range(10, 10 + 3 * page + 1))
    async with stack(sglang_driver, page, capacity=8 * page) as s:
        await s.serve(kept)
        s.driver.send("offload", tokens=kept)  # BlockStored medium "CPU_PINNED"
        await s.synced()
        check(s)
        for i in range(4):  # the pool evicts the prompt from the device; the host copy stays
            await s.serve(list(range(100 * (i + 1), 100 * (i + 1) + 3 * page)))
            check(s)
        keys = block_keys(kept, page, namespace_seed(MODEL))
        assert [s.index.holds(s.targets[0], k) for k in keys] == [Tier.CPU] * 3


async def test_sglang_a_lost_frame_is_repaired_and_a_reset_clears_the_target(sglang_driver: Driver) -> None:
    page = 4
    async with stack(sglang_driver, page, capacity=64) as s:
        await s.serve(list(range(2 * page + 1)))
        s.driver.send("lose_next")
        s.driver.send("serve", tokens=list(range(50, 50 + 3 * page)))  # never on the wire
        await s.serve(list(range(80, 80 + 2 * page)))
        check(s)
        h = s.sub.health()[s.targets[0]]
        assert h.gaps >= 1 and h.replays.get("ok", 0) >= 1 and not h.resets
        s.driver.send("clear")
        await s.synced()
        assert s.truth() == [] and s.index.keys_of(s.targets[0]) == set()
