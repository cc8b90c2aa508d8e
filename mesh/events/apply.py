"""A KV event batch into the prefix index, in slices that keep the event loop responsive.

A batch's events are decoded and applied in order, with a pause (the caller's pacer) after every
``SLICE_EVENT_BYTES`` of event msgpack (~1 ms to decode and apply here) and between every
``SLICE_BLOCKS`` blocks of one event (a long event is applied as consecutive stores of its
chained parts, which is the same chain). An event is decoded whole: the one stall left is the
msgspec decode of the largest event (~40 ns a token: 0.2 s for one 16 MiB event of 5M tokens); a
thread would not help, msgspec holds the GIL for the whole call (measured: the loop stalls as
long). Stores are keyed under ``mesh.core.keys.namespace_seed(model, lora, salt)``; a
BlockRemoved's ``remaining_copy_counts`` go to the index with it, a malformed one is counted
(``bad_copy_counts``) and the removal applied without it. Ownership: called by the stream's task
only; the index is written for that stream's target alone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import cast

from mesh.core.index import PrefixIndex
from mesh.core.keys import namespace_seed
from mesh.core.lookahead import event_keys, lookahead_seed
from mesh.events.health import LogLimiter
from mesh.events.ops import Keyed, Op, event_of
from mesh.events.stream import Stream
from mesh.events.wire import AllBlocksCleared, Batch, BlockRemoved, BlockStored, Event, GroupFilter, LazyBatch, decode_events
from policies.base import Tier

# Event media by tier: vLLM's GPU / CPU, SGLang HiCache's host tier CPU_PINNED (its pinned host memory).
TIERS = {"GPU": Tier.GPU, "DEVICE": Tier.GPU, "CPU": Tier.CPU, "HOST": Tier.CPU, "CPU_PINNED": Tier.CPU}
SLICE_EVENT_BYTES = 8 << 10
SLICE_BLOCKS = 256
SLICE_OPS = 32  # prepared events (``apply_ops``) between pauses: their decode and keying are done
MAX_SEEDS = 4096  # cached (model, LoRA) seeds; LoRA names come from the publisher, unbounded in number


class Seeds:
    """The namespace seed of each (model, LoRA) seen, bounded by ``MAX_SEEDS``."""

    __slots__ = ("_seeds",)

    def __init__(self) -> None:
        self._seeds: dict[tuple[str, str | None], int] = {}

    def __len__(self) -> int:
        return len(self._seeds)

    def get(self, model: str, lora: str | None, salt: str | None = None) -> int:
        if salt:  # one per tenant, unbounded in number: computed, never cached
            return namespace_seed(model, lora, salt)
        seed = self._seeds.get((model, lora))
        if seed is None:
            if len(self._seeds) >= MAX_SEEDS:  # a publisher naming a new LoRA per event grew it for good
                self._seeds.clear()
            seed = self._seeds[(model, lora)] = namespace_seed(model, lora)
        return seed


async def _yield() -> None:
    await asyncio.sleep(0)


async def apply_batch(index: PrefixIndex, stream: Stream, batch: LazyBatch, seeds: Seeds, logs: LogLimiter,
                      pause: Callable[[], Awaitable[None]] = _yield) -> None:
    """Decode and apply ``batch``'s raw events in order; ``pause()`` between slices (the
    subscriber's ``Pacer.turn``: it returns at once until a slice of time is used up)."""
    h = stream.health
    raws = batch.raw_events
    part = Batch(batch.ts, [], batch.data_parallel_rank)
    i = 0
    while i < len(raws):
        j, size = i, 0
        while j < len(raws) and size < SLICE_EVENT_BYTES:
            size += len(raws[j])
            j += 1
        part.events.clear()
        decode_events(raws[i:j], part)
        for ev in part.events:
            for _ in apply_event(index, stream, ev, seeds, logs):
                await pause()  # between slices of one huge event
        i = j
        if i < len(raws):
            await pause()
    if part.unknown:
        h.bump(h.events, "unknown", part.unknown)
    if part.malformed:
        h.bump(h.events, "malformed", part.malformed)


