"""The ``workers`` section: each static worker's address, role, block size and KV event stream,
and the checks over all of them (addresses against the connect policy, one stream a worker)."""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from mesh.config.base import ConfigModel, PositiveFloat, redact_url
from mesh.config.server import ServerConfig
from mesh.connect_policy import ConnectPolicy
from policies.base import Role

WORKER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")
# What a ZMQ SUB/DEALER can connect to: tcp with a host (name, IPv4, [IPv6]) and a numeric port
# (a data-parallel rank r connects to port + r), or a local transport.
ZMQ_ENDPOINT = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+):[0-9]{1,5}|(ipc|inproc)://[^\s\0]+")


def bound_topics(worker: str, topic: str) -> list[str]:
    """The topics that name ``worker`` on the gateway's bound endpoint (``mesh.events.bound``):
    its configured topic exactly, else its name exactly or llm-d's ``kv@NAME@MODEL`` (the route
    ``kv@NAME@`` stands for every model)."""
    return [topic] if topic else [worker, f"kv@{worker}@"]


class KVEventsConfig(ConfigModel):
    endpoint: str | None = Field(None, description="The worker's ZMQ PUB endpoint, e.g. tcp://10.0.0.5:5557: the gateway connects to it (the engine binds it: vLLM endpoint tcp://*:5557). None: the worker's publisher connects to the gateway's kv_events.bind instead, and its frames are told apart by topic (data-parallel size 1).")
    replay_endpoint: str | None = None  # ZMQ ROUTER endpoint for gap replay
    topic: str = Field("", description="With an endpoint: the ZMQ topic (prefix) of this worker's events there; two workers on one endpoint need topics that are not prefixes of each other. Without one (the gateway's bound endpoint): the exact topic of this worker's frames (vLLM's topic); empty: the worker's name, alone or as llm-d's kv@NAME@MODEL.")

    lookahead_tokens: int | None = Field(None, ge=0, le=64, description="Tokens after each block that the engine's block hashes cover: speculative decoding (vLLM with EAGLE hashes with num_hash_lookahead_tokens, SGLang with EAGLE keys pages by token bigrams: 1), so a block is reused only when the tokens after it match too. null: as the worker's KV events show (vLLM's lookahead_token_ids, SGLang's bigram pages); set it to declare it: events that disagree are counted (lookahead_mismatch) and keyed as they show, and stores without the lookahead tokens cannot be keyed (lookahead_missing).")

    def bound_topics(self, worker: str) -> list[str]:
        return bound_topics(worker, self.topic)

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


class WorkerConfig(ConfigModel):
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
    disagg_protocol: Literal["vllm", "sglang"] | None = Field(None, description="This worker's prefill/decode protocol when it is not disagg.protocol (a pool of SGLang workers beside vLLM ones): pairs form only between workers of one protocol.")
    bootstrap_port: int | None = Field(None, ge=1, le=65535, description="An SGLang prefill worker's --disaggregation-bootstrap-port (disagg.protocol sglang; None: SGLang's default, 8998). Its host is the url's.")
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
    default_chat_template_kwargs: dict[str, Any] = Field(default_factory=dict, description="vLLM's --default-chat-template-kwargs of this pool's workers (e.g. {\"enable_thinking\": false}): the template variables a request's chat_template_kwargs and explicit fields override. Set as the engines run, or the gateway renders another prompt and its block keys never match their cache.")

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
    bound: dict[str, str] = {}  # topic on the gateway's bound endpoint -> worker
    for w in workers:
        if w.kv_events is None:
            continue
        if w.kv_events.endpoint is None:
            _check_bound(w, bound, replays)
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


def _check_bound(w: WorkerConfig, bound: dict[str, str], replays: dict[str, str]) -> None:
    """A worker read from the gateway's bound endpoint: one rank, a topic no other worker has."""
    kv = w.kv_events
    assert kv is not None and kv.endpoint is None
    if w.dp_size != 1:
        raise ValueError(f"worker {w.name!r}: kv_events without an endpoint (the gateway's bound endpoint) needs "
                         f"dp_size 1, got {w.dp_size}: give each rank its own worker, or an endpoint per rank")
    if kv.replay_endpoint is not None:
        other = replays.setdefault(kv.replay_endpoint, w.name)
        if other != w.name:
            raise ValueError(f"workers {other!r} and {w.name!r} share the KV event replay endpoint {kv.replay_endpoint!r}")
    for topic in kv.bound_topics(w.name):
        other = bound.setdefault(topic, w.name)
        if other != w.name:
            raise ValueError(f"workers {other!r} and {w.name!r} are both named by topic {topic!r} on the gateway's "
                             "bound KV event endpoint: give each its own kv_events.topic")


def check_bound_workers(workers: Iterable[WorkerConfig], bind: str | None) -> None:
    """Workers read from the gateway's bound endpoint need one: raises ValueError when ``bind`` is None."""
    if bind is not None:
        return
    for w in workers:
        if w.kv_events is not None and w.kv_events.endpoint is None:
            raise ValueError(f"worker {w.name!r}: kv_events has no endpoint, so its publisher must connect to the "
                             "gateway's, but kv_events.bind is not set (e.g. kv_events: {bind: \"tcp://*:5557\"}); "
                             "or give the worker the endpoint its engine binds")


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
    if kv.endpoint is None:  # the gateway's bound endpoint: only the replay socket is connected to
        if kv.replay_endpoint is not None:
            policy.check_zmq(kv.replay_endpoint, "kv_events replay_endpoint")
        return
    for rank in range(worker.dp_size):
        policy.check_zmq(rank_endpoint(kv.endpoint, rank), "kv_events endpoint")
        if kv.replay_endpoint is not None:
            policy.check_zmq(rank_endpoint(kv.replay_endpoint, rank), "kv_events replay_endpoint")
