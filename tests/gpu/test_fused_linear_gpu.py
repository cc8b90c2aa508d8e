"""``workers.fused_linear`` on the GPU (bf16): the shared checks of ``tests/fused_checks.py``,
the planner's own split-K plans on real model shapes, and an engine whose decode graphs run the
fused path producing the same greedy tokens as one that does not."""

from __future__ import annotations

import pytest
import torch

from tests import fused_checks
from workers import fused_linear as fl

pytestmark = pytest.mark.gpu


def test_cases_match_reference() -> None:
    assert len(fused_checks.check_cases("cuda", torch.bfloat16)) == len(fused_checks.CASES)


def test_tiny_model_fused_forward_matches() -> None:
    assert "same greedy tokens" in fused_checks.check_model("cuda", torch.bfloat16)


@pytest.mark.parametrize("m", [1, 7, 64, 200])
@pytest.mark.parametrize("shape", [(1152, 896, False, True), (896, 896, False, False),
                                   (4864, 896, True, False), (896, 4864, False, False),
                                   (4096, 14336, False, False)])
def test_planned_shapes_match_reference(m: int, shape: tuple[int, int, bool, bool]) -> None:
    n, k, glu, bias = shape
    gen = torch.Generator(device="cuda").manual_seed(m * 7 + n)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(2 * n if glu else n, k, device="cuda", generator=gen) / k**0.5).bfloat16()
    b = torch.randn(n, device="cuda", generator=gen).bfloat16() if bias else None
    nw = (torch.rand(k, device="cuda", generator=gen) + 0.5).bfloat16() if k == 896 else None
    res = None if glu or k == 896 else torch.randn(m, n, device="cuda", generator=gen).bfloat16()
    if nw is not None:
        got = fl.ResidualStream(x.clone()).norm_linear(w, nw, 1e-6, bias=b, glu=glu)
        want = fused_checks.reference(x, w, b, nw, glu=glu)
    else:
        got = fl.fused_linear(x, w, bias=b, glu=glu, residual=res)
        want = fused_checks.reference(x, w, b, glu=glu, residual=res)
    assert fused_checks._ulps(got, want) <= 2.0
    tickets = fl._WORKSPACE.tickets.get(x.device)
    assert tickets is None or int(tickets.abs().sum()) == 0


def test_engine_greedy_equal_with_and_without_fused_decode() -> None:
    from workers.config import EngineConfig, get_preset
    from workers.engine import LLMEngine
    from workers.sequence import SamplingParams

    outs = []
    for mode in ("off", "on"):
        engine = LLMEngine(get_preset("qwen2-0.5b"), EngineConfig(device="cuda", num_kv_blocks=512, max_num_seqs=16,
                                                                   max_graph_batch_size=16, fused_decode=mode))
        assert engine.runner.model.fused_small_batches == (mode == "on")
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        prompts = [[(i * 37 + j * 11) % 5000 + 1 for j in range(40 + 13 * i)] for i in range(12)]
        outs.append(engine.generate(prompts, params))
        del engine
        torch.cuda.empty_cache()
    same = sum(a == b for a, b in zip(outs[0], outs[1], strict=True))
    assert same >= 11, f"only {same}/12 greedy outputs equal with the fused decode"
