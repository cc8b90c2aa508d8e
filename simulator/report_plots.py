"""The report's plots, as inline PNGs with an alt text naming each axis and its tick labels.

Time axes read in the unit the run's length asks for (hours past 3 h, minutes past 3 min,
seconds below), at most six ticks. When the run's busy stretch is short, the over-time plots get
a second block of panels over it: where some run's admission queue is at least a quarter of its
peak (WEKA's sessions all start at t=0: a burst of seconds in hours), else the densest tenth of
the run's arrivals when it holds at least twice its share. Legends sit outside the axes.

matplotlib stays an optional import: without it ``plots`` returns no figure and the page says so.
"""

from __future__ import annotations

import base64
import io
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from simulator.engine import RunResult

Figs = dict[str, tuple[str, str]]  # name -> (PNG data URL, alt text)
ZOOM_FRACTION = 0.1  # the busy window's width, of the whole run
ZOOM_FACTOR = 2.0  # ... shown when it holds at least this many times its share of the arrivals


@dataclass(frozen=True, slots=True)
class TimeAxis:
    """A stretch of the run's clock, [lo, hi] seconds, shown in ``unit`` (``scale`` s each)."""

    lo: float
    hi: float
    origin: float  # the run's start: tick labels count from it
    unit: str
    scale: float
    clock: str  # "simulated" / "replay"
    title: str = ""  # the panel row's title ('' for the whole run)

    @property
    def label(self) -> str:
        return f"{self.clock} time ({self.unit})"


def time_unit(span_s: float) -> tuple[str, float]:
    if span_s >= 3 * 3600:
        return "h", 3600.0
    return ("min", 60.0) if span_s >= 180 else ("s", 1.0)


def time_axis(lo: float, hi: float, origin: float, clock: str, title: str = "") -> TimeAxis:
    unit, scale = time_unit(hi - lo)
    return TimeAxis(lo, hi if hi > lo else lo + 1.0, origin, unit, scale, clock, title)


def densest_window(t: np.ndarray) -> tuple[float, float, str] | None:
    """(start, end, why) of the densest window of ``ZOOM_FRACTION`` of the span of ``t``; None
    when it holds less than ``ZOOM_FACTOR`` times its share."""
    if t.size < 20:
        return None
    t = np.sort(t)
    width = (t[-1] - t[0]) * ZOOM_FRACTION
    if width <= 0:
        return None
    counts = np.searchsorted(t, t + width, side="right") - np.arange(t.size)
    i = int(counts.argmax())
    share = counts[i] / t.size
    if share < ZOOM_FACTOR * ZOOM_FRACTION:
        return None
    return float(t[i]), float(t[i] + width), f"{share:.0%} of the arrivals"


def queue_window(results: dict[str, RunResult], span: float) -> tuple[float, float, str] | None:
    """(start, end, why) of the stretch where some run's queue is at least a quarter of its peak,
    padded; None without a queue, or when that stretch is not under half the run."""
    samples = [(r.queue_t, r.queue_len) for r in results.values() if r.queue_t.size]
    peak = max((float(q.max()) for _, q in samples), default=0.0)
    if peak < 2:
        return None
    busy = np.concatenate([t[q >= peak / 4] for t, q in samples])
    a, b = float(busy.min()), float(busy.max())
    pad = max(0.15 * (b - a), 0.002 * span, 1.0)
    a, b = max(a - pad, float(min(t.min() for t, _ in samples))), b + pad
    return (a, b, f"queue at least a quarter of its peak ({peak:,.0f})") if b - a <= span / 2 else None


