"""L2 prefetch branches in the decode graphs (workers/prefetch.py) change no value: greedy output
is the same with the prefetcher off and in each mode (weights and K/V pages), and the branches
were really captured. Imports only torch, triton, numpy, xxhash and the engine."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from workers.config import EngineConfig, get_preset  # noqa: E402
from workers.engine import LLMEngine  # noqa: E402
from workers.model import build_model  # noqa: E402
from workers.sequence import SamplingParams  # noqa: E402

CUDA = torch.device("cuda")
TINY = get_preset("tiny")


def _generate(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
        out[f"r{i}"] = []
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return [out[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("spec", [
    {"mode": "line_el", "distance": 2, "kv": "down"},
    {"mode": "line", "distance": 1, "kv": "qkv"},
    {"mode": "bulk", "distance": 2, "kv": "down", "ctas": 4},
])
def test_prefetch_branches_leave_greedy_output_unchanged(spec: dict) -> None:
    model = build_model(TINY, CUDA, seed=0)
    rng = random.Random(3)
    prompts = [[rng.randrange(258) for _ in range(rng.randrange(5, 120))] for _ in range(12)]
    runs = []
    for prefetch in (None, dict(spec, min_tensor_bytes=0)):  # tiny weights: prefetch them all
        cfg = EngineConfig(device="cuda", cuda_graphs=True, num_kv_blocks=128, max_model_len=1024,
                           extra={"l2_prefetch": prefetch})
        engine = LLMEngine(TINY, cfg, eos_token_id=257, model=model)
        runs.append(_generate(engine, prompts))
        assert engine.runner.graphs and engine.runner.num_graph_replays > 0
        pf = engine.runner.prefetcher
        if prefetch is None:
            assert pf is None
        else:  # per graph: 4 linears x 4 layers + 4 K/V page sets
            assert pf is not None and pf.num_launches >= len(engine.runner.graphs) * 20
    assert runs[0] == runs[1]
    # the hooks are gone after capture: an eager forward of the shared model launches nothing more
    assert not any(m._forward_pre_hooks for m in model.modules())
