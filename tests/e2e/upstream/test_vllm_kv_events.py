"""vLLM's own prefix cache and KV event publisher into Mesh's subscriber and index.

The engine side is vLLM's code from the pinned wheel (``tests/fakes/vllm_engine.py``, a process):
its ``KVCacheManager``/``BlockPool`` decide hits, allocations and LRU evictions and emit the
events, its ``ZmqEventPublisher`` puts them on real sockets (PUB, ROUTER replay, ports offset per
data-parallel rank). Mesh's side is the real ``KvEventSubscriber`` and ``PrefixIndex``. After each
step the index must hold exactly the router keys of the blocks vLLM's cache holds, and count the
same duplicate copies (vLLM recomputes the last block of a block-aligned prompt into a second
block of the same hash).
"""

from __future__ import annotations

import random
from contextlib import AbstractAsyncContextManager
from typing import Any

from mesh.core.keys import block_keys, namespace_seed
from mesh.events.subscriber import WorkerEvents
from tests.support.upstream_driver import Driver, Stack
from tests.support.upstream_driver import stack as upstream_stack

MODEL = "upstream-vllm"
BS = 4


def check(s: Stack, rank: int = 0) -> list[dict[str, Any]]:
    """The index holds exactly the rank's blocks, with its duplicate copies."""
    blocks = s.check_keys(rank)
    assert s.index.engine_copies(s.targets[rank]) == {b["hash"]: b["copies"] for b in blocks if b["copies"] > 1}
    return blocks


def stack(driver: Driver, ranks: int = 1, num_blocks: int = 24) -> AbstractAsyncContextManager[Stack]:
    return upstream_stack(driver, {"block_size": BS, "num_blocks": num_blocks},
                          block_size=BS, model=MODEL, ranks=ranks)


def _sessions(rng: random.Random, n: int, turns: int) -> list[list[int]]:
    """Agentic turns over a shared system prompt: each turn extends its session's last prompt; some
    block-aligned (vLLM then recomputes their last block into a second copy)."""
    system = [rng.randrange(1000) for _ in range(2 * BS)]
    convos = [list(system) for _ in range(n)]
    out = []
    for _ in range(turns):
        for c in convos:
            c += [rng.randrange(1000) for _ in range(rng.choice([BS, 2 * BS, rng.randrange(1, 3 * BS)]))]
            out.append(list(c))
            if rng.random() < 0.3:
                out.append(list(c))  # the same prompt again (a retry, a regenerate)
    return out


async def test_vllm_allocations_and_lru_evictions_leave_the_index_equal_to_the_engine(vllm_driver: Driver) -> None:
    rng = random.Random(5)
    async with stack(vllm_driver, num_blocks=20) as s:
        for tokens in _sessions(rng, 4, 5):
            await s.serve(tokens)
            check(s)
        h = s.sub.health()[s.targets[0]]
        assert h.events.get("removed", 0) > 10 and h.events.get("stored", 0) > 10  # evictions happened
        assert not h.resets


async def test_vllm_running_requests_pin_their_blocks_and_a_duplicate_copy_is_counted(vllm_driver: Driver) -> None:
    prompt = list(range(100, 100 + 3 * BS))  # block-aligned: a second request recomputes block 3
    async with stack(vllm_driver, num_blocks=12) as s:
        await s.serve(prompt, rid="a", keep=True)
        await s.serve(prompt, rid="b", keep=True)
        blocks = check(s)
        assert sorted(b["copies"] for b in blocks) == [1, 1, 2]
        s.driver.send("free", rid="a")
        s.driver.send("free", rid="b")
        for i in range(6):  # unrelated prompts evict every block of the first one, one copy at a time
            await s.serve(list(range(1000 * (i + 1), 1000 * (i + 1) + 2 * BS + 1)))
            check(s)
        keys = block_keys(prompt, BS, namespace_seed(MODEL))
        assert not s.index.keys_of(s.targets[0]) & set(keys)


async def test_vllm_data_parallel_ranks_each_publish_their_own_stream(vllm_driver: Driver) -> None:
    rng = random.Random(9)
    async with stack(vllm_driver, ranks=2, num_blocks=16) as s:
        for i, tokens in enumerate(_sessions(rng, 3, 3)):
            await s.serve(tokens, rank=i % 2)
        port = int(s.sub.health()[s.targets[0]].endpoint.rsplit(":", 1)[1])
        for rank in (0, 1):
            assert check(s, rank)
            assert s.sub.health()[s.targets[rank]].endpoint == f"tcp://127.0.0.1:{port + rank}"
        assert s.index.keys_of(s.targets[0]) != s.index.keys_of(s.targets[1])


