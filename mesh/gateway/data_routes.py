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

from mesh.errors import MeshError, error_responses

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


# What a completion answers besides 200, as OpenAI errors (``mesh.errors``).
DATA_ERRORS = error_responses({
    400: "invalid request: body, parameters, a prompt no worker can hold",
    401: "missing or invalid API key",
    404: "no worker serves the model",
    408: "the request body or head stopped arriving",
    413: "request body over server.max_body_bytes",
    429: "every worker of the model is full and the admission queue too (Retry-After)",
    431: "request head over server.max_head_bytes",
    500: "internal gateway error",
    502: "the worker failed (its error is quoted)",
    503: "no healthy worker, queue timeout, body buffer full or shutting down (Retry-After where retrying helps)",
    504: "the worker did not answer in time",
})


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
            responses=DATA_ERRORS,
            openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": _BODY_SCHEMA[route[0]]}}}},
        )
