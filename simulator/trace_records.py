"""What every trace format reader shares: the formats' vocabulary, the record a reader yields,
and field checks whose errors name the file and line.

A reader turns one file into ``Rec``s, local to that file: ``deps`` name other records of the
same file by index, and ``arrival`` is None for a record released by its dependencies.
``simulator.traces`` resolves them into global ``TraceRequest``s. Every error is a
``TraceError`` with ``file:line`` (or ``file: $.json.path``), never a traceback; every time a
trace may hold is finite and at most ``MAX_TIME``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

START, DONE = 0, 1  # a dependency's trigger: the predecessor's arrival, or its end
FORMATS = ("mooncake", "weka", "bailian", "mesh")
DEFAULT_BLOCK = {"mooncake": 512, "weka": 64, "bailian": 16, "mesh": 16}
# The largest time value a trace may hold (ms or s): beyond it sums of arrivals and think times
# overflow to inf and every latency in the report reads "nan".
MAX_TIME = 1e15


class TraceError(ValueError):
    """A trace that cannot be replayed; the message names the file (and line)."""


@dataclass(slots=True)
class Rec:
    """A request before dependency resolution, local to one file."""

    session: str | None
    arrival: float | None
    deps: list[tuple[int, int, float]]  # (local index, trigger, delay)
    prompt: int
    output: int
    ids: np.ndarray  # int64 trace block ids
    source: str


def need_int(where: str, obj: dict[str, Any], key: str, lo: int = 0) -> int:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise TraceError(f"{where}: {key!r} must be an integer >= {lo}, got {v!r}")
    return v


def need_num(where: str, obj: dict[str, Any], key: str, default: float | None = None) -> float:
    v = obj.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 <= v <= MAX_TIME:
        raise TraceError(f"{where}: {key!r} must be a number in [0, {MAX_TIME:g}], got {v!r}")
    return float(v)


def ids_array(where: str, v: Any, key: str = "hash_ids") -> np.ndarray:
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


def need_ids(where: str, obj: dict[str, Any], key: str = "hash_ids") -> np.ndarray:
    return ids_array(where, obj.get(key), key)


def check_chain(where: str, ids: np.ndarray, prompt: int, block: int) -> None:
    full, ceil = prompt // block, -(-prompt // block)
    if not full <= ids.size <= ceil:
        raise TraceError(
            f"{where}: inconsistent hash chain: {ids.size} block ids for {prompt} input tokens at "
            f"{block} tokens per block (expected {full}" + (f" or {ceil})" if ceil != full else ")")
        )


def lines(raw: bytes) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of every non-blank line."""
    for no, line in enumerate(raw.split(b"\n"), 1):
        if line.strip():
            yield no, line


def json_lines(path: Path, raw: bytes, warnings: list[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """("file:line", object) of every line; a truncated last line is skipped with a warning."""
    items = list(lines(raw))
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
