"""One huge live KV event frame, over real processes: a gateway keeps answering while it applies it.

A ~12 MiB EventBatch of ~85k BlockStored events (vLLM's map layout) takes ~3-5 s to decode and
apply; the subscriber applies one frame in slices (``mesh.events.subscriber.KvEventSubscriber._apply_frame``),
so HTTP requests are answered between slices instead of stalling behind the whole frame.

Shown against a real ``mesh serve`` process, a real echo worker and the vLLM-format publisher of
``tests/fakes/kv_publisher.py`` (real ZMQ): a ``/health`` request is answered between two
``/metrics`` scrapes that both show the frame partly applied (an ordering, never a timing); the
frame published right after it (removing some of its blocks) is applied after it, never before;
the index then holds exactly what the events say (``/debug/route`` overlaps). A frame over
``max_frame_bytes`` is counted as dropped and resets the target (never a crash): checked in
process, with a small bound.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
from pathlib import Path

import httpx
import msgspec
import pytest
import yaml

from mesh.core.index import PrefixIndex
from mesh.core.keys import block_keys, namespace_seed
from mesh.events.limits import SubscriberLimits
from mesh.events.subscriber import KvEventSubscriber, WorkerEvents
from mesh.events.wire import Batch, DecodeError, LazyBatch, decode_batch, decode_events, decode_lazy
from tests.fakes.kv_publisher import BATCH_LAYOUTS, EVENT_LAYOUTS, HASH_MODES, Publisher, encode_events
from tests.procs import ProcessGroup, free_port, wait_until

MODEL = "toy"
BS = 4
N_EVENTS = 85_000  # ~12 MiB in the map layout: under the 16 MiB bound
REMOVED = range(0, N_EVENTS, 1000)


def chain(i: int) -> list[int]:
    """The tokens of event i's one block: distinct for every i."""
    return [1 + i % 1000, 1 + i // 1000, 7, 9][:BS]


def stored_event(i: int, tokens: list[int]) -> dict:
    return {"type": "BlockStored", "block_hashes": [10_000_000 + i], "parent_block_hash": None,
            "token_ids": tokens, "block_size": BS, "lora_id": None, "medium": "GPU"}


def metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def overlap(http: httpx.Client, tokens: list[int]) -> int:
    body = {"model": MODEL, "prompt": tokens + [5], "max_tokens": 1}
    resp = http.post("/debug/route", json=body)
    assert resp.status_code == 200, resp.text
    return int(resp.json()["decision"]["candidates"]["w"]["overlap"]["gpu_blocks"])


def test_a_huge_live_frame_is_applied_in_slices_while_the_gateway_answers(procs: ProcessGroup, tmp_path: Path) -> None:
    pub = Publisher(topic=b"kv")
    try:
        worker = procs.echo_worker("w")
        port = free_port()
        cfg = {"workers": [{"name": "w", "url": worker.url, "models": [MODEL], "block_size": BS,
                            "kv_events": {"endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint,
                                          "topic": "kv"}}],
               "policy": "kv_aware"}
        (tmp_path / "mesh.yaml").write_text(yaml.safe_dump(cfg))
        procs.gateway(tmp_path / "mesh.yaml", port=port)
        http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
        probe = chain(N_EVENTS + 5)
        # the stream is up: a small frame is applied (the slow joiner missed nothing after this)
        wait_until(lambda: (pub.publish(msgspec.msgpack.encode([1.0, [stored_event(N_EVENTS + 5, probe)], 0])),
                            overlap(http, probe) == 1)[1], what="first frame applied")
        scrape = lambda: metric(http.get("/metrics").text, "mesh_kv_events_blocks_total", op="stored")  # noqa: E731
        base = scrape()

        big = msgspec.msgpack.encode([2.0, [stored_event(i, chain(i)) for i in range(N_EVENTS)], 0])
        assert 8 << 20 < len(big) < 16 << 20
        removal = msgspec.msgpack.encode([3.0, [{"type": "BlockRemoved", "block_hashes": [10_000_000 + i for i in REMOVED],
                                                 "medium": "GPU"}], 0])
        pub.publish(big)
        pub.publish(removal)  # must wait for the big frame: applied first, its removals would find nothing

        trace: list[tuple[str, float]] = []  # ("m", stored blocks) or ("h", 0), in answer order
        while True:
            stored = scrape() - base
            trace.append(("m", stored))
            if stored >= N_EVENTS:
                break
            assert http.get("/health").status_code == 200
            trace.append(("h", 0))
        mid = [i for i, (kind, v) in enumerate(trace) if kind == "h" and 0 < trace[i - 1][1] and trace[i + 1][1] < N_EVENTS]
        assert mid, f"no /health was answered while the frame was partly applied: {trace[:20]}"

        text = wait_until(lambda: (t := http.get("/metrics").text,
                                   metric(t, "mesh_kv_events_blocks_total", op="removed") >= len(REMOVED) and t)[1],
                          what="removal applied")
        assert metric(text, "mesh_kv_events_blocks_total", op="removed") == len(REMOVED)
        assert metric(text, "mesh_kv_events_blocks_total", op="stored") - base == N_EVENTS
        assert not re.search(r'mesh_kv_events_resets_total\{.*\} [1-9]', text)
        for i in [*REMOVED[:5], 1, 999, 1001, 54_321, N_EVENTS - 1]:
            assert overlap(http, chain(i)) == (0 if i in REMOVED else 1), i
        assert overlap(http, chain(N_EVENTS + 99)) == 0  # never stored
    finally:
        pub.close()


async def test_a_frame_over_the_bound_is_dropped_as_lost_and_the_stream_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "mesh.events.subscriber")
    pub = Publisher()
    index = PrefixIndex()
    sub = KvEventSubscriber(index, SubscriberLimits(max_frame_bytes=64 << 10))
    seed = namespace_seed(MODEL)
    try:
        (target,) = sub.add_worker(WorkerEvents("w", pub.endpoint, pub.replay_endpoint, model=MODEL, block_size=BS))
        h = sub.health()[target]
        first = [stored_event(0, chain(0))]
        pub.publish(msgspec.msgpack.encode([1.0, first, 0]))
        await until(lambda: h.batches == 1)
        pub.publish(msgspec.msgpack.encode([2.0, [stored_event(i, chain(i)) for i in range(1, 3000)], 0]))
        pub.publish(msgspec.msgpack.encode([3.0, [stored_event(5000, chain(5000))], 0]))
        await until(lambda: h.batches == 2)
        assert h.dropped == {"oversized": 1} and h.resets.get("oversized") == 1
        # reset: the old frame's block is no longer claimed; the next frame is applied
        assert index.keys_of(target) == {block_keys(chain(5000), BS, seed)[0]}
        assert any("over max_frame_bytes" in r.getMessage() for r in caplog.records)  # rate-limited log
    finally:
        await sub.stop()
        pub.close()


