"""The admin routes: the worker registry at runtime (list, add, remove, drain) and config reload.

All behind ``server.admin_key`` (``route_auth.admin_auth``). A worker added here or by a reload
is health-checked at once, so it takes traffic without waiting for the next health round; a
reload that fails keeps the old config and answers 400 (``Gateway.reload``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Depends, FastAPI

from mesh.cluster.registry import RegistryError
from mesh.config import WorkerConfig
from mesh.errors import MeshError
from mesh.gateway.route_auth import admin_auth

if TYPE_CHECKING:  # the type alone: mesh.gateway.app imports this module
    from mesh.gateway.app import Gateway

T = TypeVar("T")


def add_admin_routes(app: FastAPI, gateway: Gateway) -> None:
    auth = [Depends(admin_auth(gateway))]

    @app.get("/workers", tags=["admin"], dependencies=auth)
    async def list_workers() -> dict[str, Any]:
        out: dict[str, Any] = {"workers": [w.describe() for w in gateway.registry.workers.values()]}
        if gateway.discovery is not None:  # what discovery watches, its state and what it left out
            out["discovery"] = gateway.discovery.describe()
        return out

    @app.post("/workers", tags=["admin"], status_code=201, dependencies=auth)
    async def add_worker(cfg: WorkerConfig) -> dict[str, Any]:
        worker = registry_call(gateway.registry.add, cfg, "admin")
        if gateway.http is not None:
            await gateway.registry.check(worker, gateway.http)
        return worker.describe()

    @app.delete("/workers/{name}", tags=["admin"], dependencies=auth)
    async def remove_worker(name: str) -> dict[str, Any]:
        worker = registry_call(gateway.registry.remove, name)
        return {"removed": worker.name}

    @app.post("/workers/{name}/drain", tags=["admin"], dependencies=auth)
    async def drain_worker(name: str, undo: bool = False) -> dict[str, Any]:
        return registry_call(gateway.registry.drain, name, not undo).describe()

    @app.post("/admin/reload", tags=["admin"], dependencies=auth)
    async def reload() -> dict[str, Any]:
        out = gateway.reload()
        await gateway.check_new_workers()
        return out


def registry_call(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, a registry refusal answered as the client error it is."""
    try:
        return fn(*args)
    except RegistryError as exc:
        raise MeshError(exc.status, str(exc), code="worker_error") from exc
