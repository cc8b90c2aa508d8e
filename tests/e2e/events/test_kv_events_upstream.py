"""KV events exactly as current vLLM and SGLang put them on the wire, into a real gateway process.

The event structs here and the publisher (``tests/fakes/upstream_publisher.py``) are written from
the upstream sources, sharing no code with ``mesh``:

- vLLM ``vllm/distributed/kv_events.py``: ``KVCacheEvent`` is a msgspec struct with ``tag=True,
  omit_defaults=True`` (a map with ``"type"``; required fields present even when nil, defaulted ones
  left out when unset); ``BlockStored`` = block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind,
  kv_cache_spec_sliding_window, and on main also locality, ownership, session_id; ``BlockRemoved``
  = block_hashes, medium, group_idx (+ locality, ownership). Block hashes are 32-byte digests, or
  u64 ints under ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``. The batch is a map (``ts``, ``events``,
  ``data_parallel_rank``) in one release and ``[ts, events, data_parallel_rank]`` in others. The
  offloading connector (``.../kv_connector/v1/offloading/events.py``) publishes medium ``"CPU"`` or
  ``"STORAGE"``, and for chunks it has no request metadata for a placeholder BlockStored: the
  chunk's last block hash, ``token_ids=[]``, ``block_size=0``.
- Older vLLM (0.9/0.10): ``array_like=True`` events, ``lora_id`` but no ``lora_name``.
- SGLang ``python/sglang/srt/disaggregation/kv_events.py`` + ``mem_cache/radix_cache.py``:
  ``array_like`` events and batch (``[ts, events, attn_dp_rank]``), one BlockStored per page with
  ``block_size=len(page)``, signed i64 hashes, ``lora_id`` always nil, ``medium="GPU"``; under EAGLE
  the page's ``token_ids`` are bigrams ``[t_i, t_i+1]``.
- ZMQ (both): PUB frames ``[topic, seq 8 bytes big-endian, payload]``; the ROUTER replay answers
  ``[identity, b"", seq, payload]`` per kept batch then ``[identity, b"", -1 (signed), b""]``.

What the gateway indexed is read back through ``POST /debug/route`` (per-target GPU and CPU
overlap of a prompt, byte tokenizer: a prompt's tokens are its bytes).
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest
import yaml

from tests.fakes.upstream_publisher import UpstreamPublisher
from tests.procs import ProcessGroup, free_port, wait_until

BS = 4
BASE = "base-model"
U64 = (1 << 64) - 1


# ------------------------------------------------------------------ upstream struct mirrors
class VBatchMap(msgspec.Struct, omit_defaults=True, gc=False):  # vLLM EventBatch (map release)
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VBatchArray(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # vLLM EventBatch (array)
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(VEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(VEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(VEvent):
    pass


class CacheEviction(VEvent):  # an event type Mesh does not know (a newer engine's)
    request_id: str
    medium: str
    block_count: int


class OldEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class OldBlockStored(OldEvent, tag="BlockStored"):  # vLLM 0.9/0.10: lora_id, no lora_name
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class SBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # SGLang EventBatch
    ts: float
    events: list[Any]
    attn_dp_rank: int | None = None


class SEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class SBlockStored(SEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[Any]  # ints, or [t, t+1] pairs under EAGLE's bigram keys
    block_size: int
    lora_id: int | None
    medium: str | None = None


class SBlockRemoved(SEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


# ------------------------------------------------------------------ hashes and prompts
def digest(label: str) -> bytes:
    return hashlib.sha256(label.encode()).digest()


def vllm_chain(label: str, n: int, size: int = 32) -> list[bytes]:
    """Digests of ``size`` bytes (vLLM's sha256 is 32; other lengths must work alike)."""
    return [digest(f"{label}-{i}")[:size] for i in range(n)]


def u64(label: str) -> int:
    return int.from_bytes(digest(label), "big") & U64


def i64(label: str) -> int:
    return int.from_bytes(digest(label)[:8], "big", signed=True)  # SGLang's hash_str_to_int64 form


def prompt(rng: random.Random, blocks: int) -> tuple[str, list[int]]:
    text = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(blocks * BS))
    return text, list(text.encode())


