"""mesh.gateway.app in-process: the lifespan, state on app.state, OpenAPI, the FastAPI fallback path."""

from __future__ import annotations

from typing import Any

import httpx
from fastapi import FastAPI

from mesh.config import parse_config
from mesh.core.index import PrefixIndex
from mesh.gateway.app import Gateway, create_app
from mesh.gateway.proxy import Proxy


async def test_the_lifespan_builds_the_data_plane_and_takes_it_down() -> None:
    app = create_app(parse_config({}))
    gateway: Gateway = app.state.gateway
    assert gateway.proxy is None and gateway.http is None and gateway.shared is None
    async with app.router.lifespan_context(app):
        assert type(gateway.proxy) is Proxy and gateway.proxy.pool is gateway.http
        assert gateway.ingest.subscriber is not None  # KV event ingestion runs
        assert len(gateway.tasks) == 1  # housekeeping (health checks, session expiry)
    assert gateway.http is None and gateway.proxy is None and not gateway.tasks
    assert gateway.ingest.subscriber is None


def test_router_shares_the_registry_targets_and_the_index() -> None:
    app = create_app(parse_config({"workers": [{"name": "w", "url": "http://h:1", "dp_size": 2}]}))
    gateway: Gateway = app.state.gateway
    assert gateway.router.targets is gateway.registry.targets
    assert sorted(gateway.router.targets) == ["w@0", "w@1"]
    assert isinstance(gateway.index, PrefixIndex) and gateway.router.index is gateway.index
    assert gateway.router.sessions is gateway.sessions


def test_openapi_documents_the_completion_routes() -> None:
    paths = create_app(parse_config({})).openapi()["paths"]
    body = paths["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["required"] == ["model", "messages"]
    assert "/v1/completions" in paths and "/debug/route" in paths and "/workers/{name}/drain" in paths


async def test_fastapi_fallback_reaches_the_proxy() -> None:
    app = create_app(parse_config({}))

    async def plain_fastapi(scope: Any, receive: Any, send: Any) -> None:  # skips MeshApp's fast path
        await FastAPI.__call__(app, scope, receive, send)

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=plain_fastapi), base_url="http://t") as client:
        resp = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "not_ready"  # no lifespan ran


async def test_debug_route_tells_chat_from_completion_by_the_top_level_key() -> None:
    config = {"workers": [{"name": "w", "url": "http://h:1", "models": ["m"]}], "health": {"interval_s": 3600}}
    app = create_app(parse_config(config))
    async with app.router.lifespan_context(app):
        worker = app.state.gateway.registry.workers["w"]
        worker.healthy = True  # no health check runs within the test (a one-hour interval)
        worker.sync()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            # A completion whose other fields mention "messages" is still a completion...
            body = {"model": "m", "prompt": 'say "messages"', "metadata": {"messages": [1]}}
            resp = await client.post("/debug/route", json=body)
            assert resp.status_code == 200 and resp.json()["request"]["kind"] == "completion"
            chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            resp = await client.post("/debug/route", json=chat)
            assert resp.status_code == 200 and resp.json()["request"]["kind"] == "chat"
            resp = await client.post("/debug/route", content=b"[1, 2")
            assert resp.status_code == 400 and "error" in resp.json()
