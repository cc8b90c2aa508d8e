"""Decoding of vLLM's KV event wire format (REFERENCE.md section 2), tolerant of every layout.

Accepted shapes:
- batch: ``[ts, events]``, ``[ts, events, data_parallel_rank]``, or a map with those keys
  (``dp_rank`` accepted as an alias);
- event: a map with a ``"type"`` tag (current vLLM, msgspec ``tag=True``) or an array whose
  element 0 is the tag (``array_like=True``: older vLLM, SGLang); trailing fields may be missing,
  unknown keys and extra elements are ignored.
- ``BlockRemoved.remaining_copy_counts`` (vLLM PR #48933, optional): per block hash, the physical
  copies of it the engine still holds after this removal (vLLM does not deduplicate blocks: a hash
  may name several). Map key ``remaining_copy_counts``, or positional slot 4 (after group_idx).
  Present but malformed (not an array of non-negative ints as long as block_hashes): the removal
  is still decoded, without the counts, and flagged ``bad_copy_counts`` for the caller to count.

Block hashes arrive as u64, i64 or raw bytes. They are normalized to a u64 int: ints modulo 2**64
(an i64 keeps its two's-complement bits, as Dynamo's ``cast_unsigned``), bytes as
``int.from_bytes(b, "big") & (2**64 - 1)`` (the low 8 bytes), which is exactly what vLLM itself
publishes for the same block when ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` is set
(``maybe_convert_block_hash`` in ``vllm/v1/core/kv_cache_utils.py``). Engine hashes are opaque
ids, compared only within one target, so the only requirement is a stable, injective-enough map.

Nothing here raises on garbage: ``decode_batch`` returns a ``DecodeError`` for an undecodable
payload, and a batch whose individual events are malformed or unknown carries them as counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from mesh.events import wire_fields

# Kinds whose blocks form a reusable prefix (Dynamo's ``is_main_attention``).
MAIN_ATTENTION_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
# Kinds whose blocks are recurrent-state checkpoints of a hybrid model (vLLM's KVCacheSpecKind.MAMBA,
# which also covers its linear-attention layers): a prefix is resumable only where one exists.
RECURRENT_KINDS = frozenset({"mamba"})
_decoder = msgspec.msgpack.Decoder()
# A batch with its events left undecoded: one pass over the bytes that builds no event objects
# (measured: 0.06 s for a 16 MiB frame of 113k events, against 2.5 s to decode and normalize them)
_envelope = msgspec.msgpack.Decoder(list[msgspec.Raw] | dict[str, msgspec.Raw])
_raw_list = msgspec.msgpack.Decoder(list[msgspec.Raw])


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int] | None  # None or empty: a tier update of blocks known by hash
    block_size: int
    medium: str  # "GPU", "CPU", or another tier name (upper case)
    lora_name: str | None = None  # the LoRA namespace (``wire_fields.lora``: the name, else an id-only one)
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    cache_salt: str | None = None  # the namespace of a chain that starts here (see ``wire_fields.salt``)
    lookahead: list[list[int]] | None = None  # per block, the tokens after it that its hash covers


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    # vLLM PR #48933: per hash, the physical copies the engine still holds after this removal
    # (None: the producer cannot tell, e.g. offloading events, or an older engine)
    remaining_copy_counts: tuple[int, ...] | None = None
    bad_copy_counts: bool = False  # the field was present but malformed: ignored, as if absent


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class Batch:
    ts: float
    events: list[Event]
    data_parallel_rank: int | None
    unknown: int = 0  # events with an unknown tag (skipped)
    malformed: int = 0  # events with a known tag and a bad shape (skipped)
    unknown_tags: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class DecodeError:
    reason: str


def decode_batch(payload: bytes | memoryview) -> Batch | DecodeError:
    """Decode one payload frame. Never raises."""
    try:
        raw = _decoder.decode(payload)
    except Exception as exc:  # msgspec raises DecodeError, but a guard costs nothing here
        return DecodeError(f"not msgpack: {exc}")
    try:
        return _batch(raw)
    except wire_fields.BadField as exc:
        return DecodeError(str(exc))
    except Exception as exc:  # defensive: a decoder bug must not take the subscriber down
        return DecodeError(f"unexpected {type(exc).__name__}: {exc}")


@dataclass(slots=True)
class LazyBatch:
    """A batch whose events are still msgpack (``decode_lazy``): the subscriber decodes them a
    slice at a time (``decode_events``), so one huge frame never holds the loop for its whole
    decode. Events keep their order; the unknown/malformed counts are the caller's to keep."""

    ts: float
    raw_events: list[msgspec.Raw]
    data_parallel_rank: int | None