def axes_for(results: dict[str, RunResult], clock: str) -> list[TimeAxis]:
    """The whole run's time axis, and the busy window's when there is one: where the queue
    builds up, else the densest tenth of the arrivals."""
    arrivals = np.concatenate([r.arrival for r in results.values()]) if results else np.zeros(0)
    if arrivals.size < 2:
        return []
    lo, hi = float(arrivals.min()), float(max(r.finish.max() for r in results.values() if r.finish.size))
    axes = [time_axis(lo, hi, lo, clock)]
    window = queue_window(results, hi - lo) or densest_window(arrivals)
    if window is not None:
        axes[0] = time_axis(lo, hi, lo, clock, "whole run")
        a, b, why = window
        unit, scale = time_unit(b - a)
        axes.append(time_axis(a, b, lo, clock, f"busiest window, {(a - lo) / scale:,.1f}-{(b - lo) / scale:,.1f} "
                                               f"{unit}: {why}"))
    return axes


def plots(results: dict[str, RunResult], clock: str = "simulated", queue: bool = True) -> Figs:
    """The report's figures by name (none without matplotlib or served requests)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}
    results = {k: r for k, r in results.items() if r.arrival.size}
    if not results:
        return {}
    axes = axes_for(results, clock)
    figs = {"ttft_cdf": ttft_cdf(plt, results), "hit_rate": over_time(plt, results, axes, hit_rate_panel,
                                                                    "prefix hit rate (token-weighted)", "Hit rate over time")}
    if queue:
        figs["queue"] = over_time(plt, results, axes, queue_panel, "requests waiting for admission",
                                  "Queue length over time (sampled at arrivals, mean and max per time bin)")
    figs["load"] = load(plt, results)
    return figs


def png(plt: Any, fig: Any, alt: str) -> tuple[str, str]:
    """The figure as (PNG data URL, alt text with every axis' label and tick labels); closed."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")  # draws: the tick labels are set after
    parts, seen = [alt], set()
    for ax in fig.axes:
        lo, hi = sorted(ax.get_xlim())
        ticks = ", ".join(plain(t.get_text()) for t in ax.get_xticklabels()
                          if t.get_text() and lo - 1e-9 * (hi - lo) <= t.get_position()[0] <= hi + 1e-9 * (hi - lo))
        key = (ax.get_xlabel(), ticks)
        if ax.get_visible() and ticks and key not in seen:
            seen.add(key)
            parts.append(f"x: {key[0]}, ticks {ticks}")
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode(), "; ".join(parts)


def plain(tick: str) -> str:
    """A tick label without mathtext: '$\\mathdefault{10^{-2}}$' reads '10^-2'."""
    return re.sub(r"[{}$]", "", tick.replace("\\mathdefault", "").replace("\\minus", "-").replace("\u2212", "-"))


def ttft_cdf(plt: Any, results: dict[str, RunResult]) -> tuple[str, str]:
    fig, ax = plt.subplots(figsize=(8, 4), constrained_layout=True)
    styles = ("-", "--", "-.", ":")  # with widths narrowing, equal curves stay visible on each other
    for k, (label, r) in enumerate(results.items()):
        ttft = np.sort((r.first_token - r.arrival)[r.worker >= 0])
        if ttft.size:
            ax.plot(ttft, np.arange(1, ttft.size + 1) / ttft.size, label=label, linestyle=styles[k % len(styles)],
                    linewidth=max(0.8, 3.0 - 0.5 * k))
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0)
    return png(plt, fig, "TTFT CDF per run")


Panel = Callable[[Any, RunResult, TimeAxis], None]


