"""One YAML file configures a deployment: pydantic models with errors that name the YAML path.

Every section has defaults, so ``MeshConfig()`` (no file at all) is a usable gateway with no
static workers. ``load_config(path)`` reads and validates a file; any problem raises
``ConfigError`` whose ``errors`` list holds one ``"path.to.field: message"`` line per problem.
The document's bounds (``document_problem``) and those lines (``format_errors``) are
``mesh.yaml_document``'s, importable from here too. Each section's model lives in its own module
(``server``, ``workers``, ``runtime``, ``discovery``, ``state``); this package holds the whole
document and exports every section's names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from mesh.config.base import MIB, ConfigError, ConfigModel, PositiveFloat, redact_url
from mesh.config.discovery import SERVICE_ACCOUNT_DIR, DiscoveryConfig, KubernetesDiscoveryConfig
from mesh.config.events import EventsConfig
from mesh.config.runtime import (
    DEFAULT_MAX_KEYS,
    AdmissionConfig,
    CircuitBreakerConfig,
    DisaggConfig,
    HealthConfig,
    IndexConfig,
    RetentionConfig,
    RetriesConfig,
    SessionsConfig,
)
from mesh.config.server import MAX_KEY_FILE_BYTES, ServerConfig, read_key_file, read_key_files
from mesh.config.state import StateConfig, cluster_seed
from mesh.config.workers import (
    WORKER_NAME,
    KVEventsConfig,
    WorkerConfig,
    check_addresses,
    check_bound_workers,
    check_event_streams,
    check_worker_addresses,
    check_worker_url,
    normalize_url,
    rank_endpoint,
)
from mesh.connect_policy import ConnectPolicy
from mesh.files import FileProblem, read_regular_file
from mesh.yaml_document import document_problem, format_errors

__all__ = [
    "DEFAULT_MAX_KEYS", "DEFAULT_POLICY", "MAX_FILE_BYTES", "MAX_KEY_FILE_BYTES", "MIB", "SERVICE_ACCOUNT_DIR",
    "AdmissionConfig", "CircuitBreakerConfig", "ConfigError", "ConfigModel", "DisaggConfig", "DiscoveryConfig",
    "EventsConfig", "HealthConfig",
    "IndexConfig", "KVEventsConfig", "KubernetesDiscoveryConfig", "MeshConfig", "PositiveFloat", "RetentionConfig",
    "RetriesConfig", "ServerConfig", "SessionsConfig", "StateConfig", "WORKER_NAME", "WorkerConfig", "build_policy",
    "check_addresses", "check_bound_workers", "check_event_streams", "check_worker_addresses", "check_worker_url", "cluster_seed",
    "document_problem", "format_errors", "load_config", "normalize_url", "parse_config", "rank_endpoint",
    "read_key_file", "read_key_files", "redact_url",
]

MAX_FILE_BYTES = 16 * MIB  # a config of 1,000 workers is ~200 KiB; PyYAML parses ~1 MiB/s


# DESIGN.md "Defaults": precise KV-aware routing, with session affinity whenever a session id is
# present. ``session_sticky`` without params wraps ``kv_aware`` (its default inner policy): a
# request with a session id returns to its bound target while that is healthy and under the load
# ceiling; a new session is spread to the targets with the fewest live sessions (kv_aware choosing
# among them), and every other request (no session id, a moving session) is decided by kv_aware.
DEFAULT_POLICY = "session_sticky"


class MeshConfig(ConfigModel):
    server: ServerConfig = Field(default_factory=ServerConfig)
    workers: list[WorkerConfig] = Field(default_factory=list)
    health: HealthConfig = Field(default_factory=HealthConfig)
    circuit_breaker: CircuitBreakerConfig = Field(default_factory=CircuitBreakerConfig)
    retries: RetriesConfig = Field(default_factory=RetriesConfig)
    policy: Any = Field(DEFAULT_POLICY, description="The routing policy: a name or {name, params} spec, passed "
                        "untouched to policies.create_policy (docs/policies.md); the default is session_sticky over kv_aware.")
    seed: int | None = Field(None, description="Seed of the router's random choices (policies' tie-breaks and "
                             "samples); unset: a fresh one at every start. With the seed `mesh simulate --seed` "
                             "takes, a gateway and the simulator draw alike.")
    sessions: SessionsConfig = Field(default_factory=SessionsConfig)
    index: IndexConfig = Field(default_factory=IndexConfig)
    kv_events: EventsConfig = Field(default_factory=EventsConfig)
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    retention: RetentionConfig = Field(default_factory=RetentionConfig)
    state: StateConfig = Field(default_factory=StateConfig)
    discovery: DiscoveryConfig = Field(default_factory=DiscoveryConfig)
    disagg: DisaggConfig = Field(default_factory=DisaggConfig)

    @model_validator(mode="after")
    def _check(self) -> MeshConfig:
        seen: set[str] = set()
        for w in self.workers:
            if w.name in seen:
                raise ValueError(f"duplicate worker name {w.name!r}")
            seen.add(w.name)
        for i, w in enumerate(self.workers):
            try:
                check_worker_addresses(w, self.server)
            except ValueError as exc:
                raise ValueError(f"workers[{i}] ({w.name}): {exc}") from exc
        check_event_streams(self.workers)
        check_bound_workers(self.workers, self.kv_events.bind)
        kube = self.discovery.kubernetes
        if kube is not None and kube.kv_events_connect and self.kv_events.bind is None:
            raise ValueError("discovery.kubernetes.kv_events_connect: the discovered workers' publishers connect to "
                             "the gateway, but kv_events.bind is not set (e.g. kv_events: {bind: \"tcp://*:5557\"})")
        return self

    def build_policy(self) -> Any:
        """The routing policy this config names (raises ConfigError with path ``policy``)."""
        return build_policy(self.policy)


def build_policy(spec: Any) -> Any:
    from policies import create_policy

    try:
        return create_policy(spec)
    except Exception as exc:  # PluginError, or anything a third-party constructor raises
        raise ConfigError([f"policy: {exc}"]) from exc


def parse_config(data: Any, source: str | None = None, *, check_policy: bool = True) -> MeshConfig:
    """Validate a decoded YAML document; ``None`` (an empty file) means all defaults."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([f"(top level): expected a mapping of sections, got {type(data).__name__}"], source)
    problem = document_problem(data)
    if problem is not None:
        raise ConfigError([f"(top level): {problem}"], source)
    errors: list[str] = []
    try:
        config = MeshConfig.model_validate(data, context={"connect_policy": _connect_policy(data)})
    except ValidationError as exc:
        errors += format_errors(exc, MeshConfig)
    if check_policy:  # every problem of the spec with its path, beside the sections' (policies.spec_check)
        from policies.spec_check import spec_problems

        errors += spec_problems(data.get("policy", DEFAULT_POLICY))
    if errors:
        raise ConfigError(errors, source)
    return config


