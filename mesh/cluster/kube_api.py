"""A small Kubernetes API client: list and watch one resource by label selector.

Only what worker discovery (``mesh.cluster.kubernetes``) needs, over httpx:
- ``list_objects``: ``GET .../<resource>?labelSelector=...`` page by page (``limit``/``continue``);
  returns the items and the list's ``resourceVersion``.
- ``watch``: ``GET ...?watch=1&resourceVersion=RV&allowWatchBookmarks=true&timeoutSeconds=N``,
  a chunked stream of JSON lines ``{"type": ADDED|MODIFIED|DELETED|BOOKMARK|ERROR, "object": ...}``
  yielded as ``WatchEvent``s. The API server ends it after ``timeoutSeconds``; the caller resumes
  from the last resourceVersion it saw.
- ``Gone``: the resourceVersion is too old (HTTP 410, or an ``ERROR`` event whose Status has code
  410, or an expired ``continue`` token): the caller must list again.

Authentication is the pod's service account: the bearer token file is read again for every
request (the kubelet rotates it), the CA file verifies an https API server. With ``api_server``
unset the address is the in-cluster one (``KUBERNETES_SERVICE_HOST``/``_PORT``).
"""

from __future__ import annotations

import json
import os
import ssl
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from mesh.config import SERVICE_ACCOUNT_DIR, ConfigError, KubernetesDiscoveryConfig

RESOURCE_PATHS = {  # resource -> (API group path, kind of its items)
    "endpointslices": ("/apis/discovery.k8s.io/v1", "EndpointSlice"),
    "pods": ("/api/v1", "Pod"),
}
PAGE_SIZE = 500
MAX_ERROR_TEXT = 300  # of an API error body, in a log line


class KubeApiError(RuntimeError):
    """The API server refused or broke a request (not a 410)."""


class Gone(KubeApiError):
    """HTTP 410: the resourceVersion (or continue token) is too old; list again."""


@dataclass(frozen=True)
class WatchEvent:
    type: str  # ADDED, MODIFIED, DELETED, BOOKMARK
    object: dict[str, Any]

    @property
    def resource_version(self) -> str | None:
        rv = (self.object.get("metadata") or {}).get("resourceVersion")
        return rv if isinstance(rv, str) and rv else None


def api_server_url(cfg: KubernetesDiscoveryConfig, environ: Mapping[str, str]) -> str:
    """``cfg.api_server``, else the in-cluster address; ConfigError when neither is known."""
    if cfg.api_server:
        return cfg.api_server
    host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise ConfigError(["discovery.kubernetes.api_server: not set, and KUBERNETES_SERVICE_HOST is not in the "
                           "environment (not in a pod): set api_server to the API server's URL"])
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


def namespace_of(cfg: KubernetesDiscoveryConfig) -> str:
    """``cfg.namespace``, else the pod's (the service account's namespace file), else ``default``."""
    if cfg.namespace:
        return cfg.namespace
    try:
        return Path(SERVICE_ACCOUNT_DIR, "namespace").read_text().strip() or "default"
    except OSError:
        return "default"


