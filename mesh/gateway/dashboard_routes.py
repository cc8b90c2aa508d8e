"""The live view: ``GET /dashboard`` (the page) and ``GET /dashboard/state`` (its data).

The page holds no data, so it is served without a key; it reads the admin key from its URL
fragment (``#key=...``: browsers never send a fragment, so it is in no request and no log) or a
form, keeps it in the tab's ``sessionStorage`` and polls the state with
``Authorization: Bearer``. The state is behind ``server.admin_key`` as the admin API is (403
while none is set; the page then says how to set one). The page loads nothing from elsewhere,
and its ``Content-Security-Policy`` lets it load nothing but its own state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI
from fastapi.responses import HTMLResponse

from mesh.gateway.dashboard_page import PAGE
from mesh.gateway.dashboard_state import snapshot
from mesh.gateway.route_auth import admin_auth

if TYPE_CHECKING:  # the type alone: mesh.gateway.app imports this module
    from mesh.gateway.app import Gateway

PAGE_HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                               "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
    "x-content-type-options": "nosniff",
}


def add_dashboard_routes(app: FastAPI, gateway: Gateway) -> None:
    @app.get("/dashboard", tags=["ops"], include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(PAGE, headers=PAGE_HEADERS)

    @app.get("/dashboard/state", tags=["admin"], dependencies=[Depends(admin_auth(gateway))])
    async def dashboard_state() -> dict[str, Any]:
        """The live view's data: workers, prefix reuse, sessions, the last routing decisions."""
        return snapshot(gateway)
