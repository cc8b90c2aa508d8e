"""One YAML file configures a deployment: pydantic models with errors that name the YAML path.

Every section has defaults, so ``MeshConfig()`` (no file at all) is a usable gateway with no
static workers. ``load_config(path)`` reads and validates a file; any problem raises
``ConfigError`` whose ``errors`` list holds one ``"path.to.field: message"`` line per problem.
The document's bounds (``document_problem``) and those lines (``format_errors``) are
``mesh.yaml_document``'s, importable from here too.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from mesh.connect_policy import ConnectPolicy
from mesh.files import FileProblem, read_regular_file
from mesh.yaml_document import document_problem, format_errors
from policies.base import Role

WORKER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")
MIB = 1024 * 1024
# What a ZMQ SUB/DEALER can connect to: tcp with a host (name, IPv4, [IPv6]) and a numeric port
# (a data-parallel rank r connects to port + r), or a local transport.
ZMQ_ENDPOINT = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+):[0-9]{1,5}|(ipc|inproc)://[^\s\0]+")
MAX_FILE_BYTES = 16 * MIB  # a config of 1,000 workers is ~200 KiB; PyYAML parses ~1 MiB/s


class ConfigError(ValueError):
    """A configuration that cannot be used; ``errors`` holds one line per problem."""

    def __init__(self, errors: list[str], source: str | None = None) -> None:
        self.errors = errors
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(where + "; ".join(errors))


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # inf: a TTL never ending, a timeout never firing


PositiveFloat = Annotated[float, Field(gt=0)]


class ServerConfig(_Model):
    host: str = Field("127.0.0.1", description="Address the gateway listens on (`mesh serve --host`); 0.0.0.0 for every interface.")
    port: int = Field(8000, ge=0, le=65535, description="Port the gateway listens on (`mesh serve --port`).")
    api_keys: list[str] = Field(default_factory=list)  # data plane: empty = open
    admin_key: str | None = None  # admin API: None = admin API disabled (403)
    # Keys kept out of the YAML: a file of API keys (one a line; blank lines and # comments
    # skipped), added to api_keys; a file holding the admin key (instead of admin_key). Read at
    # load and at every reload (rotate a key by rewriting its file). `mesh serve` also takes them
    # from MESH_API_KEYS / MESH_ADMIN_KEY and flags (mesh.commands.serve_flags).
    api_keys_file: str | None = None
    admin_key_file: str | None = Field(None, description="A file holding the admin key (see api_keys_file); instead of admin_key.")
    max_body_bytes: int = Field(8 * MIB, ge=1024, description="Largest request body; a larger one is a 413.")
    # request body bytes held at once, over all requests (a body is held until its request ends):
    # past it a new body is a 503 with Retry-After (mesh.gateway.client_io.BodyBuffer)
    max_buffered_body_bytes: int = Field(1024 * MIB, ge=1024)
    max_tokens_limit: int = Field(1_000_000, ge=1, description="Largest max_tokens (max_completion_tokens) a request may ask for; more is a 400.")
    max_prompt_tokens: int = Field(4_000_000, ge=1, description="Largest prompt, in tokens, a request may send; more is a 400.")
    # The request's one deadline: from the moment it is routable (before the admission queue) to
    # the end of its answer, streaming included. The admission wait (admission.max_wait_s, cut to
    # what is left of it), every attempt and its retries all count against it; the upstream
    # timeouts below bound each attempt within it.
    request_timeout_s: PositiveFloat = 3600.0
    # Longest wait from sending a stream request to a worker to the first bytes of its stream (the
    # first token: queueing plus prefill). 60 s covers the prefill of a 128k-token prompt on a busy
    # GPU many times over, yet frees a hung worker's requests while nothing reached the client: past
    # it the attempt is the worker's failure (its circuit breaker) and is retried on another worker.
    # A non-streamed answer is not bounded by it: engines send its head once the whole answer is
    # generated, which takes as long as max_tokens asks; a hung worker's such requests are
    # retried as soon as the health check marks it unhealthy.
    first_byte_timeout_s: PositiveFloat = 60.0
    # Longest silence of a worker once its answer started (between a stream's chunks; between a
    # buffered answer's head and the rest of it). An engine emits a token every few tens of ms, so
    # 60 s of silence is a hung worker: a stream ends with an error event and [DONE], a buffered
    # answer (nothing reached the client) is retried elsewhere; both are the worker's failure.
    idle_timeout_s: PositiveFloat = 60.0
    # longest wait for a client to accept one chunk of a response; past it the gateway abandons
    # the client and frees its worker (a hung client held its slot until request_timeout_s)
    client_write_timeout_s: PositiveFloat = 30.0
    body_idle_timeout_s: PositiveFloat = 30.0  # longest wait for the next bytes of a request body (then 408)
    # A request head (request line and headers) longer than this is a 431 and the connection
    # closes; one not complete this long after its first byte (or a connection silent this long
    # after it opened) closes (mesh.gateway.http_protocol). nginx's buffers hold 8-32 KiB.
    max_head_bytes: int = Field(32 * 1024, ge=1024, le=16 * MIB)
    head_timeout_s: PositiveFloat = Field(5.0, description="See max_head_bytes: how long a request head may take to arrive.")
    connect_timeout_s: PositiveFloat = Field(5.0, description="Longest wait for a TCP connection to a worker; past it the attempt fails and is retried on another worker.")
    # What the gateway may connect to on a worker's behalf (mesh.connect_policy): its url and its
    # kv_events endpoints. allowed_worker_hosts: hosts (any IP spelling) or CIDR networks; None =
    # any host except link-local and cloud metadata ones (listing one allows it).
    allowed_worker_hosts: list[str] | None = None
    allowed_schemes: list[str] = Field(default_factory=lambda: ["http", "https"])  # of worker urls
    allowed_kv_event_schemes: list[Literal["tcp", "ipc", "inproc"]] = Field(default_factory=lambda: ["tcp", "ipc", "inproc"], description="Transports a worker's kv_events endpoints may use.")
    allowed_ipc_paths: list[str] = Field(default_factory=list)  # unix sockets (or their directories) ipc:// may reach
    forward_authorization: bool = False  # pass the client's Authorization header to workers
    # client headers forwarded to workers besides request ids, trace context, user-agent, accept
    # and the session header (mesh.gateway.headers.FORWARDED); any other client header is dropped
    forward_headers: list[str] = Field(default_factory=list)
    # "json": one JSON line per data-plane request on the `mesh.access` logger (stdout), written
    # by a background thread (mesh.gateway.access_log); `mesh serve --access-log json` sets it
    access_log: Literal["off", "json"] = "off"

    @model_validator(mode="before")
    @classmethod
    def _key_files(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not (data.get("api_keys_file") or data.get("admin_key_file")):
            return data
        return {**data, **read_key_files(data)}

    @field_validator("api_keys")
    @classmethod
    def _keys_not_empty(cls, keys: list[str]) -> list[str]:
        if any(not k or not k.isprintable() for k in keys):
            raise ValueError("api keys must be non-empty printable strings")
        return keys

    @field_validator("access_log", mode="before")
    @classmethod
    def _access_log_off(cls, value: Any) -> Any:
        return "off" if value is False else value  # YAML reads a bare `off` as false

    @field_validator("allowed_ipc_paths")
    @classmethod
    def _ipc_paths(cls, paths: list[str]) -> list[str]:
        for path in paths:
            if not (path.startswith("/") or path.startswith("@")) or any(c in path for c in "\r\n\t\0"):
                raise ValueError(f"ipc path {path!r} must be absolute (or an abstract @name)")
        return paths

    @model_validator(mode="after")
    def _policy(self) -> ServerConfig:
        self.connect_policy()  # a bad allowlist entry raises here, at load
        return self

    def connect_policy(self) -> ConnectPolicy:
        """The policy every worker address is checked against (``check_worker_addresses``)."""
        return ConnectPolicy(
            allowed_hosts=tuple(self.allowed_worker_hosts) if self.allowed_worker_hosts is not None else None,
            url_schemes=tuple(self.allowed_schemes), zmq_schemes=tuple(self.allowed_kv_event_schemes),
            ipc_paths=tuple(self.allowed_ipc_paths))


MAX_KEY_FILE_BYTES = 1 * MIB


def read_key_file(path: Any, what: str = "key file") -> list[str]:
    """The keys in a key file: one a line, blank lines and ``#`` comments skipped; ValueError
    naming ``what`` when it holds none or cannot be read."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"{what} must be a file path, got {path!r}")
    try:
        text = read_regular_file(path, MAX_KEY_FILE_BYTES).decode("utf-8")
    except (FileProblem, UnicodeDecodeError) as exc:
        raise ValueError(f"{what} {path!r}: cannot read it: {exc}") from None
    keys = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise ValueError(f"{what} {path!r} holds no key")
    return keys


