"""Bounded graceful shutdown for the gateway and the bundled worker (uvicorn underneath).

The first SIGTERM or SIGINT closes the listener (new connections are refused) and lets the
requests in flight finish for up to ``shutdown_timeout_s``; then ``on_timeout`` runs, so the app
ends what is left with a clean error (an error event and the end of a stream, an error answer
otherwise), and ``GRACE_S`` later uvicorn cancels whatever still runs. A second SIGTERM or SIGINT
stops at once. ``exit_code`` is 0 after a drain (finished or bounded), 1 after a forced stop.

uvicorn alone waits for every connection without a bound (a long stream held a SIGTERM'd gateway
for as long as it lasted), only a second SIGINT forced it (a second SIGTERM did nothing), and it
re-raised the signal once done, so a clean drain exited by SIGTERM (status -15) instead of 0.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import uvicorn

DEFAULT_SHUTDOWN_TIMEOUT_S = 25.0  # below Kubernetes' default 30 s grace, so the clean errors go out
GRACE_S = 2.0  # after on_timeout, for the error answers to be written


def add_argument(parser: Any) -> None:
    parser.add_argument(
        "--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S, metavar="S",
        help="on SIGTERM/Ctrl-C, let requests in flight finish for up to S seconds, then end them with an "
             f"error (default {DEFAULT_SHUTDOWN_TIMEOUT_S:g}); a second signal stops at once",
    )


class GracefulServer(uvicorn.Server):
    def __init__(
        self, config: uvicorn.Config, *, name: str, shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
        on_timeout: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        if shutdown_timeout_s < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0, not {shutdown_timeout_s:g}")
        config.timeout_graceful_shutdown = int(shutdown_timeout_s + GRACE_S + 1)  # uvicorn's last resort
        super().__init__(config)
        self.name = name
        self.shutdown_timeout_s = shutdown_timeout_s
        self.on_timeout = on_timeout
        self._hook: asyncio.Task[None] | None = None

    @property
    def exit_code(self) -> int:
        return 1 if self.force_exit else 0

    def stop(self) -> None:
        """Start a drain from the program itself (``mesh up`` when a worker died)."""
        self.should_exit = True

    def handle_exit(self, sig: int, frame: Any) -> None:
        # Nothing is recorded for uvicorn to re-raise at the end: the exit status is exit_code.
        name = signal.Signals(sig).name
        if self.should_exit:
            self.force_exit = True
            _say(f"{self.name}: {name} again: stopping now")
            return
        self.should_exit = True
        busy = len(self.server_state.tasks)
        if busy:
            _say(f"{self.name}: {name}: finishing {busy} request(s) in flight for up to "
                 f"{self.shutdown_timeout_s:g} s (send it again to stop now)")

    async def shutdown(self, sockets: Any = None) -> None:
        timer = asyncio.get_running_loop().call_later(self.shutdown_timeout_s, self._timed_out)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()
            if self._hook is not None:
                await asyncio.gather(self._hook, return_exceptions=True)

    def _timed_out(self) -> None:
        busy = len(self.server_state.tasks)
        if not busy or self.force_exit:
            return
        _say(f"{self.name}: shutdown timeout ({self.shutdown_timeout_s:g} s): ending {busy} request(s) with an error")
        if self.on_timeout is not None:
            self._hook = asyncio.ensure_future(self.on_timeout())


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