def over_time(plt: Any, results: dict[str, RunResult], axes: list[TimeAxis], draw: Panel, ylabel: str,
              title: str) -> tuple[str, str]:
    """A panel per run, a block of them per time axis (the whole run, then the busy window),
    every panel on the first one's y axis."""
    cols = min(len(results), 3)
    rows = -(-len(results) // cols)
    fig = plt.figure(figsize=(3.6 * cols + 0.8, (2.5 * rows + 0.5) * len(axes) + 0.6), layout="constrained")
    used: list[Any] = []
    for sub, taxis in zip(fig.subfigures(len(axes), 1, squeeze=False).ravel(), axes):
        grid = list(sub.subplots(rows, cols, squeeze=False).ravel())
        for ax in grid[len(results):]:
            ax.set_visible(False)
        for ax, (label, r) in zip(grid, results.items()):
            used.append(ax)
            ax.set_title(label, fontsize=9, loc="left")
            ax.grid(alpha=0.3)
            ax.set_xlim((taxis.lo - taxis.origin) / taxis.scale, (taxis.hi - taxis.origin) / taxis.scale)
            ax.xaxis.set_major_locator(plt.MaxNLocator(nbins=5))
            ax.set_xlabel(taxis.label, fontsize=8)
            draw(ax, r, taxis)
        if taxis.title:
            sub.suptitle(taxis.title, fontsize=9, x=0.02, ha="left")
    low, high = min(ax.get_ylim()[0] for ax in used), max(ax.get_ylim()[1] for ax in used)
    for ax in used:  # one y scale (sharing axes across subfigures redraws the figure at each limit)
        ax.set_ylim(low, high)
    fig.supylabel(ylabel)
    fig.suptitle(title)
    handles, labels = used[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside upper right", ncols=len(labels), fontsize=8)
    return png(plt, fig, title)


def _binned(t: np.ndarray, taxis: TimeAxis, n: int = 60) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(bin centres in the axis' unit, bin of each of ``t`` inside the axis, mask of those inside)."""
    inside = (t >= taxis.lo) & (t <= taxis.hi)
    edges = np.linspace(taxis.lo, taxis.hi, n + 1)
    idx = np.clip(np.digitize(t[inside], edges) - 1, 0, n - 1)
    return ((edges[:-1] + edges[1:]) / 2 - taxis.origin) / taxis.scale, idx, inside


def hit_rate_panel(ax: Any, r: RunResult, taxis: TimeAxis) -> None:
    served = r.worker >= 0
    t = r.arrival[served]
    ax.set_ylim(0, 1)
    if t.size < 2:
        return
    mid, idx, inside = _binned(t, taxis)
    h = np.bincount(idx, weights=r.hit[served][inside], minlength=mid.size)
    p = np.bincount(idx, weights=r.prompt[served][inside], minlength=mid.size)
    ok = p > 0
    ax.plot(mid[ok], h[ok] / p[ok], color="C0")


def queue_panel(ax: Any, r: RunResult, taxis: TimeAxis) -> None:
    if r.queue_t.size < 2:
        return
    mid, idx, inside = _binned(r.queue_t, taxis)
    q = r.queue_len[inside]
    n = np.bincount(idx, minlength=mid.size)
    mean = np.bincount(idx, weights=q, minlength=mid.size)
    peak = np.zeros(mid.size)
    np.maximum.at(peak, idx, q)
    ok = n > 0
    ax.fill_between(mid[ok], 0, peak[ok], color="C1", alpha=0.3, linewidth=0, label="max")
    ax.plot(mid[ok], mean[ok] / n[ok], color="C1", label="mean")


def load(plt: Any, results: dict[str, RunResult]) -> tuple[str, str]:
    """Requests per worker, a bar per run in each worker's group; the legend beside the axes."""
    first = next(iter(results.values()))
    fig, ax = plt.subplots(figsize=(max(7.0, 0.35 * len(first.workers) * len(results) + 2), 4),
                           constrained_layout=True)
    width = 0.8 / max(1, len(results))
    for k, (label, r) in enumerate(results.items()):
        counts = np.bincount(r.worker[r.worker >= 0], minlength=len(r.workers))
        ax.bar(np.arange(len(r.workers)) + k * width, counts, width=width, label=label)
    ax.set_xticks(np.arange(len(first.workers)) + 0.4 - width / 2)
    ax.set_xticklabels(first.workers, rotation=90 if len(first.workers) > 16 else 0)
    ax.set_xlabel("worker")
    ax.set_ylabel("requests prefilled")
    ax.set_title("Per-worker load")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0)
    return png(plt, fig, "Per-worker load")
