"""Rate-limited logging: a few lines per kind of trouble, then a count of the rest.

A peer that misbehaves in a loop (a publisher sending garbage, clients sending broken bodies)
would otherwise write a line per occurrence; the counters on ``/metrics`` count every one, the
log keeps ``burst`` lines per key per window and, when the window turns over, one line saying
how many were left out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


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
