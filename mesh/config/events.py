"""The ``kv_events`` section: the gateway's own KV event endpoint and its replay timing.

With ``bind`` set, the gateway binds one ZMQ SUB socket there (subscribed to every topic) and
engines connect their publishers to it (llm-d's layout: vLLM ``--kv-events-config`` with
``endpoint: tcp://GATEWAY:PORT``, a concrete host, so that vLLM connects; ``topic`` naming the
worker). A worker whose ``kv_events`` has no ``endpoint`` is read from there; the others keep their
own streams (the gateway connects to each one's bound PUB).
"""

from __future__ import annotations

import re

from pydantic import Field, field_validator, model_validator

from mesh.config.base import ConfigModel, PositiveFloat

# What a ZMQ SUB can bind: tcp on a wildcard (*) or a local address, with a numeric port; ipc; inproc.
ZMQ_BIND = re.compile(r"tcp://(\*|\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+):[0-9]{1,5}|(ipc|inproc)://[^\s\0]+")


class EventsConfig(ConfigModel):
    """The gateway's KV event endpoint (workers that connect to it) and the replay timing of every stream."""

    bind: str | None = Field(None, description="Bind one SUB socket here (e.g. tcp://*:5557) for the workers whose kv_events has no endpoint: their publishers connect to it (vLLM --kv-events-config endpoint tcp://GATEWAY:5557, a concrete host). A frame's topic names its worker: a worker's kv_events.topic exactly, else its name, either alone or as llm-d's kv@NAME@MODEL. Frames of any other topic are counted (mesh_kv_events_unknown_topic_frames_total) and warned about, never applied. Restart-only (a reload that changes this section is refused). None: no bound endpoint.")
    replay_idle_timeout_s: PositiveFloat = Field(2.0, description="A replay fails when the publisher's replay socket sends nothing for this long (no batch, no end marker): the timeout extends while replayed batches keep arriving, so a big buffer is rebuilt whole.")
    max_replay_s: PositiveFloat = Field(60.0, description="A replay fails past this long in all, however steadily batches arrive. A stream whose replay failed is not trusted (routing to it falls back to load) until a retried replay (from the whole buffer, after 0.5 s, doubling) completes; after 3 failures in a row it is trusted on its live batches alone, with a WARNING.")

    @field_validator("bind")
    @classmethod
    def _bind(cls, bind: str | None) -> str | None:
        if bind is None:
            return None
        if not ZMQ_BIND.fullmatch(bind):
            raise ValueError(f"bind {bind!r} must be tcp://*:PORT, tcp://ADDRESS:PORT, ipc://PATH or inproc://NAME")
        if bind.startswith("tcp://") and int(bind.rpartition(":")[2]) > 65535:
            raise ValueError(f"bind {bind!r}: port out of range 0-65535")
        return bind

    @model_validator(mode="after")
    def _timing(self) -> EventsConfig:
        if self.max_replay_s < self.replay_idle_timeout_s:
            raise ValueError(f"max_replay_s ({self.max_replay_s}) must be at least replay_idle_timeout_s "
                             f"({self.replay_idle_timeout_s})")
        return self