def read_key_files(data: dict[str, Any]) -> dict[str, Any]:
    """``api_keys`` and ``admin_key`` of a ``server`` section with its key files read in (the
    file's keys added to ``api_keys``; ``admin_key`` the file's one key)."""
    out: dict[str, Any] = {}
    if data.get("api_keys_file"):
        inline = data.get("api_keys") or []
        from_file = read_key_file(data["api_keys_file"], "api_keys_file")
        out["api_keys"] = [*inline, *(k for k in from_file if k not in inline)] if isinstance(inline, list) else inline
    if data.get("admin_key_file"):
        keys = read_key_file(data["admin_key_file"], "admin_key_file")
        if len(keys) != 1:
            raise ValueError(f"admin_key_file {data['admin_key_file']!r} must hold one key, it holds {len(keys)}")
        if data.get("admin_key") not in (None, keys[0]):
            raise ValueError("set admin_key or admin_key_file, not both")
        out["admin_key"] = keys[0]
    return out


class KVEventsConfig(_Model):
    endpoint: str  # ZMQ SUB endpoint, e.g. tcp://host:5557
    replay_endpoint: str | None = None  # ZMQ ROUTER endpoint for gap replay
    topic: str = Field("", description="ZMQ topic (prefix) of this worker's events on the endpoint; two workers on one endpoint need topics that are not prefixes of each other.")

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _endpoint(cls, endpoint: str | None) -> str | None:
        # ZMQ refuses these only when the subscriber connects (the stream then ended with a
        # "socket error" log line and the worker's index stayed untrusted): refuse them here.
        if endpoint is not None and not ZMQ_ENDPOINT.fullmatch(endpoint):
            raise ValueError(f"endpoint {endpoint!r} must be tcp://HOST:PORT (a port 0-65535), ipc://PATH or inproc://NAME")
        if endpoint is not None and endpoint.startswith("tcp://") and int(endpoint.rpartition(":")[2]) > 65535:
            raise ValueError(f"endpoint {endpoint!r}: port out of range 0-65535")
        return endpoint


