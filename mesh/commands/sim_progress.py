"""The progress of a ``mesh simulate`` run: every run (one policy at one worker count) in turn.

Two displays, picked by whether the stream (stderr) is a terminal:

- a terminal: rich's bar, rewritten in place, with the requests done and an ETA;
- anything else (a file, a pipe, CI): plain lines from a ticker thread, the first within
  ``first_s`` seconds of a run's start and then one every ``interval_s`` seconds, whatever the
  simulator is doing (a long step, a slow policy): ``mesh simulate: run 2/4 kv_aware: 1,024/9,762
  requests (10%), 31 s; ETA 4 min 40 s (all runs: 15 min)``.

Both print a line when a run ends (``finished``), so a log shows each result as it lands; a step
before the runs (``phase``: the trace load, which takes a while on a large directory) ticks too. The
ticker only reads the simulator's finished-request count (``Simulator.done``, an int written by
the simulating thread): it never touches simulation state. One lock orders every write.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO


def duration(seconds: float) -> str:
    """``42 s``, ``4 min 40 s``, ``2 h 05 min``."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


class SimProgress:
    def __init__(self, runs: int, *, stream: TextIO | None = None, interval_s: float = 5.0, first_s: float = 2.0,
                 tty: bool | None = None, enabled: bool = True, console: Any = None) -> None:
        self.runs = runs
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)()) if tty is None else tty
        self.interval_s = interval_s
        self.first_s = first_s
        self.enabled = enabled
        self.console = console  # the rich console of the terminal display
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._run = 0  # runs started
        self._label = ""
        self._total = 0
        self._count: Callable[[], int] = lambda: 0
        self._run_started = 0.0
        self._line: Callable[[float], str] = self.line  # what the ticker writes
        self._bar: Any = None
        self._task: Any = None

    # -- the run's lifecycle (main thread) --
    def say(self, text: str) -> None:
        """One line, now (loading, warnings of the progress's own)."""
        if self.enabled:
            self._write(f"mesh simulate: {text}")

    def phase(self, text: str) -> None:
        """A step before the runs (the trace load) begins: said now, then, without a terminal,
        how long it has taken so far on the ticker's schedule, until ``close``."""
        if not self.enabled:
            return
        self._write(f"mesh simulate: {text}")
        if not self.tty:
            begun = time.monotonic()
            self._line = lambda now: f"mesh simulate: {text}: {duration(now - begun)} so far"
            self._start_ticker()

    def start(self, label: str, total: int, count: Callable[[], int]) -> None:
        """Run ``label`` begins: ``count()`` says how many of its ``total`` requests finished."""
        self._run += 1
        self._label, self._total, self._count = label, total, count
        self._run_started = time.monotonic()
        if not self.enabled:
            return
        if self.tty:
            self._start_bar()
        else:
            self._write(f"mesh simulate: run {self._run}/{self.runs} {label}: {total:,} requests")
            self._line = self.line
            self._start_ticker()

    def update(self, done: int) -> None:
        """The simulator's progress callback (the bar; the ticker reads ``count()`` itself)."""
        if self._bar is not None:
            self._bar.update(self._task, completed=done)

    def finished(self, line: str) -> None:
        """The current run ended; ``line`` says its result."""
        self._stop_display()
        if self.enabled:
            self._write(f"mesh simulate: run {self._run}/{self.runs} {line}")

    def close(self) -> None:
        self._stop_display()

    # -- what a line says --
    def line(self, now: float) -> str:
        done, total = self._count(), self._total
        elapsed = now - self._run_started
        pct = f" ({done / total:.0%})" if total else ""
        text = f"mesh simulate: run {self._run}/{self.runs} {self._label}: {done:,}/{total:,} requests{pct}, " \
               f"{duration(elapsed)}"
        eta = self.eta(done, elapsed)
        if eta is None:
            return text + "; ETA: once more requests finish"
        run_left, all_left = eta
        more = f" (all runs: {duration(all_left)})" if self._run < self.runs else ""
        return text + f"; ETA {duration(run_left)}{more}"

    def eta(self, done: int, elapsed: float) -> tuple[float, float] | None:
        """(seconds left in this run, seconds left in all runs), at this run's pace; the runs not
        started are taken to last as long as this one will (None: too few requests finished to
        extrapolate from, under 0.5% of them or 10)."""
        if not self._total or done < min(self._total, max(10, self._total // 200)):
            return None
        run_total = elapsed * self._total / done
        run_left = max(0.0, run_total - elapsed)
        return run_left, run_left + run_total * (self.runs - self._run)

    # -- displays --
    def _write(self, text: str) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.console.print(text, highlight=False, markup=False, soft_wrap=True)
                return
            self.stream.write(text + "\n")
            self.stream.flush()

    def _start_ticker(self) -> None:
        self._stop.clear()
        thread = threading.Thread(target=self._tick, name="mesh-simulate-progress", daemon=True)
        thread.start()
        self._thread = thread  # only once started: an interrupt inside start() leaves nothing to join

    def _tick(self) -> None:
        wait = min(self.first_s, self.interval_s)
        while not self._stop.wait(wait):
            self._write(self._line(time.monotonic()))
            wait = self.interval_s

    def _start_bar(self) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                             TextColumn("ETA"), TimeRemainingColumn(), console=self.console, transient=True)
        self._bar.start()
        self._task = self._bar.add_task(f"run {self._run}/{self.runs} {self._label}", total=self._total)

    def _stop_display(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        if self._bar is not None:
            with self._lock:
                self._bar.stop()
                self._bar = None
