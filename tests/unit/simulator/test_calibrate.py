"""The prefill fit of ``mesh calibrate``: TTFTs priced in the engine's steps recover the profile."""

from __future__ import annotations

import numpy as np
import pytest

from simulator.calibrate_fit import fit_prefill, fit_prefill_terms, prefill_features, refit_prefill
from simulator.fit import fit_terms, nnls
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


def test_a_ttft_rising_with_the_prompt_fits_a_positive_per_token_cost() -> None:
    """TTFT from 140 to 614 ms over a sweep whose curve the quadratic term alone fits better: the
    per-token cost still comes out positive (the quadratic left out, and named), never 0."""
    cold = [(n, 0.140 + 0.474 * (n / 8192) ** 3) for n in (16, 64, 256, 1024, 2048, 4096, 8192)]
    fit = fit_prefill_terms(cold, [], 8192)
    assert fit.values["per_token"] * 8192 == pytest.approx(0.474, rel=0.25)
    assert fit.values["base"] > 0
    assert "per_token" not in fit.unfitted and "per_token2" in fit.unfitted
    assert fit_prefill(cold, [], 8192)[1] == fit.values["per_token"]


def test_terms_it_cannot_fit_are_named_with_the_reason() -> None:
    flat = [(n, 0.1) for n in (16, 256, 1024)]
    fit = fit_prefill_terms(flat, [], 8192)
    assert fit.values["per_token"] == 0.0 and "non-positive slope" in fit.unfitted["per_token"]
    assert "not measured" in fit.unfitted["per_hit_token"]  # no cached-context point
    few = fit_terms(("base", "per_seq", "per_ctx_token"), [[1.0, 1.0, 40.0], [1.0, 2.0, 80.0]], [0.01, 0.012])
    assert "too few points" in few.unfitted["per_ctx_token"]
    assert few.values["per_seq"] == pytest.approx(0.002) and few.values["base"] == pytest.approx(0.008)


def test_nnls_recovers_nonnegative_coefficients_and_clips_the_rest() -> None:
    a = np.array([[1.0, x, x * x] for x in np.linspace(0, 100, 20)])
    assert nnls(a, a @ np.array([2.0, 0.5, 0.01])) == pytest.approx([2.0, 0.5, 0.01], rel=1e-8)
    y = a @ np.array([2.0, -0.5, 0.0])  # falls with x: the x term is clipped at 0, the rest refitted
    x = nnls(a, y)
    assert x[1] == 0.0 and (x >= 0).all()


def test_the_workers_capacity_is_recorded_not_the_base_profiles() -> None:
    import argparse

    from simulator.calibrate import WorkerCapacity, resolve_capacity
    from simulator.profile import BUILTIN

    base = BUILTIN["h200-8b"]
    args = argparse.Namespace(kv_blocks=None, block_size=None)
    assert resolve_capacity(args, base, WorkerCapacity(16384, 16, "the worker's /metrics"))[:2] == (16, 16384)
    assert resolve_capacity(args, base, WorkerCapacity(8192, 32, "m"))[:2] == (32, 8192)  # its own block size
    assert resolve_capacity(args, base, WorkerCapacity(262144, 1, "sglang tokens"))[:2] == (16, 16384)
    assert resolve_capacity(args, base, WorkerCapacity(1000, None, "bundled"))[:2] == (16, 1000)
    kept = resolve_capacity(args, base, None)
    assert kept[1] == base.kv_blocks and "reported no KV capacity" in kept[2]
    assert resolve_capacity(argparse.Namespace(kv_blocks=5, block_size=None), base, WorkerCapacity(9, 16, "m"))[1] == 5