def v_stored(hashes: list[Any], parent: Any, tokens: list[int], **kw: Any) -> BlockStored:
    fields: dict[str, Any] = {"lora_id": None, "medium": "GPU", "lora_name": None, "block_size": BS}
    fields.update(kw)
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, **fields)


def s_pages(hashes: list[int], tokens: list[Any], parent: int | None = None, **kw: Any) -> list[SBlockStored]:
    """SGLang's ``_record_store_event``: one BlockStored per page, chained by parent."""
    out = []
    for i, h in enumerate(hashes):
        page = tokens[i * BS : (i + 1) * BS]
        out.append(SBlockStored([h], parent, page, len(page), None, **kw))
        parent = h
    return out


# ------------------------------------------------------------------ the stack
class Stack:
    def __init__(self, url: str, vpub: UpstreamPublisher, spub: UpstreamPublisher) -> None:
        self.http = httpx.Client(base_url=url, timeout=30)
        self.vpub, self.spub = vpub, spub
        self.rng = random.Random(77)

    def overlaps(self, text: str, model: str = BASE) -> dict[str, tuple[int, int]]:
        resp = self.http.post("/debug/route", json={"model": model, "prompt": text})
        assert resp.status_code == 200, resp.text
        cands = resp.json()["decision"]["candidates"]
        return {t: (c["overlap"]["gpu_blocks"], c["overlap"]["cpu_blocks"]) for t, c in cands.items()}

    def until(self, text: str, target: str, want: tuple[int, int]) -> None:
        wait_until(lambda: self.overlaps(text).get(target) == want, timeout_s=10,
                   what=f"{target} overlap {want} for {text[:12]!r} (now {self.overlaps(text).get(target)})")

    def marker(self, pub: UpstreamPublisher, target: str, sglang: bool = False) -> None:
        """Publish a fresh one-block chain after the events under test and wait until it is indexed:
        everything published before it was applied (one stream, in order)."""
        text, tokens = prompt(self.rng, 1)
        h = self.rng.getrandbits(63)
        if sglang:
            pub.publish(SBatch(time.time(), s_pages([h], tokens, medium="GPU"), 0))
        else:
            pub.publish(VBatchMap(time.time(), [v_stored([h], None, tokens)], 0))
        self.until(text, target, (1, 0))

    def metric(self, name: str, **labels: str) -> float:
        text = self.http.get("/metrics").text
        for line in text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
        return 0.0


EARLY_TEXT = "published before the gateway ran!"[: 8 * BS]


@pytest.fixture(scope="module")
def stack(module_procs: ProcessGroup) -> Iterator[Stack]:
    vpub, spub = UpstreamPublisher(), UpstreamPublisher(topic="kv@sglang")
    try:
        # sent before any subscriber exists: reaches the gateway only through the replay socket
        early = list(EARLY_TEXT.encode())
        vpub.publish(VBatchMap(time.time(), [v_stored(vllm_chain("early", 8), None, early, group_idx=0,
                                                      kv_cache_spec_kind="full_attention")], 0))
        wv = module_procs.echo_worker("wv", "--model", BASE)
        ws = module_procs.echo_worker("ws", "--model", BASE)
        cfg = {
            "workers": [
                {"name": "wv", "url": wv.url, "block_size": BS,
                 "kv_events": {"endpoint": vpub.endpoint, "replay_endpoint": vpub.replay_endpoint}},
                {"name": "ws", "url": ws.url, "block_size": BS,
                 "kv_events": {"endpoint": spub.endpoint, "replay_endpoint": spub.replay_endpoint,
                               "topic": "kv@sglang"}},
            ],
            "health": {"interval_s": 0.2, "timeout_s": 1},
            "index": {"speculative_ttl_s": 0},  # every overlap seen comes from the published events
        }
        path = module_procs.log_dir / "upstream_events.yaml"
        path.write_text(yaml.safe_dump(cfg))
        gw = module_procs.gateway(path, port=free_port(), name="gateway-upstream-events")
        s = Stack(gw.url, vpub, spub)
        wait_until(lambda: s.metric("mesh_kv_events_healthy", target="wv") == 1.0
                   and s.metric("mesh_kv_events_healthy", target="ws") == 1.0, what="both streams live")
        yield s
        s.http.close()
    finally:
        vpub.close()
        spub.close()


