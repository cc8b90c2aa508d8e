"""The keys of workers that hash each block with the tokens after it (``mesh.core.lookahead``),
the lookahead fields of their KV events, and the router's overlap for them."""

from __future__ import annotations

import msgspec
import pytest

from mesh.core.index import PrefixIndex
from mesh.core.keys import block_keys, namespace_seed
from mesh.core.lookahead import event_keys, lookahead_seed, merge_overlaps, prompt_keys
from mesh.events.wire import Batch, BlockStored, decode_batch
from policies.base import ClusterView, Overlap, RequestInfo

BS = 4
SEED = namespace_seed("m")


def test_a_prompt_block_is_keyed_only_when_its_lookahead_tokens_follow_it() -> None:
    tokens = list(range(3 * BS))
    assert len(prompt_keys(tokens, BS, SEED, 1)) == 2  # the last block has no token after it
    assert len(prompt_keys(tokens + [7], BS, SEED, 1)) == 3
    assert len(prompt_keys(tokens + [7], BS, SEED, 2)) == 2
    assert len(prompt_keys(tokens[:BS], BS, SEED, 1)) == 0


def test_prompts_parting_right_after_a_block_share_every_key_before_it() -> None:
    shared = list(range(100, 100 + 2 * BS))
    a, b = prompt_keys(shared + [1, 2], BS, SEED, 1), prompt_keys(shared + [3, 2], BS, SEED, 1)
    assert a[0] == b[0] and a[1] != b[1]
    assert block_keys(shared + [1], BS, SEED) == block_keys(shared + [3], BS, SEED)  # plain keys cannot tell


def test_an_events_keys_equal_the_prompts_keys_of_the_same_tokens() -> None:
    tokens = list(range(50, 50 + 3 * BS + 2))
    for la in (1, 2):
        ahead = [tokens[(i + 1) * BS : (i + 1) * BS + la] for i in range(3)]
        whole = event_keys(tokens[: 3 * BS], ahead, BS, lookahead_seed(SEED, la))
        assert whole == prompt_keys(tokens, BS, SEED, la)
        head = event_keys(tokens[:BS], ahead[:1], BS, lookahead_seed(SEED, la))  # a chain over two events
        assert head + event_keys(tokens[BS : 3 * BS], ahead[1:], BS, head[-1]) == whole
    with pytest.raises(ValueError):
        event_keys(tokens[:BS], [[1], [2]], BS, SEED)


def test_lookahead_keys_are_their_own_namespace() -> None:
    tokens = list(range(2 * BS + 1))
    plain = set(block_keys(tokens, BS, SEED))
    assert not plain & set(prompt_keys(tokens, BS, SEED, 1))
    assert lookahead_seed(SEED, 1) != lookahead_seed(SEED, 2) != SEED


def test_merge_takes_each_lookahead_targets_overlap_from_its_own_match() -> None:
    plain = {"p": Overlap(3), "la1": Overlap(3), "la2": Overlap(2)}
    ahead = {1: {"la1": Overlap(2), "p": Overlap(9)}, 2: {}}
    assert merge_overlaps(plain, ahead, {"la1": 1, "la2": 2}) == {"p": Overlap(3), "la1": Overlap(2)}


def _info(tokens: list[int]) -> RequestInfo:
    return RequestInfo(model="m", block_keys=block_keys(tokens, BS, SEED), block_size=BS,
                       prompt_tokens=len(tokens), tokens=tokens, key_seed=SEED)


def test_router_overlap_of_a_lookahead_target_counts_a_block_only_when_the_next_token_matches() -> None:
    held = list(range(3 * BS)) + [1]
    index = PrefixIndex()
    index.store("plain", block_keys(held, BS, SEED))
    index.store("eagle", prompt_keys(held, BS, SEED, 1))
    index.lookaheads["eagle"] = 1
    other = list(range(3 * BS)) + [2]
    view = ClusterView(targets=[], now=0.0, index=index)
    assert view.overlaps(_info(other)) == {"plain": Overlap(3), "eagle": Overlap(2)}
    view = ClusterView(targets=[], now=0.0, index=index)
    assert view.overlaps(_info(held)) == {"plain": Overlap(3), "eagle": Overlap(3)}


def test_without_lookahead_targets_the_plain_match_is_the_overlap() -> None:
    index = PrefixIndex()
    tokens = list(range(2 * BS))
    index.store("plain", block_keys(tokens, BS, SEED))
    assert ClusterView(targets=[], now=0.0, index=index).overlaps(_info(tokens)) == {"plain": Overlap(2)}


def _stored(event: dict[str, object]) -> BlockStored:
    batch = decode_batch(msgspec.msgpack.encode([0.0, [event]]))
    assert isinstance(batch, Batch) and not batch.malformed, batch
    ev = batch.events[0]
    assert isinstance(ev, BlockStored)
    return ev


def test_vllm_lookahead_token_ids_and_sglang_bigram_pages_decode_as_lookahead() -> None:
    vllm = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None, "token_ids": list(range(8)),
            "block_size": 4, "lora_id": None, "medium": "GPU", "lookahead_token_ids": [[4], [9]]}
    assert _stored(vllm).lookahead == [[4], [9]]
    assert _stored({**vllm, "lookahead_token_ids": None}).lookahead is None
    pairs = [[t, t + 1] for t in range(8)]
    sgl = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None, "token_ids": pairs,
           "block_size": 4, "lora_id": None}
    ev = _stored(sgl)
    assert ev.token_ids == list(range(8)) and ev.lookahead == [[4], [8]]


def test_a_malformed_lookahead_is_a_malformed_event() -> None:
    bad = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None, "token_ids": list(range(8)),
           "block_size": 4, "lora_id": None, "lookahead_token_ids": [[4], [9, 1]]}
    batch = decode_batch(msgspec.msgpack.encode([0.0, [bad]]))
    assert isinstance(batch, Batch) and batch.malformed == 1 and not batch.events