def decode_lazy(payload: bytes | memoryview) -> LazyBatch | DecodeError:
    """Decode one payload frame's envelope; its events stay raw. Never raises.

    Invalid msgpack anywhere in the frame is found here (the whole frame is walked), so a frame
    is refused before any of its events is applied, as ``decode_batch`` does."""
    try:
        env = _envelope.decode(payload)
    except msgspec.ValidationError:  # valid msgpack of another shape: the full decoder says why
        full = decode_batch(payload)
        if isinstance(full, DecodeError):
            return full
        return LazyBatch(full.ts, [msgspec.Raw(msgspec.msgpack.encode(e)) for e in _raw_events(payload)],
                         full.data_parallel_rank)
    except Exception as exc:
        return DecodeError(f"not msgpack: {exc}")
    try:
        if isinstance(env, list):
            if len(env) < 2:
                raise wire_fields.BadField(f"batch array of {len(env)} elements")
            ts_raw, ev_raw, rank_raw = env[0], env[1], env[2] if len(env) > 2 else None
        else:
            if "events" not in env:
                raise wire_fields.BadField("batch map without 'events'")
            ts_raw, ev_raw = env.get("ts"), env["events"]
            rank_raw = env.get("data_parallel_rank", env.get("dp_rank"))
        try:
            events = _raw_list.decode(ev_raw)
        except msgspec.ValidationError:
            raise wire_fields.BadField("batch events is not an array") from None
        ts = _decoder.decode(ts_raw) if ts_raw is not None else 0.0
        rank = _decoder.decode(rank_raw) if rank_raw is not None else None
    except wire_fields.BadField as exc:
        return DecodeError(str(exc))
    except Exception as exc:  # defensive: a decoder bug must not take the subscriber down
        return DecodeError(f"unexpected {type(exc).__name__}: {exc}")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        ts = 0.0
    return LazyBatch(float(ts), events, rank if wire_fields.is_int(rank) else None)


def _raw_events(payload: bytes | memoryview) -> list[Any]:
    """The events of a batch that only the generic decoder reads (e.g. a map with non-str keys)."""
    raw = _decoder.decode(payload)
    events = raw[1] if isinstance(raw, (list, tuple)) else raw["events"]
    return list(events)


def decode_events(raws: Sequence[msgspec.Raw], into: Batch) -> None:
    """Decode raw events (of a ``LazyBatch``) into ``into.events``, counting unknown and malformed
    ones on ``into``, as ``decode_batch`` does. Never raises. Several events are decoded in one
    call (as one msgpack array: a call per small event cost a third more in all)."""
    if len(raws) > 1:
        try:
            evs = _decoder.decode(b"\xdd" + len(raws).to_bytes(4, "big") + b"".join(raws))
        except Exception:
            evs = None  # one of them is bad: each on its own below
        if isinstance(evs, list):
            for ev in evs:
                _add_event(into, ev)
            return
    for raw in raws:
        try:
            ev = _decoder.decode(raw)
        except Exception:
            into.malformed += 1
            continue
        _add_event(into, ev)


def _add_event(batch: Batch, ev: Any) -> None:
    try:
        decoded = _event(ev)
    except wire_fields.BadField:
        batch.malformed += 1
        return
    if isinstance(decoded, str):
        batch.unknown += 1
        if len(batch.unknown_tags) < 8:
            batch.unknown_tags.append(decoded[:64])
    else:
        batch.events.append(decoded)


