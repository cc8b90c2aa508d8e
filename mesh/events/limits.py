"""The KV event subscriber's limits and timings, one frozen value (``KvEventSubscriber(limits=...)``).

Defaults suit a gateway in front of real engines; tests and benchmarks shorten the timings. Derived
bounds (``max_message_bytes``, the floors of ``max_replay_s`` and ``max_backlog_bytes``) are
properties, so a value never disagrees with the fields it comes from.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SubscriberLimits:
    # A frame over it (16 MiB: ~100x the largest batch a vLLM scheduler step publishes, and 2-3 s
    # of work on one core, in slices) is counted, logged and treated as lost: a reset.
    max_frame_bytes: int = 16 << 20
    replay_timeout_s: float = 2.0  # a replay's longest wait for its next message
    replay_total_s: float = 60.0  # a replay's longest run, whatever keeps coming
    replay_retry_s: float = 0.5  # the first wait before a failed replay is retried (then doubled)
    max_replay_batches: int = 200_000
    max_replay_bytes: int = 1 << 30
    unhealthy_after_bad_frames: int = 8
    stale_after_s: float | None = None  # a stream silent this long is unhealthy (None: never)
    yield_every: int = 64  # frames applied between yields to the loop
    digest_window: int = 4096  # recent frames remembered to recognise a replayed duplicate
    rcvhwm: int = 100_000
    # A stream's budget: frames received but not applied yet (10,000: minutes of a real engine's one
    # batch a scheduler step, under a second of a flood; 64 MiB: four frames of the largest
    # accepted). Over it, ingestion cannot keep up: the stream is reset.
    max_backlog_frames: int = 10_000
    backlog_bytes: int = 64 << 20
    slice_s: float = 0.0005  # one slice of event work on the loop ...
    share: float = 0.5  # ... and the loop's share that event work may take (``mesh.events.pacer``)

    @property
    def max_replay_s(self) -> float:
        return max(self.replay_total_s, self.replay_timeout_s)

    @property
    def max_backlog_bytes(self) -> int:
        return max(self.backlog_bytes, self.max_frame_bytes)

    @property
    def max_message_bytes(self) -> int:
        """The largest replayed message ZMQ accepts (it drops the replay connection past it: the
        replay fails, as an oversized batch would reset the stream; without it a replay socket's
        2 GB frame was received whole). Not set on the SUB socket: after refusing a frame there,
        ZMQ did not reconnect (measured), so a giant live frame is still received whole."""
        return max(4 * self.max_frame_bytes, 64 << 20)

    @property
    def frames_per_yield(self) -> int:
        return max(1, self.yield_every)
