"""Fitting a timing profile's terms to what ``mesh calibrate`` measured (pure functions).

Prefill: every TTFT priced as the engine runs it, in steps of ``max_batched_tokens`` chunks
(``prefill_features``), all terms fitted at once by non-negative least squares
(``simulator.fit``); a TTFT that rises with the prompt always gets a positive per-token cost.
Decode: ``base + per_seq * B + per_ctx_token * C``. Mixed steps: the excess TTFT of a prompt
arriving while streams decode. A term that cannot be fitted is named with its reason.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from simulator.fit import TermFit, fit_terms, linear_slope
from simulator.profile import Profile


class CalibrationError(RuntimeError):
    """The endpoint could not be measured (unreachable, errors, no streaming)."""


def prefill_features(new: int, cached: int, chunk: int) -> list[float]:
    """What one request's prefill of ``new`` tokens after ``cached`` ones costs, in the profile's
    terms (``simulator.step_timing``): the engine runs it in steps of at most ``chunk`` tokens,
    each step ``base + per_token * c + per_token2 * c^2 + per_token_ctx * c * (tokens before it)``,
    and the cached prefix costs ``per_hit_token`` per token once. The columns are the sums of
    those terms: [steps, tokens, sum c^2, sum c * before, cached]."""
    steps = tok2 = ctx = 0.0
    done = cached
    left = new
    while left > 0:
        c = min(left, chunk)
        steps += 1
        tok2 += c * c
        ctx += c * done
        done += c
        left -= c
    return [steps, float(new), tok2, ctx, float(cached)]


PREFILL_TERMS = ("base", "per_token", "per_token2", "per_token_ctx", "per_hit_token")


def fit_prefill(cold: list[tuple[int, float]], context: list[tuple[int, int, float, float]],
                chunk: int) -> tuple[float, float, float, float, float]:
    """(base, per_token, per_token2, per_token_ctx, per_hit_token) in s (``fit_prefill_terms``)."""
    fit = fit_prefill_terms(cold, context, chunk)
    return tuple(fit.values[name] for name in PREFILL_TERMS)  # type: ignore[return-value]


def fit_prefill_terms(cold: list[tuple[int, float]], context: list[tuple[int, int, float, float]],
                      chunk: int) -> TermFit:
    """The prefill terms in s, one non-negative least-squares fit (``simulator.fit``) of every
    TTFT measured: the cold prompts (tokens, TTFT) and the prompts extending a cached context
    ((cached, new, TTFT, _) as ``_context_points`` records them), each priced as the engine runs
    it, in ``chunk``-token steps (``prefill_features``; its step count is the intercept). A cold
    prompt longer than a step measures the attention of its later steps over the earlier ones:
    the same ``per_token_ctx`` that a cached context costs.

    The per-token cost comes first: when TTFT rises with prompt length (the cold points' line,
    with an intercept, has a positive slope) and the finer terms (quadratic, context) take it
    all, leaving ``per_token`` at 0, they are left out one by one (named in ``unfitted``) until
    ``per_token`` is positive."""
    rows = [prefill_features(n, 0, chunk) for n, _ in cold]
    rows += [prefill_features(n, c, chunk) for c, n, _, _ in context if n > 0]
    ys = [t for _, t in cold] + [t for _, n, t, _ in context if n > 0]
    fit = fit_terms(PREFILL_TERMS, rows, ys)
    slope = linear_slope([n for n, _ in cold], [t for _, t in cold])
    if fit.values["per_token"] > 0 or slope is None or slope <= 0:
        if slope is not None and slope <= 0:
            fit.unfitted["per_token"] = "non-positive slope (TTFT did not rise with prompt length over the sweep)"
        return fit
    left_out: list[str] = []
    for finer in ("per_token2", "per_token_ctx"):
        left_out.append(finer)
        keep = [i for i, name in enumerate(PREFILL_TERMS) if name not in left_out]
        sub = fit_terms([PREFILL_TERMS[i] for i in keep], [[r[i] for i in keep] for r in rows], ys)
        if sub.values["per_token"] > 0:
            why = "left out: with it the fit put no cost on a prompt token (TTFT rises with prompt length)"
            return TermFit({**{name: 0.0 for name in left_out}, **sub.values},
                           {**sub.unfitted, **{name: why for name in left_out}})
    return fit


DECODE_TERMS = ("base", "per_seq", "per_ctx_token")


def fit_decode_terms(batch_pts: list[tuple[int, float, int]], ctx_pts: list[tuple[int, float]]) -> TermFit:
    """``base + per_seq * B + per_ctx_token * C`` (s) over all decode points."""
    rows = [[1.0, b, c] for b, _, c in batch_pts] + [[1.0, 1.0, c] for c, _ in ctx_pts]
    ys = [t for _, t, _ in batch_pts] + [t for _, t in ctx_pts]
    return fit_terms(DECODE_TERMS, rows, ys)


MIXED_TERMS = ("mixed", "mixed_per_seq", "mixed_per_token")


def fit_mixed_terms(points: list[tuple[int, int, float, float]]) -> TermFit:
    """The excess as ``mixed + mixed_per_seq * B + mixed_per_token * P`` (s, non-negative); a
    term whose variable took one value in the sweep is not measured."""
    if not points:
        return TermFit({name: 0.0 for name in MIXED_TERMS}, {name: "not measured" for name in MIXED_TERMS})
    bs = {b for b, _, _, _ in points}
    ps = {p for _, p, _, _ in points}
    rows = [[1.0, float(b) if len(bs) > 1 else 0.0, float(p) if len(ps) > 1 else 0.0] for b, p, _, _ in points]
    fit = fit_terms(MIXED_TERMS, rows, [e for _, _, e, _ in points])
    for name, values in (("mixed_per_seq", bs), ("mixed_per_token", ps)):
        if len(values) < 2:
            fit.unfitted[name] = "not measured (one value in the sweep)"
    return fit


def refit_prefill(profile: Profile, points: dict[str, Any]) -> Profile:
    """``profile`` with its prefill terms fitted again (``fit_prefill``, in steps of its
    ``max_batched_tokens``) from the points a ``mesh calibrate`` profile records under
    ``calibration.points``; the mixed-step terms are kept."""
    cold = [(int(n), float(t)) for n, t in points.get("prefill") or []]
    context = [(int(c), int(n), float(t), float(cold_t)) for c, n, t, cold_t in points.get("context") or []]
    if not cold:
        raise CalibrationError("the profile records no prefill points to fit")
    base, per_tok, per_tok2, per_ctx, per_hit = fit_prefill(cold, context, profile.max_batched_tokens)
    return replace(profile, prefill=replace(profile.prefill, base_ms=base * 1e3, per_token_ms=per_tok * 1e3,
                                            per_token2_ms=per_tok2 * 1e3, per_token_ctx_ms=per_ctx * 1e3,
                                            per_hit_token_ms=per_hit * 1e3))