async def apply_ops(index: PrefixIndex, stream: Stream, ops: Sequence[Op], seeds: Seeds, logs: LogLimiter,
                    pause: Callable[[], Awaitable[None]] = _yield) -> None:
    """Apply a prepared frame's events in order (``mesh.events.prepare``: decoded, stores keyed
    where their parent's key was known there), as ``apply_batch`` applies the same frame."""
    for i, op in enumerate(ops):
        if i and not i % SLICE_OPS:
            await pause()
        ev, keyed = event_of(op)
        for _ in apply_event(index, stream, ev, seeds, logs, keyed):
            await pause()


def apply_event(index: PrefixIndex, stream: Stream, ev: Event, seeds: Seeds, logs: LogLimiter,
                keyed: Keyed | None = None) -> Iterator[None]:
    """Apply one event; yields between slices of ``SLICE_BLOCKS`` blocks. ``keyed``: a store's
    proposed keys (``mesh.events.ops``), used by the index only if chained from its parent key."""
    h = stream.health
    if type(ev) is BlockStored:
        yield from _stored(index, stream, ev, seeds, logs, keyed)
    elif type(ev) is AllBlocksCleared:
        index.apply_cleared(h.target)
        stream.filter = GroupFilter()
        h.bump(h.events, "cleared")
    else:  # the union's last member
        yield from _removed(index, stream, cast("BlockRemoved", ev), logs)


def _stored(index: PrefixIndex, stream: Stream, ev: BlockStored, seeds: Seeds, logs: LogLimiter,
            keyed: Keyed | None = None) -> Iterator[None]:
    h = stream.health
    spec = stream.spec
    tier = TIERS.get(ev.medium)
    if stream.filter.is_state_stored(ev):
        _state_stored(index, stream, ev, seeds)
        return
    if tier is None or not stream.filter.accept_stored(ev):
        h.bump(h.events, "filtered")
        return
    bs = ev.block_size or spec.block_size or 0
    # a store without tokens (a tier update by hash) needs no block size
    if (bs <= 0 and ev.token_ids) or (spec.block_size is not None and bs != spec.block_size):
        h.bump(h.events, "block_size_mismatch")
        return
    hashes, tokens = ev.block_hashes, ev.token_ids
    if tokens and len(tokens) != len(hashes) * bs:
        h.bump(h.events, "invalid")  # checked whole: a part must not be applied alone
        return
    seed = seeds.get(spec.model, ev.lora_name, ev.cache_salt)
    keys: Sequence[int] | None = None
    keyed_from: int | None = None  # set: ``keys`` are proposed, chained from it
    if tokens:
        la = _lookahead(index, stream, ev, logs)
        if la is None:
            return
        if la:
            seed = lookahead_seed(seed, la)
            keys = _lookahead_keys(index, stream, ev, bs, seed)
            if keys is None:
                return
        elif keyed is not None:
            keyed_from, keys = keyed
    parent, done, invalid = ev.parent_block_hash, 0, False
    for a in range(0, len(hashes), SLICE_BLOCKS):
        if a:
            yield
        b = min(len(hashes), a + SLICE_BLOCKS)
        try:
            done += index.apply_stored(h.target, hashes[a:b] if a or b < len(hashes) else hashes,
                                       parent if not a else hashes[a - 1],
                                       tokens[a * bs : b * bs] if tokens and (a or b < len(hashes)) else tokens,
                                       bs, seed, tier, keys=None if keys is None else keys[a:b],
                                       keyed_from=_keyed_from(keyed_from, keys, a))
        except ValueError:  # a bad token id: the rest of the chain cannot be keyed either
            invalid = True
            break
    if invalid and not done:
        h.bump(h.events, "invalid")
        return
    h.bump(h.events, "invalid" if invalid else "stored")
    h.bump(h.blocks, "stored", done)
    if done < len(hashes):
        h.bump(h.blocks, "skipped", len(hashes) - done)


def _keyed_from(first: int | None, keys: Sequence[int] | None, a: int) -> int | None:
    """The key proposed keys of the slice from block ``a`` chain from (None: not proposed)."""
    if first is None or keys is None:
        return None
    return keys[a - 1] if a else first


