"""A MiniMax-shaped model (lightning attention beside full attention, sparse MoE, scaled
residuals; ``workers.hf_config`` builds this config from a MiniMaxForCausalLM checkpoint) on a
CUDA GPU: eager decode (no CUDA graphs), the Triton recurrent decode kernel and attention
kernels; greedy output equal to the CPU engine's (which ``tests/unit/workers/test_model_minimax.py``
holds to transformers) with checkpoints on and off, and a second turn resumed at a checkpoint.

Random weights (no transformers on the GPU image). Imports only torch, triton, numpy, xxhash and
the engine."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from workers.config import EngineConfig, ModelConfig, ResidualFactors  # noqa: E402
from workers.engine.llm_engine import LLMEngine  # noqa: E402
from workers.engine.sequence import SamplingParams  # noqa: E402
from workers.model.decoder import build_model  # noqa: E402

MM = ModelConfig(
    name="tiny-minimax", vocab_size=512, hidden_size=128, intermediate_size=96, num_layers=4, num_heads=4,
    num_kv_heads=2, head_dim=32, rope_theta=10000.0, rms_norm_eps=1e-5, dtype="float32", init_std=0.1,
    layer_types=("linear_attention", "full_attention", "linear_attention", "linear_attention"),
    linear_num_heads=4, linear_key_dim=32, linear_value_dim=32, linear_attention="lightning",
    num_experts=4, num_experts_per_tok=2, hf_architecture="minimax",
    residual_factors=ResidualFactors((1.4, 0.8), (0.9, 1.3), (1.2, 0.7)),
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
_CPU_MODEL = build_model(MM, torch.device("cpu"), seed=0)
_GPU_MODEL = build_model(MM, torch.device("cpu"), seed=0).to("cuda")


def _engine(device: str, **kw: object) -> LLMEngine:
    cfg: dict[str, object] = dict(device=device, num_kv_blocks=512, block_size=16, state_checkpoint_interval=32)
    cfg.update(kw)
    model = _GPU_MODEL if device == "cuda" else _CPU_MODEL
    return LLMEngine(MM, EngineConfig(**cfg), eos_token_id=2, model=model)  # type: ignore[arg-type]


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    head = [rng.randrange(3, 512) for _ in range(60)]
    return [head[: rng.randrange(20, 61)] + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 30))]
            for _ in range(6)]


@pytest.mark.parametrize("chunk", [None, 23])
def test_minimax_greedy_on_cuda_equals_cpu_with_and_without_checkpoints(chunk: int | None) -> None:
    prompts = _prompts()
    cpu = _engine("cpu", enable_prefix_caching=False, chunked_prefill_size=chunk, cpu_threads=4).generate(prompts, GREEDY)
    on = _engine("cuda", chunked_prefill_size=chunk)
    off = _engine("cuda", num_state_checkpoints=0, chunked_prefill_size=chunk)
    for _ in range(2):  # the second round hits the first round's checkpoints
        assert on.generate(prompts, GREEDY) == cpu
        assert off.generate(prompts, GREEDY) == cpu
    assert on.stats()["state_checkpoints_restored"] > 0
    assert not on.runner.graphs  # hybrid and MoE models decode eagerly


def test_minimax_second_turn_resumes_at_the_end_of_turn_checkpoint() -> None:
    prompt = _prompts()[0]
    eng = _engine("cuda")
    first = eng.generate([prompt], GREEDY)[0]
    follow = prompt + first + [7, 8, 9]
    second = eng.generate([follow], GREEDY)[0]
    assert eng.stats()["state_checkpoints_restored"] >= 1
    assert second == _engine("cpu", enable_prefix_caching=False, cpu_threads=4).generate([follow], GREEDY)[0]
