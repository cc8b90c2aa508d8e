"""The operations routes: ``/health``, ``/ready``, ``/metrics``, and the OpenAI model list.

``/health`` always answers 200 and says how many workers are healthy; ``/ready`` answers 503
until some worker is healthy and not draining (what a load balancer should poll); ``/metrics``
is the Prometheus text of ``Gateway.metrics``. ``/v1/models`` lists what the registry's workers
serve, behind ``server.api_keys`` as the completion routes are; so are the API's own docs,
``/openapi.json`` and ``/docs`` (the schema describes what the keys protect).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response

from mesh.errors import MeshError
from mesh.gateway.route_auth import data_auth
from mesh.metrics import CONTENT_TYPE

if TYPE_CHECKING:  # the type alone: mesh.gateway.app imports this module
    from mesh.gateway.app import Gateway


def model_card(model: str) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": 0, "owned_by": "mesh"}


def add_ops_routes(app: FastAPI, gateway: Gateway) -> None:
    auth = [Depends(data_auth(gateway))]

    @app.get("/health", tags=["ops"])
    async def health() -> dict[str, Any]:
        workers = gateway.registry.workers.values()
        healthy = sum(1 for w in workers if w.healthy)
        return {"status": "ok" if healthy else "no_healthy_workers", "workers": len(workers), "healthy_workers": healthy}

    @app.get("/ready", tags=["ops"])
    async def ready() -> Response:
        healthy = any(w.healthy and not w.draining for w in gateway.registry.workers.values())
        body: dict[str, Any] = {"ready": healthy}
        blind = {w.name: w.index_problem for w in gateway.registry.workers.values() if w.index_problem}
        if blind:  # serving, but precise routing is off for these workers
            body["index_problems"] = blind
        return JSONResponse(body, status_code=200 if healthy else 503)

    @app.get("/metrics", tags=["ops"])
    async def metrics() -> Response:
        return Response(gateway.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", tags=["openai"], dependencies=auth)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(m) for m in gateway.registry.models()]}

    @app.get("/v1/models/{model:path}", tags=["openai"], dependencies=auth)
    async def model(model: str) -> dict[str, Any]:
        """One model (the openai client's ``models.retrieve``); ids may hold slashes."""
        if model not in gateway.registry.models():
            raise MeshError(404, f"the model {model!r} does not exist", code="model_not_found", param="model")
        return model_card(model)

    @app.get("/openapi.json", include_in_schema=False, dependencies=auth)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False, dependencies=auth)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="Mesh API")
