"""KV events of speculative decoding workers into the index (``mesh.events.apply`` with
``mesh.core.lookahead``): detection, the declared form, and what cannot be keyed."""

from __future__ import annotations

import logging

import pytest

from mesh.core.index import PrefixIndex
from mesh.core.keys import block_keys, namespace_seed
from mesh.core.lookahead import prompt_keys
from mesh.events.apply import Seeds, apply_event
from mesh.events.health import LogLimiter, StreamHealth
from mesh.events.stream import Stream, WorkerEvents
from mesh.events.wire import BlockRemoved, BlockStored

BS = 4
SEED = namespace_seed("m")
TOKENS = list(range(100, 100 + 2 * BS + 1))


def _stream(declared: int | None = None) -> Stream:
    spec = WorkerEvents("w", "tcp://127.0.0.1:1", model="m", block_size=BS, lookahead_tokens=declared)
    return Stream(spec, StreamHealth("w", "w", 0, "tcp://127.0.0.1:1", None))


def _apply(index: PrefixIndex, stream: Stream, ev: object) -> None:
    for _ in apply_event(index, stream, ev, Seeds(), LogLimiter()):  # type: ignore[arg-type]
        pass


def _store(hashes: list[int], parent: int | None, tokens: list[int], ahead: list[list[int]] | None) -> BlockStored:
    return BlockStored(hashes, parent, tokens, BS, "GPU", lookahead=ahead)


def test_a_store_with_lookahead_tokens_is_keyed_with_them_and_the_target_marked() -> None:
    index, stream = PrefixIndex(), _stream()
    _apply(index, stream, _store([1], None, TOKENS[:BS], [[TOKENS[BS]]]))
    _apply(index, stream, _store([2], 1, TOKENS[BS : 2 * BS], [[TOKENS[2 * BS]]]))
    assert index.lookaheads == {"w": 1}
    assert index.keys_of("w") == set(prompt_keys(TOKENS, BS, SEED, 1))
    _apply(index, stream, _store([3], 1, TOKENS[BS : 2 * BS], [[7]]))  # the other variant of block 2
    _apply(index, stream, BlockRemoved([2], "GPU"))
    assert index.keys_of("w") == set(prompt_keys(TOKENS[: 2 * BS] + [7], BS, SEED, 1))


def test_declared_lookahead_without_lookahead_tokens_is_counted_and_not_keyed(caplog: pytest.LogCaptureFixture) -> None:
    index, stream = PrefixIndex(), _stream(declared=1)
    with caplog.at_level(logging.WARNING):
        _apply(index, stream, _store([1], None, TOKENS[:BS], None))
    assert stream.health.events == {"lookahead_missing": 1}
    assert index.keys_of("w") == set() and "cannot be keyed" in caplog.text


def test_a_target_that_starts_hashing_with_lookahead_drops_its_plain_keys() -> None:
    index, stream = PrefixIndex(), _stream()
    _apply(index, stream, _store([1, 2], None, TOKENS[: 2 * BS], None))
    assert index.keys_of("w") == set(block_keys(TOKENS, BS, SEED)) and not index.lookaheads
    _apply(index, stream, _store([5], None, TOKENS[:BS], [[TOKENS[BS]]]))
    assert index.keys_of("w") == set(prompt_keys(TOKENS[: BS + 1], BS, SEED, 1))