def _connect_policy(data: dict[str, Any]) -> ConnectPolicy | None:
    """The connect policy of the document's ``server`` section; None when that section is invalid
    (its own errors are reported, and each worker's addresses are checked by ``MeshConfig``)."""
    try:
        return ServerConfig.model_validate(data.get("server") or {}).connect_policy()
    except (ValidationError, ValueError, TypeError):
        return None


def load_config(path: str | Path | None = None, *, allow_empty: bool = True) -> MeshConfig:
    """Read and validate one YAML file; ``None`` returns the embedded defaults. A reload passes
    ``allow_empty=False``: an empty file there is a write in progress or a truncated file, and
    taking it for "all defaults" would drop every worker and the admin key."""
    if path is None:
        return MeshConfig()
    source = str(path)
    try:
        raw = read_regular_file(path, MAX_FILE_BYTES)
        text = raw.decode("utf-8")
    except FileProblem as exc:
        raise ConfigError([f"cannot read the config: {exc}"], source) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError([f"cannot read file: {exc}"], source) from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError([f"invalid YAML: {exc}"], source) from exc
    except RecursionError as exc:  # the parser recurses once per nesting level
        raise ConfigError([f"invalid YAML: nested more than the parser can follow ({exc})"], source) from exc
    if data is None and not allow_empty:
        raise ConfigError(["the file is empty (being written?): write the new config to another file and rename it over this one"], source)
    return parse_config(data, source)
