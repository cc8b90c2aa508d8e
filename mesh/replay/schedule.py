"""The replay's schedule: which trace requests are sent, grouped into sessions, released by what.

A *session group* is what ``--concurrency`` counts: the requests connected by dependencies (a
WEKA file: one agent session with its sub-agents; a Mesh or Bailian session; a Mooncake request
alone). A group is admitted when a slot is free and its first arrival has come; its requests
then keep the trace's release semantics (``simulator.traces``):

- a request without dependencies at its arrival (already multiplied by the time scale by the
  loader), shifted by how late its group was admitted;
- a request with dependencies when the last of them fires: ``DONE`` = the predecessor finished
  plus its think time, ``START`` = the predecessor was sent plus its offset; every delay is
  already time-scaled and is capped here at ``max_think_s``.

Requests are dropped (with their dependents) past ``max_turns`` per group or over
``max_prompt_units``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mesh.replay.prompts import PromptBuilder
from simulator.session_gate import session_groups
from simulator.traces import Trace, TraceRequest


@dataclass(slots=True)
class Turn:
    pos: int  # index in Plan.turns
    request: TraceRequest
    group: int
    deps: tuple[tuple[int, int, float], ...]  # (predecessor pos, START|DONE, delay s after the cap)
    arrival: float | None  # s (time-scaled), for a request released by no dependency
    units: int  # prompt length in units
    max_tokens: int

    @property
    def session(self) -> str | None:
        return self.request.session


@dataclass(slots=True)
class Plan:
    turns: list[Turn]
    groups: list[list[int]]  # turn positions of each group, in trace order
    group_start: list[float]  # each group's first arrival (s)
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> requests

    @property
    def sessions(self) -> int:
        return len({t.session for t in self.turns if t.session is not None})


def output_tokens(r: TraceRequest, fixed: int | None, prompt_scale: float, cap: int) -> int:
    """``max_tokens`` of a request: ``fixed``, or the trace's output scaled like its prompt
    (at least 1, at most ``cap``)."""
    if fixed is not None:
        return fixed
    return max(1, min(cap, round(r.output_tokens / prompt_scale)))


def build_plan(trace: Trace, builder: PromptBuilder, *, max_think_s: float = 2.0, max_turns: int | None = None,
               max_prompt_units: int | None = None, fixed_output: int | None = 32,
               max_output_tokens: int = 256) -> Plan:
    """The schedule of ``trace`` (its requests in trace order; dependencies point backwards)."""
    if max_think_s < 0:
        raise ValueError(f"max think time must be >= 0 s, got {max_think_s}")
    group_of = session_groups(trace.requests)
    pos_of: dict[int, int] = {}
    turns: list[Turn] = []
    per_group: dict[int, int] = {}
    dropped: dict[str, int] = {}

    def drop(reason: str) -> None:
        dropped[reason] = dropped.get(reason, 0) + 1

    for r in trace.requests:
        g = group_of[r.idx]
        if any(p not in pos_of for p, _, _ in r.deps):
            drop("predecessor dropped")
            continue
        units = builder.units(r)
        if max_prompt_units is not None and units > max_prompt_units:
            drop(f"prompt over {max_prompt_units} tokens")
            continue
        if max_turns is not None and per_group.get(g, 0) >= max_turns:
            drop(f"past {max_turns} turns per session")
            continue
        per_group[g] = per_group.get(g, 0) + 1
        deps = tuple((pos_of[p], trig, min(delay, max_think_s)) for p, trig, delay in r.deps)
        pos_of[r.idx] = len(turns)
        turns.append(Turn(len(turns), r, g, deps, None if deps else (r.arrival or 0.0), units,
                          output_tokens(r, fixed_output, builder.prompt_scale, max_output_tokens)))
    index: dict[int, int] = {}
    groups: list[list[int]] = []
    for t in turns:  # renumber the groups that kept a request, in order
        k = index.setdefault(t.group, len(groups))
        if k == len(groups):
            groups.append([])
        t.group = k
        groups[k].append(t.pos)
    starts = [min(a for p in g if (a := turns[p].arrival) is not None) for g in groups]
    return Plan(turns, groups, starts, dropped)
