"""The hybrid preset (recurrent layers beside full attention) in the engine on CPU: recurrent-state
checkpoints never change a greedy token, a hit resumes only where a checkpoint exists, and a turn
after a finished turn computes only its new suffix. Integrity is checked after every step."""

from __future__ import annotations

import random
from collections.abc import Sequence as Seq

import pytest
import torch

from workers.config import EngineConfig, get_preset
from workers.engine.block_manager import BlockRemoved, BlockStored
from workers.engine.llm_engine import LLMEngine
from workers.engine.sequence import SamplingParams, Sequence
from workers.engine.state_checkpoints import GROUP, KIND
from workers.model.decoder import build_model

HYB = get_preset("tiny-hybrid")
BS = 16
# Top-2 logit margin (relative to the top logit) under which a greedy step is a near tie: a
# resumed prefix batches its tokens differently, and fp32 reordering (~1e-6 relative on the
# logits; which kernels run depends on the CPU's ISA) may then pick either of the tied tokens.
NEAR_TIE = 1e-5


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_model(HYB, torch.device("cpu"), seed=0)


def _engine(model: torch.nn.Module, **kw: object) -> LLMEngine:
    cfg: dict[str, object] = dict(device="cpu", num_kv_blocks=512, cpu_threads=1, block_size=BS)
    cfg.update(kw)
    return LLMEngine(HYB, EngineConfig(**cfg), eos_token_id=257, model=model)  # type: ignore[arg-type]


def _run(engine: LLMEngine, prompts: Seq[list[int]], params: SamplingParams,
         arrivals: Seq[int] | None = None) -> list[list[int]]:
    """Add request i at step ``arrivals[i]``; step to completion, checking integrity each step."""
    arrivals = arrivals or [0] * len(prompts)
    out: dict[str, list[int]] = {}
    pending = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    step, base = 0, len(engine.requests)
    tag = f"t{engine.num_steps}-"
    while pending or engine.has_unfinished():
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            engine.add_request(f"{tag}{i}", list(prompts[i]), params)
            out[f"{tag}{i}"] = []
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        engine.block_manager.check(engine.scheduler.all_seqs())
        step += 1
    assert base == 0
    return [out[f"{tag}{i}"] for i in range(len(prompts))]


class _Recorder:
    """Stands in for the KV event publisher: keeps every batch's events."""

    def __init__(self, into: list[object]) -> None:
        self.into = into

    def publish(self, events: list[object]) -> None:
        self.into += events


