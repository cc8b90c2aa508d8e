"""Least-squares fits of cost terms that say which terms they could not fit.

``fit_terms`` fits ``y ~ sum(coef_i * x_i)`` with every coefficient >= 0 (a cost never pays
back time): non-negative least squares (Lawson-Hanson, on columns scaled to unit norm so
that a count of 1 and a count of 10^8 weigh alike). A term it cannot fit is set to 0 and named
in ``TermFit.unfitted`` with the reason, never a silent 0:

- "not measured": no point exercises it (its column is all zeros);
- "too few points": fewer measurements than terms, the last terms (the finer ones) left out;
- "non-positive slope": the best fit with it free wants it <= 0 (the measurements do not grow
  with it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, slots=True)
class TermFit:
    values: dict[str, float]  # every term, fitted or 0
    unfitted: dict[str, str] = field(default_factory=dict)  # term -> why it is 0

    def merged(self, other: TermFit) -> TermFit:
        return TermFit({**self.values, **other.values}, {**self.unfitted, **other.unfitted})


def nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin ||a x - y|| over x >= 0 (Lawson-Hanson active set)."""
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    m = a / scale
    n = m.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 10 * np.finfo(float).eps * max(m.shape) * max(1.0, float(np.abs(m).sum(axis=0).max()))
    for _ in range(3 * n + 3):
        w = m.T @ (y - m @ x)
        free = ~passive & (w > tol)
        if not free.any():
            break
        passive[int(np.argmax(np.where(free, w, -np.inf)))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(m[:, passive], y, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            bad = passive & (z <= 0)
            alpha = float(np.min(x[bad] / (x[bad] - z[bad])))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
    out: np.ndarray = x / scale
    return out


def fit_terms(names: Sequence[str], rows: Sequence[Sequence[float]], ys: Sequence[float]) -> TermFit:
    """Fit the terms ``names`` (the columns of ``rows``, coarsest first) to ``ys``."""
    a = np.asarray(rows, dtype=float).reshape(len(rows), len(names))
    y = np.asarray(ys, dtype=float)
    values = {name: 0.0 for name in names}
    unfitted: dict[str, str] = {}
    cols = []
    for i, name in enumerate(names):
        if not a.size or not np.any(a[:, i]):
            unfitted[name] = "not measured (no measurement exercises it)"
        else:
            cols.append(i)
    while cols and len(y) < len(cols):
        unfitted[names[cols[-1]]] = f"too few points ({len(y)} measured for {len(cols)} terms)"
        cols.pop()
    if cols:
        coef = nnls(a[:, cols], y)
        for i, c in zip(cols, coef, strict=True):
            if c > 0:
                values[names[i]] = float(c)
            else:
                unfitted[names[i]] = "non-positive slope (the measurements do not grow with it)"
    return TermFit(values, unfitted)


def linear_slope(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """The slope of the least-squares line with an intercept (None: fewer than 2 distinct xs)."""
    if len(set(xs)) < 2:
        return None
    slope, _ = np.polyfit(np.asarray(xs, dtype=float), np.asarray(ys, dtype=float), 1)
    return float(slope)
