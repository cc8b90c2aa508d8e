"""Where one KV event's cost goes, stage by stage, in one process (no sockets, no loop contention).

The frames of ``bench/kv_ingest_capacity.py``'s flood (one BlockStored of one new 16-token block
each), through each stage the gateway runs on them: splitting the frame, decoding the envelope,
decoding and normalizing the event, keying it, and applying it to a default-bounded index; then
the receiver process's path (``mesh.events.prepare`` in the child, its pickle, the loop's unpickle
and ``apply_ops``). Microseconds a frame, the garbage collector off (its pauses are
``bench/kv_ingest_loop_lag.py``'s to measure).

    python bench/kv_ingest_stages.py [--frames 60000]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import pickle
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from bench.kv_ingest_capacity import BLOCK, Frames  # noqa: E402
from mesh.config import DEFAULT_MAX_KEYS  # noqa: E402
from mesh.core.index import PrefixIndex  # noqa: E402
from mesh.core.keys import block_keys, namespace_seed  # noqa: E402
from mesh.events.apply import Seeds, apply_event, apply_ops  # noqa: E402
from mesh.events.health import LogLimiter, StreamHealth  # noqa: E402
from mesh.events.ops import Prepared  # noqa: E402
from mesh.events.prepare import Preparer  # noqa: E402
from mesh.events.stream import Stream, WorkerEvents, split_frame  # noqa: E402
from mesh.events.wire import Batch, BlockStored, LazyBatch, decode_events, decode_lazy  # noqa: E402


def _us(n: int, fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) / n * 1e6


def _stream() -> Stream:
    return Stream(WorkerEvents("w", "tcp://127.0.0.1:1", model="m", block_size=BLOCK),
                  StreamHealth("w", "w", 0, "tcp://127.0.0.1:1", None))


def in_process(frames: list[list[bytes]]) -> dict[str, float]:
    n, seed = len(frames), namespace_seed("m")
    payloads = [f[2] for f in frames]
    lazies: list[LazyBatch] = []
    events: list[BlockStored] = []
    keys: list[list[int]] = []

    def decode() -> None:
        for lazy in lazies:
            batch = Batch(lazy.ts, [], None)
            decode_events(lazy.raw_events, batch)
            events.append(batch.events[0])  # type: ignore[arg-type]

    index, stream, seeds, logs = PrefixIndex(max_keys=DEFAULT_MAX_KEYS), _stream(), Seeds(), LogLimiter()
    out = {"split frame": _us(n, lambda: [split_frame(f) for f in frames]),
           "decode envelope": _us(n, lambda: lazies.extend(decode_lazy(p) for p in payloads)),  # type: ignore[misc]
           "decode + normalize event": _us(n, decode),
           "key (chained xxh3)": _us(n, lambda: keys.extend(block_keys(e.token_ids or [], BLOCK, seed) for e in events))}
    keyed = PrefixIndex(max_keys=DEFAULT_MAX_KEYS)
    out["index mutation (keys given)"] = _us(n, lambda: [keyed.apply_stored("w", e.block_hashes, None, e.token_ids, BLOCK,
                                                                            seed, keys=k) for e, k in zip(events, keys)])
    out["validate + key + mutate (apply_event)"] = _us(n, lambda: [list(apply_event(index, stream, e, seeds, logs))
                                                                    for e in events])
    return out


def split(frames: list[list[bytes]]) -> dict[str, float]:
    n = len(frames)
    preparer = Preparer("m", BLOCK, 16 << 20)
    prepared: list[Prepared] = []
    blobs: list[bytes] = []
    out = {"child: prepare": _us(n, lambda: prepared.extend(preparer.prepare(f) for f in frames)),
           "child: pickle": _us(n, lambda: blobs.extend(pickle.dumps(tuple(p), pickle.HIGHEST_PROTOCOL) for p in prepared))}
    back: list[Prepared] = []
    out["loop: unpickle"] = _us(n, lambda: back.extend(Prepared._make(pickle.loads(b)) for b in blobs))
    index, stream, logs = PrefixIndex(max_keys=DEFAULT_MAX_KEYS), _stream(), LogLimiter()

    async def apply() -> None:
        seeds = Seeds()
        for p in back:
            await apply_ops(index, stream, p.ops, seeds, logs)

    out["loop: apply_ops (validate + mutate)"] = _us(n, lambda: asyncio.run(apply()))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=60_000)
    args = ap.parse_args()
    gen = Frames(random.Random(1))
    frames = [[b"", i.to_bytes(8, "big"), gen.payload(i)] for i in range(args.frames)]
    gc.disable()
    for name, us in {**in_process(frames), **split(frames)}.items():
        print(f"{name:42s} {us:6.2f} us/frame")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