class _Candidates:
    """Wraps an engine's sampler: keeps, per request and step, the tokens whose logit is within
    the near-tie margin of the top one (one token where the step is decided)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.sample = engine.runner.sampler
        self.steps: dict[str, list[set[int]]] = {}
        engine.runner.sampler = self  # type: ignore[assignment]

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        top = logits.max(dim=-1, keepdim=True).values
        tied = logits >= top - NEAR_TIE * top.abs().clamp_min(1.0)
        for row, seq in zip(tied, seqs, strict=True):
            self.steps.setdefault(seq.request_id, []).append(set(row.nonzero().flatten().tolist()))
        return self.sample(logits, seqs)

    def run(self, tag: str, n: int) -> list[list[set[int]]]:
        """The candidates of requests ``{tag}0`` .. ``{tag}{n-1}`` (``_run``'s ids)."""
        return [self.steps[f"{tag}{i}"] for i in range(n)]


def _agreed(got: list[int], ref: list[int], candidates: list[set[int]]) -> int:
    """Steps of ``got`` checked against the reference ``ref``: every token is the reference's up to
    the first near tie, which may go either way (the runs diverge legitimately after it)."""
    assert len(got) == len(ref) == len(candidates)
    for j, (token, want, cands) in enumerate(zip(got, ref, candidates, strict=True)):
        assert want in cands
        assert token in cands, f"step {j}: token {token}, reference {want} (candidates {sorted(cands)})"
        if len(cands) > 1:
            return j + 1
    return len(got)


def _computed(engine: LLMEngine) -> int:
    st = engine.stats()
    return int(st["prefill_computed_tokens"] + st["decode_computed_tokens"])


def test_preset_shape() -> None:
    assert HYB.attention_layers == [1, 3] and HYB.recurrent_layers == [0, 2] and HYB.is_hybrid
    eng = LLMEngine(HYB, EngineConfig(device="cpu", num_kv_blocks=8, cpu_threads=1, max_num_seqs=4,
                                      num_state_checkpoints=5), eos_token_id=257)
    assert eng.runner.kv_cache.shape[0] == 2  # K/V only for the full-attention layers
    assert tuple(eng.runner.states.shape) == (2, 2 * 4 + 5, 4, 32, 32)  # type: ignore[union-attr]


@pytest.mark.parametrize("chunk", [None, 7, 16, 45])
def test_checkpoints_never_change_greedy_output(model: torch.nn.Module, chunk: int | None) -> None:
    """Families of prompts sharing prefixes, two rounds, staggered arrivals: identical tokens with
    checkpoints on (hits resumed), checkpoints off, and no prefix cache at all, up to a near tie
    of the reference (nearly all steps have none); the hits happen, and only at checkpoint
    positions."""
    rng = random.Random(chunk or 0)
    heads = [[rng.randrange(256) for _ in range(70)] for _ in range(3)]
    prompts = [heads[i % 3][: rng.randrange(20, 71)] + [rng.randrange(256) for _ in range(rng.randrange(1, 30))]
               for i in range(9)]
    arrivals = [rng.randrange(0, 12) for _ in prompts]
    params = _greedy(24)
    kw = dict(chunked_prefill_size=chunk, state_checkpoint_interval=32, max_num_batched_tokens=96)
    ref_engine = _engine(model, enable_prefix_caching=False, **kw)
    cands = _Candidates(ref_engine)
    ref = _run(ref_engine, prompts, params, arrivals)
    near = cands.run("t0-", len(prompts))
    off = _engine(model, num_state_checkpoints=0, **kw)
    on = _engine(model, **kw)
    checked = 0
    for _ in range(2):  # the second round hits what the first left
        for engine in (off, on):
            got = _run(engine, prompts, params, arrivals)
            checked += sum(_agreed(g, r, c) for g, r, c in zip(got, ref, near, strict=True))
    assert checked >= 0.9 * 4 * len(prompts) * params.max_tokens  # near ties are rare
    s_on, s_off = on.stats(), off.stats()
    assert s_off["prefix_cache_hits"] == 0 and s_off["prefix_unresumable_tokens"] > 0
    assert s_on["prefix_cache_hits"] > 0 and s_on["state_checkpoints_restored"] > 0
    assert s_on["prefix_cache_hits"] % BS == 0


def test_restored_state_is_the_state(model: torch.nn.Module) -> None:
    """The equality above is not vacuous: zeroing the checkpoints changes what a resumed turn says."""
    prompt = list(range(30, 95))
    first = _run(_engine(model), [prompt], _greedy(12))[0]
    follow = prompt + first + [7, 8, 9]
    ref = _run(_engine(model, enable_prefix_caching=False), [follow], _greedy(12))[0]
    eng = _engine(model)
    _run(eng, [prompt], _greedy(12))
    states = eng.block_manager.states
    assert states is not None and len(states) > 0
    # boundary buffers and pool (the end-of-turn promotion is a copy queued for the next step)
    eng.runner.states[:, eng.config.max_num_seqs :] = 0  # type: ignore[index]
    assert _run(eng, [follow], _greedy(12))[0] != ref


def test_turn_after_finished_turn_computes_only_its_suffix(model: torch.nn.Module) -> None:
    """A 17-token prompt, 512 generated tokens; the next turn (everything + 1 new token) resumes
    from the end-of-turn checkpoint at 528 tokens (512 generated reused) and computes 2 tokens."""
    eng = _engine(model)
    prompt = list(range(100, 117))
    out = _run(eng, [prompt], _greedy(512))[0]
    assert len(out) == 512
    follow = prompt + out + [42]  # 530 tokens; the last generated one was never computed
    before, restored = _computed(eng), eng.stats()["state_checkpoints_restored"]
    eng.add_request("turn2", follow, _greedy(1))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert outs[-1].num_cached_tokens == 528
    assert _computed(eng) - before == 2
    assert eng.stats()["state_checkpoints_restored"] == restored + 1
    ref = _run(_engine(model, enable_prefix_caching=False), [follow], _greedy(1))[0]
    assert outs[-1].new_token_ids == ref


def test_interval_checkpoint_and_truthful_counters(model: torch.nn.Module) -> None:
    """A 300-token prompt leaves checkpoints at 128 and 256 (interval 128) and its end of turn; a
    prompt sharing 200 tokens resumes at 128 (blocks up to 192 exist, no checkpoint there):
    cached_tokens 128, the 64 matched but unresumable tokens counted."""
    rng = random.Random(3)
    prompt = [rng.randrange(256) for _ in range(300)]
    assert EngineConfig(block_size=BS, state_checkpoint_interval=100).checkpoint_interval_tokens == 112  # whole blocks
    eng = _engine(model, state_checkpoint_interval=128)
    _run(eng, [prompt], _greedy(1))
    other = prompt[:200] + [rng.randrange(256) for _ in range(20)]
    eng.add_request("b", other, _greedy(1))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert outs[-1].num_cached_tokens == 128
    st = eng.stats()
    assert st["prefix_unresumable_tokens"] == 192 - 128
    # 128, 256 (interval), 288 (first turn's end), 208 (second turn's end)
    assert st["state_checkpoints_saved"] == 4
    assert st["state_checkpoints_end_of_turn"] == 2


def test_checkpoint_events_and_lru_eviction(model: torch.nn.Module) -> None:
    """Checkpoints are announced as the recurrent group's BlockStored (one block: its key, parent
    and tokens) and evicted least recently used first, with a BlockRemoved of that group."""
    eng = _engine(model, num_state_checkpoints=2, state_checkpoint_interval=0)
    events: list[object] = []
    eng.publisher = _Recorder(events)
    rng = random.Random(5)
    prompts = [[rng.randrange(256) for _ in range(40)] for _ in range(3)]
    for p in prompts:
        _run(eng, [p], _greedy(1))
    eng.publisher = None
    stored = [e for e in events if isinstance(e, BlockStored) and e.group_idx == GROUP]
    removed = [e for e in events if isinstance(e, BlockRemoved) and e.group_idx == GROUP]
    assert [e.kind for e in stored] == [KIND] * 3
    assert all(len(e.block_hashes) == 1 and len(e.token_ids) == BS and e.parent_block_hash is not None for e in stored)
    assert [e.block_hashes for e in removed] == [stored[0].block_hashes]  # the oldest one went
    attn = [e for e in events if isinstance(e, BlockStored) and e.group_idx != GROUP]
    assert attn and all(e.group_idx == 0 and e.kind == "full_attention" for e in attn)
    # each checkpoint's key is its block's chained key, as the attention group announced it
    attn_keys = {h for e in attn for h in e.block_hashes}
    assert all(e.block_hashes[0] in attn_keys for e in stored)
    assert eng.stats()["state_checkpoints_evicted"] == 1


def test_a_hybrid_worker_without_checkpoints_refuses_a_disaggregated_role() -> None:
    """A transferred hybrid prefix resumes only at a state checkpoint: a prefill or decode worker
    without any is refused at start (the KV transfer would move nothing it could resume from)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "workers.server.cli", "--preset", "tiny-hybrid", "--role", "decode",
                           "--device", "cpu", "--num-kv-blocks", "16", "--cpu-threads", "1", "--state-checkpoints", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "needs --state-checkpoints > 0" in done.stderr, done.stderr[-500:]
