"""KV event frames made ready for the index away from the gateway's loop (``mesh.events.child``).

``Preparer.prepare(frames)`` does for one live frame everything that needs no index: it splits
the frame (seq, payload), digests the payload (the duplicate proof of ``mesh.events.stream``),
decodes the envelope and every event (``mesh.events.wire``) and keys each plain BlockStored (no
lookahead, no recurrent-state checkpoint) with the router's chained hashes (``mesh.core.keys``).

Keys chain from the parent block's router key, which only the index knows for sure: a preparer
keeps, per stream, the key it computed for each engine hash it saw stored (``hints``, at most
``MAX_HINTS``) and proposes keys chained from it. The index uses them only when that parent key
is its own (``PrefixIndex.apply_stored(keyed_from=...)``) and keys the store itself otherwise, so
prepared ingestion applies exactly what in-process ingestion applies, whatever the hints hold.

A ``Prepared`` frame is a tuple of plain values (cheap to pickle); its events are
``mesh.events.ops`` tuples. Ownership: a ``Preparer`` belongs to one stream of the child process.
"""

from __future__ import annotations

import math

from mesh.core.keys import block_keys
from mesh.events.apply import Seeds
from mesh.events.ops import Keyed, Op, Prepared, op_of
from mesh.events.stream import digest, split_frame
from mesh.events.wire import RECURRENT_KINDS, AllBlocksCleared, Batch, BlockStored, DecodeError, Event, decode_events, decode_lazy

MAX_HINTS = 1 << 18  # engine hash -> key hints kept per stream (~30 MB); past it they start over


class Preparer:
    """One stream's frames -> ``Prepared`` (its hints and seeds are the stream's)."""

    __slots__ = ("model", "block_size", "max_frame_bytes", "hints", "seeds")

    def __init__(self, model: str, block_size: int | None, max_frame_bytes: int) -> None:
        self.model, self.block_size, self.max_frame_bytes = model, block_size, max_frame_bytes
        self.hints: dict[int, int] = {}
        self.seeds = Seeds()

    def prepare(self, frames: list[bytes]) -> Prepared:
        parsed = split_frame(frames)
        if parsed is None:
            return Prepared(-1, 0, 0, 0.0, None, [], 0, 0, "malformed")
        seq, payload = parsed
        size, dig = len(payload), digest(payload)
        lazy = decode_lazy(payload)
        ts = -math.inf if isinstance(lazy, DecodeError) else lazy.ts  # (a stale frame's test reads it)
        if size > self.max_frame_bytes:
            return Prepared(seq, size, dig, ts, None, [], 0, 0, "oversized")
        if isinstance(lazy, DecodeError):
            return Prepared(seq, size, dig, ts, None, [], 0, 0, f"undecodable: {lazy.reason}")
        batch = Batch(lazy.ts, [], lazy.data_parallel_rank)
        decode_events(lazy.raw_events, batch)
        ops = [self._op(ev) for ev in batch.events]
        return Prepared(seq, size, dig, lazy.ts, lazy.data_parallel_rank, ops, batch.unknown, batch.malformed, None)

    def _op(self, ev: Event) -> Op:
        if type(ev) is BlockStored:
            return op_of(ev, self._key(ev))
        if type(ev) is AllBlocksCleared:
            self.hints.clear()
        return op_of(ev)

    def _key(self, ev: BlockStored) -> Keyed | None:
        """Proposed keys of a plain store, chained from its parent's hint (the seed at a
        prompt's start); None when the store is not plain or its parent has no hint."""
        tokens = ev.token_ids
        if not tokens or ev.lookahead is not None or ev.kv_cache_spec_kind in RECURRENT_KINDS:
            return None
        bs = ev.block_size or self.block_size or 0
        if bs <= 0 or len(tokens) != len(ev.block_hashes) * bs:
            return None
        seed = self.seeds.get(self.model, ev.lora_name, ev.cache_salt)
        parent = seed if ev.parent_block_hash is None else self.hints.get(ev.parent_block_hash)
        if parent is None:
            return None
        try:
            keys = block_keys(tokens, bs, parent)
        except ValueError:
            return None  # a bad token id: the loop counts the store invalid
        hints = self.hints
        if len(hints) + len(keys) > MAX_HINTS:
            hints.clear()
        hints.update(zip(ev.block_hashes, keys))
        return parent, keys