def _batch(raw: Any) -> Batch:
    if isinstance(raw, (list, tuple)):
        if len(raw) < 2:
            raise wire_fields.BadField(f"batch array of {len(raw)} elements")
        ts, events = raw[0], raw[1]
        rank = raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict):
        if "events" not in raw:
            raise wire_fields.BadField("batch map without 'events'")
        ts, events = raw.get("ts", 0.0), raw["events"]
        rank = raw.get("data_parallel_rank", raw.get("dp_rank"))
    else:
        raise wire_fields.BadField(f"batch is a {type(raw).__name__}")
    if not isinstance(events, (list, tuple)):
        raise wire_fields.BadField("batch events is not an array")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        ts = 0.0
    if not wire_fields.is_int(rank):
        rank = None
    batch = Batch(float(ts), [], rank)
    for ev in events:
        _add_event(batch, ev)
    return batch


def _event(ev: Any) -> Event | str:
    """An event, or the tag (str) of an unknown event type."""
    if isinstance(ev, dict):
        tag = ev.get("type")
        if not isinstance(tag, str):
            raise wire_fields.BadField("event map without a string 'type'")
        if tag == "BlockStored":
            return _stored_map(ev)
        if tag == "BlockRemoved":
            hashes = wire_fields.hashes(ev.get("block_hashes"))
            counts = wire_fields.copy_counts(ev.get("remaining_copy_counts"), len(hashes))
            return BlockRemoved(
                hashes,
                wire_fields.medium(ev.get("medium")),
                wire_fields.opt_int(ev.get("group_idx")),
                wire_fields.opt_str(ev.get("kv_cache_spec_kind")),
                None if counts is wire_fields.BAD_FIELD else counts,
                counts is wire_fields.BAD_FIELD,
            )
        if tag == "AllBlocksCleared":
            return AllBlocksCleared()
        return tag
    if isinstance(ev, (list, tuple)) and ev and isinstance(ev[0], str):
        tag = ev[0]
        if tag == "BlockStored":
            return _stored_array(ev)
        if tag == "BlockRemoved":
            return _removed_array(ev)
        if tag == "AllBlocksCleared":
            return AllBlocksCleared()
        return tag
    raise wire_fields.BadField("event is neither a tagged map nor a tagged array")


def _stored_map(ev: dict[str, Any]) -> BlockStored:
    if "block_hashes" not in ev:
        raise wire_fields.BadField("BlockStored without block_hashes")
    return BlockStored(
        wire_fields.hashes(ev["block_hashes"]),
        wire_fields.opt_hash(ev.get("parent_block_hash")),
        wire_fields.tokens(ev.get("token_ids")),
        wire_fields.block_size(ev.get("block_size")),
        wire_fields.medium(ev.get("medium")),
        wire_fields.lora(ev.get("lora_name"), ev.get("lora_id")),
        wire_fields.opt_int(ev.get("group_idx")),
        wire_fields.opt_str(ev.get("kv_cache_spec_kind")),
        wire_fields.salt(ev.get("cache_salt"), ev.get("extra_keys"), ev.get("lora_name")),
        _lookahead(ev.get("lookahead_token_ids"), ev.get("token_ids"), ev.get("block_size")),
    )


def _stored_array(ev: Sequence[Any]) -> BlockStored:
    # tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
    # extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window
    n = len(ev)
    if n < 2:
        raise wire_fields.BadField("BlockStored array without block_hashes")
    medium: Any = ev[6] if n > 6 else None
    if n > 5 and isinstance(ev[5], str) and n <= 6:  # an SGLang-style tuple: medium in slot 5
        medium = ev[5]
    group_idx, kind = _tail(ev[9:])
    return BlockStored(
        wire_fields.hashes(ev[1]),
        wire_fields.opt_hash(ev[2] if n > 2 else None),
        wire_fields.tokens(ev[3] if n > 3 else None),
        wire_fields.block_size(ev[4] if n > 4 else None),
        wire_fields.medium(medium),
        wire_fields.lora(ev[7] if n > 7 else None, ev[5] if n > 5 else None),
        group_idx,
        kind,
        wire_fields.salt(None, ev[8] if n > 8 else None, ev[7] if n > 7 else None),
        # vLLM's tail: sliding_window, locality, ownership, session_id, lookahead_token_ids
        _lookahead(ev[15] if n > 15 else None, ev[3] if n > 3 else None, ev[4] if n > 4 else None),
    )


