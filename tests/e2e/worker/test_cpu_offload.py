"""The CPU offload tier (``--cpu-offload-blocks``) on the tiny preset, CPU device (where the "CPU
tier" is a second, larger pool: the same logic, plain copies).

- Reuse is real: a prefix evicted from a GPU pool too small to keep it is saved, restored on the
  next match (only the suffix is computed), and re-registered on the GPU (the next turn hits
  there, with no restore); restored pages are bit-exact copies.
- Nothing is ever wrong: greedy output equals offload off and no prefix caching; a page-level
  stress of 2,000 requests (fake forward pass writing a value that names each token's prefix)
  checks every page a step reads and every page either tier holds; a model-level stress checks
  tokens; ``check()`` after every step.
- KV events rebuild both tiers exactly in the gateway's own subscriber and index.
- Disaggregation: a prefill's transferred blocks are freed only after the decode pull and the
  CPU save (either order), exactly once, with no leak.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from typing import Any

import httpx
import pytest
import torch

from mesh.core.index import PrefixIndex
from mesh.core.keys import block_keys, namespace_seed
from mesh.events.limits import SubscriberLimits
from mesh.events.subscriber import KvEventSubscriber, WorkerEvents
from policies.base import Overlap, Tier
from tests.disagg_cluster import (
    Cluster,
    assert_no_leaks,
    completion,
    metrics,
    prompt_tokens,
    set_faults,
    status,
    wait_for,
)
from tests.procs import ProcessGroup, free_port
from workers.config import EngineConfig, get_preset
from workers.engine.block_manager import MEDIUM_CPU, BlockRemoved, BlockStored, KVEvent
from workers.engine.llm_engine import LLMEngine
from workers.engine.scheduler import ScheduledBatch
from workers.engine.sequence import SamplingParams
from workers.model.decoder import build_model

TINY = get_preset("tiny")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_model(TINY, torch.device("cpu"), seed=0)


def _engine(model: torch.nn.Module, **kw: Any) -> LLMEngine:
    cfg: dict[str, Any] = dict(device="cpu", num_kv_blocks=40, block_size=8, cpu_threads=1)
    cfg.update(kw)
    return LLMEngine(TINY, EngineConfig(**cfg), eos_token_id=257, model=model)


def _run(engine: LLMEngine, prompts: Seq[list[int]], params: SamplingParams | list[SamplingParams] = GREEDY,
         arrivals: Seq[int] | None = None) -> list[list[int]]:
    """Add request i at step ``arrivals[i]``; step to completion, checking integrity each step."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    arrivals = arrivals or [0] * len(prompts)
    tag = f"r{time.monotonic_ns()}-"  # request ids unique across calls on one engine
    out: dict[str, list[int]] = {f"{tag}{i}": [] for i in range(len(prompts))}
    pending = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    step = 0
    while pending or engine.has_unfinished():
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            engine.add_request(f"{tag}{i}", list(prompts[i]), plist[i])
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        engine.block_manager.check(engine.scheduler.all_seqs())
        step += 1
    return [out[f"{tag}{i}"] for i in range(len(prompts))]


def _send(engine: LLMEngine, prompt: list[int], params: SamplingParams = GREEDY) -> tuple[list[int], int]:
    """One request alone: its tokens and its usage.cached_tokens."""
    rid = f"s{time.monotonic_ns()}"
    engine.add_request(rid, prompt, params)
    tokens: list[int] = []
    cached = -1
    while engine.has_unfinished():
        for o in engine.step():
            tokens += o.new_token_ids
            cached = o.num_cached_tokens
        engine.block_manager.check(engine.scheduler.all_seqs())
    return tokens, cached


class Recorder:
    """Stands in for the KV event publisher: keeps every event of every step, in order."""

    num_published = num_dropped = 0

    def __init__(self) -> None:
        self.events: list[KVEvent] = []

    def publish(self, events: list[KVEvent]) -> int:
        self.events += events
        return 0

    def close(self) -> None:
        pass


# ---- reuse and equality ---------------------------------------------------------------------------