def _lookahead(index: PrefixIndex, stream: Stream, ev: BlockStored, logs: LogLimiter) -> int | None:
    """The tokens past each block that this store's hashes cover (0: plain keys), as the store
    shows it; the target's from now on (``PrefixIndex.lookaheads``, read by the router). None:
    the worker is declared to hash with lookahead but the store does not carry it (not keyable)."""
    h, declared = stream.health, stream.spec.lookahead_tokens
    target = h.target
    if ev.lookahead is None and declared:
        h.bump(h.events, "lookahead_missing")
        logs.log(logging.WARNING, (target, "lookahead_missing"),
                 "kv events %s: lookahead_tokens is %d but a BlockStored carries no lookahead tokens "
                 "(lookahead_token_ids or bigram pages): its blocks cannot be keyed", target, declared)
        return None
    la = len(ev.lookahead[0]) if ev.lookahead else 0
    if declared is not None and declared != la:
        h.bump(h.events, "lookahead_mismatch")
        logs.log(logging.WARNING, (target, "lookahead_mismatch"),
                 "kv events %s: lookahead_tokens is %d but its events hash %d tokens past each block; "
                 "keyed as the events show", target, declared, la)
    if index.lookaheads.get(target, 0) != la:
        if index.keys_of(target):  # keyed the other way so far: those keys would never match
            index.clear_target(target)
        logs.log(logging.WARNING, (target, "lookahead"), "kv events %s: block hashes cover %d token(s) past "
                 "each block (speculative decoding): its blocks are keyed with them", target, la)
        if la:
            index.lookaheads[target] = la
        else:
            index.lookaheads.pop(target, None)
    return la


def _lookahead_keys(index: PrefixIndex, stream: Stream, ev: BlockStored, bs: int, seed: int) -> list[int] | None:
    """The store's lookahead keys (``mesh.core.lookahead.event_keys``); [] when its parent is
    unknown (the index then skips it); None after counting a store that cannot be keyed."""
    h = stream.health
    ahead = ev.lookahead or []
    parent = index.parent_key(h.target, ev.parent_block_hash, seed)
    if parent is None:
        return []
    try:
        if len(ahead) != len(ev.block_hashes):
            raise ValueError("lookahead lists do not match the block hashes")
        return event_keys(ev.token_ids or [], ahead, bs, parent)
    except ValueError:
        h.bump(h.events, "invalid")
        return None


def _state_stored(index: PrefixIndex, stream: Stream, ev: BlockStored, seeds: Seeds) -> None:
    """A hybrid model's recurrent-state checkpoint(s): the target is hybrid from now on, and its
    matches end at checkpoints (``PrefixIndex.apply_state_stored``). Only a device-tier store is a
    resumable checkpoint here."""
    h = stream.health
    bs = ev.block_size or stream.spec.block_size or 0
    if TIERS.get(ev.medium) is not Tier.GPU:
        index.mark_hybrid(h.target)
        h.bump(h.events, "filtered")
        return
    try:
        done = index.apply_state_stored(h.target, ev.block_hashes, ev.parent_block_hash, ev.token_ids, bs,
                                        seeds.get(stream.spec.model, ev.lora_name, ev.cache_salt))
    except ValueError:
        h.bump(h.events, "invalid")
        return
    h.bump(h.events, "state_stored")
    h.bump(h.blocks, "state_stored" if done else "state_skipped", done or len(ev.block_hashes))


def _removed(index: PrefixIndex, stream: Stream, ev: BlockRemoved, logs: LogLimiter) -> Iterator[None]:
    h = stream.health
    target = h.target
    if stream.filter.is_state_removed(ev):
        h.bump(h.events, "state_removed")
        h.bump(h.blocks, "state_removed", index.apply_state_removed(target, ev.block_hashes))
        return
    tier = TIERS.get(ev.medium)
    if tier is None or not stream.filter.accept_removed(ev):
        h.bump(h.events, "filtered")
        return
    if ev.bad_copy_counts:  # applied as if absent (one copy per removal on the GPU)
        h.bump(h.events, "bad_copy_counts")
        logs.log(logging.WARNING, (target, "bad_copy_counts"),
                 "kv events %s: BlockRemoved with a malformed remaining_copy_counts, ignored", target)
    hashes, counts = ev.block_hashes, ev.remaining_copy_counts
    for a in range(0, len(hashes), SLICE_BLOCKS):
        if a:
            yield
        if len(hashes) <= SLICE_BLOCKS:
            part, rest = hashes, counts
        else:
            part = hashes[a : a + SLICE_BLOCKS]
            rest = None if counts is None else counts[a : a + SLICE_BLOCKS]
        h.bump(h.blocks, "removed", index.apply_removed(target, part, tier, rest))
    h.bump(h.events, "removed")
