"""The hybrid preset on a CUDA GPU: the engine's Triton decode kernel for the recurrent layers
(eager, no CUDA graphs for hybrid models), greedy output identical with checkpoints on and off
and without a prefix cache, and equal to the CPU engine's; a follow-up turn resumes from the
end-of-turn checkpoint and computes only its suffix.

Imports only torch, triton, numpy, xxhash and the engine."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from workers.config import EngineConfig, get_preset  # noqa: E402
from workers.engine.llm_engine import LLMEngine  # noqa: E402
from workers.engine.sequence import SamplingParams  # noqa: E402
from workers.model.decoder import build_model  # noqa: E402

HYB = get_preset("tiny-hybrid")
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


_CPU_MODEL = build_model(HYB, torch.device("cpu"), seed=0)  # random draws differ by device type: one set of weights
_GPU_MODEL = build_model(HYB, torch.device("cpu"), seed=0).to("cuda")


def _engine(device: str, **kw: object) -> LLMEngine:
    cfg: dict[str, object] = dict(device=device, num_kv_blocks=512, block_size=16, state_checkpoint_interval=32)
    cfg.update(kw)
    model = _GPU_MODEL if device == "cuda" else _CPU_MODEL
    return LLMEngine(HYB, EngineConfig(**cfg), eos_token_id=257, model=model)  # type: ignore[arg-type]


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    head = [rng.randrange(256) for _ in range(60)]
    return [head[: rng.randrange(20, 61)] + [rng.randrange(256) for _ in range(rng.randrange(1, 30))] for _ in range(8)]


@pytest.mark.parametrize("chunk", [None, 16, 23])
def test_hybrid_greedy_equal_with_and_without_checkpoints(chunk: int | None) -> None:
    prompts = _prompts()
    ref = _engine("cuda", enable_prefix_caching=False, chunked_prefill_size=chunk).generate(prompts, GREEDY)
    on = _engine("cuda", chunked_prefill_size=chunk)
    off = _engine("cuda", num_state_checkpoints=0, chunked_prefill_size=chunk)
    for _ in range(2):
        assert on.generate(prompts, GREEDY) == ref
        assert off.generate(prompts, GREEDY) == ref
    st = on.stats()
    assert st["state_checkpoints_restored"] > 0 and st["prefix_cache_hits"] > 0
    assert not on.runner.graphs  # hybrid models decode eagerly
    cpu = _engine("cpu", enable_prefix_caching=False, chunked_prefill_size=chunk, cpu_threads=4).generate(prompts, GREEDY)
    assert cpu == ref  # the Triton recurrent decode and attention kernels agree with the CPU path


def test_follow_up_turn_computes_only_its_suffix() -> None:
    eng = _engine("cuda")
    prompt = list(range(100, 117))
    out = eng.generate([prompt], SamplingParams(temperature=0.0, max_tokens=512, ignore_eos=True))[0]
    st = eng.stats()
    before = st["prefill_computed_tokens"] + st["decode_computed_tokens"]
    eng.add_request("t2", prompt + out + [42], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    st = eng.stats()
    assert outs[-1].num_cached_tokens == 528
    assert st["prefill_computed_tokens"] + st["decode_computed_tokens"] - before == 2