def _family_prompts(rng: random.Random, n: int, head: int = 96) -> list[list[int]]:
    heads = [[rng.randrange(256) for _ in range(head)] for _ in range(3)]
    return [heads[i % 3][: rng.randrange(24, head + 1)] + [rng.randrange(256) for _ in range(rng.randrange(1, 40))]
            for i in range(n)]


def test_greedy_output_identical_with_offload_on_off_and_without_prefix_caching(model: torch.nn.Module) -> None:
    rng = random.Random(3)
    prompts = _family_prompts(rng, 16)
    prompts += prompts[:6]  # exact repeats: hits up to the last block
    arrivals = [rng.randrange(0, 40) for _ in prompts]
    reference = _run(_engine(model, enable_prefix_caching=False), prompts)
    configs: dict[str, dict[str, Any]] = {
        "off": {},
        "on": dict(cpu_offload_blocks=256),
        "tight_cpu": dict(cpu_offload_blocks=12),  # the CPU tier evicts too
        "chunked": dict(cpu_offload_blocks=64, max_num_batched_tokens=40, chunked_prefill_size=7, max_num_seqs=3),
    }
    stats = {}
    for name, cfg in configs.items():
        engine = _engine(model, **cfg)
        assert _run(engine, prompts, arrivals=arrivals) == reference, name
        stats[name] = engine.stats()
    assert stats["off"]["cpu_blocks_saved"] == 0
    for name in ("on", "tight_cpu", "chunked"):
        assert stats[name]["cpu_blocks_restored"] > 0, name  # the GPU pool is too small: blocks came back
    assert stats["tight_cpu"]["cpu_blocks_evicted"] > 0
    assert stats["on"]["prefill_computed_tokens"] < stats["off"]["prefill_computed_tokens"]
    assert stats["on"]["prompt_cached_tokens"] > stats["off"]["prompt_cached_tokens"]


def _pages(engine: LLMEngine, keys: list[int]) -> dict[int, torch.Tensor]:
    bm, kv = engine.block_manager, engine.runner.kv_cache
    return {k: kv[:, :, bm.cached[k]].clone() for k in keys if k in bm.cached}


def test_long_prompt_evicted_to_cpu_computes_only_the_suffix_then_hits_on_the_gpu(model: torch.nn.Module) -> None:
    engine = _engine(model, block_size=16, num_kv_blocks=50, cpu_offload_blocks=128)
    rec = Recorder()
    engine.publisher = rec
    bm, rng = engine.block_manager, random.Random(5)
    a = [rng.randrange(256) for _ in range(645)]  # 40 full blocks before the last token's block
    b = [rng.randrange(256) for _ in range(645)]
    keys = block_keys(a[:640], 16, namespace_seed("tiny"))
    first, cached = _send(engine, a)
    assert cached == 0
    original = _pages(engine, keys)
    assert len(original) == 40

    _send(engine, b)  # needs 41 of the 50 blocks: most of a's blocks are evicted to the CPU
    on_cpu = [k for k in keys if k not in bm.cached]
    assert len(on_cpu) >= 30 and all(k in bm.cpu for k in on_cpu)
    order = {(type(e).__name__, e.medium, h): i for i, e in enumerate(rec.events)
             if isinstance(e, (BlockStored, BlockRemoved)) for h in e.block_hashes}
    for k in on_cpu:  # the CPU store is announced before the GPU removal: never lost in between
        assert order[("BlockStored", MEDIUM_CPU, k)] < order[("BlockRemoved", "GPU", k)]

    before = engine.stats()
    second, cached = _send(engine, a)
    after = engine.stats()
    assert second == first and cached == 640
    assert after["prefill_computed_tokens"] - before["prefill_computed_tokens"] == 5  # only the suffix
    assert after["cpu_blocks_restored"] - before["cpu_blocks_restored"] == len(on_cpu)
    assert after["cpu_prefix_cache_hits"] - before["cpu_prefix_cache_hits"] == 16 * len(on_cpu)
    restored = _pages(engine, keys)  # re-registered on the GPU, bit-exact copies
    assert restored.keys() == original.keys()
    assert all(torch.equal(restored[k], original[k]) for k in keys)

    third, cached = _send(engine, a)
    final = engine.stats()
    assert third == first and cached == 640
    assert final["cpu_blocks_restored"] == after["cpu_blocks_restored"]  # a GPU hit, no restore
    assert final["prefill_computed_tokens"] - after["prefill_computed_tokens"] == 5


