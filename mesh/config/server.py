"""The ``server`` section: where the gateway listens, its keys (inline or in key files), its
request bounds and timeouts, and what it may connect to on a worker's behalf."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from mesh.config.base import MIB, ConfigModel, PositiveFloat
from mesh.connect_policy import ConnectPolicy
from mesh.files import FileProblem, read_regular_file


class ServerConfig(ConfigModel):
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