async def until(cond, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.01)


def test_lazy_decoding_yields_what_decode_batch_does_in_every_layout() -> None:
    rng = random.Random(5)
    events = [("stored", [11, 12], None, list(range(1, 9)), "GPU"), ("removed", [12], "GPU"), ("cleared",),
              ("stored", [13], 11, [3, 4, 5, 6], "CPU")]
    payloads = [encode_events(events, ev, batch, hashes, rng)
                for ev in EVENT_LAYOUTS for batch in BATCH_LAYOUTS for hashes in HASH_MODES]
    payloads += [
        msgspec.msgpack.encode([1.0, [["BlockStored"], {"type": "Nope"}, 7, ["AllBlocksCleared"]], 2]),
        msgspec.msgpack.encode({1: 2, "events": [["AllBlocksCleared"]]}),  # a key of another type
        msgspec.msgpack.encode([1.0, 5]), msgspec.msgpack.encode("x"), b"\xc1\x00", msgspec.msgpack.encode([1.0]),
    ]
    for p in payloads:
        whole, lazy = decode_batch(p), decode_lazy(p)
        if isinstance(whole, DecodeError):
            assert isinstance(lazy, DecodeError), p
            continue
        assert isinstance(lazy, LazyBatch), p
        got = Batch(lazy.ts, [], lazy.data_parallel_rank)
        for raw in lazy.raw_events:
            decode_events((raw,), got)
        assert (got.ts, got.events, got.data_parallel_rank, got.unknown, got.malformed) == \
            (whole.ts, whole.events, whole.data_parallel_rank, whole.unknown, whole.malformed), p
        together = Batch(lazy.ts, [], lazy.data_parallel_rank)
        decode_events(lazy.raw_events, together)  # several in one call, as the subscriber does
        assert (together.events, together.unknown, together.malformed) == (got.events, got.unknown, got.malformed)
