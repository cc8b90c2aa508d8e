"""What ``mesh up`` shows while its workers start: each worker's phase and its elapsed seconds.

A worker is ``starting`` (its process runs its imports: torch takes seconds), then ``loading model``
(it printed ``workers.server.cli.LOADING_LINE`` to its log: weights and KV cache being built),
then ``ready`` (``/health`` answers 200). An echo worker has no model: starting, then ready.

Two displays, picked by whether the stream (stderr) is a terminal, both with a line per phase
change (``mesh up: worker-0 loading model (2.1 s)``), so a log file tells the same story:

- a terminal: below those lines, one status line rewritten in place a few times a second;
- anything else (a file, a pipe, CI): every ``interval_s`` seconds without a change, a line naming
  each worker still pending, its phase and seconds, so a long load never looks hung.
"""

from __future__ import annotations

import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from workers.server.cli import LOADING_LINE  # no torch: the CLI module imports it lazily

STARTING, LOADING, READY = "starting", "loading model", "ready"


class StartupDisplay:
    def __init__(self, names: list[str], *, stream: TextIO | None = None, tty: bool | None = None,
                 interval_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)()) if tty is None else tty
        self.interval_s = interval_s
        self.clock = clock
        self.t0 = clock()
        self.phases = dict.fromkeys(names, STARTING)
        self._last_line = self.t0
        self._status_shown = False
        self._write(f"mesh up: starting {len(names)} workers ({', '.join(names)})")

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def set(self, name: str, phase: str) -> None:
        """``name`` is in ``phase`` now (a line when that is a change)."""
        if self.phases[name] == phase:
            return
        self.phases[name] = phase
        self._write(f"mesh up: {name} {phase} ({self.elapsed():.1f} s)")

    def tick(self) -> None:
        """Called a few times a second while waiting: the status line, or the periodic one."""
        pending = ", ".join(f"{n} {p}" for n, p in self.phases.items() if p != READY)
        if not pending:
            return
        text = f"  waiting {self.elapsed():.0f} s: {pending}"
        if self.tty:
            self.stream.write("\r\x1b[2K" + text)
            self.stream.flush()
            self._status_shown = True
        elif self.clock() - self._last_line >= self.interval_s:
            self._write("mesh up:" + text.removeprefix(" "))

    def done(self) -> None:
        self._write(f"mesh up: {len(self.phases)} workers ready in {self.elapsed():.1f} s; starting the gateway")

    def close(self) -> None:
        if self._status_shown:
            self.stream.write("\r\x1b[2K")
            self.stream.flush()
            self._status_shown = False

    def _write(self, line: str) -> None:
        self.close()
        self.stream.write(line + "\n")
        self.stream.flush()
        self._last_line = self.clock()


def worker_phase(port: int, log: Path, current: str) -> str:
    """A worker's phase now, from ``/health`` and its log (read until the loading line shows)."""
    if health_ok(f"http://127.0.0.1:{port}/health"):
        return READY
    if current == STARTING:
        try:
            if LOADING_LINE in log.read_text(errors="replace"):
                return LOADING
        except OSError:
            pass
    return current


def health_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return bool(resp.status == 200)
    except Exception:  # noqa: BLE001  (not up yet)
        return False


def wait_healthy(workers: list[Any], timeout_s: float, log_dir: Path, stream: TextIO | None = None) -> None:
    """Wait until every worker (``name``, ``port``, ``proc``) answers ``/health``, showing their
    phases; RuntimeError (with the log's tail) when one exits or ``timeout_s`` passes."""
    display = StartupDisplay([w.name for w in workers], stream=stream)
    deadline = time.monotonic() + timeout_s
    try:
        while any(p != READY for p in display.phases.values()):
            for w in workers:
                phase = display.phases[w.name]
                if phase == READY:
                    continue
                if w.proc.poll() is not None:
                    tail = (log_dir / f"{w.name}.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"{w.name} exited with code {w.proc.returncode} while {phase}:\n{tail}")
                display.set(w.name, worker_phase(w.port, log_dir / f"{w.name}.log", phase))
            if time.monotonic() > deadline:
                pending = sorted(n for n, p in display.phases.items() if p != READY)
                raise RuntimeError(f"workers not healthy after {timeout_s:.0f} s: {pending} (logs in {log_dir})")
            display.tick()
            time.sleep(0.1)
        display.done()
    finally:
        display.close()