# ------------------------------------------------------------------ vLLM
def test_vllm_batch_from_the_replay_buffer_with_digest_hashes(stack: Stack) -> None:
    stack.until(EARLY_TEXT, "wv", (8, 0))
    assert stack.overlaps(EARLY_TEXT)["ws"] == (0, 0)


def test_vllm_current_events_with_every_newer_field_and_an_unknown_type(stack: Stack) -> None:
    text, tokens = prompt(stack.rng, 6)
    for size in (32, 16, 8):  # digests of any length: the low 8 bytes name the block
        text, tokens = prompt(stack.rng, 6)
        h = vllm_chain(f"full-{size}", 6, size)
        first = v_stored(h[:2], None, tokens[: 2 * BS], extra_keys=[None, None], group_idx=0,
                         kv_cache_spec_kind="full_attention", locality="LOCAL", session_id="req-1")
        second = v_stored(h[2:], h[1], tokens[2 * BS :], extra_keys=[None] * 4, group_idx=0,
                          kv_cache_spec_kind="full_attention", kv_cache_spec_sliding_window=None,
                          ownership=None, session_id="req-1")
        stack.vpub.publish(VBatchMap(time.time(), [first, CacheEviction("r", "GPU", 3), second], 0))
        stack.until(text, "wv", (6, 0))
    # u64 ints above the i64 range (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES), the array batch layout
    text, tokens = prompt(stack.rng, 3)
    h = [u64(f"int-{i}") | (1 << 63) for i in range(3)]
    stack.vpub.publish(VBatchArray(time.time(), [v_stored(h, None, tokens, group_idx=0)], 0))
    stack.until(text, "wv", (3, 0))
    # a hybrid model's sliding-window group repeats the hashes: it must not add or remove anything
    stack.vpub.publish(VBatchArray(time.time(), [
        v_stored([], None, tokens, group_idx=1, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=8),
        BlockRemoved([h[2]], "GPU", group_idx=1)], 0))
    stack.marker(stack.vpub, "wv")
    assert stack.overlaps(text)["wv"] == (3, 0)
    stack.vpub.publish(VBatchArray(time.time(), [BlockRemoved([h[2]], "GPU", group_idx=0)], 0))
    stack.until(text, "wv", (2, 0))


def test_vllm_cpu_offload_and_unknown_media(stack: Stack) -> None:
    text, tokens = prompt(stack.rng, 4)
    h = vllm_chain("tiers", 4)
    stack.vpub.publish(VBatchMap(time.time(), [
        v_stored(h, None, tokens, group_idx=0, kv_cache_spec_kind="full_attention"),
        # the offloading connector's self-describing store: the same blocks, now also on CPU
        v_stored(h, None, tokens, medium="CPU", group_idx=0, kv_cache_spec_kind="full_attention"),
        BlockRemoved(h[2:], "GPU", group_idx=0),
    ], 0))
    stack.until(text, "wv", (2, 2))
    # tiers Mesh does not rank ("STORAGE", a remote or an unknown one) are not claimed
    other, otokens = prompt(stack.rng, 2)
    g = vllm_chain("storage", 2)
    stack.vpub.publish(VBatchMap(time.time(), [
        v_stored(g, None, otokens, medium="STORAGE", locality="REMOTE", ownership="kvcr"),
        v_stored(g, None, otokens, medium="MARS"),
    ], 0))
    stack.marker(stack.vpub, "wv")
    assert stack.overlaps(other)["wv"] == (0, 0)


def test_vllm_offload_placeholder_store_is_a_tier_update(stack: Stack) -> None:
    """The offloading connector's placeholder BlockStored (chunk key hash, ``token_ids=[]``,
    ``block_size=0``) says a block known by hash is now on CPU too: after the GPU copy is evicted
    the block is still on the worker."""
    text, tokens = prompt(stack.rng, 2)
    h = vllm_chain("placeholder", 2)
    stack.vpub.publish(VBatchMap(time.time(), [
        v_stored(h, None, tokens, group_idx=0, kv_cache_spec_kind="full_attention")], 0))
    stack.until(text, "wv", (2, 0))
    placeholders = [v_stored([x], None, [], block_size=0, medium="CPU", group_idx=0) for x in h]
    stack.vpub.publish(VBatchMap(time.time(), [*placeholders, BlockRemoved(h, "GPU", group_idx=0)], 0))
    stack.until(text, "wv", (0, 2))
    stack.vpub.publish(VBatchMap(time.time(), [BlockRemoved(h, "CPU", group_idx=0)], 0))
    stack.until(text, "wv", (0, 0))


