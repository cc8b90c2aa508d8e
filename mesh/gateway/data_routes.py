"""The two completion routes, served by the proxy at raw ASGI level.

``MeshApp.__call__`` sends ``DATA_ROUTES`` straight to ``serve_data``, before FastAPI's routing
(measured: that layer alone cost ~40% of the rate); ``add_data_routes`` also registers them with
FastAPI, for the OpenAPI schema and for a caller that routes through FastAPI anyway. Either way
the proxy gets the untouched ASGI exchange, its body still unread. Before the lifespan built the
proxy (and after it closed it) they answer 503 ``not_ready``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.responses import Response

from mesh.errors import MeshError

if TYPE_CHECKING:  # the type alone: mesh.gateway.app imports this module
    from mesh.gateway.app import Gateway

# path -> (request kind, metrics route label)
DATA_ROUTES = {"/v1/chat/completions": ("chat", "chat"), "/v1/completions": ("completion", "completions")}


async def serve_data(gateway: Gateway, scope: Any, receive: Any, send: Any, route: tuple[str, str]) -> None:
    proxy = gateway.proxy
    if proxy is None:
        response = MeshError(503, "gateway is starting or stopping", code="not_ready").response()
        await response(scope, receive, send)
        return
    await proxy.handle(scope, receive, send, route[0], route[1])


class _ProxyResponse(Response):
    """Hands the untouched ASGI exchange to the proxy (the request body is still unread)."""

    def __init__(self, gateway: Gateway, route: tuple[str, str]) -> None:
        super().__init__()
        self.gateway = gateway
        self.route = route

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await serve_data(self.gateway, scope, receive, send, self.route)


_BODY_SCHEMA = {
    "chat": {
        "type": "object",
        "required": ["model", "messages"],
        "properties": {
            "model": {"type": "string"},
            "messages": {"type": "array", "items": {"type": "object"}},
            "stream": {"type": "boolean"},
            "max_tokens": {"type": "integer"},
            "user": {"type": "string"},
        },
    },
    "completion": {
        "type": "object",
        "required": ["model", "prompt"],
        "properties": {
            "model": {"type": "string"},
            "prompt": {"oneOf": [{"type": "string"}, {"type": "array"}]},
            "stream": {"type": "boolean"},
            "max_tokens": {"type": "integer"},
            "user": {"type": "string"},
        },
    },
}


def add_data_routes(app: FastAPI, gateway: Gateway) -> None:
    """Documented in the OpenAPI schema; ``MeshApp.__call__`` serves them before FastAPI routing."""
    def endpoint_for(route: tuple[str, str]) -> Any:
        async def endpoint() -> Response:
            return _ProxyResponse(gateway, route)

        return endpoint

    for path, route in DATA_ROUTES.items():
        app.add_api_route(
            path,
            endpoint_for(route),
            methods=["POST"],
            tags=["openai"],
            summary=f"OpenAI {route[0]} completion, proxied to the chosen worker (streaming or not)",
            openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": _BODY_SCHEMA[route[0]]}}}},
        )
