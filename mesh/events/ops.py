"""Compact KV events: what the child process hands the gateway's loop (``mesh.events.prepare``).

An ``Op`` is a tuple of plain values (cheap to pickle and to rebuild): ``(OP_STORED, BlockStored
fields, keyed_from, keys)``, ``(OP_REMOVED, BlockRemoved fields)`` or ``(OP_CLEARED,)``. A store's
``keys`` (None: not keyed) are the router keys proposed for its blocks, chained from
``keyed_from`` (``PrefixIndex.apply_stored`` uses them only when that is its own parent key).
``op_of`` and ``event_of`` are inverse; the field order is the dataclasses' own. A ``Prepared``
is one live frame so handed over (it travels as a plain tuple).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from mesh.events.wire import AllBlocksCleared, BlockRemoved, BlockStored, Event

OP_STORED, OP_REMOVED, OP_CLEARED = 0, 1, 2
Op = tuple[Any, ...]
Keyed = tuple[int, list[int]]  # (the parent key the keys chain from, the blocks' keys)
LOST = "receiver_lost"  # a ``Prepared.error``: the child process died (a marker, not a frame)


class Prepared(NamedTuple):
    """One live frame, ready for the loop. ``error``: None, ``"malformed"`` (not a
    ``[topic, seq, payload]`` frame: ``seq`` is -1), ``"oversized"`` or ``"undecodable: <why>"``
    (no events; ``ts`` is the envelope's, -inf when it has none), or ``LOST`` (a marker)."""

    seq: int
    size: int  # payload bytes (the backlog budget counts them)
    digest: int
    ts: float
    data_parallel_rank: int | None
    ops: list[Op]
    unknown: int
    malformed: int
    error: str | None


def op_of(ev: Event, keyed: Keyed | None = None) -> Op:
    if type(ev) is BlockStored:
        return (OP_STORED, (ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size, ev.medium,
                            ev.lora_name, ev.group_idx, ev.kv_cache_spec_kind, ev.cache_salt, ev.lookahead),
                None if keyed is None else keyed[0], None if keyed is None else keyed[1])
    if type(ev) is BlockRemoved:
        return (OP_REMOVED, (ev.block_hashes, ev.medium, ev.group_idx, ev.kv_cache_spec_kind,
                             ev.remaining_copy_counts, ev.bad_copy_counts))
    return (OP_CLEARED,)


def event_of(op: Op) -> tuple[Event, Keyed | None]:
    """The event an ``Op`` carries, with its proposed keys (stores only)."""
    kind = op[0]
    if kind == OP_STORED:
        return BlockStored(*op[1]), None if op[3] is None else (op[2], op[3])
    if kind == OP_REMOVED:
        return BlockRemoved(*op[1]), None
    return AllBlocksCleared(), None
