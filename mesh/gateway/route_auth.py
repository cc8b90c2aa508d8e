"""The bearer-key checks of the routes FastAPI serves, as route dependencies (``Depends``).

``data_auth``: ``server.api_keys`` (none configured: open), as the proxy checks the completion
routes. ``admin_auth``: ``server.admin_key``; without one the admin API answers 403. Both read
the gateway's config at each request, so a reload applies at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from fastapi import Request

from mesh.errors import MeshError
from mesh.gateway.headers import check_bearer

if TYPE_CHECKING:  # the type alone: mesh.gateway.app imports this module
    from mesh.gateway.app import Gateway


def data_auth(gateway: Gateway) -> Callable[[Request], None]:
    def check(request: Request) -> None:
        keys = gateway.config.server.api_keys
        if keys:
            check_bearer(request.scope["headers"], keys, "API key")

    return check


def admin_auth(gateway: Gateway) -> Callable[[Request], None]:
    def check(request: Request) -> None:
        key = gateway.config.server.admin_key
        if not key:
            raise MeshError(403, "the admin API is disabled: set server.admin_key", code="admin_disabled")
        check_bearer(request.scope["headers"], [key], "admin key")

    return check
