"""Trace files on disk: which files a path names, their bytes (gzip inflated, bounded), and
their format, told from the content, never the name.

Invariants: a file is read whole and at most ``MAX_TRACE_BYTES``, on disk and once
decompressed (a gzip bomb is refused, not inflated); an empty file, a truncated gzip stream or
an unknown format is a ``TraceError`` naming the file.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterable
from pathlib import Path

import msgspec

from mesh.files import FileProblem, read_regular_file
from simulator.trace_records import FORMATS, TraceError, lines

MAX_TRACE_BYTES = 1 << 30  # one file, on disk and inflated (2 GiB of zeros gzip to 2 MB)
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


def read_bytes(path: Path) -> bytes:
    try:
        raw = read_regular_file(path, MAX_TRACE_BYTES)
    except FileProblem as exc:
        raise TraceError(f"{path}: {exc}{': split it' if 'limit' in str(exc) else ''}") from None
    if raw[:2] == b"\x1f\x8b":
        raw = gunzip(path, raw)
    if not raw.strip():
        raise TraceError(f"{path}: empty trace file")
    return raw


def gunzip(path: Path, raw: bytes) -> bytes:
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


def detect_format(path: Path, raw: bytes) -> str:
    """The trace format of a file's content; TraceError when it is none of ``FORMATS``."""
    head = raw[:4096].lstrip()
    if head[:1] == b"{" and b'"requests"' in head and b'"block_size"' in head:
        return "weka"  # one JSON document per session: parsed once, by the WEKA reader
    first = next(lines(raw))[1]
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