class KubeApi:
    """List and watch ``cfg.resource`` in one namespace, by ``cfg.selector``."""

    def __init__(self, cfg: KubernetesDiscoveryConfig, environ: Mapping[str, str] = os.environ) -> None:
        self.cfg = cfg
        self.base = api_server_url(cfg, environ)
        self.namespace = namespace_of(cfg)
        group, self.kind = RESOURCE_PATHS[cfg.resource]
        self.path = f"{group}/namespaces/{self.namespace}/{cfg.resource}"
        # The read timeout outlasts a watch's own end (timeoutSeconds): a silent stream past it is broken.
        timeout = httpx.Timeout(10.0, read=cfg.watch_timeout_s + 30.0)
        self._http = httpx.AsyncClient(base_url=self.base, timeout=timeout, verify=_verify(cfg), trust_env=False)

    async def aclose(self) -> None:
        await self._http.aclose()

    @property
    def where(self) -> str:
        """What is watched, for logs and ``describe``."""
        return f"{self.base}{self.path}?labelSelector={self.cfg.label_selector()}"

    def _headers(self) -> dict[str, str]:
        try:
            token = Path(self.cfg.token_file).read_text().strip()
        except OSError:
            if self.cfg.api_server is None:  # in a pod the token must be there
                raise KubeApiError(f"cannot read the service account token {self.cfg.token_file}") from None
            token = ""
        return {"accept": "application/json", **({"authorization": f"Bearer {token}"} if token else {})}

    async def list_objects(self) -> tuple[list[dict[str, Any]], str]:
        """Every matching object and the list's resourceVersion (raises ``Gone``, ``KubeApiError``)."""
        items: list[dict[str, Any]] = []
        params: dict[str, str | int] = {"labelSelector": self.cfg.label_selector(), "limit": PAGE_SIZE}
        while True:
            resp = await self._http.get(self.path, params=params, headers=self._headers())
            body = _checked(resp, "list")
            items += [o for o in body.get("items") or [] if isinstance(o, dict)]
            meta = body.get("metadata") or {}
            token = meta.get("continue")
            if not token:
                rv = meta.get("resourceVersion")
                if not isinstance(rv, str) or not rv:
                    raise KubeApiError("list answer without metadata.resourceVersion")
                return items, rv
            params["continue"] = token

    async def watch(self, resource_version: str) -> AsyncIterator[WatchEvent]:
        """The events after ``resource_version`` until the API server ends the watch (raises
        ``Gone``, ``KubeApiError``, or httpx's errors when the connection breaks)."""
        params: dict[str, str | int] = {"labelSelector": self.cfg.label_selector(), "watch": 1,
                                        "resourceVersion": resource_version, "allowWatchBookmarks": "true",
                                        "timeoutSeconds": self.cfg.watch_timeout_s}
        async with self._http.stream("GET", self.path, params=params, headers=self._headers()) as resp:
            if resp.status_code != 200:
                await resp.aread()
                _checked(resp, "watch")
            async for line in resp.aiter_lines():
                if line.strip():
                    yield _event(line)


def _event(line: str) -> WatchEvent:
    try:
        data = json.loads(line)
    except ValueError as exc:
        raise KubeApiError(f"watch stream: not a JSON line: {line[:MAX_ERROR_TEXT]!r}") from exc
    kind, obj = (data.get("type"), data.get("object")) if isinstance(data, dict) else (None, None)
    if not isinstance(obj, dict) or kind not in ("ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR"):
        raise KubeApiError(f"watch stream: not a watch event: {line[:MAX_ERROR_TEXT]!r}")
    if kind == "ERROR":
        text = f"watch error {obj.get('code')} {obj.get('reason')}: {obj.get('message')}"
        raise Gone(text) if obj.get("code") == 410 else KubeApiError(text)
    return WatchEvent(kind, obj)


def _checked(resp: httpx.Response, what: str) -> dict[str, Any]:
    """The JSON body of a 200; ``Gone`` for a 410, ``KubeApiError`` for the rest."""
    if resp.status_code == 200:
        try:
            body = resp.json()
        except ValueError as exc:
            raise KubeApiError(f"{what}: the answer is not JSON") from exc
        if not isinstance(body, dict):
            raise KubeApiError(f"{what}: the answer is not a JSON object")
        return body
    text = f"{what}: HTTP {resp.status_code}: {resp.text[:MAX_ERROR_TEXT]}"
    if resp.status_code == 410:
        raise Gone(text)
    if resp.status_code in (401, 403):
        text += " (does the gateway's service account have get/list/watch on this resource? deploy/kubernetes/rbac.yaml)"
    raise KubeApiError(text)


def _verify(cfg: KubernetesDiscoveryConfig) -> ssl.SSLContext | bool:
    """The CA file's context when it exists (the cluster's CA), else the system's CAs."""
    if os.path.isfile(cfg.ca_file):
        return ssl.create_default_context(cafile=cfg.ca_file)
    return True
