"""Trace loaders: real request traces with prefix-reuse information, in one replayable shape.

Formats (detected from the file's content, never its name):

- **mooncake**: JSON lines ``{timestamp (ms), input_length, output_length, hash_ids}``, one id
  per 512-token block (Mooncake FAST'25 traces). Open loop: each request arrives at its timestamp.
- **weka**: one gzipped (or plain) JSON document per agent session, ``{id, block_size (64),
  hash_id_scope, requests: [...]}``; requests ``{t, type: n|s, in, out, hash_ids, api_time}`` and
  sub-agents ``{type: subagent, t (its end), duration_ms, requests: [...]}`` whose inner ``t`` count
  from the sub-agent's start. Ids are local to a file (scoped by the file's ``id``).
- **bailian**: JSON lines ``{chat_id, parent_chat_id (-1 = first turn), turn, timestamp (s),
  input_length, output_length, hash_ids}`` (Alibaba Bailian style; 16-token blocks unless told).
- **mesh**: Mesh's own session format, documented in ``examples/traces/README.md``.

Every loaded request becomes a ``TraceRequest`` whose ``keys`` are router block keys of the
simulation block size: a chained mapping of the trace's ids (equal id prefixes give equal keys,
and a key names its whole prefix, as ``mesh.core.keys`` does), re-blocked when the simulation block
size differs from the trace's. Only full blocks get keys.

Session-aware replay: a request either arrives at a fixed time (``arrival``) or is released by
its dependencies (``deps``): ``(predecessor, trigger, delay)`` with trigger ``START`` (delay after
the predecessor arrived) or ``DONE`` (delay after it finished: a closed loop with think time). A
request with several dependencies is released when the last of them fires. WEKA times count
from each session's start (every session starts at t=0: a start-up burst);
``LoadOptions.session_start_spread`` shifts each session's fixed times by a seeded offset.

Errors are ``TraceError`` with ``file:line`` (or ``file: $.json.path``), never a traceback.
"""

from __future__ import annotations

import math
import os
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import xxhash

from mesh.files import FileProblem, read_regular_file

START, DONE = 0, 1
FORMATS = ("mooncake", "weka", "bailian", "mesh")
DEFAULT_BLOCK = {"mooncake": 512, "weka": 64, "bailian": 16, "mesh": 16}
# The largest time value a trace may hold (ms or s) and the largest time scale: beyond them sums
# of arrivals and think times overflowed to inf and every latency in the report read "nan".
MAX_TIME = 1e15
MAX_TIME_SCALE = 1e6


class TraceError(ValueError):
    """A trace that cannot be replayed; the message names the file (and line)."""


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


# ---------------------------------------------------------------------------- key chains
# h_i = sum_{k<=i} x_k * R^(i-k) mod 2^64 over mixed ids x_k: a chained hash of the id prefix,
# computed for a whole request with numpy (cumsum of x_k * R^-k, times R^i). A block key is
# splitmix64(h_b ^ offset-term ^ namespace), where b is the last trace block the sim block
# touches and the offset says how far into it the sim block ends.
_R = 0x9E3779B97F4A7C15 | 1
_R_INV = pow(_R, -1, 2**64)
_pow: list[np.ndarray] = [np.ones(1, dtype=np.uint64), np.ones(1, dtype=np.uint64)]


def _powers(n: int) -> tuple[np.ndarray, np.ndarray]:
    if _pow[0].size < n:
        size = max(n, 2 * _pow[0].size, 1024)
        with np.errstate(over="ignore"):
            for i, base in ((0, _R), (1, _R_INV)):
                out = np.empty(size, dtype=np.uint64)
                out[0] = 1
                b = np.uint64(base)
                for j in range(1, size):  # once per process, up to the longest request
                    out[j] = out[j - 1] * b
                _pow[i] = out
    return _pow[0][:n], _pow[1][:n]