class WorkerConfig(_Model):
    name: str = Field(description="Unique name (1-64 of A-Za-z0-9_.-): in /workers, metrics labels and routing decisions.")
    url: str = Field(description="Base URL of the worker's OpenAI-compatible API, e.g. http://10.0.0.5:8000 "
                                 "(no credentials, query or fragment).")
    models: list[str] | None = None  # None: discovered from the worker's /v1/models
    role: Role = Field(Role.MIXED, description="mixed (prefill and decode), prefill or decode (disaggregated serving: docs/disaggregation.md).")
    dp_size: int = Field(1, ge=1, le=1024, description="Data-parallel ranks behind this URL; each rank is a routing target (its KV events on endpoint port + rank).")
    block_size: int = Field(16, ge=1, le=65536, description="The engine's KV block size in tokens: prefix hashes are computed per block of this size, as the engine does.")
    tokenizer: str | None = None  # None = byte-level; else a tokenizer.json or model directory
    kv_events: KVEventsConfig | None = Field(None, description="The engine's KV cache event stream (vLLM/SGLang ZMQ publisher): precise prefix-aware routing. None: the index learns only from the gateway's own routing.")
    hybrid: bool = Field(False, description="The worker serves a hybrid model (recurrent layers beside attention): a cached prefix counts only up to its deepest recurrent-state checkpoint (docs/hybrid.md). Learned anyway from the first checkpoint its KV events announce; set it so no attention-only prefix is claimed before that.")
    max_in_flight: int = Field(0, ge=0)  # 0 = no admission limit
    api_key: str | None = None  # sent to the worker as a Bearer token
    # server.first_byte_timeout_s / server.idle_timeout_s for this worker alone (None: the server's)
    first_byte_timeout_s: PositiveFloat | None = None
    idle_timeout_s: PositiveFloat | None = Field(None, description="See first_byte_timeout_s: server.idle_timeout_s for this worker alone.")
    # LoRA adapters served under their own model names, adapter -> base model (None: discovered
    # from /v1/models ``parent``). A list of adapter names means "on the first of ``models``".
    loras: dict[str, str] | None = None
    # vLLM's --chat-template-content-format for this pool's template: "auto" detects it from the
    # template (mesh.request.chat), "string"/"openai" force it (as the engine is run with, or keys diverge)
    chat_template_content_format: Literal["auto", "string", "openai"] = "auto"

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not WORKER_NAME.match(name):
            raise ValueError("worker name must be 1-64 of [A-Za-z0-9_.-], starting with a letter or digit")
        return name

    @field_validator("url")
    @classmethod
    def _url(cls, url: str) -> str:
        return normalize_url(url)

    @field_validator("loras", mode="before")
    @classmethod
    def _lora_list(cls, loras: Any, info: ValidationInfo) -> Any:
        if not isinstance(loras, list):
            return loras
        models = info.data.get("models")
        if not models:
            raise ValueError("a list of LoRA adapters needs `models` (they run on the first one); "
                             "else map each adapter to its base model: {adapter: base}")
        return {name: models[0] for name in loras}

    @model_validator(mode="after")
    def _check_loras(self) -> WorkerConfig:
        for adapter, base in (self.loras or {}).items():
            for what, name in (("adapter", adapter), ("base model", base)):
                if not name or len(name) > 256 or not name.isprintable():
                    raise ValueError(f"loras: {what} name {name!r} must be 1-256 printable characters")
            if self.models is not None and base not in self.models:
                raise ValueError(f"loras: adapter {adapter!r} runs on {base!r}, which is not in models {self.models}")
            if self.models is not None and adapter in self.models:
                raise ValueError(f"loras: adapter {adapter!r} is also listed in models (list base models only)")
        return self

    @model_validator(mode="after")
    def _addresses(self, info: ValidationInfo) -> WorkerConfig:
        """Under ``parse_config`` (its context holds the server's connect policy) the addresses are
        checked here, so an error names this worker's path (``workers[1]``); else by ``MeshConfig``."""
        policy = (info.context or {}).get("connect_policy")
        if isinstance(policy, ConnectPolicy):
            check_addresses(policy, self)
        return self