# ---- stress: pages ------------------------------------------------------------------------------------


def _value(parent: int, token: int, offset: int) -> float:
    """What the fake forward pass writes for a token: it names the token's whole prefix (the
    parent key names the chain before its block). Exact in float32 (< 2**24)."""
    return float((parent * 1_000_003 + token * 131 + offset) % (1 << 24))


class FakeForward:
    """Replaces ``ModelRunner.run``: writes each computed token's value into its K/V slots and
    samples a token from the sequence's tail; first checks that every page the step reads
    (the computed prefix of a sequence just admitted) holds exactly what names its prefix."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.kv = engine.runner.kv_cache
        self.bs = engine.config.block_size
        self.checked: dict[int, int] = {}  # seq_id -> admissions already checked
        self.reads_checked = 0

    def expected(self, parent: int, tokens: Seq[int]) -> torch.Tensor:
        return torch.tensor([_value(parent, t, o) for o, t in enumerate(tokens)])

    def __call__(self, batch: ScheduledBatch) -> dict[int, int]:
        sampled = {}
        for seq, n in batch.items():
            if self.checked.get(seq.seq_id) != seq.admissions:
                self.checked[seq.seq_id] = seq.admissions
                self._check_reads(seq)
            self._write(seq, seq.num_computed_tokens, n)
            if seq.num_computed_tokens + n == len(seq):
                sampled[seq.seq_id] = (sum(seq.token_ids[-4:]) * 7 + len(seq)) % 250 + 1
        return sampled

    def _parent(self, seq: Any, i: int) -> int:
        return seq.key_seed if i == 0 else seq.keys_upto(i)[i - 1]

    def _check_reads(self, seq: Any) -> None:
        for i in range(seq.num_computed_tokens // self.bs):
            got = self.kv[0, 0, seq.block_table[i], :, 0, 0]
            want = self.expected(self._parent(seq, i), seq.block_tokens(i))
            assert torch.equal(got, want), f"seq {seq.seq_id} reads a wrong page at block {i}"
            self.reads_checked += 1

    def _write(self, seq: Any, start: int, n: int) -> None:
        p = start
        while p < start + n:
            i, o = divmod(p, self.bs)
            end = min(start + n, (i + 1) * self.bs)
            parent = self._parent(seq, i)
            vals = torch.tensor([_value(parent, seq.token_ids[q], q - i * self.bs) for q in range(p, end)])
            self.kv[:, :, seq.block_table[i], o : o + end - p] = vals[:, None, None]
            p = end

    def check_tiers(self) -> int:
        """Every page either tier holds names its block's prefix; returns how many were checked."""
        bm, cpu_cache = self.engine.block_manager, self.engine.cpu_cache
        for bid in bm.cached.values():
            block = bm.blocks[bid]
            assert torch.equal(self.kv[0, 0, bid, :, 0, 0], self.expected(block.parent_key, block.token_ids))
        assert bm.cpu is not None and cpu_cache is not None
        heads_dim = TINY.num_kv_heads * TINY.head_dim
        for key, cb in bm.cpu.blocks.items():
            page = cpu_cache.pages[cb.slot, 0].view(self.bs, heads_dim)[:, 0]
            assert torch.equal(page, self.expected(cb.parent_key, cb.token_ids)), f"CPU slot {cb.slot} ({key:#x})"
        return len(bm.cached) + len(bm.cpu)