def test_lora_blocks_never_count_for_the_base_model(stack: Stack) -> None:
    """vLLM 0.9/0.10 name a request's adapter by ``lora_id`` alone (no ``lora_name``); current vLLM
    sends both. Either way the adapter's blocks are not the base model's, even for equal tokens."""
    text, tokens = prompt(stack.rng, 3)
    stack.vpub.publish(VBatchArray(time.time(), [OldBlockStored([u64("old-lora-0")], None, tokens[:BS], BS, 3, "GPU")], 0))
    stack.vpub.publish(VBatchMap(time.time(), [
        v_stored([u64("new-lora-0")], None, tokens[:BS], lora_id=4, lora_name="adapter",
                 extra_keys=[("adapter",)], group_idx=0, kv_cache_spec_kind="full_attention")], 0))
    stack.marker(stack.vpub, "wv")
    assert stack.overlaps(text)["wv"] == (0, 0)
    # the same tokens announced for the base model (lora_id 0 or nil) do count
    stack.vpub.publish(VBatchArray(time.time(), [OldBlockStored([u64("old-base-0")], None, tokens[:BS], BS, None, "GPU")], 0))
    stack.until(text, "wv", (1, 0))


def test_a_block_size_other_than_the_workers_is_skipped_and_counted(stack: Stack) -> None:
    """Keys chained over 8-token blocks are not the 4-token keys the router asks for: the store is
    skipped (never keyed at the wrong size) and counted."""
    text, tokens = prompt(stack.rng, 2)
    before = stack.metric("mesh_kv_events_events_total", target="wv", type="block_size_mismatch")
    stack.vpub.publish(VBatchMap(time.time(), [v_stored([u64("bs8")], None, tokens, block_size=8)], 0))
    stack.marker(stack.vpub, "wv")
    assert stack.overlaps(text)["wv"] == (0, 0)
    assert stack.metric("mesh_kv_events_events_total", target="wv", type="block_size_mismatch") == before + 1


# ------------------------------------------------------------------ SGLang
def test_sglang_pages_signed_hashes_and_removal(stack: Stack) -> None:
    text, tokens = prompt(stack.rng, 4)
    h = [i64(f"sg-{i}") for i in range(4)]
    assert any(x < 0 for x in h)
    stack.spub.publish(SBatch(time.time(), s_pages(h[:2], tokens[: 2 * BS], medium="GPU"), 0))
    # a release without ``medium`` (its trailing default left out) on the same chain
    stack.spub.publish(SBatch(time.time(), s_pages(h[2:], tokens[2 * BS :], parent=h[1]), 0))
    stack.until(text, "ws", (4, 0))
    assert stack.overlaps(text)["wv"] == (0, 0)
    stack.spub.publish(SBatch(time.time(), [SBlockRemoved([h[3]], "GPU"), SBlockRemoved([h[2]])], 0))
    stack.until(text, "ws", (2, 0))


def test_sglang_eagle_bigram_pages(stack: Stack) -> None:
    """Under EAGLE, SGLang's radix keys (and the token_ids of its BlockStored) are bigrams
    ``(t_i, t_i+1)``: position i holds token i's KV, and a page is reused only when the token
    after it agrees too (``mesh.core.lookahead``)."""
    text, tokens = prompt(stack.rng, 4)
    bigrams = [[tokens[i], tokens[i + 1]] for i in range(3 * BS)]
    h = [i64(f"eagle-{i}") for i in range(3)]
    stack.spub.publish(SBatch(time.time(), s_pages(h, bigrams, medium="GPU"), 0))
    stack.until(text, "ws", (3, 0))  # the fourth block's first token follows the third page
    stack.until(text[: 3 * BS], "ws", (2, 0))  # nothing follows the third: it cannot be credited
    parted = text[:BS] + chr(ord(text[BS]) ^ 1) + text[BS + 1 :]
    stack.until(parted, "ws", (0, 0))  # parts right after the first page: not even that one