def _lookahead(raw: Any, raw_tokens: Any, raw_bs: Any) -> list[list[int]] | None:
    if raw is None and not (raw_tokens and isinstance(raw_tokens, list) and isinstance(raw_tokens[0], (list, tuple))):
        return None  # the common store: no lookahead, no bigrams
    return wire_fields.lookahead(raw, raw_tokens, raw_bs if wire_fields.is_int(raw_bs) else 0)


def _removed_array(ev: Sequence[Any]) -> BlockRemoved:
    # tag, block_hashes, medium, group_idx, remaining_copy_counts (vLLM PR #48933); older tails:
    # tag, block_hashes, medium, group_idx (, kv_cache_spec_kind, sliding_window). An array in
    # slot 4 is the counts (no older tail puts one there); anything else there is an older tail.
    n = len(ev)
    if n < 2:
        raise wire_fields.BadField("BlockRemoved array without block_hashes")
    hashes = wire_fields.hashes(ev[1])
    if n > 4 and isinstance(ev[4], (list, tuple)):
        counts = wire_fields.copy_counts(ev[4], len(hashes))
        group_idx, kind = _tail(ev[3:4])
    else:
        counts = None
        group_idx, kind = _tail(ev[3:])
    if counts is wire_fields.BAD_FIELD:
        return BlockRemoved(hashes, wire_fields.medium(ev[2] if n > 2 else None), group_idx, kind, None, True)
    return BlockRemoved(hashes, wire_fields.medium(ev[2] if n > 2 else None), group_idx, kind, counts)


def _tail(tail: Sequence[Any]) -> tuple[int | None, str | None]:
    """``(group_idx, kv_cache_spec_kind)`` from the metadata tail of a positional event.

    The current layout is fixed (``group_idx, kind, sliding_window``); older producers appended
    metadata opportunistically (possibly after multimodal infos), so when the fixed layout does
    not type-check, the first int is the group and the first string the kind.
    """
    if not tail:
        return None, None
    g, k = tail[0], tail[1] if len(tail) > 1 else None
    if (g is None or wire_fields.is_int(g)) and (k is None or isinstance(k, str)):
        return g, k
    ints = [x for x in tail if wire_fields.is_int(x)]
    strs = [x for x in tail if isinstance(x, str)]
    return (ints[0] if ints else None), (strs[0] if strs else None)


class GroupFilter:
    """Which events of a hybrid model describe the reusable prefix (one per stream).

    Only full-attention groups qualify (``MAIN_ATTENTION_KINDS``); the first such group seen
    becomes the stream's main group and the others are skipped, since each group reports the
    same block hashes. Without a kind, only group 0 (or no group) qualifies. Removals carry a
    group but no kind: they qualify when their group is the main group (group 0 until one is
    learned) or absent.

    Groups of a recurrent kind (``RECURRENT_KINDS``) carry recurrent-state checkpoints: a store of
    one is a checkpoint (``is_state_stored``, which learns the group), and a removal naming a
    learned recurrent group is a checkpoint evicted (``is_state_removed``).
    """

    __slots__ = ("main", "recurrent")

    def __init__(self) -> None:
        self.main: int | None = None
        self.recurrent: set[int] = set()

    def is_state_stored(self, ev: BlockStored) -> bool:
        if ev.kv_cache_spec_kind not in RECURRENT_KINDS:
            return False
        self.recurrent.add(ev.group_idx or 0)
        return True

    def is_state_removed(self, ev: BlockRemoved) -> bool:
        return ev.group_idx is not None and ev.group_idx in self.recurrent and ev.group_idx != self.main

    def accept_stored(self, ev: BlockStored) -> bool:
        group = ev.group_idx or 0
        if ev.kv_cache_spec_kind is not None:
            if ev.kv_cache_spec_kind not in MAIN_ATTENTION_KINDS:
                return False
            if self.main is None:
                self.main = group
            return group == self.main
        return group == (0 if self.main is None else self.main)

    def accept_removed(self, ev: BlockRemoved) -> bool:
        if ev.group_idx is None:
            return True
        return ev.group_idx == (0 if self.main is None else self.main)
