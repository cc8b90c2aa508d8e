"""Rate-limited logging: a few lines per kind of trouble, then a count of the rest.

A peer that misbehaves in a loop (a publisher sending garbage, clients sending broken bodies,
clients that stop reading) would otherwise write a line per occurrence; the counters on
``/metrics`` count every one. Two policies: ``LogLimiter`` keeps ``burst`` lines per key (a
source and a kind of trouble) per window and, when the window turns over, one line saying how
many were left out; ``RateLimitedWarning`` writes one warning of its kind per period and a timed
summary of the ones it held (the summary comes even if no further warning does).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

LOG_EVERY_S = 10.0  # client write timeouts are logged at most once per this (the rest summed up)


class LogLimiter:
    """At most ``burst`` lines per key (a source and a kind of trouble) per ``window_s`` on ``logger``;
    ``what`` names the sources in the left-out line ("kv events w0: 3 more ...")."""

    def __init__(self, logger: logging.Logger, what: str, burst: int = 5, window_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.what = logger, what
        self.burst, self.window_s, self.clock = burst, window_s, clock
        self._windows: dict[tuple[str, str], list[float]] = {}  # key -> [window start, lines, left out]

    def log(self, level: int, key: tuple[str, str], msg: str, *args: object, exc_info: bool = False) -> None:
        now = self.clock()
        w = self._windows.get(key)
        if w is None or now - w[0] >= self.window_s:
            if w is not None and w[2]:
                self.logger.log(level, "%s %s: %d more %r lines left out in the last %.0f s", self.what, key[0],
                                int(w[2]), key[1], now - w[0])
            if len(self._windows) > 4096:  # bounded: keys may come from peers, never trust that
                self._windows.clear()
            w = self._windows[key] = [now, 0, 0]
        if w[1] < self.burst:
            w[1] += 1
            self.logger.log(level, msg, *args, exc_info=exc_info)
        else:
            w[2] += 1


class RateLimitedWarning:
    """Warnings of one kind, at most one line per ``every_s``: the first in full; the ones within
    ``every_s`` of the last line are held and counted, and one line says how many when that time
    is up (a timer on the running loop; else the next call writes it). Loop-thread only."""

    __slots__ = ("_log", "_what", "_every_s", "_clock", "_last_line", "_held", "_timer")

    def __init__(self, logger: logging.Logger, what: str, every_s: float = LOG_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log = logger
        self._what = what  # plural noun, e.g. "client write timeouts"
        self._every_s = every_s
        self._clock = clock
        self._last_line = float("-inf")  # clock time of the last line written
        self._held = 0  # warnings since then, not written
        self._timer: asyncio.TimerHandle | None = None  # writes the summary when the period ends

    def warning(self, msg: str, *args: object) -> None:
        now = self._clock()
        if self._held and now - self._last_line >= self._every_s:  # the timer did not run (no loop, or a late one)
            self.flush()
        if now - self._last_line >= self._every_s:
            self._log.warning(msg, *args)
            self._last_line = now
            return
        self._held += 1
        if self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return  # no loop: the next call writes the summary
            self._timer = loop.call_later(self._last_line + self._every_s - now, self.flush)

    def flush(self) -> None:
        """Write the summary of the held warnings, if any (a new period starts with it)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._held:
            return
        now = self._clock()
        self._log.warning("%s: %d more in the last %.3g s (logged at most once per %g s)",
                          self._what, self._held, now - self._last_line, self._every_s)
        self._held = 0
        self._last_line = now
