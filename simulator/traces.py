"""Trace loaders: real request traces with prefix-reuse information, in one replayable shape.

Formats (detected from the file's content, never its name; ``simulator.trace_files``):

- **mooncake**: JSON lines ``{timestamp (ms), input_length, output_length, hash_ids}``, one id
  per 512-token block (Mooncake FAST'25 traces). Open loop: each request arrives at its timestamp.
- **weka**: one JSON document per agent session, with sub-agents (``simulator.trace_weka``).
- **bailian**: JSON lines ``{chat_id, parent_chat_id (-1 = first turn), turn, timestamp (s),
  input_length, output_length, hash_ids}`` (Alibaba Bailian style; 16-token blocks unless told).
- **mesh**: Mesh's own session format, documented in ``examples/traces/README.md``.

Every loaded request becomes a ``TraceRequest`` whose ``keys`` are router block keys of the
simulation block size (``simulator.trace_keys.chain_keys``). Session-aware replay: a request
either arrives at a fixed time (``arrival``) or is released by its dependencies (``deps``):
``(predecessor, trigger, delay)`` with trigger ``START`` (delay after the predecessor arrived)
or ``DONE`` (delay after it finished: a closed loop with think time); several dependencies
release it when the last fires. ``LoadOptions.session_start_spread`` shifts each session's fixed
times by a seeded offset. Errors are ``TraceError`` with ``file:line``, never a traceback.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from simulator.trace_files import detect_format, expand_paths, read_bytes
from simulator.trace_jsonl import mesh_block_size, read_bailian, read_mesh, read_mooncake
from simulator.trace_keys import chain_keys, scope_seed
from simulator.trace_records import DEFAULT_BLOCK, DONE, FORMATS, MAX_TIME, START, Rec, TraceError
from simulator.trace_weka import read_weka

# What other modules and tests import from here (the readers live in the modules named above).
__all__ = ["DEFAULT_BLOCK", "DONE", "FORMATS", "MAX_TIME", "MAX_TIME_SCALE", "START", "LoadOptions", "Trace",
           "TraceError", "TraceRequest", "chain_keys", "load_traces"]

# The largest time scale: beyond it sums of arrivals and think times overflow to inf.
MAX_TIME_SCALE = 1e6


@dataclass(slots=True)
class TraceRequest:
    idx: int
    session: str | None
    arrival: float | None  # seconds, for requests not released by dependencies
    deps: tuple[tuple[int, int, float], ...]  # (predecessor idx, START|DONE, delay s)
    prompt_tokens: int
    output_tokens: int
    keys: np.ndarray  # uint64 router keys of the full blocks at the simulation block size
    source: str  # "file:line" or "file: $.requests[i]"


@dataclass(slots=True)
class Trace:
    requests: list[TraceRequest]
    block_size: int  # simulation block size the keys are computed at
    formats: list[str]
    files: list[str]
    warnings: list[str] = field(default_factory=list)
    # each request's session group for closed-loop admission (``simulator.session_gate``); None:
    # the groups the dependencies link (``session_groups``)
    groups: list[int] | None = None

    @property
    def sessions(self) -> int:
        return len({r.session for r in self.requests if r.session is not None})

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.requests)


@dataclass(frozen=True, slots=True)
class LoadOptions:
    block_size: int | None = None  # simulation block size (default: the trace's)
    trace_block_size: int | None = None  # override the tokens per trace id
    time_scale: float = 1.0  # multiplies arrival times and think times (0.5 = twice the rate)
    max_sessions: int | None = None  # first N sessions (a request without one counts as one)
    max_requests: int | None = None  # first N requests (dependents of dropped ones are dropped)
    namespace: str = "mesh-sim"  # seeds the key chains (like mesh.core.keys' model namespace)
    # Each session's fixed times shifted by its own uniform offset in [0, S) seconds (after
    # time_scale), drawn with ``seed`` in the order sessions first appear; its later turns follow
    # (they are released by their predecessors). WEKA sessions all start at t=0 otherwise.
    session_start_spread: float = 0.0
    seed: int = 0


class _Loaded(NamedTuple):
    """One file, read: its records are local to it (``deps`` index ``recs``)."""

    path: Path
    fmt: str
    block: int  # tokens per trace block id
    scope: str  # the id space of its block ids (seeds its key chains)
    recs: list[Rec]


_READERS = {"mooncake": read_mooncake, "bailian": read_bailian, "mesh": read_mesh}


def load_traces(paths: Iterable[str | os.PathLike[str]], options: LoadOptions = LoadOptions()) -> Trace:
    """Load and merge trace files (format detected per file) into one replayable ``Trace``."""
    _check_options(options)
    warnings: list[str] = []
    loaded = [_load_file(path, options, warnings) for path in expand_paths(paths)]
    blocks = {f.block for f in loaded}
    sim_block = options.block_size
    if sim_block is None:
        if len(blocks) > 1:
            raise TraceError(f"traces have different block sizes {sorted(blocks)}: choose one with --block-size")
        sim_block = blocks.pop()
    return _assemble(loaded, sim_block, options, warnings)


def _check_options(options: LoadOptions) -> None:
    if not 0 < options.time_scale <= MAX_TIME_SCALE:  # (NaN fails it too)
        raise TraceError(f"time scale must be a number in (0, {MAX_TIME_SCALE:g}], got {options.time_scale}")
    for name in ("block_size", "trace_block_size", "max_sessions", "max_requests"):
        v = getattr(options, name)
        if v is not None and v < 1:
            raise TraceError(f"{name.replace('_', '-')} must be >= 1, got {v}")
    if not 0 <= options.session_start_spread <= MAX_TIME:  # (NaN fails it too)
        raise TraceError(f"session-start-spread must be a number of seconds in [0, {MAX_TIME:g}], "
                         f"got {options.session_start_spread}")


def _load_file(path: Path, options: LoadOptions, warnings: list[str]) -> _Loaded:
    raw = read_bytes(path)
    fmt = detect_format(path, raw)
    block = options.trace_block_size or DEFAULT_BLOCK[fmt]
    if fmt == "weka":
        recs, block, scope = read_weka(path, raw, options.trace_block_size, warnings)
    else:
        if fmt == "mesh":
            block = options.trace_block_size or mesh_block_size(path, raw)
        recs, scope = _READERS[fmt](path, raw, block, warnings), path.name
    if not recs:
        raise TraceError(f"{path}: no requests in trace")
    return _Loaded(path, fmt, block, scope, recs)


def _assemble(loaded: list[_Loaded], sim_block: int, options: LoadOptions, warnings: list[str]) -> Trace:
    assembly = _Assembly(options, sim_block)
    stems: dict[str, int] = {}
    for fno, f in enumerate(loaded):
        stem = f.path.name.split(".")[0]
        stems[stem] = stems.get(stem, 0) + 1
        prefix = stem if stems[stem] == 1 else f"{stem}#{stems[stem]}"
        assembly.add_file(fno, f, prefix)
    if not assembly.requests:
        raise TraceError("no requests left after applying the session/request caps")
    if options.session_start_spread and not assembly.offsets:
        warnings.append("--session-start-spread: no request belongs to a session, times unchanged")
    return Trace(
        requests=assembly.requests,
        block_size=sim_block,
        formats=[f.fmt for f in loaded],
        files=[str(f.path) for f in loaded],
        warnings=warnings,
    )


class _Assembly:
    """The merge of the files' records into one request list, in file order: caps applied,
    dependencies renumbered globally, session start offsets drawn at each session's first
    request. A record whose predecessor was dropped is dropped too."""

    def __init__(self, options: LoadOptions, sim_block: int) -> None:
        self.options = options
        self.sim_block = sim_block
        self.scale = options.time_scale
        self.index: dict[tuple[int, int], int] = {}  # (file, local index) -> global index, after caps
        self.sessions_seen: dict[Any, int] = {}
        self.rng = np.random.default_rng(options.seed)
        self.offsets: dict[Any, float] = {}  # session key -> start offset (s), drawn at its first request
        self.requests: list[TraceRequest] = []

    def add_file(self, fno: int, f: _Loaded, prefix: str) -> None:
        seed = scope_seed(self.options.namespace, f.scope)
        max_requests = self.options.max_requests
        for li, rec in enumerate(f.recs):
            if max_requests is not None and len(self.requests) >= max_requests:
                break
            deps = self._deps(fno, rec)
            if deps is None:
                continue
            # The unit of --max-sessions: a WEKA file is one agent session with its sub-agents.
            if f.fmt == "weka":
                sess_key: tuple[Any, ...] = (fno,)
            else:
                sess_key = (fno, rec.session) if rec.session is not None else (fno, None, li)
            if not self._admit_session(sess_key):
                continue
            offset = self._offset(sess_key, rec)
            g = len(self.requests)
            self.index[(fno, li)] = g
            self.requests.append(TraceRequest(
                idx=g,
                session=f"{prefix}/{rec.session}" if rec.session is not None else None,
                arrival=rec.arrival * self.scale + offset if rec.arrival is not None else None,
                deps=tuple(deps),
                prompt_tokens=rec.prompt,
                output_tokens=rec.output,
                keys=chain_keys(rec.ids, rec.prompt, f.block, self.sim_block, seed),
                source=rec.source,
            ))

    def _deps(self, fno: int, rec: Rec) -> list[tuple[int, int, float]] | None:
        """The record's dependencies in global indices, delays scaled; None when one was dropped."""
        deps = []
        for p, trig, delay in rec.deps:
            g = self.index.get((fno, p))
            if g is None:
                return None
            deps.append((g, trig, delay * self.scale))
        return deps

    def _admit_session(self, sess_key: tuple[Any, ...]) -> bool:
        """False for a new session past ``max_sessions``."""
        max_sessions = self.options.max_sessions
        if max_sessions is not None and sess_key not in self.sessions_seen and len(self.sessions_seen) >= max_sessions:
            return False
        self.sessions_seen.setdefault(sess_key, len(self.sessions_seen))
        return True

    def _offset(self, sess_key: tuple[Any, ...], rec: Rec) -> float:
        """The session's start offset, drawn at its first request (0 without a spread or a session)."""
        spread = self.options.session_start_spread
        if not spread or rec.session is None:
            return 0.0
        offset = self.offsets.get(sess_key, -1.0)
        if offset < 0:
            offset = self.offsets[sess_key] = float(self.rng.uniform(0.0, spread))
        return offset
