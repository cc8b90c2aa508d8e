"""The WEKA / AgentX trace format: one gzipped (or plain) JSON document per agent session.

``{id, block_size (64), hash_id_scope, requests: [...]}``; requests ``{t, type: n|s, in, out,
hash_ids, api_time}`` and sub-agents ``{type: subagent, t (its end), duration_ms, requests:
[...]}`` whose inner ``t`` count from the sub-agent's start. Ids are local to a file (scoped by
its ``id``), and times count from the session's start (every session starts at t=0).

Dependencies follow the recorded times: a request that starts before its predecessor ended is
released that long after the predecessor started (``START``), else that long after it ended
(``DONE``: think time); a sub-agent's first request follows its parent request, and the first
parent request at or after a sub-agent's end also waits for that sub-agent's last request.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from simulator.trace_records import DONE, MAX_TIME, START, Rec, TraceError, check_chain, ids_array

_OVERLAP_EPS = 1e-6
Deps = list[tuple[int, int, float]]
Join = tuple[float, int, float]  # (sub-agent end, its last request, that request's end)


class _WReq(msgspec.Struct, tag_field="type", tag="n"):
    t: float
    in_: int = msgspec.field(name="in")
    out: int = 0
    hash_ids: list[int] = []
    api_time: float = 0.0


class _WReqS(_WReq, tag="s"):
    pass


class _WSub(msgspec.Struct, tag_field="type", tag="subagent"):
    t: float
    agent_id: str = ""
    duration_ms: float | None = None
    requests: list[_WReq | _WReqS] = []


class _WTrace(msgspec.Struct):
    id: str
    block_size: int
    requests: list[_WReq | _WReqS | _WSub]
    hash_id_scope: str = "local"


_WEKA = msgspec.json.Decoder(_WTrace)


def read_weka(path: Path, raw: bytes, block: int | None, warnings: list[str]) -> tuple[list[Rec], int, str]:
    """(records, trace block size, scope) of one WEKA file; ``block`` overrides the file's."""
    doc = _decode(path, raw)
    block = block or doc.block_size
    if block < 1:
        raise TraceError(f"{path}: block_size must be >= 1, got {doc.block_size}")
    out = _SessionReader(path, block, doc.id).read(doc.requests)
    if not out:
        raise TraceError(f"{path}: WEKA trace {doc.id!r} has no requests")
    for rec in out:
        if rec.deps:
            rec.arrival = None
    return out, block, doc.id


def _decode(path: Path, raw: bytes) -> _WTrace:
    try:
        return _WEKA.decode(raw)
    except msgspec.ValidationError as exc:
        raise TraceError(f"{path}: invalid WEKA/AgentX trace: {exc}") from None
    except msgspec.DecodeError as exc:
        raise TraceError(f"{path}:1: truncated or malformed JSON document ({exc})") from None
    except RecursionError:
        raise TraceError(f"{path}: JSON nested too deeply") from None


def _chain(prev: int | None, t_abs: float, api_prev: float, t_prev: float) -> Deps:
    """The dependency of a request at ``t_abs`` on its predecessor (started at ``t_prev``, busy
    for ``api_prev``): none for the first, else released after its start or after its end."""
    if prev is None:
        return []
    end_prev = t_prev + api_prev
    if t_abs + _OVERLAP_EPS < end_prev:  # recorded as concurrent: released after it started
        return [(prev, START, max(0.0, t_abs - t_prev))]
    return [(prev, DONE, t_abs - end_prev)]


class _SessionReader:
    """One session's records in file order: its own requests and its sub-agents'."""

    def __init__(self, path: Path, block: int, session: str) -> None:
        self.path = path
        self.block = block
        self.session = session
        self.out: list[Rec] = []

    def read(self, entries: list[_WReq | _WReqS | _WSub]) -> list[Rec]:
        prev: int | None = None
        prev_t = prev_api = 0.0
        pending_joins: list[Join] = []
        for i, entry in enumerate(entries):
            where = f"{self.path}: $.requests[{i}]"
            if isinstance(entry, _WSub):
                if prev is None:
                    raise TraceError(f"{where}: sub-agent {entry.agent_id!r} before any parent request")
                join = self._sub_agent(entry, i, where, (prev, prev_t, prev_api))
                if join is not None:
                    pending_joins.append(join)
                continue
            k = self._add(entry, entry.t, where, self.session)
            self.out[k].deps = _chain(prev, entry.t, prev_api, prev_t)
            for sub_end, last, last_end in pending_joins:  # a blocking sub-agent joins here
                if entry.t + _OVERLAP_EPS >= sub_end:
                    self.out[k].deps.append((last, DONE, max(0.0, entry.t - last_end)))
            pending_joins = [j for j in pending_joins if entry.t + _OVERLAP_EPS < j[0]]
            prev, prev_t, prev_api = k, entry.t, entry.api_time
        return self.out

    def _sub_agent(self, entry: _WSub, i: int, where: str, parent: tuple[int, float, float]) -> Join | None:
        """Read a sub-agent's requests, the first spawned by ``parent`` (the request before the
        marker: index, start, busy time); returns its join, None when it has no requests."""
        if not (0 <= entry.t <= MAX_TIME and 0 <= (entry.duration_ms or 0.0) <= MAX_TIME):
            raise TraceError(f"{where}: 't' and 'duration_ms' must be in [0, {MAX_TIME:g}] (got {entry.t}, {entry.duration_ms})")
        start = entry.t - (entry.duration_ms or 0.0) / 1000.0
        sub_sess = f"{self.session}/{entry.agent_id or i}"
        prev, prev_t, prev_api = parent
        for j, inner in enumerate(entry.requests):
            t_abs = start + inner.t
            k = self._add(inner, t_abs, f"{where}.requests[{j}]", sub_sess)
            self.out[k].deps = _chain(prev, t_abs, prev_api, prev_t)
            prev, prev_t, prev_api = k, t_abs, inner.api_time
        return (entry.t, prev, prev_t + prev_api) if entry.requests else None

    def _add(self, req: _WReq, t_abs: float, where: str, sess: str) -> int:
        """Check one request and append its record; returns its index."""
        if req.in_ < 1 or req.out < 0:
            raise TraceError(f"{where}: 'in' must be >= 1 and 'out' >= 0 (got {req.in_}, {req.out})")
        # times count from the session's (or sub-agent's) start: a negative one would make the
        # first request finish before time 0, which the engine takes for "never finished"
        if not (0 <= req.t <= MAX_TIME and 0 <= req.api_time <= MAX_TIME):
            raise TraceError(f"{where}: 't' and 'api_time' must be in [0, {MAX_TIME:g}] (got {req.t}, {req.api_time})")
        ids = ids_array(where, req.hash_ids)
        check_chain(where, ids, req.in_, self.block)
        self.out.append(Rec(sess, t_abs, [], req.in_, req.out, ids, where))
        return len(self.out) - 1
