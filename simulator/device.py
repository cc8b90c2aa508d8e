"""Workers that time-share one device: a step's pace depends on how many of them are busy.

Processes on one GPU without MPS take turns on it (time-slicing): while ``k`` of them have work
in flight, each advances at a fraction of its pace alone. The profile gives the two measured
ends (``simulator.profile``): a step's cost alone, and its cost while ``shared_workers`` (``N``)
workers are all busy. A step whose costs are ``alone`` and ``shared`` (``sigma = shared /
alone``, at least 1: sharing never speeds a step up) runs ``slowdown(k)`` times slower than
alone while ``k`` workers are busy, linear in the busy workers between the two measurements::

    slowdown(k) = 1 + (k - 1) * (sigma - 1) / (N - 1)

(without a shared measurement: ``k``, fair time-slicing). The pace changes whenever a worker
of the device starts or stops being busy, also in the middle of a step: a step is a fixed
amount of work (its cost alone) done at the pace of the moment (processor sharing).

Ownership: ``Device`` owns the set of its busy workers; each worker owns its segment's progress
(``Paced``: work done, the pace, the end time) and is told to re-pace (``repace``) when the busy
count changes. A worker is busy from the start of a segment until it goes idle.
"""

from __future__ import annotations

from typing import Protocol


class Paced(Protocol):
    """A worker whose running segment can change pace."""

    def repace(self, t: float, busy: int) -> None: ...


class Device:
    """One device time-shared by its workers (see the module docstring)."""

    def __init__(self, measured_workers: int) -> None:
        if measured_workers == 1 or measured_workers < 0:
            raise ValueError(f"measured workers must be 0 (not measured) or >= 2, got {measured_workers}")
        self.measured = measured_workers
        self.busy: list[Paced] = []  # in the order they became busy

    def slowdown(self, k: int, sigma: float) -> float:
        """How many times slower than alone a step of cost ratio ``sigma`` runs with ``k`` busy."""
        if k <= 1:
            return 1.0
        if not self.measured:
            return float(k)
        return 1.0 + (k - 1) * (max(sigma, 1.0) - 1.0) / (self.measured - 1)

    def start(self, worker: Paced, t: float) -> int:
        """``worker`` is busy from ``t`` (no-op if it was); the busy count."""
        if worker not in self.busy:
            self.busy.append(worker)
            self._repace_others(worker, t)
        return len(self.busy)

    def stop(self, worker: Paced, t: float) -> None:
        """``worker`` is idle from ``t`` (no-op if it was)."""
        if worker in self.busy:
            self.busy.remove(worker)
            self._repace_others(worker, t)

    def _repace_others(self, worker: Paced, t: float) -> None:
        k = len(self.busy)
        for other in self.busy:
            if other is not worker:
                other.repace(t, k)