async def test_vllm_lora_and_cache_salt_blocks_are_their_own_namespaces(vllm_driver: Driver) -> None:
    tokens = list(range(7, 7 + 3 * BS + 2))
    async with stack(vllm_driver, num_blocks=32) as s:
        await s.serve(tokens)
        await s.serve(tokens, lora="adapter-a")
        await s.serve(tokens, salt="tenant-1")
        await s.serve(tokens, lora="adapter-a", salt="tenant-2")
        await s.serve(tokens + [1, 2, 3, 4], lora="adapter-a")  # extends the LoRA chain below its hit
        blocks = check(s)
        assert {(b["lora"], b["salt"]) for b in blocks} == {(None, None), ("adapter-a", None), (None, "tenant-1"),
                                                            ("adapter-a", "tenant-2")}
        full = block_keys(tokens, BS, namespace_seed(MODEL, "adapter-a"))
        assert s.index.match(full)[s.targets[0]].gpu_blocks == 3


async def test_vllm_a_lost_frame_is_repaired_through_its_replay_socket(vllm_driver: Driver) -> None:
    async with stack(vllm_driver) as s:
        await s.serve(list(range(2 * BS + 1)))
        s.driver.send("lose_next")
        s.driver.send("serve", tokens=list(range(50, 50 + 3 * BS)), rid="lost")  # never on the wire
        await s.serve(list(range(80, 80 + 2 * BS)))  # the next frame shows the gap
        check(s)
        h = s.sub.health()[s.targets[0]]
        assert h.gaps >= 1 and h.replays.get("ok", 0) >= 1 and not h.resets
        assert s.index.match(block_keys(list(range(50, 50 + 3 * BS)), BS, namespace_seed(MODEL)))


async def test_vllm_reset_prefix_cache_clears_the_target(vllm_driver: Driver) -> None:
    async with stack(vllm_driver) as s:
        await s.serve(list(range(3 * BS)))
        assert s.index.keys_of(s.targets[0])
        s.driver.send("clear")
        await s.synced()
        assert s.truth() == [] and s.index.keys_of(s.targets[0]) == set()
        assert s.sub.health()[s.targets[0]].events.get("cleared") == 1
        await s.serve(list(range(5, 5 + 2 * BS)))
        check(s)


async def test_vllm_full_report_mode_reannounced_hits_are_not_extra_copies(vllm_driver: Driver) -> None:
    """``vllm_xargs: {"kv_cache_report_mode": "full"}``: vLLM announces every prefix hit again as a
    BlockStored from the root (parent None) of blocks it already holds; no block is copied and no
    removal will follow for it. Counted as copies, the index kept claiming the prefix after vLLM
    evicted it (5 blocks claimed, 0 held)."""
    prompt = list(range(300, 300 + 5 * BS + 1))  # five full blocks and a partial one
    full = {"kv_cache_report_mode": "full"}
    async with stack(vllm_driver, num_blocks=16) as s:
        await s.serve(prompt)
        for _ in range(3):
            reply = await s.serve(prompt, xargs=full)
            assert reply["hit_tokens"] == 5 * BS
            check(s)
        assert s.sub.health()[s.targets[0]].events.get("stored") == 4  # the three reports came in
        for i in range(8):  # unrelated prompts evict the prompt's blocks
            await s.serve(list(range(1000 * (i + 1), 1000 * (i + 1) + 3 * BS + 1)), xargs=full)
            check(s)
        keys = block_keys(prompt, BS, namespace_seed(MODEL))
        assert not any(b["tokens"] == prompt[:BS] for b in s.truth())
        assert not s.index.keys_of(s.targets[0]) & set(keys)


async def test_vllm_a_subscriber_that_joins_late_rebuilds_the_index_from_the_replay_buffer(
        vllm_driver: Driver) -> None:
    """A gateway restarting while the engine runs: its new stream asks vLLM's ROUTER for every
    batch kept (stores and the evictions since), and the index it rebuilds equals the cache."""
    rng = random.Random(11)
    async with stack(vllm_driver, num_blocks=20) as s:
        prompts = _sessions(rng, 3, 4)
        for tokens in prompts[:3]:
            await s.serve(tokens)
        spec = WorkerEvents("engine", s.sub.health()[s.targets[0]].endpoint,
                            s.sub.health()[s.targets[0]].replay_endpoint, model=MODEL, block_size=BS)
        await s.sub.remove_worker("engine")
        for i, tokens in enumerate(prompts[3:]):  # published while nobody listens
            s.driver.send("serve", tokens=tokens, rid=f"late-{i}")
        assert s.index.keys_of(s.targets[0]) == set()
        assert s.sub.add_worker(spec) == s.targets
        await s.synced()
        blocks = check(s)
        assert blocks and s.sub.health()[s.targets[0]].replays.get("ok", 0) >= 1
