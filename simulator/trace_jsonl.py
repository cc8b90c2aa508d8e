"""The JSON-lines trace formats, one reader each: ``mooncake``, ``bailian`` and ``mesh``.

Each reader turns one file's lines into ``Rec``s in file order (``simulator.trace_records``):
mooncake requests arrive at their timestamps (open loop); a bailian turn and a later mesh turn
are released by their session's previous turn (closed loop), and only a session's first turn
keeps an absolute arrival. A reader checks every field it reads and that each request's ids
cover its prompt (``check_chain``); it never sees another file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from simulator.trace_records import (
    DEFAULT_BLOCK,
    DONE,
    START,
    Rec,
    TraceError,
    check_chain,
    json_lines,
    lines,
    need_ids,
    need_int,
    need_num,
)


def read_mooncake(path: Path, raw: bytes, block: int, warnings: list[str]) -> list[Rec]:
    out = []
    for where, obj in json_lines(path, raw, warnings):
        prompt = need_int(where, obj, "input_length", 1)
        ids = need_ids(where, obj)
        check_chain(where, ids, prompt, block)
        out.append(Rec(None, need_num(where, obj, "timestamp") / 1000.0, [],
                       prompt, need_int(where, obj, "output_length"), ids, where))
    return out


def read_bailian(path: Path, raw: bytes, block: int, warnings: list[str]) -> list[Rec]:
    out: list[Rec] = []
    by_chat: dict[Any, int] = {}
    root_of: dict[Any, Any] = {}
    for where, obj in json_lines(path, raw, warnings):
        chat, parent = obj.get("chat_id"), obj.get("parent_chat_id", -1)
        if chat is None:
            raise TraceError(f"{where}: missing 'chat_id'")
        for key, v in (("chat_id", chat), ("parent_chat_id", parent)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, str))):
                raise TraceError(f"{where}: {key!r} must be an integer or a string, got {type(v).__name__}")
        prompt = need_int(where, obj, "input_length", 1)
        ids = need_ids(where, obj)
        check_chain(where, ids, prompt, block)
        t = need_num(where, obj, "timestamp")
        rec = Rec(None, t, [], prompt, need_int(where, obj, "output_length"), ids, where)
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


def read_mesh(path: Path, raw: bytes, block: int, warnings: list[str]) -> list[Rec]:
    out: list[Rec] = []
    last: dict[str, int] = {}
    for where, obj in json_lines(path, raw, warnings):
        if obj.get("format") == "mesh-sessions":
            continue
        prompt = need_int(where, obj, "input_tokens", 1)
        ids = need_ids(where, obj)
        check_chain(where, ids, prompt, block)
        session = obj.get("session")
        if session is not None and not isinstance(session, str):
            raise TraceError(f"{where}: 'session' must be a string, got {session!r}")
        rec = Rec(session, None, [], prompt, need_int(where, obj, "output_tokens"), ids, where)
        if session is not None and session in last:
            if "t" in obj:
                raise TraceError(f"{where}: a later turn of session {session!r} takes 'think_s', not 't'")
            rec.deps = [(last[session], DONE, need_num(where, obj, "think_s", 0.0))]
        else:
            if "t" not in obj:
                raise TraceError(f"{where}: the first request of a session (or one without a session) needs 't'")
            rec.arrival = need_num(where, obj, "t")
        if session is not None:
            last[session] = len(out)
        out.append(rec)
    return out


def mesh_block_size(path: Path, raw: bytes) -> int:
    """The block size a mesh file's header line names (else the format's default)."""
    first = msgspec.json.decode(next(lines(raw))[1])
    if isinstance(first, dict) and first.get("format") == "mesh-sessions":
        b = first.get("block_size", DEFAULT_BLOCK["mesh"])
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise TraceError(f"{path}:1: block_size must be an integer >= 1, got {b!r}")
        return b
    return DEFAULT_BLOCK["mesh"]
