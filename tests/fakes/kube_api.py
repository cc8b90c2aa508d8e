"""A fake Kubernetes API server for discovery tests: list and watch of EndpointSlices and Pods.

Run as ``python -m tests.fakes.kube_api --port N [--token T]``. It keeps objects per resource,
one resourceVersion counter and the history of events, and serves what ``mesh.cluster.kube_api``
reads: ``GET /apis/discovery.k8s.io/v1/namespaces/NS/endpointslices`` and
``GET /api/v1/namespaces/NS/pods`` (``labelSelector`` of ``k=v`` terms; ``watch=1`` with
``resourceVersion``: the history after it, then live events, as JSON lines in a chunked answer,
ended after ``timeoutSeconds``; a resourceVersion older than the compaction floor answers an
``ERROR`` event with a 410 Status, as the real one does).

The test drives it through ``/control``:
- ``POST /control/put {resource, object}``: create or replace (ADDED or MODIFIED);
- ``POST /control/delete {resource, name}``: DELETED;
- ``POST /control/drop``: break every open watch (the connection is cut mid-stream);
- ``POST /control/compact {resource, delete: [names]}``: delete those objects with no event,
  move the floor past every resourceVersion handed out and break the watches: a client can
  only catch up by listing again;
- ``POST /control/token {token}``: accept only this bearer token from now on (a rotation);
- ``GET /control/log``: every list and watch request (verb, resource, resourceVersion).

With ``--certfile``/``--keyfile`` it serves https, as an in-cluster API server does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

_DROP = object()


class Store:
    def __init__(self) -> None:
        self.rv = 1
        self.floor = 0  # a watch from below it is 410 Gone
        self.objects: dict[str, dict[str, dict[str, Any]]] = {"endpointslices": {}, "pods": {}}
        self.history: list[tuple[int, str, str, dict[str, Any]]] = []  # (rv, resource, type, object)
        self.watchers: set[tuple[str, asyncio.Queue[Any]]] = set()
        self.log: list[dict[str, Any]] = []

    def change(self, resource: str, kind: str, obj: dict[str, Any]) -> None:
        self.rv += 1
        obj = {**obj, "metadata": {**obj.get("metadata", {}), "resourceVersion": str(self.rv)}}
        name = obj["metadata"]["name"]
        if kind == "DELETED":
            self.objects[resource].pop(name, None)
        else:
            self.objects[resource][name] = obj
        self.history.append((self.rv, resource, kind, obj))
        for res, queue in self.watchers:
            if res == resource:
                queue.put_nowait((kind, obj))

    def drop(self) -> None:
        for _, queue in self.watchers:
            queue.put_nowait(_DROP)


def matches(obj: dict[str, Any], selector: str) -> bool:
    labels = obj.get("metadata", {}).get("labels") or {}
    terms = [t.split("=", 1) for t in selector.split(",") if t]
    return all(labels.get(k) == v for k, v in terms)


def build_app(token: str | None) -> FastAPI:
    app = FastAPI()
    store = Store()
    tokens = {"accepted": token}

    def authorized(request: Request) -> bool:
        return tokens["accepted"] is None or request.headers.get("authorization") == f"Bearer {tokens['accepted']}"

    async def serve(resource: str, request: Request) -> Response:
        if not authorized(request):
            return JSONResponse({"kind": "Status", "code": 401, "message": "Unauthorized"}, status_code=401)
        q = request.query_params
        selector = q.get("labelSelector", "")
        if q.get("watch") not in ("1", "true"):
            store.log.append({"verb": "list", "resource": resource})
            items = [o for o in store.objects[resource].values() if matches(o, selector)]
            return JSONResponse({"kind": "List", "metadata": {"resourceVersion": str(store.rv)}, "items": items})
        since = int(q.get("resourceVersion") or 0)
        store.log.append({"verb": "watch", "resource": resource, "resourceVersion": since})
        timeout = float(q.get("timeoutSeconds") or 300)
        if since < store.floor:
            gone = {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired",
                                                "message": f"too old resource version: {since} ({store.floor})"}}
            return Response(json.dumps(gone) + "\n", media_type="application/json")
        queue: asyncio.Queue[Any] = asyncio.Queue()
        for rv, res, kind, obj in store.history:  # registered in the same step: nothing falls between
            if rv > since and res == resource:
                queue.put_nowait((kind, obj))
        entry = (resource, queue)
        store.watchers.add(entry)
        return StreamingResponse(events(queue, entry, selector, timeout), media_type="application/json")

    async def events(queue: asyncio.Queue[Any], entry: Any, selector: str, timeout: float) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        try:
            yield b""
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), max(0.0, end - loop.time()))
                except asyncio.TimeoutError:
                    return  # timeoutSeconds: a clean end
                if item is _DROP:
                    raise ConnectionAbortedError("watch dropped by the test")  # uvicorn cuts the connection
                kind, obj = item
                if matches(obj, selector):
                    yield (json.dumps({"type": kind, "object": obj}) + "\n").encode()
        finally:
            store.watchers.discard(entry)

    @app.get("/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices")
    async def slices(ns: str, request: Request) -> Response:
        return await serve("endpointslices", request)

    @app.get("/api/v1/namespaces/{ns}/pods")
    async def pods(ns: str, request: Request) -> Response:
        return await serve("pods", request)

    @app.post("/control/put")
    async def put(body: dict[str, Any]) -> dict[str, Any]:
        name = body["object"]["metadata"]["name"]
        kind = "MODIFIED" if name in store.objects[body["resource"]] else "ADDED"
        store.change(body["resource"], kind, body["object"])
        return {"resourceVersion": store.rv}

    @app.post("/control/delete")
    async def delete(body: dict[str, Any]) -> dict[str, Any]:
        obj = store.objects[body["resource"]][body["name"]]
        store.change(body["resource"], "DELETED", obj)
        return {"resourceVersion": store.rv}

    @app.post("/control/drop")
    async def drop() -> dict[str, Any]:
        store.drop()
        return {"dropped": True}

    @app.post("/control/compact")
    async def compact(body: dict[str, Any]) -> dict[str, Any]:
        for name in body.get("delete", []):
            store.objects[body["resource"]].pop(name, None)
        store.rv += 1
        store.floor = store.rv
        store.history.clear()
        store.drop()
        return {"resourceVersion": store.rv, "floor": store.floor}

    @app.post("/control/token")
    async def rotate(body: dict[str, Any]) -> dict[str, Any]:
        tokens["accepted"] = body["token"]
        return {"rotated": True}

    @app.get("/control/log")
    async def log() -> list[dict[str, Any]]:
        return store.log

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"ok": True}

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description="fake Kubernetes API server (list/watch)")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token")
    parser.add_argument("--certfile")
    parser.add_argument("--keyfile")
    args = parser.parse_args()
    uvicorn.run(build_app(args.token), host="127.0.0.1", port=args.port, log_level="warning",
                ssl_certfile=args.certfile, ssl_keyfile=args.keyfile)


if __name__ == "__main__":
    main()