class Workload:
    """Agent-like traffic: sessions that grow turn by turn (the last prompt, its answer so far,
    new text) over shared system prompts, one-off prompts, exact repeats; random lengths."""

    def __init__(self, rng: random.Random, max_len: int) -> None:
        self.rng, self.max_len = rng, max_len
        self.system = [[rng.randrange(1, 250) for _ in range(rng.randrange(16, 64))] for _ in range(4)]
        self.sessions: list[tuple[list[int], str]] = []  # (last prompt, its request id)
        self.sent: list[list[int]] = []

    def next(self, rid: str, outputs: dict[str, list[int]]) -> list[int]:
        rng = self.rng
        r = rng.random()
        new = [rng.randrange(1, 250) for _ in range(rng.randrange(1, 48))]
        if r < 0.5 and self.sessions:
            i = rng.randrange(len(self.sessions))
            last, last_rid = self.sessions[i]
            prompt = last + outputs.get(last_rid, []) + new[:24]
            if len(prompt) > self.max_len:
                prompt = rng.choice(self.system) + prompt[-8:]
            self.sessions[i] = (prompt, rid)
        elif r < 0.65 and self.sent:
            prompt = list(rng.choice(self.sent))
        else:
            prompt = rng.choice(self.system) + new
            if len(self.sessions) < 24:
                self.sessions.append((prompt, rid))
        self.sent = (self.sent + [prompt])[-64:]
        return prompt


def test_stress_of_save_evict_restore_never_reads_or_keeps_a_wrong_page(model: torch.nn.Module) -> None:
    engine = _engine(model, num_kv_blocks=48, cpu_offload_blocks=64, max_num_seqs=6,
                     max_num_batched_tokens=64, chunked_prefill_size=32)
    fake = FakeForward(engine)
    engine.runner.run = fake  # type: ignore[method-assign]
    rng = random.Random(11)
    work = Workload(rng, max_len=200)
    outputs: dict[str, list[int]] = {}
    live: list[str] = []
    total, step, tier_pages = 0, 0, 0
    for _round in range(4):
        sent = 0
        while sent < 500 or engine.has_unfinished():
            for _ in range(rng.randrange(0, 3) if sent < 500 else 0):
                rid = f"q{total}"
                prompt = work.next(rid, outputs)
                params = SamplingParams(temperature=0, max_tokens=rng.randrange(1, 9), ignore_eos=True)
                engine.add_request(rid, prompt, params)
                live.append(rid)
                sent += 1
                total += 1
            if live and rng.random() < 0.03:
                engine.abort_request(live.pop(rng.randrange(len(live))))
            for o in engine.step():
                outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finished and o.request_id in live:
                    live.remove(o.request_id)
            engine.block_manager.check(engine.scheduler.all_seqs())
            step += 1
            if step % 10 == 0:
                tier_pages += fake.check_tiers()
    tier_pages += fake.check_tiers()
    s = engine.stats()
    assert total == 2000
    assert s["cpu_blocks_saved"] > 500 and s["cpu_blocks_restored"] > 500 and s["cpu_blocks_evicted"] > 100
    assert s["preemptions"] > 0 and s["blocks_revived"] > 0
    assert fake.reads_checked > 5000 and tier_pages > 10000


# ---- stress: tokens -----------------------------------------------------------------------------------


def test_stress_rounds_with_the_real_model_never_return_wrong_tokens(model: torch.nn.Module) -> None:
    rng = random.Random(7)
    pool = _family_prompts(rng, 24, head=80)
    reference = _run(_engine(model, enable_prefix_caching=False, num_kv_blocks=512), pool)
    engine = _engine(model, num_kv_blocks=36, cpu_offload_blocks=40, max_num_seqs=4)
    for _round in range(3):
        picks = [rng.randrange(len(pool)) for _ in range(60)]
        params = [SamplingParams(temperature=0, max_tokens=rng.randrange(1, 9), ignore_eos=True) for _ in picks]
        got = _run(engine, [pool[i] for i in picks], params, arrivals=sorted(rng.randrange(0, 90) for _ in picks))
        for i, p, g in zip(picks, params, got, strict=True):
            assert g == reference[i][: p.max_tokens]
    s = engine.stats()
    assert s["cpu_blocks_restored"] > 50 and s["cpu_blocks_evicted"] > 0


# ---- KV events: the gateway's subscriber and index see both tiers -----------------------------------------