class HealthConfig(_Model):
    interval_s: PositiveFloat = Field(2.0, description="Seconds between health checks of each worker (GET /health).")
    timeout_s: PositiveFloat = Field(2.0, description="Longest wait for one health check's answer.")
    # each round also reads every worker's /metrics for its KV usage and capacity (vLLM, SGLang,
    # bundled names: mesh.cluster.worker_metrics); off: they stay unknown and the KV checks never fire
    worker_metrics: bool = True
    unhealthy_threshold: int = Field(2, ge=1, description="Consecutive failed checks that mark a worker unhealthy (it gets no requests).")
    healthy_threshold: int = Field(1, ge=1, description="Consecutive good checks that mark it healthy again.")


class CircuitBreakerConfig(_Model):
    failure_threshold: int = Field(5, ge=1)  # consecutive request failures that open it
    open_s: PositiveFloat = 10.0  # then half-open: the next request is a probe


class RetriesConfig(_Model):
    max_attempts: int = Field(3, ge=1, le=16)  # attempts in all, each on another target
    backoff_base_s: float = Field(0.01, ge=0, description="Wait before the second attempt; doubled for each later one.")
    backoff_max_s: float = Field(0.5, ge=0, description="Longest wait between attempts.")


class SessionsConfig(_Model):
    header: str = Field("x-session-id", description="Request header carrying a session id (requests of one session go to one worker while it can take them).")
    body_field: str = Field("user", description="Body field read as the session id when the header is absent (OpenAI's user).")
    idle_ttl_s: PositiveFloat = Field(600.0, description="A session's binding to its worker ends after this long without a request.")
    max_sessions: int = Field(1_000_000, ge=1, description="Session bindings kept at once; past it the least recently used goes.")
    # The load ceiling of a bound session is a parameter of the session policy
    # (``session_sticky``: ``load_factor``, ``load_slack``, ``max_in_flight``), not of the table.

    @field_validator("header")
    @classmethod
    def _header(cls, header: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9\-_]{1,64}", header):
            raise ValueError("header must be an HTTP header name")
        return header.lower()


class AdmissionConfig(_Model):
    """Late binding (``mesh.gateway.admission_queue``): a request that finds every worker of its
    model at ``max_in_flight`` waits at the gateway and is routed once one has room."""

    max_waiting: int = Field(256, ge=0)  # requests held at once; one more is a 429 (0: no holding, 429 at once)
    max_wait_s: PositiveFloat = 30.0  # longest hold; then a 503 queue_timeout
    # a session whose worker is full waits this long for it before it may move (0: moves at once)
    home_wait_s: float = Field(2.0, ge=0)


