"""A progress line on stderr that works with and without a terminal.

On a terminal the line is rewritten in place (``\\r``) a few times a second; otherwise (a log
file, CI, a pipe) one full line is written every ``interval_s`` seconds, plus a last one at the
end: ``mesh replay: 120/400 requests, 2 errors, 31.0 s``.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressLine:
    def __init__(self, total: int, *, prefix: str = "mesh replay", stream: TextIO | None = None,
                 interval_s: float = 5.0, enabled: bool = True) -> None:
        self.total = total
        self.prefix = prefix
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval_s = interval_s
        self.enabled = enabled
        self._last = -1e9
        self._drawn = False

    def line(self, done: int, errors: int, elapsed_s: float) -> str:
        pct = f" ({done / self.total:.0%})" if self.total else ""
        return f"{self.prefix}: {done:,}/{self.total:,} requests{pct}, {errors:,} errors, {elapsed_s:.1f} s"

    def __call__(self, done: int, errors: int, elapsed_s: float) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        final = done >= self.total
        if not final and now - self._last < (0.2 if self.tty else self.interval_s):
            return
        self._last = now
        text = self.line(done, errors, elapsed_s)
        if self.tty:
            self.stream.write("\r\x1b[2K" + text + ("\n" if final else ""))
            self._drawn = not final
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
