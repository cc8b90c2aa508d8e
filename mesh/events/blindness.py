"""Blind event streams: a worker that serves requests while its configured KV event stream
delivers nothing. Precise routing then silently becomes load-only routing for it; this makes it
loud (a WARNING naming the worker, the endpoint and the likely fix) and visible
(``Worker.index_problem``: ``GET /workers``, ``GET /ready``).

The commonest cause is vLLM's ZMQ rule: its publisher binds only a wildcard, ipc or inproc
address (``tcp://*:P``) and connects to a concrete one (``tcp://127.0.0.1:P``), so a worker given
the gateway's address connects, the gateway connects too, and the two never meet.

A worker whose publisher connects to the gateway's bound endpoint (``kv_events.bind``) is blind
the same way when no frame of its topic arrives (wrong gateway address, a wildcard that makes
vLLM bind, or a topic naming no worker).

A stream is blind once it has delivered no valid frame in ``BLIND_AFTER_S`` since it was first
seen, while requests holding ``BLIND_AFTER_BLOCKS`` full KV blocks have been routed to its target
(an engine stores, and announces, at least the first of them; prompts shorter than a block
announce nothing); it stops being blind at its first frame. Owned by ``mesh.events.ingest.KvIngest``, checked on its keeper's tick.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from mesh.cluster.registry import Worker
from mesh.events.health import StreamHealth

log = logging.getLogger("mesh.events.blindness")

BLIND_AFTER_S = 5.0
BLIND_AFTER_BLOCKS = 8


@dataclass(slots=True)
class _Watch:
    since: float  # when the stream was first seen


class BlindWatch:
    def __init__(self) -> None:
        self._watches: dict[str, _Watch] = {}  # target -> watch

    def check(self, now: float, streams: dict[str, StreamHealth], workers: dict[str, Worker]) -> None:
        """Mark and warn about blind streams; clear the mark once events arrive."""
        for tid in [t for t in self._watches if t not in streams]:
            del self._watches[tid]
        for tid, h in streams.items():
            worker = workers.get(h.worker)
            target = next((t for t in worker.targets if t.id == tid), None) if worker is not None else None
            if worker is None or target is None:
                continue
            watch = self._watches.setdefault(tid, _Watch(now))
            if h.last_event_at is not None:
                self._clear(worker, h)
            elif (worker.index_problem is None and now - watch.since >= BLIND_AFTER_S
                  and target.routed_blocks >= BLIND_AFTER_BLOCKS):
                self._mark(worker, h, now - watch.since, target.routed_blocks)

    @staticmethod
    def _mark(worker: Worker, h: StreamHealth, quiet_s: float, blocks: int) -> None:
        source = f"of topic {h.topic} at {h.endpoint}" if h.bound else f"from {h.endpoint}"
        worker.index_problem = (f"index blind: no KV event {source} in {quiet_s:.0f} s, though requests of "
                                f"{blocks} KV blocks were routed here; {likely_fix(h)}")
        log.warning("kv events of worker %s (target %s): %s. Routing to it uses load only until events arrive.",
                    worker.name, h.target, worker.index_problem)

    @staticmethod
    def _clear(worker: Worker, h: StreamHealth) -> None:
        if worker.index_problem is not None:
            worker.index_problem = None
            log.info("kv events of worker %s (target %s) arriving from %s: the index sees it again",
                     worker.name, h.target, h.endpoint)


def likely_fix(h: StreamHealth) -> str:
    """The likeliest reason a stream delivers nothing, from what the subscriber saw."""
    if h.bound:
        return ("the worker's publisher must connect to the gateway's bound endpoint: give it a concrete gateway "
                "address (vLLM --kv-events-config endpoint tcp://GATEWAY_HOST:PORT; tcp://*:PORT makes it bind "
                "instead) and a topic naming the worker; "
                "mesh_kv_events_unknown_topic_frames_total counts frames whose topic names no worker")
    if not h.connected:
        return (f"the gateway's SUB socket never connected to {h.endpoint}: nothing listens there. The worker's "
                "publisher must bind it: give the worker a wildcard address (vLLM --kv-events-config endpoint "
                "tcp://*:PORT, SGLang likewise); a concrete host (tcp://127.0.0.1:PORT) makes it connect instead")
    return (f"connected to {h.endpoint}, but no event came: is the worker started with KV events on "
            "(vLLM --kv-events-config enable_kv_cache_events: true, prefix caching on) and the topic right?")
