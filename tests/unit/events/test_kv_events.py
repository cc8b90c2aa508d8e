"""Decoding every layout of vLLM's KV event payloads, and garbage."""

from __future__ import annotations

import random

import msgspec
import pytest

from mesh.events.wire import (
    AllBlocksCleared,
    Batch,
    BlockRemoved,
    BlockStored,
    DecodeError,
    GroupFilter,
    decode_batch,
)

enc = msgspec.msgpack.encode


# msgspec structs shaped like vLLM's own (tag=True; array_like for the older layout)
class MapStored(msgspec.Struct, tag="BlockStored", omit_defaults=True):
    block_hashes: list
    parent_block_hash: object
    token_ids: list
    block_size: int
    lora_id: object = None
    medium: object = None
    lora_name: object = None
    extra_keys: object = None
    group_idx: object = None
    kv_cache_spec_kind: object = None
    kv_cache_spec_sliding_window: object = None


class MapRemoved(msgspec.Struct, tag="BlockRemoved", omit_defaults=True):
    block_hashes: list
    medium: object = None
    group_idx: object = None


class MapCleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


class ArrStored(msgspec.Struct, tag="BlockStored", array_like=True):
    block_hashes: list
    parent_block_hash: object
    token_ids: list
    block_size: int
    lora_id: object
    medium: object


class ArrRemoved(msgspec.Struct, tag="BlockRemoved", array_like=True):
    block_hashes: list
    medium: object


class MapBatch(msgspec.Struct):
    ts: float
    events: list
    data_parallel_rank: object = None


def test_current_vllm_map_layout() -> None:
    payload = enc(
        MapBatch(
            1.5,
            [
                MapStored([2**64 - 1, 7], None, [1, 2, 3, 4], 2, medium="GPU", group_idx=0,
                          kv_cache_spec_kind="full_attention"),
                MapRemoved([7], "CPU"),
                MapCleared(),
            ],
            3,
        )
    )
    batch = decode_batch(payload)
    assert isinstance(batch, Batch)
    assert batch.ts == 1.5 and batch.data_parallel_rank == 3
    stored, removed, cleared = batch.events
    assert stored == BlockStored([2**64 - 1, 7], None, [1, 2, 3, 4], 2, "GPU", None, 0, "full_attention")
    assert removed == BlockRemoved([7], "CPU", None)
    assert cleared == AllBlocksCleared()


def test_older_array_layout_and_two_element_batch() -> None:
    payload = enc([2.0, [ArrStored([5, 6], 4, [9] * 32, 16, None, None), ArrRemoved([5], None)]])
    batch = decode_batch(payload)
    assert isinstance(batch, Batch) and batch.data_parallel_rank is None
    stored, removed = batch.events
    assert stored.block_hashes == [5, 6] and stored.parent_block_hash == 4
    assert stored.block_size == 16 and stored.medium == "GPU"  # None means GPU
    assert removed == BlockRemoved([5], "GPU")


def test_three_element_array_batch_and_full_positional_tail() -> None:
    ev = ["BlockStored", [1], None, [0, 1], 2, None, "cpu", "my-lora", None, 1, "full_attention", None, "extra"]
    batch = decode_batch(enc([0.0, [ev], 1]))
    assert isinstance(batch, Batch) and batch.data_parallel_rank == 1
    (stored,) = batch.events
    assert stored.medium == "CPU" and stored.lora_name == "my-lora"
    assert stored.group_idx == 1 and stored.kv_cache_spec_kind == "full_attention"


def test_legacy_tail_with_multimodal_infos_before_the_group() -> None:
    ev = ["BlockStored", [1], None, [0, 1], 2, None, None, None, None, [None], 2, "sliding_window"]
    (stored,) = decode_batch(enc([0.0, [ev]])).events  # type: ignore[union-attr]
    assert stored.group_idx == 2 and stored.kv_cache_spec_kind == "sliding_window"


def test_cache_salt_from_vllm_extra_keys_and_from_a_cache_salt_field() -> None:
    """An explicit ``cache_salt`` field (Dynamo, SGLang) is the salt. vLLM's first-block
    ``extra_keys``: a leading LoRA name is the LoRA namespace, one remaining string is the salt,
    anything richer (multimodal ids, prompt-embedding bytes) an opaque namespace no query uses."""
    events = [
        {"type": "BlockStored", "block_hashes": [3], "parent_block_hash": None, "token_ids": [0, 0],
         "block_size": 2, "cache_salt": "tenant-b"},
        ["BlockStored", [4], None, [0, 0], 2, None, "GPU", None, [["tenant-c"]]],
        MapStored([1], None, [0, 0], 2, lora_name="my-lora", extra_keys=[["my-lora"]]),
        MapStored([2], None, [0, 0], 2, lora_name="my-lora", extra_keys=[["my-lora", "tenant-d"]]),
        MapStored([5], None, [0, 0], 2, extra_keys="garbage"),
        MapStored([6], None, [0, 0], 2),
        MapStored([7, 8], None, [0] * 4, 2, extra_keys=[["mm-hash", "tenant-a"], None]),
        MapStored([9], None, [0, 0], 2, extra_keys=[["tenant-e", b"\x01"]]),
        MapStored([10], None, [0, 0], 2, extra_keys=[[7]]),
    ]
    batch = decode_batch(enc([0.0, events]))
    assert isinstance(batch, Batch) and batch.malformed == 0
    salts = [e.cache_salt for e in batch.events]
    assert salts[:6] == ["tenant-b", "tenant-c", None, "tenant-d", None, None]
    opaque = salts[6:]
    assert all(s is not None and s.startswith("\0opaque\0") for s in opaque) and len(set(opaque)) == 3


