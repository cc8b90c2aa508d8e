"""The ``discovery`` section: workers found at run time (Kubernetes) besides the static ones."""

from __future__ import annotations

import re
import urllib.parse
from typing import Literal

from pydantic import Field, field_validator, model_validator

from mesh.config.base import ConfigModel, PositiveFloat

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
# A label key (an optional DNS-subdomain prefix and a name) and a label value, as Kubernetes
# validates them; a selector of other text would be refused by the API server at every list.
LABEL_KEY = re.compile(r"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                       r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


class KubernetesDiscoveryConfig(ConfigModel):
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
    kv_events_connect: bool = Field(False, description="The discovered workers' publishers connect to the gateway's kv_events.bind (llm-d's layout) instead: each worker gets kv_events without an endpoint, named by its pod name as vLLM's topic (kv@POD@MODEL, or the pod name). Excludes kv_events_port.")
    kv_events_replay_port: str | int | None = Field(None, description="The port of the worker's KV event replay socket (name or number): each worker gets kv_events replay_endpoint tcp://address:port; null: none (a lost batch then resets the worker's index entries).")
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

    @field_validator("port", "kv_events_port", "kv_events_replay_port")
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

    @model_validator(mode="after")
    def _kv_events(self) -> KubernetesDiscoveryConfig:
        if self.kv_events_connect and self.kv_events_port is not None:
            raise ValueError("kv_events_connect (publishers connect to the gateway) and kv_events_port (the gateway "
                             "connects to each worker's publisher) exclude each other")
        return self

    def label_selector(self) -> str:
        """The selector as the API's ``labelSelector`` query value (``k=v,k2=v2``)."""
        return ",".join(f"{k}={v}" for k, v in sorted(self.selector.items()))


class DiscoveryConfig(ConfigModel):
    """Workers found at runtime besides the static ``workers``; read at startup only."""

    kubernetes: KubernetesDiscoveryConfig | None = Field(None, description="Discover workers from the Kubernetes API (see its keys); null: off.")
