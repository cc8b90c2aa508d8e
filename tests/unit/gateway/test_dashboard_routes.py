"""``GET /dashboard`` (the page, open: it holds no data) and ``GET /dashboard/state`` (behind
``server.admin_key``, 403 while none is set, as the admin API)."""

from __future__ import annotations

from fastapi.testclient import TestClient

from mesh.config import MeshConfig
from mesh.gateway.app import create_app


def client(**server: object) -> TestClient:
    return TestClient(create_app(MeshConfig.model_validate({"server": server})))


def test_the_page_is_open_self_contained_and_loads_nothing_from_elsewhere() -> None:
    with client(admin_key="k") as c:
        resp = c.get("/dashboard")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/html")
    csp = resp.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    page = resp.text.replace('"http://www.w3.org/2000/svg"', "")  # the SVG namespace: a name, never fetched
    assert "http://" not in page and "https://" not in page


def test_the_state_needs_the_admin_key_and_is_refused_without_one_configured() -> None:
    with client(admin_key="k") as c:
        assert c.get("/dashboard/state").status_code == 401
        assert c.get("/dashboard/state", headers={"authorization": "Bearer nope"}).status_code == 401
        ok = c.get("/dashboard/state", headers={"authorization": "Bearer k"})
    assert ok.status_code == 200
    state = ok.json()
    assert state["workers"] == [] and state["decisions"] == [] and state["sessions"]["live"] == 0
    assert state["prefix"] == {"predicted": 0, "reported": 0, "prompt": 0, "targets": {}}
    with client() as c:
        refused = c.get("/dashboard/state", headers={"authorization": "Bearer k"})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_disabled"
