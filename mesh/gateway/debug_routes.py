"""``POST /debug/route``: the decision the router would make for a completion body, explained.

It parses the body as the proxy does, mirrors the session's shared binding in, and asks the
router under the proxy's admission rule (targets at their limit skipped), but forwards and
commits nothing, and draws from a copy of the router's RNG (``Router.preview``), so the next live
request decides as shown. Workers whose index is blind (``mesh.events.blindness``) are
named under ``index_problems``: their overlaps read 0 for want of events. Behind ``server.api_keys``,
as the completion routes.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi import Depends, FastAPI, Request

from mesh.errors import MeshError
from mesh.gateway.client_io import read_body
from mesh.gateway.route_auth import data_auth
from mesh.request.prompt import ParsedRequest
from policies.base import Decision, NoCandidate, RequestInfo

if TYPE_CHECKING:  # the type alone: mesh.gateway.app imports this module
    from mesh.gateway.app import Gateway


def add_debug_routes(app: FastAPI, gateway: Gateway) -> None:
    @app.post("/debug/route", tags=["debug"], dependencies=[Depends(data_auth(gateway))])
    async def debug_route(request: Request) -> dict[str, Any]:
        """The decision the router would make for this completion body; forwards and commits nothing."""
        server = gateway.config.server
        raw = await read_body(request.receive, request.scope["headers"], server.max_body_bytes, server.body_idle_timeout_s,
                              gateway.bodies)
        try:
            return await _explain(gateway, request, raw)
        finally:
            gateway.bodies.give(len(raw))


async def _explain(gateway: Gateway, request: Request, raw: bytes) -> dict[str, Any]:
    """The decision for the completion body ``raw``, with what went into it."""
    kind = request.query_params.get("kind") or _body_kind(raw)
    if kind not in ("chat", "completion"):
        raise MeshError(400, "kind must be 'chat' or 'completion'", param="kind")
    header = request.headers.get(gateway.config.sessions.header)
    parsed = await gateway.prompts.process(raw, kind, header.encode("latin-1") if header is not None else None)
    await gateway.mirror_session(parsed.info.session_id)
    now = time.monotonic()
    gateway.registry.tick(now)
    try:  # as the proxy routes: targets at their admission limit are skipped
        decision = gateway.router.preview(parsed.info, now, exclude=gateway.registry.full_targets())
    except NoCandidate as exc:
        raise MeshError(503, f"no healthy worker: {exc}", code="no_healthy_worker") from exc
    out = {
        "decision": decision.explain(),
        "policy": gateway.router.policy.describe(),
        "request": _request_summary(kind, parsed),
        "session": _session_state(gateway, parsed.info.session_id, now),
    }
    inner = _inner_decision(gateway, parsed.info, decision, now)
    if inner is not None:
        out["inner_decision"] = inner
    blind = {w.name: w.index_problem for w in gateway.registry.workers.values() if w.index_problem}
    if blind:  # their overlaps above read 0 because the index cannot see them, not because they hold nothing
        out["index_problems"] = blind
    return out


def _request_summary(kind: str, parsed: ParsedRequest) -> dict[str, Any]:
    info = parsed.info
    return {
        "kind": kind,
        "model": info.model,
        "lora": info.lora,  # the adapter whose key namespace the prompt is hashed in, if any
        "stream": parsed.stream,
        "prompt_tokens": info.prompt_tokens,
        "block_size": info.block_size,
        "blocks": len(info.block_keys),
        "max_tokens": info.max_tokens,
        "session_id": info.session_id,
    }


def _session_state(gateway: Gateway, session_id: str | None, now: float) -> dict[str, Any]:
    """The request's binding as the router sees it now (an idle-expired one is ``None``)."""
    sessions = gateway.sessions
    bound = sessions.bound_target(session_id, now) if session_id else None
    return {
        "enabled": True,
        "bound_target": bound,
        "idle_ttl_s": sessions.idle_ttl_s,
        "max_sessions": sessions.max_sessions,
        "live_sessions": len(sessions),
    }


def _inner_decision(gateway: Gateway, info: RequestInfo, decision: Decision, now: float) -> dict[str, Any] | None:
    """For a wrapper policy whose decision skipped its inner policy (a session kept on its bound
    target), the inner policy's dry run: every candidate's overlap and cost, for debugging only."""
    # Probes, not typed fields: ``Policy`` declares no ``inner``; a wrapper policy has one
    # (``session_sticky``; ``GuardedPolicy`` forwards a plugin's), and ``policies/`` owns that interface.
    inner = getattr(gateway.router.policy, "inner", None)
    if inner is None or not hasattr(inner, "decide") or not decision.scores or any(len(s) > 1 for s in decision.scores.values()):
        return None
    try:
        return inner.decide(info, gateway.router.view(now, rng=gateway.router.preview_rng())).explain()  # type: ignore[no-any-return]
    except NoCandidate:
        return None


class _TopLevelKeys(msgspec.Struct):
    messages: msgspec.Raw = msgspec.Raw(b"")  # not decoded: only its presence matters


def _body_kind(raw: bytes) -> str:
    """``chat`` when the body's top-level object has ``messages`` (what ``/v1/chat/completions``
    takes), else ``completion``; a body that is not an object is left to the prompt parser."""
    try:
        return "chat" if len(msgspec.json.decode(raw, type=_TopLevelKeys).messages) else "completion"
    except msgspec.MsgspecError:
        return "completion"