class RetentionConfig(_Model):
    """Session-aware retention (``mesh.core.retention``): requests of sessions that do not fit
    their worker's KV cache carry ``x-mesh-retention: spill`` (the bundled worker evicts their
    blocks first; other workers ignore the header)."""

    spill_hint: bool = Field(True, description="Mark requests of sessions that do not fit their worker's KV cache with x-mesh-retention: spill.")
    fill: float = Field(0.9, gt=0, le=1)  # share of a worker's KV capacity the kept sessions may fill
    active_s: PositiveFloat = 30.0  # a session idle this long stops counting


# The index's default bound: 32 workers of ~32k GPU blocks each (an H100's KV for an 8B model at
# block size 16) in one index; measured ~570 bytes of gateway memory a key at the bound (nodes,
# engine maps with the evicted nodes' hashes not yet swept, the LRU heap): ~600 MB at most.
# Least recently stored/matched leaves go first (hot prefixes stay).
DEFAULT_MAX_KEYS = 1_000_000


class IndexConfig(_Model):
    max_keys: int = Field(DEFAULT_MAX_KEYS, ge=0, description="Bound on the prefix index's keys (KV blocks over all workers); 0 = unbounded. Least recently stored or matched leaves go first.")
    speculative_ttl_s: float = Field(2.0, ge=0, description="A routed request's prompt blocks count as cached on its worker for this long, until the engine's KV events confirm them (0: off).")
    # KV event ingestion (``mesh.events.pacer``, ``mesh.events.inbox``)
    ingest_slice_ms: float = Field(0.5, gt=0, le=100, description="KV event work runs on the gateway's loop in slices this long, so a request's callbacks wait at most one slice behind it.")
    ingest_share: float = Field(0.5, gt=0, le=1, description="The share of the gateway's loop KV event work may take while events pour in (a rest follows each slice); a flood past it piles up in the stream's backlog.")
    max_backlog_frames: int = Field(10_000, ge=1, description="A stream's backlog budget: past this many frames received and not applied, the stream is reset (its backlog dropped, its index entries rebuilt from replay; a WARNING and mesh_kv_events_resets_total{reason=\"backlog\"}).")
    max_backlog_bytes: int = Field(64 << 20, ge=1, description="The same budget in payload bytes (never below one frame of the largest size accepted, 16 MiB).")


SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
# A label key (an optional DNS-subdomain prefix and a name) and a label value, as Kubernetes
# validates them; a selector of other text would be refused by the API server at every list.
LABEL_KEY = re.compile(r"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                       r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


class KubernetesDiscoveryConfig(_Model):
    """Workers found in Kubernetes (``mesh.cluster.kubernetes``): the objects matching ``selector``
    are listed, then watched; each ready endpoint (EndpointSlices) or ready pod (Pods) is a worker
    named after its pod, at ``scheme://address:port``; one that turns unready or leaves is removed,
    a terminating one that still serves is drained. Its role, models and block size come from the
    object's labels or annotations ``mesh.dev/role``, ``mesh.dev/models`` (comma-separated) and
    ``mesh.dev/block-size`` when given. Every address passes ``server``'s connect policy."""

    resource: Literal["endpointslices", "pods"] = Field("endpointslices", description="What is watched: endpointslices (discovery.k8s.io/v1; the endpoints of the Services matching selector, ready as Kubernetes decides) or pods (v1; their podIP and Ready condition).")
    namespace: str | None = Field(None, description="Namespace watched; null: the pod's own (the service account's namespace file), else default.")
    selector: dict[str, str] = Field(min_length=1, description="Label selector (all must match), e.g. {app: mesh-worker}; an EndpointSlice carries its Service's labels and kubernetes.io/service-name.")
    port: str | int = Field("http", description="The worker's HTTP port: a port name (the EndpointSlice's port, or the pod's containerPort) or a number.")
    kv_events_port: str | int | None = Field(None, description="The port of the worker's KV event publisher (name or number): each worker gets kv_events tcp://address:port; null: none.")
    scheme: Literal["http", "https"] = Field("http", description="Scheme of the discovered worker URLs.")
    block_size: int = Field(16, ge=1, le=65536, description="KV block size of discovered workers without a mesh.dev/block-size label or annotation.")
    api_server: str | None = Field(None, description="The API server's URL; null: in-cluster (https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT).")
    token_file: str = Field(SERVICE_ACCOUNT_DIR + "/token", description="Bearer token sent to the API server, re-read at every connection (tokens rotate); a missing file sends none when api_server is set.")
    ca_file: str = Field(SERVICE_ACCOUNT_DIR + "/ca.crt", description="CA bundle that verifies an https API server (the system's when the file is missing).")
    watch_timeout_s: int = Field(300, ge=1, le=3600, description="Each watch request asks the API server to end it after this long (then it is resumed from the last resourceVersion).")
    backoff_max_s: PositiveFloat = Field(30.0, description="Longest wait between reconnects to the API server (doubling from 0.2 s while it fails).")

    @field_validator("selector")
    @classmethod
    def _selector(cls, selector: dict[str, str]) -> dict[str, str]:
        for key, value in selector.items():
            if not LABEL_KEY.fullmatch(key) or len(key.rpartition("/")[0]) > 253:
                raise ValueError(f"selector key {key!r} is not a Kubernetes label key")
            if not LABEL_VALUE.fullmatch(value):
                raise ValueError(f"selector value {value!r} (of {key!r}) is not a Kubernetes label value")
        return selector

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, namespace: str | None) -> str | None:
        if namespace is not None and not DNS_LABEL.fullmatch(namespace):
            raise ValueError(f"namespace {namespace!r} is not a Kubernetes namespace name")
        return namespace

    @field_validator("port", "kv_events_port")
    @classmethod
    def _port(cls, port: str | int | None) -> str | int | None:
        if isinstance(port, int) and not 1 <= port <= 65535:
            raise ValueError(f"port {port} out of range 1-65535")
        if isinstance(port, str) and not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,13}[a-z0-9])?", port):
            raise ValueError(f"port name {port!r} is not a Kubernetes port name (1-15 of a-z0-9-)")
        return port

    @field_validator("api_server")
    @classmethod
    def _api_server(cls, url: str | None) -> str | None:
        if url is None:
            return None
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.query or parsed.username:
            raise ValueError(f"api_server {url!r} must be http(s)://host[:port] without credentials or a query")
        return url.rstrip("/")

    def label_selector(self) -> str:
        """The selector as the API's ``labelSelector`` query value (``k=v,k2=v2``)."""
        return ",".join(f"{k}={v}" for k, v in sorted(self.selector.items()))


