"""Late binding: a request that finds every worker of its model at its in-flight ceiling waits here.

A held request is decided only once some target can take it, on the index and load as they are
then: each lease released (``released``, the router's release hook) wakes the first request in
line, which decides again. Invariants:
- FIFO: a request arriving while others wait joins the back of the line; a woken request that
  still finds no room (the freed target serves another model, or a newcomer took it) keeps its
  place and hands the wake-up to the next one.
- Bounded: at most ``admission.max_waiting`` requests wait (one more is answered 429 at once),
  each at most ``admission.max_wait_s`` (then 503), and never past its request's deadline
  (``server.request_timeout_s``: the wait counts against it); ``max_waiting: 0`` turns holding off.
- A request that leaves the line without a lease (cancelled, timed out) passes on a wake-up it
  was given, so a freed slot is never lost.
- Every ``RECHECK_S`` a waiter decides again without being woken: workers added, healed or
  reconfigured free capacity that no lease release announces.
Owned by the gateway (``Gateway.admission``); the proxy holds requests in it, the router feeds it.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from mesh.config import AdmissionConfig
from mesh.errors import MeshError
from mesh.metrics import Metrics

RECHECK_S = 0.25

T = TypeVar("T")


class OverCapacity(MeshError):
    """Every worker serving the request's model is at its in-flight ceiling (``max_in_flight``)."""

    def __init__(self) -> None:
        super().__init__(429, "every worker serving this model is at its in-flight limit", code="over_capacity",
                         headers={"retry-after": "1"})


class _Waiter:
    __slots__ = ("woken",)

    def __init__(self) -> None:
        self.woken = asyncio.Event()


class AdmissionQueue:
    """The line of held requests (the module docstring); ``limits`` reads the live config."""

    def __init__(self, limits: Callable[[], AdmissionConfig], metrics: Metrics) -> None:
        self._limits = limits
        self._line: deque[_Waiter] = deque()
        self.held_total = 0  # requests that waited at all
        self._wait_hist = metrics.histogram("mesh_admission_wait_seconds",
                                            "Time a request waited at the gateway for a worker with room")
        self._turned_away = metrics.counter("mesh_admission_rejected_total",
                                            "Requests refused while held: the line was full or the wait too long",
                                            ["reason"])
        metrics.add_collector(self._families)

    @property
    def waiting(self) -> int:
        return len(self._line)

    def released(self, _target: object = None) -> None:
        """A lease ended (capacity freed somewhere): wake the first request in line not yet woken."""
        for waiter in self._line:
            if not waiter.woken.is_set():
                waiter.woken.set()
                return

    async def admit(self, route: Callable[[], T], deadline: float | None = None) -> T:
        """``route()``'s result, at once when a target has room and nobody waits, else once a
        target frees. ``route`` raises ``OverCapacity`` while every candidate is full.
        ``deadline``: the request's (monotonic); the wait ends there at the latest."""
        limits = self._limits()
        if not self._line:
            try:
                return route()
            except OverCapacity:
                if limits.max_waiting == 0:
                    raise
        if len(self._line) >= limits.max_waiting:
            self._turned_away.labels("full").inc()
            raise MeshError(429, f"every worker serving this model is at its in-flight limit and {len(self._line)} "
                                 "requests already wait (admission.max_waiting)", code="over_capacity",
                            headers={"retry-after": "1"})
        max_wait_s = limits.max_wait_s
        if deadline is not None:
            max_wait_s = min(max_wait_s, deadline - time.monotonic())
        return await self._hold(route, max_wait_s)

    async def _hold(self, route: Callable[[], T], max_wait_s: float) -> T:
        waiter = _Waiter()
        self._line.append(waiter)
        self.held_total += 1
        start = time.monotonic()
        served = False
        try:
            while True:
                left = max_wait_s - (time.monotonic() - start)
                if left <= 0:
                    self._turned_away.labels("timeout").inc()
                    raise MeshError(503, f"no worker serving this model had room within {max_wait_s:g} s "
                                         "(admission.max_wait_s)", code="queue_timeout", headers={"retry-after": "1"})
                try:  # asyncio.timeout, not wait_for: a cancel (the client left) is never swallowed
                    async with asyncio.timeout(min(left, RECHECK_S)):
                        await waiter.woken.wait()
                except TimeoutError:
                    pass
                try:
                    result = route()
                except OverCapacity:
                    if waiter.woken.is_set():
                        waiter.woken.clear()
                        self._wake_after(waiter)
                    continue
                served = True
                return result
        finally:
            self._line.remove(waiter)
            if not served and waiter.woken.is_set():
                self.released()  # the wake-up this request was given goes to the next one
            self._wait_hist.observe(time.monotonic() - start)

    def _wake_after(self, waiter: _Waiter) -> None:
        """Hand a wake-up ``waiter`` could not use to the next request behind it not yet woken."""
        behind = False
        for other in self._line:
            if other is waiter:
                behind = True
            elif behind and not other.woken.is_set():
                other.woken.set()
                return

    def _families(self) -> list[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        return [GaugeMetricFamily("mesh_admission_waiting", "Requests waiting at the gateway for a worker with room",
                                  value=len(self._line)),
                CounterMetricFamily("mesh_admission_held", "Requests that waited at the gateway for a worker with room",
                                    value=self.held_total)]
