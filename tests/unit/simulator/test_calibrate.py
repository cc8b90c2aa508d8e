"""The prefill fit of ``mesh calibrate``: TTFTs priced in the engine's steps recover the profile."""

from __future__ import annotations

import pytest

from simulator.calibrate import fit_prefill, prefill_features, refit_prefill
from simulator.profile import Profile
from simulator.step_timing import StepTiming

TRUE = (0.015, 1.4e-5, 1.4e-9, 1.2e-9, 0.0)  # base, per token, per token^2, per token x context, per hit (s)


def ttft(new: int, cached: int, chunk: int) -> float:
    return sum(c * x for c, x in zip(TRUE, prefill_features(new, cached, chunk), strict=True))


def test_a_prompt_of_two_steps_measures_the_attention_over_the_first() -> None:
    cold = [(n, ttft(n, 0, 8192)) for n in (25, 263, 1018, 2021, 4028, 8040, 16049)]
    fit = fit_prefill(cold, [], 8192)  # no cached-context point at all
    assert fit == pytest.approx(TRUE, rel=1e-6, abs=1e-12)


def test_cached_contexts_and_cold_prompts_fit_together() -> None:
    cold = [(n, ttft(n, 0, 4096)) for n in (64, 1024, 4000)]
    context = [(c, n, ttft(n, c, 4096), 0.0) for c, n in ((1024, 256), (4016, 1000), (4016, 10), (256, 64))]
    assert fit_prefill(cold, context, 4096) == pytest.approx(TRUE, rel=1e-6, abs=1e-12)


def test_the_features_are_the_simulators_step_costs() -> None:
    profile = refit_prefill(Profile(max_batched_tokens=8192), {"prefill": [[n, ttft(n, 0, 8192)] for n in
                                                                            (25, 1018, 4028, 8040, 16049)]})
    steps = StepTiming(profile, 16)
    by_steps = steps.prefill_step(8192, 0, 0, 0, 0, 0, 0) + steps.prefill_step(16049 - 8192, 8192 * (16049 - 8192),
                                                                                  0, 0, 0, 0, 0)
    assert by_steps == pytest.approx(ttft(16049, 0, 8192), rel=1e-6)