class DiscoveryConfig(_Model):
    """Workers found at runtime besides the static ``workers``; read at startup only."""

    kubernetes: KubernetesDiscoveryConfig | None = Field(None, description="Discover workers from the Kubernetes API (see its keys); null: off.")


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (userinfo and ``?password=``); else unchanged."""
    try:
        parts = urllib.parse.urlsplit(url)
        netloc = parts.netloc
        if parts.password is not None:
            user, _, host = netloc.rpartition("@")
            netloc = f"{user.partition(':')[0]}:***@{host}"
        query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
        if any(k.lower() == "password" for k, _ in query):
            masked = [(k, "***" if k.lower() == "password" else v) for k, v in query]
            parts = parts._replace(query=urllib.parse.urlencode(masked, safe="*"))
        out = urllib.parse.urlunsplit(parts._replace(netloc=netloc))
        if url.startswith(f"{parts.scheme}://") and not out.startswith(f"{parts.scheme}://"):
            out = f"{parts.scheme}://{out.partition(':')[2]}"  # unix:///tmp/r.sock: urlunsplit dropped the //
        return out
    except ValueError:  # unparsable: show no part of it that could hold a secret
        return "<unparsable redis url>"


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


class StateConfig(_Model):
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



# DESIGN.md "Defaults": precise KV-aware routing, with session affinity whenever a session id is
# present. ``session_sticky`` without params wraps ``kv_aware`` (its default inner policy): a
# request with a session id returns to its bound target while that is healthy and under the load
# ceiling; a new session is spread to the targets with the fewest live sessions (kv_aware choosing
# among them), and every other request (no session id, a moving session) is decided by kv_aware.
DEFAULT_POLICY = "session_sticky"


class MeshConfig(_Model):
    server: ServerConfig = Field(default_factory=ServerConfig)
    workers: list[WorkerConfig] = Field(default_factory=list)
    health: HealthConfig = Field(default_factory=HealthConfig)
    circuit_breaker: CircuitBreakerConfig = Field(default_factory=CircuitBreakerConfig)
    retries: RetriesConfig = Field(default_factory=RetriesConfig)
    policy: Any = Field(DEFAULT_POLICY, description="The routing policy: a name or {name, params} spec, passed "
                        "untouched to policies.create_policy (docs/policies.md); the default is session_sticky over kv_aware.")
    sessions: SessionsConfig = Field(default_factory=SessionsConfig)
    index: IndexConfig = Field(default_factory=IndexConfig)
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    retention: RetentionConfig = Field(default_factory=RetentionConfig)
    state: StateConfig = Field(default_factory=StateConfig)
    discovery: DiscoveryConfig = Field(default_factory=DiscoveryConfig)

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


def rank_endpoint(endpoint: str, rank: int) -> str:
    """The PUB endpoint of data-parallel rank ``rank`` (``mesh.events.subscriber.offset_endpoint``'s rule)."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        return f"{host}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


def normalize_url(url: str) -> str:
    """``scheme://host[:port][/base]`` without a trailing slash; rejects what cannot be a worker."""
    if not isinstance(url, str) or not url or any(c in url for c in "\r\n\t\0 "):
        raise ValueError("worker url must be a non-empty URL without whitespace or control characters")
    parsed = urllib.parse.urlsplit(url)
    shown = redact_url(url)  # errors reach logs and admin clients: never with a password
    if not parsed.scheme or not parsed.hostname:
        raise ValueError(f"worker url {shown!r} needs a scheme and a host, e.g. http://10.0.0.5:8000")
    if parsed.query or parsed.fragment or parsed.username or parsed.password:
        raise ValueError(f"worker url {shown!r} must not carry credentials, a query or a fragment")
    try:
        parsed.port  # noqa: B018  (raises on a bad port)
    except ValueError as exc:
        raise ValueError(f"worker url {shown!r}: {exc}") from exc
    return url.rstrip("/")


def check_event_streams(workers: Iterable[WorkerConfig]) -> None:
    """Every worker reads its own KV event stream; raises ValueError when two would share one.

    ZMQ topics filter by prefix, so two workers on one PUB endpoint (of some data-parallel rank)
    with topics equal or one a prefix of the other would both be credited with one engine's
    blocks; a replay endpoint answers every topic, so two workers may not share one either."""
    streams: dict[str, list[tuple[str, str]]] = {}  # PUB endpoint of a rank -> [(topic, worker)]
    replays: dict[str, str] = {}  # replay endpoint of a rank -> worker
    for w in workers:
        if w.kv_events is None:
            continue
        for rank in range(w.dp_size):
            endpoint, topic = rank_endpoint(w.kv_events.endpoint, rank), w.kv_events.topic
            replay = w.kv_events.replay_endpoint
            if replay is not None:
                other = replays.setdefault(rank_endpoint(replay, rank), w.name)
                if other != w.name:
                    raise ValueError(f"workers {other!r} and {w.name!r} share the KV event replay endpoint "
                                     f"{rank_endpoint(replay, rank)!r}")
            for other_topic, other in streams.setdefault(endpoint, []):
                if other != w.name and (topic.startswith(other_topic) or other_topic.startswith(topic)):
                    raise ValueError(f"workers {other!r} and {w.name!r} subscribe to the same KV event stream "
                                     f"{endpoint!r} (topics {other_topic!r} and {topic!r}, matched by prefix): "
                                     "give each worker its own endpoint or topic")
            streams[endpoint].append((topic, w.name))


def check_worker_url(url: str, server: ServerConfig) -> None:
    """``url`` against the server's connect policy (``mesh.connect_policy``); raises ValueError."""
    server.connect_policy().check_url(url)


def check_worker_addresses(worker: WorkerConfig, server: ServerConfig) -> None:
    """Every address the gateway would connect to for ``worker`` against the server's connect
    policy (``check_addresses``); raises ValueError."""
    check_addresses(server.connect_policy(), worker)


def check_addresses(policy: ConnectPolicy, worker: WorkerConfig) -> None:
    """``worker``'s url and each rank's KV event and replay endpoint against ``policy``."""
    policy.check_url(worker.url)
    kv = worker.kv_events
    if kv is None:
        return
    for rank in range(worker.dp_size):
        policy.check_zmq(rank_endpoint(kv.endpoint, rank), "kv_events endpoint")
        if kv.replay_endpoint is not None:
            policy.check_zmq(rank_endpoint(kv.replay_endpoint, rank), "kv_events replay_endpoint")


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
