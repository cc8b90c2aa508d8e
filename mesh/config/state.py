"""The ``state`` section: where session bindings and in-flight load live (memory or Redis)."""

from __future__ import annotations

import urllib.parse
from typing import Literal

from pydantic import Field, field_validator, model_validator

from mesh.config.base import ConfigModel, redact_url


def cluster_seed(seed: str) -> tuple[str, int] | None:
    """``host:port`` (``[v6]:port`` too) -> (host, port); None when it is not exactly that."""
    try:
        parts = urllib.parse.urlsplit("//" + seed)
        port = parts.port
    except ValueError:
        return None
    if (not parts.hostname or port is None or port == 0 or parts.username is not None or parts.path
            or parts.query or parts.fragment or any(c in seed for c in "\r\n\t\0 /")):
        return None
    return parts.hostname, port


class StateConfig(ConfigModel):
    """Where session bindings and in-flight load live: this process (``memory``, the default) or
    Redis, shared by every gateway replica (``mesh.state.redis_state``): one server, or a Redis Cluster
    (``cluster: true``)."""

    backend: Literal["memory", "redis"] = Field("memory", description="memory: this process; redis: shared by every gateway replica.")
    url: str | None = None  # redis://host:port/db, rediss://..., unix:///path; required for redis
    key_prefix: str = Field("mesh:", description="Prefix of every Redis key Mesh writes.")
    timeout_s: float = Field(0.1, gt=0, le=10)  # per Redis call; past it the gateway goes local
    # redis only: every load_sync_s each replica publishes its own per-target load and adds the
    # other live replicas' to its TargetStates (mesh.state.shared_load.SharedLoad); 0 = sessions only.
    load_sync_s: float = Field(0.1, ge=0, le=10)
    # redis only: url is a seed node of a Redis Cluster (redis-py's RedisCluster finds the others
    # and follows MOVED/ASK); cluster_seeds are more seeds (host:port, with url's scheme,
    # credentials and options), tried when url's node is down at the first discovery.
    cluster: bool = False
    cluster_seeds: list[str] = Field(default_factory=list, max_length=64, description="See cluster: more seed nodes of a Redis Cluster (host:port).")

    @field_validator("url")
    @classmethod
    def _url(cls, url: str | None) -> str | None:
        if url is None:
            return None
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("redis", "rediss", "unix") or any(c in url for c in "\r\n\t\0 "):
            raise ValueError(f"url {redact_url(url)!r} must be redis://host:port/db, rediss://... or unix:///path")
        if parsed.scheme != "unix" and not parsed.hostname:
            raise ValueError(f"url {redact_url(url)!r} needs a host, e.g. redis://127.0.0.1:6379/0")
        try:
            parsed.port  # noqa: B018  (raises on a bad port)
        except ValueError as exc:
            raise ValueError(f"url {redact_url(url)!r}: {exc}") from exc
        return url

    @field_validator("key_prefix")
    @classmethod
    def _prefix(cls, prefix: str) -> str:
        if not prefix or len(prefix) > 64 or not prefix.isprintable() or " " in prefix:
            raise ValueError("key_prefix must be 1-64 printable characters without spaces")
        return prefix

    @field_validator("load_sync_s")
    @classmethod
    def _sync(cls, period: float) -> float:
        if 0 < period < 0.01:
            raise ValueError(f"load_sync_s must be 0 (off) or at least 0.01 s, got {period}")
        return period

    @field_validator("cluster_seeds")
    @classmethod
    def _seeds(cls, seeds: list[str]) -> list[str]:
        for i, seed in enumerate(seeds):
            if cluster_seed(seed) is None:
                raise ValueError(f"cluster_seeds[{i}] {seed!r} must be host:port, e.g. 10.0.0.3:6379 "
                                 "(the scheme, credentials and options are url's)")
        return seeds

    @model_validator(mode="after")
    def _needs_url(self) -> StateConfig:
        if self.backend == "redis" and self.url is None:
            raise ValueError("backend redis needs a url, e.g. redis://127.0.0.1:6379/0")
        if self.cluster_seeds and not self.cluster:
            raise ValueError("cluster_seeds needs cluster: true")
        if self.cluster:
            self._check_cluster()
        return self

    def _check_cluster(self) -> None:
        """A Redis Cluster: TCP only, database 0 only, and no hash tag in the key prefix (Mesh adds
        ``{key_prefix}`` to the keys that must share a slot; a brace in it would change that slot)."""
        if self.backend != "redis" or self.url is None:
            raise ValueError("cluster: true needs backend: redis and a url (a seed node), e.g. redis://10.0.0.2:6379")
        parsed = urllib.parse.urlsplit(self.url)
        if parsed.scheme == "unix":
            raise ValueError(f"cluster: true needs a redis:// or rediss:// url (a cluster node's host:port), "
                             f"got {redact_url(self.url)!r}")
        dbs = [parsed.path.strip("/"), *urllib.parse.parse_qs(parsed.query).get("db", [])]
        if any(db not in ("", "0") for db in dbs):
            raise ValueError(f"url {redact_url(self.url)!r} names a database other than 0; a Redis Cluster has only database 0")
        if "{" in self.key_prefix or "}" in self.key_prefix:
            raise ValueError(f"key_prefix {self.key_prefix!r} must not contain '{{' or '}}' with cluster: true "
                             f"(Mesh adds the hash tag {{key_prefix}} to the keys that must share a slot)")
