"""Paces KV event work on the gateway's loop: short slices, and a bounded share of the loop.

Index mutation stays on the loop (the router writes speculative entries there too: one thread
owns the index). Every stream task calls ``turn()`` before each unit of work (a frame, a slice of
a large frame). A slice ends after ``slice_s`` of work (a turn after a pause or ``idle()`` starts
a fresh one: a rest is only ever owed for time worked; a gap longer than any unit of work yields
once first, since a unit stretched by a starved CPU looks the same as a pause), and
then the loop is left alone for long enough that event work uses at most ``share`` of the loop while a flood lasts (``slice_s`` work,
then ``slice_s * (1 - share) / share`` rest; a rest shorter than ``_MIN_REST_S`` is a plain
yield). A request's callbacks thus wait at most one slice behind event work, and a flood past what
that share can apply piles up in the streams' inboxes until their budget resets them
(``mesh.events.inbox``). One ``Pacer`` is shared by every stream of a subscriber: the share is
the subscriber's, not each stream's. Ownership: used on the loop only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

_MIN_REST_S = 0.0002
_GAP_S = 0.002


class Pacer:
    def __init__(self, slice_s: float = 0.0005, share: float = 0.5,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if slice_s <= 0 or not 0 < share <= 1:
            raise ValueError(f"pacer needs slice_s > 0 and 0 < share <= 1, got {slice_s}, {share}")
        self.slice_s, self.share, self.clock = slice_s, share, clock
        self._start = 0.0  # when the current slice began
        self._idle = True  # no work since ``idle()``: the next turn starts a fresh slice
        self._last = 0.0  # the last turn; a turn more than ``_gap_s`` later starts a fresh slice too
        self._gap_s = max(4 * slice_s, _GAP_S)  # (no unit of event work runs that long: a pause)
        self._resume_at = 0.0  # no event work before this (a rest in progress)
        self.slices = 0  # slices ended (tests, debugging)
        self.rested_s = 0.0

    async def turn(self) -> None:
        """Before a unit of event work: returns at once within a slice, else yields or rests."""
        now = self.clock()
        if now < self._resume_at:  # another stream's rest: wait it out
            await asyncio.sleep(self._resume_at - now)
            self._fresh()
        elif self._idle:  # the stream waited for frames (the loop ran meanwhile): a new slice
            self._start = now
        elif now - self._last > self._gap_s:
            # longer than any unit of event work: a pause nobody worked through, or a unit stretched
            # by a starved CPU. No rest is owed for it, but the loop may not have run: yield once.
            await asyncio.sleep(0)
            self._fresh()
        elif now - self._start >= self.slice_s:
            worked = min(now - self._start, self._gap_s)  # never a rest for time nobody worked
            rest = worked * (1 - self.share) / self.share
            self.slices += 1
            if rest >= _MIN_REST_S:
                self._resume_at = now + rest
                self.rested_s += rest
                await asyncio.sleep(rest)
            else:
                await asyncio.sleep(0)
            self._fresh()
        self._idle = False
        self._last = self.clock()

    def idle(self) -> None:
        """A stream has nothing left to do (it is about to wait for frames)."""
        self._idle = True

    def _fresh(self) -> None:
        self._start = self.clock()