def _splitmix(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def chain_keys(
    ids: Sequence[int] | np.ndarray, prompt_tokens: int, trace_block: int, sim_block: int, scope: int
) -> np.ndarray:
    """Router keys (uint64) of the full ``sim_block`` blocks of a prompt named by trace ids."""
    ids_arr = np.asarray(ids).astype(np.uint64, copy=False)
    covered = min(prompt_tokens, ids_arr.size * trace_block)
    n_keys = covered // sim_block
    if n_keys == 0:
        return np.zeros(0, dtype=np.uint64)
    last_b = (n_keys * sim_block - 1) // trace_block
    x = _splitmix(ids_arr[: last_b + 1] ^ np.uint64(scope))
    pw, pw_inv = _powers(x.size)
    with np.errstate(over="ignore"):
        h = np.cumsum(x * pw_inv) * pw
    if sim_block == trace_block:
        return _splitmix(h ^ np.uint64(scope ^ (trace_block * 0xD6E8FEB86659FD93 & 0xFFFFFFFFFFFFFFFF)))
    ends = np.arange(1, n_keys + 1, dtype=np.int64) * sim_block
    b = (ends - 1) // trace_block
    off = (ends - b * trace_block).astype(np.uint64)
    with np.errstate(over="ignore"):
        mixed = h[b] ^ (off * np.uint64(0xD6E8FEB86659FD93)) ^ np.uint64(scope)
    return _splitmix(mixed)


def _scope_seed(namespace: str, scope: str) -> int:
    return xxhash.xxh3_64_intdigest(f"{namespace}\0{scope}".encode())


# ---------------------------------------------------------------------------- file reading
# One trace file, read whole, at most this many bytes (on disk and once decompressed): a gzip bomb
# (2 GiB of zeros in 2 MB) was inflated whole, and the machine ran out of memory.
MAX_TRACE_BYTES = 1 << 30


def _read_bytes(path: Path) -> bytes:
    try:
        raw = read_regular_file(path, MAX_TRACE_BYTES)
    except FileProblem as exc:
        raise TraceError(f"{path}: {exc}{': split it' if 'limit' in str(exc) else ''}") from None
    if raw[:2] == b"\x1f\x8b":
        raw = _gunzip(path, raw)
    if not raw.strip():
        raise TraceError(f"{path}: empty trace file")
    return raw


def _gunzip(path: Path, raw: bytes) -> bytes:
    """Every gzip member of ``raw``, inflated up to ``MAX_TRACE_BYTES`` (then a ``TraceError``)."""
    out = bytearray()
    data = raw
    try:
        while True:
            d = zlib.decompressobj(31)
            out += d.decompress(data, MAX_TRACE_BYTES + 1 - len(out))
            if len(out) > MAX_TRACE_BYTES:
                raise TraceError(f"{path}: decompresses to over {MAX_TRACE_BYTES:,} bytes (a gzip bomb, or split it)")
            if not d.eof:
                raise TraceError(f"{path}: truncated or corrupt gzip data (end of stream not reached)")
            data = d.unused_data
            if not data.strip(b"\0"):  # nothing but padding left (else: the next gzip member)
                return bytes(out)
    except zlib.error as exc:
        raise TraceError(f"{path}: truncated or corrupt gzip data ({exc})") from None


def _lines(raw: bytes) -> Iterator[tuple[int, bytes]]:
    for no, line in enumerate(raw.split(b"\n"), 1):
        if line.strip():
            yield no, line


def detect_format(path: Path, raw: bytes) -> str:
    """The trace format of a file's content; TraceError when it is none of ``FORMATS``."""
    head = raw[:4096].lstrip()
    if head[:1] == b"{" and b'"requests"' in head and b'"block_size"' in head:
        return "weka"  # one JSON document per session: parsed once, by the WEKA reader
    first = next(_lines(raw))[1]
    try:
        obj = msgspec.json.decode(first)
    except RecursionError:
        raise TraceError(f"{path}:1: JSON nested too deeply") from None
    except msgspec.DecodeError:
        obj = None
        if raw.lstrip()[:1] == b"{" and b"\n" not in raw.strip():
            raise TraceError(f"{path}:1: truncated or malformed JSON document") from None
    if isinstance(obj, dict):
        if "requests" in obj and "block_size" in obj:
            return "weka"
        if obj.get("format") == "mesh-sessions" or "input_tokens" in obj:
            return "mesh"
        if "chat_id" in obj and "hash_ids" in obj:
            return "bailian"
        if "timestamp" in obj and "hash_ids" in obj and "input_length" in obj:
            return "mooncake"
    if obj is None:
        raise TraceError(f"{path}:1: not JSON: cannot detect the trace format")
    keys = ", ".join(sorted(obj)[:8]) if isinstance(obj, dict) else type(obj).__name__
    raise TraceError(
        f"{path}: unknown trace format (first record has: {keys}); expected one of {', '.join(FORMATS)}"
        " (see examples/traces/README.md)"
    )


# ---------------------------------------------------------------------------- records
@dataclass(slots=True)
class _Rec:
    """A request before dependency resolution, local to one file."""

    session: str | None
    arrival: float | None
    deps: list[tuple[int, int, float]]  # (local index, trigger, delay)
    prompt: int
    output: int
    ids: np.ndarray  # int64 trace block ids
    source: str


def _need_int(where: str, obj: dict[str, Any], key: str, lo: int = 0) -> int:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise TraceError(f"{where}: {key!r} must be an integer >= {lo}, got {v!r}")
    return v


def _need_num(where: str, obj: dict[str, Any], key: str, default: float | None = None) -> float:
    v = obj.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 <= v <= MAX_TIME:
        raise TraceError(f"{where}: {key!r} must be a number in [0, {MAX_TIME:g}], got {v!r}")
    return float(v)


def _ids_array(where: str, v: Any, key: str = "hash_ids") -> np.ndarray:
    """Block ids as a 1-d integer array (validated in C: integers, non-negative)."""
    bad = f"{where}: {key!r} must be a list of non-negative integer block ids"
    if not isinstance(v, list):
        raise TraceError(bad)
    if not v:
        return np.zeros(0, dtype=np.int64)
    try:
        arr = np.array(v)
    except (TypeError, ValueError, OverflowError):
        raise TraceError(bad) from None
    if arr.ndim != 1 or arr.dtype.kind not in "iu" or (arr.dtype.kind == "i" and arr.min() < 0):
        raise TraceError(bad)
    return arr


def _need_ids(where: str, obj: dict[str, Any], key: str = "hash_ids") -> np.ndarray:
    return _ids_array(where, obj.get(key), key)


def _check_chain(where: str, ids: np.ndarray, prompt: int, block: int) -> None:
    full, ceil = prompt // block, -(-prompt // block)
    if not full <= ids.size <= ceil:
        raise TraceError(
            f"{where}: inconsistent hash chain: {ids.size} block ids for {prompt} input tokens at "
            f"{block} tokens per block (expected {full}" + (f" or {ceil})" if ceil != full else ")")
        )


def _json_lines(path: Path, raw: bytes, warnings: list[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    items = list(_lines(raw))
    last_no = items[-1][0] if items else 0
    truncated_tail = not raw.endswith(b"\n")
    for no, line in items:
        try:
            obj = msgspec.json.decode(line)
        except RecursionError:
            raise TraceError(f"{path}:{no}: JSON nested too deeply") from None
        except msgspec.DecodeError as exc:
            if no == last_no and truncated_tail:
                warnings.append(f"{path}:{no}: truncated last line skipped (partial trace)")
                return
            raise TraceError(f"{path}:{no}: malformed JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{path}:{no}: expected a JSON object, got {type(obj).__name__}")
        yield f"{path}:{no}", obj


def _mooncake(path: Path, raw: bytes, block: int, warnings: list[str]) -> list[_Rec]:
    out = []
    for where, obj in _json_lines(path, raw, warnings):
        prompt = _need_int(where, obj, "input_length", 1)
        ids = _need_ids(where, obj)
        _check_chain(where, ids, prompt, block)
        out.append(_Rec(None, _need_num(where, obj, "timestamp") / 1000.0, [],
                        prompt, _need_int(where, obj, "output_length"), ids, where))
    return out


def _bailian(path: Path, raw: bytes, block: int, warnings: list[str]) -> list[_Rec]:
    out: list[_Rec] = []
    by_chat: dict[Any, int] = {}
    root_of: dict[Any, Any] = {}
    for where, obj in _json_lines(path, raw, warnings):
        chat, parent = obj.get("chat_id"), obj.get("parent_chat_id", -1)
        if chat is None:
            raise TraceError(f"{where}: missing 'chat_id'")
        for key, v in (("chat_id", chat), ("parent_chat_id", parent)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, str))):
                raise TraceError(f"{where}: {key!r} must be an integer or a string, got {type(v).__name__}")
        prompt = _need_int(where, obj, "input_length", 1)
        ids = _need_ids(where, obj)
        _check_chain(where, ids, prompt, block)
        t = _need_num(where, obj, "timestamp")
        rec = _Rec(None, t, [], prompt, _need_int(where, obj, "output_length"), ids, where)
        if parent is not None and parent != -1:
            if parent not in by_chat:
                raise TraceError(f"{where}: parent_chat_id {parent!r} does not appear before this turn")
            p = by_chat[parent]
            # The next turn follows the recorded gap after the parent started, and never before
            # the parent finished (closed loop).
            rec.deps = [(p, START, max(0.0, t - out[p].arrival)), (p, DONE, 0.0)]  # type: ignore[operator]
            root_of[chat] = root_of[parent]
        else:
            root_of[chat] = chat
        rec.session = f"chat-{root_of[chat]}"
        by_chat[chat] = len(out)
        out.append(rec)
    for rec in out:  # a dependent turn's time is relative; keep only roots' absolute arrivals
        if rec.deps:
            rec.arrival = None
    return out


def _mesh(path: Path, raw: bytes, block: int, warnings: list[str]) -> list[_Rec]:
    out: list[_Rec] = []
    last: dict[str, int] = {}
    for where, obj in _json_lines(path, raw, warnings):
        if obj.get("format") == "mesh-sessions":
            continue
        prompt = _need_int(where, obj, "input_tokens", 1)
        ids = _need_ids(where, obj)
        _check_chain(where, ids, prompt, block)
        session = obj.get("session")
        if session is not None and not isinstance(session, str):
            raise TraceError(f"{where}: 'session' must be a string, got {session!r}")
        rec = _Rec(session, None, [], prompt, _need_int(where, obj, "output_tokens"), ids, where)
        if session is not None and session in last:
            if "t" in obj:
                raise TraceError(f"{where}: a later turn of session {session!r} takes 'think_s', not 't'")
            rec.deps = [(last[session], DONE, _need_num(where, obj, "think_s", 0.0))]
        else:
            if "t" not in obj:
                raise TraceError(f"{where}: the first request of a session (or one without a session) needs 't'")
            rec.arrival = _need_num(where, obj, "t")
        if session is not None:
            last[session] = len(out)
        out.append(rec)
    return out


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
_OVERLAP_EPS = 1e-6


def _weka(path: Path, raw: bytes, block: int | None, warnings: list[str]) -> tuple[list[_Rec], int, str]:
    try:
        doc = _WEKA.decode(raw)
    except msgspec.ValidationError as exc:
        raise TraceError(f"{path}: invalid WEKA/AgentX trace: {exc}") from None
    except msgspec.DecodeError as exc:
        raise TraceError(f"{path}:1: truncated or malformed JSON document ({exc})") from None
    except RecursionError:
        raise TraceError(f"{path}: JSON nested too deeply") from None
    block = block or doc.block_size
    if block < 1:
        raise TraceError(f"{path}: block_size must be >= 1, got {doc.block_size}")
    out: list[_Rec] = []
    session = doc.id

    def add(req: _WReq, t_abs: float, where: str, sess: str) -> int:
        if req.in_ < 1 or req.out < 0:
            raise TraceError(f"{where}: 'in' must be >= 1 and 'out' >= 0 (got {req.in_}, {req.out})")
        # times count from the session's (or sub-agent's) start: a negative one made the first
        # request finish before time 0, which the engine took for "never finished"
        if not (0 <= req.t <= MAX_TIME and 0 <= req.api_time <= MAX_TIME):
            raise TraceError(f"{where}: 't' and 'api_time' must be in [0, {MAX_TIME:g}] (got {req.t}, {req.api_time})")
        ids = _ids_array(where, req.hash_ids)
        _check_chain(where, ids, req.in_, block)
        out.append(_Rec(sess, t_abs, [], req.in_, req.out, ids, where))
        return len(out) - 1

    def chain(prev: int | None, t_abs: float, api_prev: float, t_prev: float) -> list[tuple[int, int, float]]:
        if prev is None:
            return []
        end_prev = t_prev + api_prev
        if t_abs + _OVERLAP_EPS < end_prev:  # recorded as concurrent: released after it started
            return [(prev, START, max(0.0, t_abs - t_prev))]
        return [(prev, DONE, t_abs - end_prev)]

    prev: int | None = None
    prev_t = prev_api = 0.0
    pending_joins: list[tuple[float, int, float]] = []  # (sub-agent end, its last request, its end)
    for i, entry in enumerate(doc.requests):
        where = f"{path}: $.requests[{i}]"
        if isinstance(entry, _WSub):
            if prev is None:
                raise TraceError(f"{where}: sub-agent {entry.agent_id!r} before any parent request")
            if not (0 <= entry.t <= MAX_TIME and 0 <= (entry.duration_ms or 0.0) <= MAX_TIME):
                raise TraceError(f"{where}: 't' and 'duration_ms' must be in [0, {MAX_TIME:g}] (got {entry.t}, {entry.duration_ms})")
            start = entry.t - (entry.duration_ms or 0.0) / 1000.0
            sub_sess = f"{session}/{entry.agent_id or i}"
            sprev: int | None = None
            sp_t = sp_api = 0.0
            for j, inner in enumerate(entry.requests):
                t_abs = start + inner.t
                k = add(inner, t_abs, f"{where}.requests[{j}]", sub_sess)
                if sprev is None:  # spawned by the parent request before the marker
                    out[k].deps = chain(prev, t_abs, prev_api, prev_t)
                else:
                    out[k].deps = chain(sprev, t_abs, sp_api, sp_t)
                sprev, sp_t, sp_api = k, t_abs, inner.api_time
            if sprev is not None:
                pending_joins.append((entry.t, sprev, sp_t + sp_api))
            continue
        k = add(entry, entry.t, where, session)
        out[k].deps = chain(prev, entry.t, prev_api, prev_t)
        for sub_end, last, last_end in pending_joins:  # a blocking sub-agent joins here
            if entry.t + _OVERLAP_EPS >= sub_end:
                out[k].deps.append((last, DONE, max(0.0, entry.t - last_end)))
        pending_joins = [j for j in pending_joins if entry.t + _OVERLAP_EPS < j[0]]
        prev, prev_t, prev_api = k, entry.t, entry.api_time
    if not out:
        raise TraceError(f"{path}: WEKA trace {doc.id!r} has no requests")
    for rec in out:
        if rec.deps:
            rec.arrival = None
    return out, block, doc.id


# ---------------------------------------------------------------------------- public API
# A directory contributes its files with these endings (a README or LICENSE beside the traces is
# not one); a file named explicitly is read whatever its name.
TRACE_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".gz")


