"""Hybrid targets in the prefix index: a match ends at a recurrent-state checkpoint.

The main test drives the real bundled engine (the tiny-hybrid preset, CPU) with random
multi-turn traffic under pressure (a small KV cache and a small checkpoint pool, so blocks and
checkpoints are evicted), sends every KV event batch it publishes through the wire (the worker's
encoder, msgpack, Mesh's decoder, ``mesh.events.apply``) into a ``PrefixIndex``, and after every
engine step compares ``match()`` with the engine's own resumable prefix (``BlockManager._match``:
attention blocks AND a checkpoint) for random queries. The router never claims a block more than
the engine would reuse, and never fewer."""

from __future__ import annotations

import random

import msgspec
import pytest
import torch

from mesh.core.index import PrefixIndex
from mesh.core.keys import block_keys, namespace_seed
from mesh.events.apply import Seeds, apply_event
from mesh.events.health import LogLimiter, StreamHealth
from mesh.events.stream import Stream, WorkerEvents
from mesh.events.wire import BlockRemoved, BlockStored, GroupFilter, decode_batch
from policies.base import Overlap
from workers.config import EngineConfig, get_preset
from workers.engine.llm_engine import LLMEngine
from workers.engine.sequence import SamplingParams, Sequence
from workers.model.decoder import build_model
from workers.server.kv_events import encode_event

HYB = get_preset("tiny-hybrid")
BS = 4
T = "w0"


class _WirePublisher:
    """Stands in for the worker's ZMQ publisher: each batch encoded as on the wire, decoded by
    Mesh's decoder and applied to the index in order, at once."""

    num_published = num_dropped = 0

    def __init__(self, index: PrefixIndex, model: str) -> None:
        self.index = index
        spec = WorkerEvents(worker=T, endpoint="tcp://127.0.0.1:1", model=model, block_size=BS)
        self.stream = Stream(spec, StreamHealth(T, T, 0, spec.endpoint, None))
        self.seeds, self.logs = Seeds(), LogLimiter()
        self.kinds: set[tuple[str, int | None, str | None]] = set()

    def publish(self, events: list[object]) -> None:
        payload = msgspec.msgpack.encode([0.0, [encode_event(e) for e in events], 0])  # type: ignore[arg-type]
        batch = decode_batch(payload)
        assert not isinstance(batch, (str,)) and hasattr(batch, "events"), batch
        assert not batch.unknown and not batch.malformed
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self.kinds.add(("stored", ev.group_idx, ev.kv_cache_spec_kind))
            elif isinstance(ev, BlockRemoved):
                self.kinds.add(("removed", ev.group_idx, None))
            for _ in apply_event(self.index, self.stream, ev, self.seeds, self.logs):
                pass

    def close(self) -> None:
        pass


def _truth(engine: LLMEngine, tokens: list[int]) -> int:
    """The engine's resumable prefix of ``tokens`` in blocks (what it would reuse if sent now)."""
    seq = Sequence("probe", tokens, SamplingParams(max_tokens=1), BS, engine._seed(None))
    return len(engine.block_manager._match(seq))


