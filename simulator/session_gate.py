"""Closed-loop admission of session groups: at most N in flight, nothing released past a horizon.

The rules are ``mesh replay``'s client's (``mesh.replay.client``), in simulated time, so that a
simulated run issues exactly the requests a live replay of the same plan would:

- a *session group* is a set of requests linked by dependencies (``session_groups``; a replay
  plan passes its own, ``Trace.groups``); groups are admitted in order of first arrival (ties by
  group number), each taking one of ``concurrency`` slots (0: no limit) until every one of its
  requests has ended or been skipped;
- a group admitted at ``t`` later than its first arrival ``s`` has its dependency-free requests
  shifted by ``t - s``; a group is admitted no earlier than the one before it;
- with a horizon ``H``: a group whose first arrival is past ``H``, or reached once the group
  before it was admitted after ``H``, is never admitted; a request whose release time is past
  ``H`` is skipped, and so are its dependents still waiting; requests released in time run to
  their end.

State per request only moves forward: WAITING -> LAUNCHED -> SETTLED, or WAITING -> SETTLED
(skipped). ``free`` slots + admitted groups not yet done == ``concurrency`` (when limited).
Pure bookkeeping: the engine asks, the gate answers with the releases to schedule.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

Release = tuple[int, float]  # (request index, release time s)

_WAITING, _LAUNCHED, _SETTLED = 0, 1, 2


class GatedRequest(Protocol):
    """What the gate reads of a trace request."""

    @property
    def arrival(self) -> float | None: ...

    @property
    def deps(self) -> tuple[tuple[int, int, float], ...]: ...


def session_groups(requests: Sequence[GatedRequest]) -> list[int]:
    """Each request's group: the union of the requests linked by dependencies (which point
    backwards), numbered in order of first appearance."""
    parent = list(range(len(requests)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for idx, r in enumerate(requests):
        for p, _, _ in r.deps:
            a, b = find(idx), find(p)
            if a != b:
                parent[max(a, b)] = min(a, b)
    label: dict[int, int] = {}
    return [label.setdefault(find(i), len(label)) for i in range(len(requests))]


class SessionGate:
    """Which requests are released when (see the module docstring for the rules)."""

    def __init__(self, requests: Sequence[GatedRequest], groups: Sequence[int], concurrency: int = 0,
                 horizon_s: float | None = None) -> None:
        if len(groups) != len(requests):
            raise ValueError(f"{len(groups)} group labels for {len(requests)} requests")
        if concurrency < 0:
            raise ValueError(f"concurrency must be >= 0 (0: no limit), got {concurrency}")
        self.requests = requests
        self.group_of = list(groups)
        n_groups = max(self.group_of, default=-1) + 1
        self.members: list[list[int]] = [[] for _ in range(n_groups)]
        for i, g in enumerate(self.group_of):
            self.members[g].append(i)
        self.succ: list[list[int]] = [[] for _ in requests]
        for i, r in enumerate(requests):
            for p, _, _ in r.deps:
                self.succ[p].append(i)
        starts = [min((a for i in m if (a := requests[i].arrival) is not None and not requests[i].deps),
                      default=math.inf) for m in self.members]
        self.start = starts
        self.order = sorted(range(n_groups), key=lambda g: (starts[g], g))
        self.next = 0  # position in ``order`` of the next group to admit
        self.last_admit = 0.0  # when the previous group was admitted
        self.limited = concurrency > 0
        self.free = concurrency
        self.horizon = math.inf if horizon_s is None else float(horizon_s)
        self.state = [_WAITING] * len(requests)
        self.left = [len(m) for m in self.members]  # requests of each group not SETTLED
        self.admitted = [False] * n_groups  # holds a slot now
        self.skipped: set[int] = set()  # requests settled unsent

    # ------------------------------------------------------------------ the engine's calls
    def open(self) -> list[Release]:
        """The releases at the start of the run (time 0)."""
        return self._admit(0.0)

    def fired(self, j: int, at: float, now: float) -> list[Release]:
        """Request ``j``'s last dependency fired at ``now``, asking for its release at ``at``."""
        if self.state[j] != _WAITING:
            return []
        if at > self.horizon:
            return self._skip(j, now)
        self.state[j] = _LAUNCHED
        return [(j, at)]

    def ended(self, i: int, now: float) -> list[Release]:
        """Request ``i`` ended (served or refused) at ``now``."""
        return self._settle(i, now)

    def released(self, i: int) -> bool:
        """Whether request ``i`` was (or is to be) sent: launched, or settled but not skipped."""
        return self.state[i] != _WAITING and i not in self.skipped

    # ------------------------------------------------------------------ rules
    def _admit(self, now: float) -> list[Release]:
        out: list[Release] = []
        while self.next < len(self.order):
            g = self.order[self.next]
            start = self.start[g]
            if start > self.horizon or self.last_admit > self.horizon:
                self.next += 1
                for i in self._arrivals(g):
                    out += self._skip(i, now)
                continue
            if self.limited and self.free == 0:
                break
            self.next += 1
            self.free -= 1
            self.admitted[g] = True
            at = max(now, start, self.last_admit)
            self.last_admit = at
            out += self._launch_group(g, at - start, now)
        return out

    def _arrivals(self, g: int) -> list[int]:
        return [i for i in self.members[g] if self.requests[i].arrival is not None and not self.requests[i].deps
                and self.state[i] == _WAITING]

    def _launch_group(self, g: int, shift: float, now: float) -> list[Release]:
        out: list[Release] = []
        for i in self._arrivals(g):
            at = self.requests[i].arrival + shift  # type: ignore[operator]
            if at > self.horizon:
                out += self._skip(i, now)
            else:
                self.state[i] = _LAUNCHED
                out.append((i, at))
        return out  # (a group whose requests were all skipped gave its slot back in _settle)

    def _skip(self, i: int, now: float) -> list[Release]:
        """Settle ``i`` unsent, with its dependents still waiting."""
        out: list[Release] = []
        stack = [i]
        while stack:
            p = stack.pop()
            if self.state[p] == _SETTLED:
                continue
            self.skipped.add(p)
            out += self._settle(p, now)
            stack.extend(j for j in self.succ[p] if self.state[j] == _WAITING)
        return out

    def _settle(self, i: int, now: float) -> list[Release]:
        if self.state[i] == _SETTLED:
            return []
        self.state[i] = _SETTLED
        g = self.group_of[i]
        self.left[g] -= 1
        if self.left[g] == 0:
            return self._group_done(g, now)
        return []

    def _group_done(self, g: int, now: float) -> list[Release]:
        if not self.admitted[g]:
            return []  # never held a slot
        self.admitted[g] = False
        if self.limited:
            self.free += 1
        return self._admit(now)