def test_missing_trailing_fields_and_sglang_short_tuple() -> None:
    short = ["BlockStored", [1, 2], None, [0, 1, 2, 3], 2, None]  # ends at lora_id
    removed = ["BlockRemoved", [1]]
    (s, r) = decode_batch(enc([0.0, [short, removed]])).events  # type: ignore[union-attr]
    assert s.medium == "GPU" and s.lora_name is None and s.group_idx is None
    assert r == BlockRemoved([1], "GPU")


def test_hash_normalization_int_negative_and_bytes() -> None:
    digest = bytes(range(32))
    ev = {"type": "BlockRemoved", "block_hashes": [-1, 5, digest, b"\x01\x02"], "medium": None}
    (r,) = decode_batch(enc({"ts": 0.0, "events": [ev]})).events  # type: ignore[union-attr]
    assert r.block_hashes == [2**64 - 1, 5, int.from_bytes(digest[-8:], "big"), 0x0102]


def test_map_batch_with_dp_rank_alias() -> None:
    batch = decode_batch(enc({"ts": 3, "events": [], "dp_rank": 2}))
    assert isinstance(batch, Batch) and batch.data_parallel_rank == 2 and batch.ts == 3.0


def test_unknown_event_types_are_counted_and_skipped() -> None:
    events = [{"type": "BlockMoved", "x": 1}, ["Heartbeat"], {"type": "AllBlocksCleared", "extra": 1}]
    batch = decode_batch(enc([0.0, events]))
    assert isinstance(batch, Batch)
    assert batch.unknown == 2 and batch.unknown_tags == ["BlockMoved", "Heartbeat"]
    assert batch.events == [AllBlocksCleared()]


def test_malformed_events_are_counted_and_the_rest_kept() -> None:
    events = [
        {"type": "BlockStored"},  # no hashes
        ["BlockStored", "nope"],
        ["BlockRemoved", [1.5]],
        {"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": -3},
        42,
        {"type": 7},
        ["BlockRemoved", [9]],
    ]
    batch = decode_batch(enc([0.0, events]))
    assert isinstance(batch, Batch)
    assert batch.malformed == 6 and batch.events == [BlockRemoved([9], "GPU")]


@pytest.mark.parametrize(
    "payload",
    [b"", b"\xc1", b"\x92", enc("text"), enc([1.0]), enc({"ts": 1.0}), enc([0.0, "x"]), enc(None), b"\xff" * 50],
)
def test_garbage_payloads_give_a_decode_error(payload: bytes) -> None:
    assert isinstance(decode_batch(payload), DecodeError)


def test_random_bytes_never_raise() -> None:
    rng = random.Random(0)
    good = enc([0.0, [["BlockStored", [1, 2], None, list(range(8)), 4, None, "GPU"]], 0])
    for _ in range(2000):
        blob = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        cut = good[: rng.randrange(len(good))]
        flipped = bytearray(good)
        flipped[rng.randrange(len(good))] = rng.randrange(256)
        for p in (blob, cut, bytes(flipped)):
            assert isinstance(decode_batch(p), (Batch, DecodeError))


def test_group_filter_keeps_only_the_main_full_attention_group() -> None:
    f = GroupFilter()
    sliding = BlockStored([1], None, [0], 1, "GPU", None, 0, "sliding_window")
    full = BlockStored([1], None, [0], 1, "GPU", None, 1, "full_attention")
    full2 = BlockStored([1], None, [0], 1, "GPU", None, 2, "full_attention")
    assert not f.accept_stored(sliding)
    assert f.accept_stored(full) and f.main == 1
    assert not f.accept_stored(full2)  # same hashes again for a second group: skipped
    assert f.accept_removed(BlockRemoved([1], "GPU", 1))
    assert not f.accept_removed(BlockRemoved([1], "GPU", 0))
    assert f.accept_removed(BlockRemoved([1], "GPU", None))
    plain = GroupFilter()
    assert plain.accept_stored(BlockStored([1], None, [0], 1, "GPU"))
    assert not plain.accept_stored(BlockStored([1], None, [0], 1, "GPU", None, 3))