def _expected_tier(engine: LLMEngine, key: int) -> Tier | None:
    bm = engine.block_manager
    if key in bm.cached:
        return Tier.GPU
    return Tier.CPU if bm.cpu is not None and key in bm.cpu else None


def _check_index(index: PrefixIndex, target: str, engine: LLMEngine, prompts: list[list[int]]) -> int:
    """The index holds exactly the engine's blocks, each on its tier; returns CPU-only keys seen."""
    bm = engine.block_manager
    assert bm.cpu is not None
    assert index.keys_of(target) == set(bm.cached) | set(bm.cpu.blocks)
    cpu_only = 0
    for p in prompts:
        keys = block_keys(p, 8, namespace_seed("tiny"))
        tiers = [_expected_tier(engine, k) for k in keys]
        assert [index.holds(target, k) for k in keys] == tiers
        cpu_only += tiers.count(Tier.CPU)
        total = next((i for i, t in enumerate(tiers) if t is None), len(tiers))
        gpu = next((i for i, t in enumerate(tiers) if t is not Tier.GPU), len(tiers))
        assert index.match(keys).get(target, Overlap()) == Overlap(gpu, total - gpu)
    return cpu_only


async def _caught_up(sub: KvEventSubscriber, target: str, engine: LLMEngine) -> None:
    """Publish empty batches until the subscriber applied the last one (the tail is never late)."""
    pub = engine.publisher
    for _ in range(400):
        if sub.health()[target].last_seq == pub.last_seq and sub.healthy(target):
            return
        pub.publish([])
        await asyncio.sleep(0.025)
    raise AssertionError(f"subscriber stuck at {sub.health()[target].last_seq}, publisher at {pub.last_seq}")


async def test_kv_events_rebuild_both_tiers_in_the_gateway_index(model: torch.nn.Module) -> None:
    port, replay = free_port(), free_port()
    engine = _engine(model, num_kv_blocks=40, cpu_offload_blocks=24, kv_events_endpoint=f"tcp://*:{port}",
                     kv_events_replay_endpoint=f"tcp://127.0.0.1:{replay}")
    index = PrefixIndex()
    sub = KvEventSubscriber(index, SubscriberLimits(replay_timeout_s=2.0))
    try:
        (target,) = sub.add_worker(WorkerEvents("w", f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}",
                                                model="tiny", block_size=8))
        await _caught_up(sub, target, engine)
        rng = random.Random(9)
        prompts = _family_prompts(rng, 30)
        cpu_only = 0
        for rnd in range(3):
            batch = [rng.choice(prompts) for _ in range(12)]
            _run(engine, batch, arrivals=[rng.randrange(0, 20) for _ in batch])
            await _caught_up(sub, target, engine)
            cpu_only += _check_index(index, target, engine, prompts)
        s = engine.stats()
        assert cpu_only > 0 and s["cpu_blocks_evicted"] > 0 and s["cpu_blocks_restored"] > 0
        assert engine.reset_prefix_cache()  # AllBlocksCleared covers both tiers
        await _caught_up(sub, target, engine)
        assert engine.block_manager.cpu is not None and len(engine.block_manager.cpu) == 0
        assert index.keys_of(target) == set()
    finally:
        await sub.stop()
        engine.close()


# ---- worker processes: CLI, HTTP usage, metrics, disaggregation --------------------------------------------


@pytest.fixture(scope="module")
def cluster(module_procs: ProcessGroup) -> Iterator[Cluster]:
    c = Cluster(module_procs)
    ev, rp = free_port(), free_port()
    w = c.start("po", "prefill", "--num-kv-blocks", "24", "--cpu-offload-blocks", "64",
                "--kv-events-endpoint", f"tcp://*:{ev}", "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{rp}")
    w.proc.meta["events"] = (f"tcp://127.0.0.1:{ev}", f"tcp://127.0.0.1:{rp}")
    c.start("d", "decode")
    c.wait()
    yield c
    assert_no_leaks(c.alive())


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    return dict(r.json())


def _live(url: str) -> list[dict[str, Any]]:
    return list(httpx.get(f"{url}/kv_transfer/transfers", timeout=30).json()["transfers"])


