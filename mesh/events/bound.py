"""The gateway's bound KV event endpoint: one SUB socket that engines' publishers connect to.

llm-d's layout: every vLLM pod's publisher connects to one address of the gateway
(``--kv-events-config`` ``endpoint: tcp://GATEWAY:5557``, a concrete host, so that vLLM
connects; ``tcp://*:P`` would make it bind) and its ``topic`` names the pod. ``Demux`` stands for
that socket in the receiver thread (``mesh.events.inbox.Receiver``, as a stream's ``Inbox`` does
for a socket of its own): it hands each frame to the inbox of the stream its topic names (the
routes of ``mesh.config.KVEventsConfig.bound_topics``: an exact topic, else llm-d's
``kv@NAME@...`` by its second field). A frame whose topic names no stream is counted by topic and
warned about (rate-limited, naming the topic), never applied. Sequence numbers count per
publisher, so each topic is a stream of its own (``mesh.events.stream``): its own gaps, replay
and health. Ownership: ``routes`` is replaced whole by the loop (``route``/``unroute``) and only
read by the thread (one reference read a frame: no lock); the unknown-topic counts are the
thread's, read by the collector at scrape time.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric

from mesh.events.health import LogLimiter
from mesh.events.inbox import Inbox

MAX_UNKNOWN_TOPICS = 64  # distinct unknown topics counted by name; the rest under OTHER_TOPICS
OTHER_TOPICS = "(other)"
LLM_D_PREFIX = b"kv@"


class Demux:
    """Frames of the bound SUB socket -> the inbox of the stream their topic names."""

    __slots__ = ("bind", "routes", "unknown", "logs", "_touched")

    def __init__(self, bind: str, logs: LogLimiter | None = None) -> None:
        self.bind = bind
        self.routes: dict[bytes, Inbox] = {}  # topic (or llm-d's kv@NAME@ prefix) -> inbox
        self.unknown: dict[str, int] = {}  # topic -> frames naming no stream
        self.logs = logs or LogLimiter()  # the thread's own (a LogLimiter is not shared across threads)
        self._touched: set[Inbox] = set()

    # -- the loop's side --
    def route(self, topics: list[str], inbox: Inbox) -> None:
        routes = dict(self.routes)
        for t in topics:
            routes[t.encode()] = inbox
        self.routes = routes  # one reference swap: the thread sees the old table or the new

    def unroute(self, inbox: Inbox) -> None:
        self.routes = {t: i for t, i in self.routes.items() if i is not inbox}

    # -- the thread's side (the receiver calls it as it calls an Inbox) --
    def overflowed(self) -> bool:
        return False  # an overflowed stream's inbox drops its own frames; the socket is read on

    def put(self, frames: list[bytes]) -> bool:
        inbox = self.lookup(frames[0]) if len(frames) == 3 else None
        if inbox is None:
            self._unknown(frames)
            return True
        inbox.put(frames)  # over its budget: dropped and counted there, the stream is reset
        self._touched.add(inbox)
        return True

    def lookup(self, topic: bytes) -> Inbox | None:
        routes = self.routes
        inbox = routes.get(topic)
        if inbox is None and topic.startswith(LLM_D_PREFIX):
            name, sep, _ = topic[len(LLM_D_PREFIX):].partition(b"@")
            if sep:
                inbox = routes.get(LLM_D_PREFIX + name + b"@")
        return inbox

    def wake(self) -> None:
        touched, self._touched = self._touched, set()
        for inbox in touched:
            inbox.wake()

    def _unknown(self, frames: list[bytes]) -> None:
        topic = frames[0].decode("utf-8", "backslashreplace") if len(frames) == 3 else "(not [topic, seq, payload])"
        key = topic if topic in self.unknown or len(self.unknown) < MAX_UNKNOWN_TOPICS else OTHER_TOPICS
        self.unknown[key] = self.unknown.get(key, 0) + 1
        self.logs.log(logging.WARNING, ("bound", key),
                      "kv events at %s: a frame of topic %r names no worker (%d so far): not applied. Give the "
                      "worker kv_events.topic %r, or name the worker as the topic does (its name, or kv@NAME@MODEL)",
                      self.bind, topic, self.unknown[key], topic)

    # -- a prometheus collector (on the subscriber's registry) --
    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        fam = CounterMetricFamily("mesh_kv_events_unknown_topic_frames",
                                  "Frames at the gateway's bound KV event endpoint whose topic names no worker",
                                  labels=["topic"])
        for topic, n in sorted(dict(self.unknown).items()):
            fam.add_metric([topic], n)
        yield fam