def expand_paths(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """Files named, with directories expanded to their trace files (sorted)."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(x for x in p.iterdir() if x.is_file() and not x.name.startswith(".")
                           and x.name.endswith(TRACE_SUFFIXES))
            if not found:
                raise TraceError(f"{p}: directory holds no trace files (*{', *'.join(TRACE_SUFFIXES)})")
            files.extend(found)
        else:
            files.append(p)
    if not files:
        raise TraceError("no trace files given")
    return files


def load_traces(paths: Iterable[str | os.PathLike[str]], options: LoadOptions = LoadOptions()) -> Trace:
    """Load and merge trace files (format detected per file) into one replayable ``Trace``."""
    if not 0 < options.time_scale <= MAX_TIME_SCALE:  # (NaN fails it too)
        raise TraceError(f"time scale must be a number in (0, {MAX_TIME_SCALE:g}], got {options.time_scale}")
    for name in ("block_size", "trace_block_size", "max_sessions", "max_requests"):
        v = getattr(options, name)
        if v is not None and v < 1:
            raise TraceError(f"{name.replace('_', '-')} must be >= 1, got {v}")
    if not 0 <= options.session_start_spread <= MAX_TIME:  # (NaN fails it too)
        raise TraceError(f"session-start-spread must be a number of seconds in [0, {MAX_TIME:g}], "
                         f"got {options.session_start_spread}")
    files = expand_paths(paths)
    loaded: list[tuple[Path, str, int, str, list[_Rec]]] = []
    warnings: list[str] = []
    for path in files:
        raw = _read_bytes(path)
        fmt = detect_format(path, raw)
        block = options.trace_block_size or DEFAULT_BLOCK[fmt]
        if fmt == "weka":
            recs, block, scope = _weka(path, raw, options.trace_block_size, warnings)
        else:
            if fmt == "mesh":
                block = options.trace_block_size or _mesh_block_size(path, raw)
            reader = {"mooncake": _mooncake, "bailian": _bailian, "mesh": _mesh}[fmt]
            recs, scope = reader(path, raw, block, warnings), path.name
        if not recs:
            raise TraceError(f"{path}: no requests in trace")
        loaded.append((path, fmt, block, scope, recs))
    blocks = {b for _, _, b, _, _ in loaded}
    sim_block = options.block_size
    if sim_block is None:
        if len(blocks) > 1:
            raise TraceError(f"traces have different block sizes {sorted(blocks)}: choose one with --block-size")
        sim_block = blocks.pop()
    return _assemble(loaded, sim_block, options, warnings)


def _mesh_block_size(path: Path, raw: bytes) -> int:
    first = msgspec.json.decode(next(_lines(raw))[1])
    if isinstance(first, dict) and first.get("format") == "mesh-sessions":
        b = first.get("block_size", DEFAULT_BLOCK["mesh"])
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise TraceError(f"{path}:1: block_size must be an integer >= 1, got {b!r}")
        return b
    return DEFAULT_BLOCK["mesh"]


def _assemble(
    loaded: list[tuple[Path, str, int, str, list[_Rec]]], sim_block: int, options: LoadOptions,
    warnings: list[str],
) -> Trace:
    scale = options.time_scale
    stems: dict[str, int] = {}
    # Global index of every (file, local index), after caps.
    index: dict[tuple[int, int], int] = {}
    sessions_seen: dict[Any, int] = {}
    spread = options.session_start_spread
    rng = np.random.default_rng(options.seed)
    offsets: dict[Any, float] = {}  # session key -> start offset (s), drawn at its first request
    requests: list[TraceRequest] = []
    for fno, (path, fmt, block, scope, recs) in enumerate(loaded):
        stem = path.name.split(".")[0]
        stems[stem] = stems.get(stem, 0) + 1
        prefix = stem if stems[stem] == 1 else f"{stem}#{stems[stem]}"
        seed = _scope_seed(options.namespace, scope)
        for li, rec in enumerate(recs):
            if options.max_requests is not None and len(requests) >= options.max_requests:
                break
            deps = []
            dropped = False
            for p, trig, delay in rec.deps:
                g = index.get((fno, p))
                if g is None:
                    dropped = True
                    break
                deps.append((g, trig, delay * scale))
            if dropped:
                continue
            # The unit of --max-sessions: a WEKA file is one agent session with its sub-agents.
            if fmt == "weka":
                sess_key: tuple[Any, ...] = (fno,)
            else:
                sess_key = (fno, rec.session) if rec.session is not None else (fno, None, li)
            if options.max_sessions is not None and sess_key not in sessions_seen:
                if len(sessions_seen) >= options.max_sessions:
                    continue
            sessions_seen.setdefault(sess_key, len(sessions_seen))
            offset = 0.0
            if spread and rec.session is not None:
                offset = offsets.get(sess_key, -1.0)
                if offset < 0:
                    offset = offsets[sess_key] = float(rng.uniform(0.0, spread))
            keys = chain_keys(rec.ids, rec.prompt, block, sim_block, seed)
            g = len(requests)
            index[(fno, li)] = g
            requests.append(TraceRequest(
                idx=g,
                session=f"{prefix}/{rec.session}" if rec.session is not None else None,
                arrival=rec.arrival * scale + offset if rec.arrival is not None else None,
                deps=tuple(deps),
                prompt_tokens=rec.prompt,
                output_tokens=rec.output,
                keys=keys,
                source=rec.source,
            ))
    if not requests:
        raise TraceError("no requests left after applying the session/request caps")
    if spread and not offsets:
        warnings.append("--session-start-spread: no request belongs to a session, times unchanged")
    return Trace(
        requests=requests,
        block_size=sim_block,
        formats=[f for _, f, _, _, _ in loaded],
        files=[str(p) for p, _, _, _, _ in loaded],
        warnings=warnings,
    )
