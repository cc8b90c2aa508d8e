"""Session bindings and in-flight load shared by several gateway replicas through Redis
(``state.backend: redis``): the names the gateway and the tests import, one module per job.

- ``mesh.state.redis_backend``: ``RedisStateBackend``, the ``StateBackend`` over one Redis
  server or a Redis Cluster; bounded calls that never raise, back-off, outage lines.
- ``mesh.state.shared_sessions``: ``SharedSessionTable`` (the local table policies read, with
  ``mirror`` before each decision and the write-behind flusher), ``shared_session_table``, and
  ``SharedState`` (what one gateway runs: flusher, load sync, metrics).
- ``mesh.state.shared_load``: ``SharedLoad``, in-flight load summed over the replicas.

The modules log on one channel, ``mesh.state.redis_state``.
"""

from __future__ import annotations

from mesh.state.redis_backend import Claim, RedisStateBackend, Refresh, redis_client
from mesh.state.shared_load import SharedLoad
from mesh.state.shared_sessions import SharedSessionTable, SharedState, shared_session_table

__all__ = ["Claim", "RedisStateBackend", "Refresh", "SharedLoad", "SharedSessionTable", "SharedState", "redis_client",
           "shared_session_table"]
