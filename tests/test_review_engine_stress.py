"""Review: seeded stress of the engine in-process (tiny preset, CPU) and the bugs it found.

Each test is the smallest sequence that failed before its fix."""

from __future__ import annotations

import torch
import pytest

from mesh.keys import block_keys
from workers.block_ops import BlockOps
from workers.config import EngineConfig, get_preset
from workers.engine import LLMEngine
from workers.model import build_model
from workers.sequence import SamplingParams

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
