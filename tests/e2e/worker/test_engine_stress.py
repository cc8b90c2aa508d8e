"""Seeded stress of the engine in-process (tiny preset, CPU), and the smallest sequences of the
cases it exercises: each such test pins one rule of the scheduler and block manager."""

from __future__ import annotations

import pytest
import torch

from mesh.core.keys import block_keys, namespace_seed
from workers.config import EngineConfig, get_preset
from workers.engine.llm_engine import LLMEngine
from workers.engine.sequence import SamplingParams
from workers.model.decoder import build_model
from workers.transfer.block_ops import BlockOps

TINY = get_preset("tiny")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_model(TINY, torch.device("cpu"), seed=0)


def _engine(model: torch.nn.Module, **kw: object) -> LLMEngine:
    cfg: dict[str, object] = dict(device="cpu", num_kv_blocks=8, block_size=4, cpu_threads=1)
    cfg.update(kw)
    return LLMEngine(TINY, EngineConfig(**cfg), eos_token_id=257, model=model)  # type: ignore[arg-type]


def _reference(model: torch.nn.Module, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    eng = _engine(model, num_kv_blocks=256, enable_prefix_caching=False)
    return eng.generate([prompt], params)[0]


def test_request_waits_while_transfer_pins_hold_the_blocks_it_needs(model: torch.nn.Module) -> None:
    """A prefill worker pins a finished prompt's blocks until the decode side pulls them. A request
    that fits the cache but not the blocks left free must wait for the unpin, not be aborted as
    'fits in no free block set' (nothing else was running)."""
    eng = _engine(model)
    ops = BlockOps(eng)
    first = list(range(20))  # 5 full blocks
    eng.generate([first], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    keys = block_keys(first, 4, eng._seed(None))
    pinned = ops.pin_prefix(keys, [first[i:i + 4] for i in range(0, 20, 4)], eng._seed(None))
    assert len(pinned.block_ids) == 5 and eng.block_manager.num_free_blocks == 3
    prompt = list(range(100, 112))
    eng.add_request("b", prompt, GREEDY)  # 12 + 8 tokens = 5 blocks > 3 free
    got: list[int] = []
    for _ in range(5):
        for o in eng.step():
            got += o.new_token_ids
            assert o.finish_reason != "abort", "aborted while the pins were about to go"
    assert eng.requests and eng.stats()["num_requests_waiting"] == 1
    ops.unpin(pinned.block_ids)
    while eng.has_unfinished():
        for o in eng.step():
            got += o.new_token_ids
    assert got == _reference(model, prompt)
    assert eng.block_manager.num_used_blocks == 0
    eng.block_manager.check(eng.scheduler.all_seqs())


# ---- the seeded stress itself: sessions, aborts, pins, evictions, both tiers, every oracle ----------


class _Subscriber:
    """KV events over a real ZMQ SUB socket, decoded with msgpack (written independently of the
    engine's encoder): the block sets a router would hold per tier. Refuses a gap, a store of a
    block already held or a removal of one never stored."""

    def __init__(self, port: int) -> None:
        import msgspec
        import zmq

        self._zmq = zmq
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.decode = msgspec.msgpack.Decoder().decode
        self.tiers: dict[str, set[int]] = {"GPU": set(), "CPU": set()}
        self.last = -1

    def connect(self, publisher: object) -> None:
        """Publish empty batches until one arrives (the slow joiner), then start from there."""
        for _ in range(200):
            publisher.publish([])  # type: ignore[attr-defined]
            if self.sock.poll(20):
                break
        else:
            raise AssertionError("the SUB socket never received a batch")
        while self.sock.poll(100):
            self.last = int.from_bytes(self.sock.recv_multipart()[1], "big")

    def catch_up(self, last_seq: int) -> None:
        while self.last < last_seq:
            assert self.sock.poll(5000), f"no batch after {self.last} (publisher at {last_seq})"
            _, seq_b, payload = self.sock.recv_multipart()
            seq = int.from_bytes(seq_b, "big")
            assert seq == self.last + 1, f"gap: {self.last} -> {seq}"
            self.last = seq
            _, events, _ = self.decode(payload)
            for ev in events:
                if ev["type"] == "AllBlocksCleared":
                    for tier in self.tiers.values():
                        tier.clear()
                    continue
                tier = self.tiers[ev["medium"]]
                hashes = set(ev["block_hashes"])
                if ev["type"] == "BlockStored":
                    assert not hashes & tier, f"stored twice: {ev}"
                    if ev["token_ids"]:  # a GPU store: its keys are the chain of its tokens after its parent
                        extra = ev.get("extra_keys") or [None]
                        salt = extra[0][0] if extra[0] else None
                        parent = ev["parent_block_hash"]
                        seed = namespace_seed("tiny", None, salt) if parent is None else 0
                        assert block_keys(ev["token_ids"], ev["block_size"], seed, parent=parent) == ev["block_hashes"], ev
                    tier |= hashes
                else:
                    assert hashes <= tier, f"removed, never stored: {ev}"
                    tier -= hashes

    def close(self) -> None:
        self.sock.close(linger=0)


def _stress(model: torch.nn.Module, seed: int, cpu_blocks: int, **cfg: object) -> dict[str, float]:
    import random

    from tests.procs import free_port

    rng = random.Random(seed)
    port = free_port()
    eng = _engine(model, cpu_offload_blocks=cpu_blocks, kv_events_endpoint=f"tcp://*:{port}", **cfg)
    sub = _Subscriber(port)
    ops, pins = BlockOps(eng), []
    bs = eng.config.block_size
    computed: dict[str, int] = {}  # prompt tokens run through the model at first admission
    run = eng.runner.run

    def spy(batch):  # type: ignore[no-untyped-def]
        for s, n in batch.items():
            if s.admissions == 1 and s.num_computed_tokens < s.num_prompt_tokens:
                computed[s.request_id] = computed.get(s.request_id, 0) + min(n, s.num_prompt_tokens - s.num_computed_tokens)
        return run(batch)

    eng.runner.run = spy  # type: ignore[method-assign]
    try:
        sub.connect(eng.publisher)
        system = [rng.randrange(256) for _ in range(9)]
        sessions = [dict(ctx=(system if i % 2 else []) + [rng.randrange(256) for _ in range(rng.randrange(2, 20))],
                         salt="s" if i == 3 else None, live=None, turns=0) for i in range(6)]
        reqs: dict[str, dict] = {}  # type: ignore[type-arg]
        step = 0
        while step < 2000:
            for s in sessions:
                if s["live"] is None and s["turns"] < 4 and rng.random() < 0.3:
                    rid = f"r{len(reqs)}"
                    greedy = rng.random() < 0.7
                    params = SamplingParams(
                        temperature=0.0 if greedy else 0.9, seed=None if greedy else rng.randrange(99),
                        max_tokens=rng.randrange(1, 14), ignore_eos=rng.random() < 0.5,
                        stop_token_ids=tuple(rng.sample(range(300), 4)) if rng.random() < 0.3 else ())
                    try:
                        eng.add_request(rid, list(s["ctx"]), params, cache_salt=s["salt"])
                    except ValueError:  # grew past the cache: refused, never queued
                        s["turns"] = 4
                        continue
                    reqs[rid] = dict(prompt=list(s["ctx"]), params=params, out=[], seq=eng.requests[rid], sess=s)
                    s["live"], s["turns"] = rid, s["turns"] + 1
            live = [s for s in sessions if s["live"]]
            if live and rng.random() < 0.07:  # a client goes away
                rid = rng.choice(live)["live"]
                assert eng.abort_request(rid)
            if rng.random() < 0.05:  # a transfer pins a cached prefix (and saves it to the CPU tier)
                s = rng.choice(sessions)
                n = (len(s["ctx"]) - 1) // bs
                seed_ = eng._seed(s["salt"])
                got = ops.pin_prefix(block_keys(s["ctx"][: n * bs], bs, seed_),
                                     [s["ctx"][i * bs:(i + 1) * bs] for i in range(n)], seed_)
                if got.block_ids:
                    pins.append(got)
                    if cpu_blocks and rng.random() < 0.5:
                        ops.save_to_cpu(got.block_ids, got.keys)
            if pins and (rng.random() < 0.1 or step > 1500):
                ops.unpin(pins.pop(rng.randrange(len(pins))).block_ids)
            if rng.random() < 0.02:
                eng.block_manager.evict_free()
                eng.run_swaps()
            for o in eng.step():
                r = reqs[o.request_id]
                r["out"] += o.new_token_ids
                if o.finished:
                    r["reason"], r["cached"] = o.finish_reason, o.num_cached_tokens
                    sess = r["sess"]
                    sess["live"] = None
                    if o.finish_reason != "abort":
                        sess["ctx"] = r["prompt"] + r["out"] + [rng.randrange(256) for _ in range(rng.randrange(1, 8))]
            assert ops.leak_check()["leaked_blocks"] == 0
            step += 1
            if not pins and not eng.has_unfinished() and all(s["live"] is None and s["turns"] >= 4 for s in sessions):
                break
        assert step < 2000, "the workload did not drain"
        bm, st = eng.block_manager, eng.stats()
        bm.check(eng.scheduler.all_seqs())
        assert all(b.ref_count == 0 for b in bm.blocks) and bm.num_free_blocks == bm.num_blocks
        assert st["num_requests_running"] == st["num_requests_waiting"] == 0 and not eng.requests
        sub.catch_up(eng.publisher.last_seq)
        assert sub.tiers["GPU"] == set(bm.cached)
        assert sub.tiers["CPU"] == (set(bm.cpu.blocks) if bm.cpu else set())
        _check_pages(model, eng, [r["seq"] for r in reqs.values()])
        for rid, r in reqs.items():
            p = r["params"]
            if p.greedy or p.seed is not None:  # equal to prefix caching off, one request at a time
                ref = _reference(model, r["prompt"], p)
                assert r["out"] == (ref[: len(r["out"])] if r["reason"] == "abort" else ref), rid
            if r["reason"] != "abort" and r["seq"].admissions == 1:
                assert r["cached"] % bs == 0 and computed.get(rid, 0) == len(r["prompt"]) - r["cached"], rid
        return st
    finally:
        sub.close()
        eng.close()


def _check_pages(model: torch.nn.Module, eng: LLMEngine, seqs: list) -> None:  # type: ignore[type-arg]
    """Every cached block, on either tier, holds the K/V of its prefix (a fresh prefill of it)."""
    bs, bm = eng.config.block_size, eng.block_manager
    prefixes = {k: s.token_ids[: (i + 1) * bs] for s in seqs for i, k in enumerate(s.keys_upto(s.num_full_blocks))}
    held = [(k, bid, None) for k, bid in bm.cached.items()]
    held += [(k, None, cb.slot) for k, cb in bm.cpu.blocks.items()] if bm.cpu else []
    ref = _engine(model, num_kv_blocks=256, enable_prefix_caching=False)
    for key, bid, slot in held:
        tokens = prefixes[key]
        ref.add_request("p", tokens + [1], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        seq = ref.requests["p"]
        ref.step()  # the whole prefill
        want = ref.runner.kv_cache[:, :, seq.block_table[len(tokens) // bs - 1]]
        got = eng.runner.kv_cache[:, :, bid] if slot is None else eng.cpu_cache.pages[slot].view(want.shape)
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), f"block {key:#x} holds other K/V"
        ref.abort_request("p")
        ref.step()


@pytest.mark.parametrize(("seed", "cpu_blocks", "cfg"), [
    (1, 0, dict(num_kv_blocks=14, max_num_batched_tokens=12, chunked_prefill_size=5, max_num_seqs=5)),
    (2, 4, dict(num_kv_blocks=16, max_num_batched_tokens=9, max_num_seqs=4)),
])
def test_seeded_stress_keeps_outputs_refcounts_events_and_cached_tokens(
        model: torch.nn.Module, seed: int, cpu_blocks: int, cfg: dict[str, object]) -> None:
    st = _stress(model, seed, cpu_blocks, **cfg)
    assert st["preemptions"] > 0 and st["blocks_evicted"] > 0 and st["prompt_cached_tokens"] > 0
    if cpu_blocks:
        assert st["cpu_blocks_restored"] > 0 and st["cpu_blocks_evicted"] > 0


@pytest.mark.parametrize("async_decode", [False, True])
@pytest.mark.parametrize(("budget", "chunk"), [(1, None), (64, 1)])
def test_one_token_prefill_chunk_is_not_run_as_a_decode_on_the_graph_path(
        model: torch.nn.Module, async_decode: bool, budget: int, chunk: int | None) -> None:
    """A step whose token budget (or the chunk size) leaves one token for a prefill in progress
    schedules that token as a prefill, not a "decode": the CUDA graph path computes a decode at the
    sequence's *last* position (and samples from it), so position 0 of a 5-token prompt would run
    as position 4 with no context, sample a bogus token, and the next step index past the block
    table."""
    from tests.support.cuda_graphs import emulate_graphs

    prompt = [7, 3, 9, 1, 4]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = _reference(model, prompt, params)
    eng = _engine(model, num_kv_blocks=32, attention_backend="torch", max_graph_batch_size=4,
                  max_num_batched_tokens=budget, chunked_prefill_size=chunk)
    with pytest.MonkeyPatch.context() as mp:
        emulate_graphs(eng.runner, mp)
        eng.async_decode = async_decode
        got = eng.generate([prompt], params)[0]
    assert got == want
    assert eng.runner.num_graph_replays > 0  # the decodes did run on the (stand-in) graphs


async def test_async_loop_waits_for_the_unpin_then_serves_the_request(model: torch.nn.Module) -> None:
    """The same through the engine thread: pins taken by a call, a request that needs their
    blocks streams nothing and is not aborted; the unpin (fire and forget) wakes the loop."""
    import asyncio

    from workers.transfer.kv_transfer import TransferEngine

    eng = _engine(model)
    first = list(range(20))
    eng.generate([first], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    te = TransferEngine(eng)
    te.start()
    try:
        seed = eng._seed(None)
        pinned = await te.call(te.ops.pin_prefix, block_keys(first, 4, seed),
                               [first[i:i + 4] for i in range(0, 20, 4)], seed)
        assert len(pinned.block_ids) == 5
        prompt = list(range(100, 112))
        got: list[int] = []

        async def consume() -> str | None:
            async for o in te.generate("b", prompt, GREEDY):
                got.extend(o.new_token_ids)
                if o.finished:
                    return o.finish_reason
            return None

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.5)
        assert not task.done(), "the request ended while the pins held its blocks"
        te.submit(te.ops.unpin, pinned.block_ids)
        assert await asyncio.wait_for(task, 30) == "length"
        assert got == _reference(model, prompt)
        assert (await te.call(te.ops.leak_check)) == {"leaked_blocks": 0, "pinned_blocks": 0, "pinned_states": 0}
    finally:
        te.shutdown()