def _router(index: PrefixIndex, seed: int, tokens: list[int]) -> int:
    # the engine never reuses the block holding a prompt's last token: query the blocks before it
    keys = block_keys(tokens, BS, seed)[: (len(tokens) - 1) // BS]
    return index.match(keys).get(T, Overlap()).blocks


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_model(HYB, torch.device("cpu"), seed=0)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_index_matches_engine_resumable_prefix(model: torch.nn.Module, seed: int) -> None:
    rng = random.Random(seed)
    cfg = EngineConfig(device="cpu", cpu_threads=1, block_size=BS, num_kv_blocks=90, max_num_seqs=4,
                       max_num_batched_tokens=48, chunked_prefill_size=rng.choice([None, 11, 20]),
                       num_state_checkpoints=7, state_checkpoint_interval=rng.choice([0, 8, 20]))
    engine = LLMEngine(HYB, cfg, eos_token_id=257, model=model)
    index = PrefixIndex()
    index.mark_hybrid(T)  # the gateway's workers[].hybrid (before the first checkpoint event)
    pub = _WirePublisher(index, engine.model_name)
    engine.publisher = pub
    ns = namespace_seed(engine.model_name)
    sessions: list[list[int]] = [[rng.randrange(256) for _ in range(rng.randrange(3, 30))] for _ in range(5)]
    live: dict[str, int] = {}  # request id -> session
    out: dict[str, list[int]] = {}
    checks = claimed = 0
    for step in range(260):
        if len(live) < 3 and rng.random() < 0.5:  # a session's next turn
            s = rng.randrange(len(sessions))
            if s not in live.values():
                rid = f"s{s}-{step}"
                prompt = sessions[s] + [rng.randrange(256) for _ in range(rng.randrange(1, 12))]
                engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 30),
                                                               ignore_eos=True))
                sessions[s] = prompt
                live[rid], out[rid] = s, []
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
            if o.finished:
                s = live.pop(o.request_id)
                sessions[s] = sessions[s] + out[o.request_id]
        engine.block_manager.check(engine.scheduler.all_seqs())
        for _ in range(4):  # random queries: a session's history, cut or extended, or a fresh prompt
            base = rng.choice(sessions)
            q = base[: rng.randrange(1, len(base) + 1)] + [rng.randrange(256) for _ in range(rng.randrange(0, 6))]
            if len(q) < 2:
                continue
            truth, got = _truth(engine, q), _router(index, ns, q)
            assert got == truth, (step, len(q), got, truth)
            checks += 1
            claimed += got > 0
    assert index.is_hybrid(T)
    st = engine.stats()
    # the traffic exercised what the test is about
    assert checks > 500 and claimed > 50
    assert st["state_checkpoints_evicted"] > 0 and st["blocks_evicted"] > 0 and st["state_checkpoints_restored"] > 0
    assert st["prefix_unresumable_tokens"] > 0  # attention blocks the router must not have claimed
    assert ("stored", 1, "mamba") in pub.kinds and ("removed", 1, None) in pub.kinds
    assert ("stored", 0, "full_attention") in pub.kinds


def test_first_checkpoint_event_marks_the_target_hybrid(model: torch.nn.Module) -> None:
    """Without workers[].hybrid the index learns it from the first recurrent-group store."""
    engine = LLMEngine(HYB, EngineConfig(device="cpu", cpu_threads=1, block_size=BS, num_kv_blocks=64),
                       eos_token_id=257, model=model)
    index = PrefixIndex()
    engine.publisher = _WirePublisher(index, engine.model_name)
    engine.generate([list(range(30))], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert index.is_hybrid(T) and index.state_keys_of(T)


def test_hybrid_target_without_checkpoint_is_no_match() -> None:
    """Attention blocks alone are no hit for a hybrid target; a plain target beside it keeps its overlap."""
    index = PrefixIndex()
    seed = namespace_seed("m")
    tokens = list(range(40))
    keys = block_keys(tokens, BS, seed)
    hashes = [1000 + i for i in range(len(keys))]
    for t in ("hyb", "plain"):
        index.apply_stored(t, hashes, None, tokens, BS, seed)
    index.mark_hybrid("hyb")
    assert index.match(keys) == {"plain": Overlap(10, 0)}
    # a checkpoint after block 6 (hashes[6]); its parent is block 5's engine hash
    assert index.apply_state_stored("hyb", [hashes[6]], hashes[5], tokens[24:28], BS, seed) == 1
    assert index.match(keys) == {"plain": Overlap(10, 0), "hyb": Overlap(7, 0)}
    assert index.match(keys[:5]) == {"plain": Overlap(5, 0)}  # the checkpoint lies deeper than the query
    # vLLM's Mamba group shape: token_ids span null blocks before the one hash (it names the last block)
    assert index.apply_state_stored("hyb", [hashes[9]], hashes[6], tokens[28:40], BS, seed) == 1
    assert index.match(keys)["hyb"] == Overlap(10, 0)
    assert index.apply_state_removed("hyb", [hashes[9]]) == 1
    assert index.match(keys)["hyb"] == Overlap(7, 0)
    index.apply_cleared("hyb")
    assert index.is_hybrid("hyb") and "hyb" not in index.match(keys)


def test_group_filter_routes_recurrent_groups() -> None:
    f = GroupFilter()
    attn = BlockStored([1], None, [0] * BS, BS, "GPU", group_idx=0, kv_cache_spec_kind="full_attention")
    state = BlockStored([1], None, [0] * BS, BS, "GPU", group_idx=1, kv_cache_spec_kind="mamba")
    assert not f.is_state_stored(attn) and f.accept_stored(attn)
    assert not f.is_state_removed(BlockRemoved([1], "GPU", 1))  # the group is not known yet
    assert f.is_state_stored(state) and not f.accept_stored(state)
    assert f.is_state_removed(BlockRemoved([1], "GPU", 1))
    assert not f.is_state_removed(BlockRemoved([1], "GPU", 0)) and f.accept_removed(BlockRemoved([1], "GPU", 0))