async def test_worker_restores_from_cpu_over_http_and_the_index_sees_the_tiers(cluster: Cluster) -> None:
    po = cluster.workers["po"]
    endpoint, replay = po.proc.meta["events"]  # type: ignore[misc]
    index = PrefixIndex()
    sub = KvEventSubscriber(index, SubscriberLimits(replay_timeout_s=2.0))
    try:
        (target,) = sub.add_worker(WorkerEvents("po", str(endpoint), str(replay), model="tiny", block_size=16))
        await asyncio.sleep(0.3)  # the SUB joins (a later join is repaired by replay at the next batch)
        a, b = prompt_tokens(300, seed=21), prompt_tokens(300, seed=22)  # 18 full blocks each; the GPU holds 24
        keys_a = block_keys(a[:288], 16, namespace_seed("tiny"))
        m0 = metrics(po.url)
        first = _post(po.url, completion(a, 4))
        _post(po.url, completion(b, 4))
        await wait_for(lambda: index.match(keys_a).get(target, Overlap()).cpu_blocks > 0, what="a's CPU tier")
        assert index.match(keys_a)[target].blocks == 18  # every block of a is on one tier or the other
        again = _post(po.url, completion(a, 4))
        m1 = metrics(po.url)
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 288
        computed = "mesh_worker_prefill_computed_tokens_total"
        assert m1[computed] - m0[computed] == 300 + 300 + 12  # a, b, then only a's suffix
        assert m1["mesh_worker_cpu_blocks_restored_total"] > m0["mesh_worker_cpu_blocks_restored_total"]
        assert m1["mesh_worker_cpu_blocks_saved_total"] > m0["mesh_worker_cpu_blocks_saved_total"]
        assert m1["mesh_worker_cpu_kv_blocks_total"] == 64
        await wait_for(lambda: index.match(keys_a).get(target) == Overlap(18, 0), what="a back on the GPU")
        assert index.holds(target, keys_a[-1]) is Tier.GPU
    finally:
        await sub.stop()


async def test_disaggregated_prefill_with_offload_frees_blocks_only_after_both_consumers(cluster: Cluster) -> None:
    po, d = cluster.workers["po"].url, cluster.workers["d"].url
    assert status(po)["consumers"] == ["decode", "cpu_save"]
    try:
        for seed, order in ((30, "cpu_save first"), (31, "decode first")):
            set_faults(po, cpu_save_hold=order == "decode first")
            before, saved0 = status(po), metrics(po)["mesh_worker_cpu_blocks_saved_total"]
            body = completion(prompt_tokens(150, seed=seed), 6)  # 9 blocks move
            pre = _post(po, {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
            if order == "cpu_save first":
                await wait_for(lambda: bool(_live(po)) and _live(po)[0]["pending"] == ["decode"], what="the CPU save")
                s = status(po)
                assert s["transfers_active"] == 1 and s["pinned_blocks"] == 9  # saved, not pulled yet: still pinned
                assert metrics(po)["mesh_worker_cpu_blocks_saved_total"] - saved0 >= 9
            answer = _post(d, {**body, "kv_transfer_params": pre["kv_transfer_params"]})
            assert answer["choices"][0]["text"] == _post(po, body)["choices"][0]["text"]
            if order == "decode first":
                await wait_for(lambda: bool(_live(po)) and _live(po)[0]["pending"] == ["cpu_save"],
                               what="the decode's release")
                assert status(po)["pinned_blocks"] == 9  # pulled, but the CPU save has not reported
                set_faults(po, cpu_save_hold=False)
            await wait_for(lambda: status(po)["transfers_active"] == 0, what=f"the release ({order})")
            after = status(po)
            assert after["transfers_released_by_consumer"] == before["transfers_released_by_consumer"] + 1
            assert after["cpu_saves_ok"] == before["cpu_saves_ok"] + 1
            assert after["transfer_duplicate_releases"] == before["transfer_duplicate_releases"]
            assert after["leaked_blocks"] == 0 and after["pinned_blocks"] == 0
    finally:
        set_faults(po, cpu_save_hold=False)
