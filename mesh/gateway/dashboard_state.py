"""What ``GET /dashboard/state`` answers: one JSON snapshot of the gateway for the live view.

Read-only and read from the owners' objects at request time (the registry's workers and
targets, the metrics' prefix counters, the session table, the router's ring of recent
decisions, the index), never by parsing ``/metrics`` text. Times are wall-clock seconds (the
page shows ages and countdowns); the router and the session table keep monotonic times, turned
into wall time here. Session ids are the gateway's hashes (``session_key``), shortened.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client.core import Metric

from mesh.cluster.worker import Worker
from policies.base import TargetState

if TYPE_CHECKING:  # the type alone: mesh.gateway.app imports this module's importer
    from mesh.gateway.app import Gateway

DECISIONS_SHOWN = 50
EXPIRIES_SHOWN = 8
SESSION_CHARS = 12  # of the 32-hex-char hashed id: enough to tell sessions apart on one screen


def snapshot(gateway: Gateway) -> dict[str, Any]:
    mono, wall = time.monotonic(), time.time()
    gateway.sessions.expire(mono)  # the counts and expiries shown are exact, not as of the last round
    return {
        "time": wall,
        "policy": gateway.router.policy.describe(),
        "workers": [_worker(w) for w in gateway.registry.workers.values()],
        "prefix": _prefix(gateway),
        "sessions": _sessions(gateway, mono, wall),
        "decisions": _decisions(gateway, mono, wall),
        "index": {"keys": len(gateway.index), "max_keys": gateway.index.max_keys, "evicted": gateway.index.evicted},
        "admission_waiting": gateway.admission.waiting,
    }


def _worker(w: Worker) -> dict[str, Any]:
    return {
        "name": w.name,
        "role": w.config.role.value,
        "healthy": w.healthy,
        "draining": w.draining,
        "circuit": w.breaker.state,
        "kv_events": w.events_state(),
        "index_problem": w.index_problem,
        "last_error": w.last_error,
        "models": sorted(w.models),
        "targets": [_target(t, w.reported[i] is not None if i < len(w.reported) else False)
                    for i, t in enumerate(w.targets)],
    }


def _target(t: TargetState, reported: bool) -> dict[str, Any]:
    return {
        "id": t.id,
        "in_flight": t.in_flight,
        "max_in_flight": t.max_in_flight,  # 0: no ceiling
        "kv_usage": t.kv_usage if reported else None,  # None: the worker's /metrics did not say
        "kv_capacity_blocks": t.kv_capacity_blocks or None,
        "live_sessions": t.live_sessions,
        "index_healthy": t.index_healthy,
        "prefill_tokens": t.prefill_tokens,
        "decode_tokens": t.decode_tokens,
    }


def _by_target(families: Iterable[Metric], name: str) -> dict[str, float]:
    """A counter family labelled by ``target``, summed per target (over models, where labelled)."""
    out: dict[str, float] = {}
    for family in families:
        if family.name != name:
            continue
        for sample in family.samples:
            if sample.name == name + "_total":
                target = sample.labels["target"]
                out[target] = out.get(target, 0.0) + sample.value
    return out


def _prefix(gateway: Gateway) -> dict[str, Any]:
    """Cached prompt tokens, predicted by the router vs reported by the workers, per target and
    overall (both counted for the answers that report ``cached_tokens``), over the prompt tokens
    the workers reported: the hit rates, predicted and reported."""
    m = gateway.metrics
    predicted = _by_target(m.prefix_predicted_tokens_total.collect(), "mesh_prefix_predicted_tokens")
    reported = _by_target(m.prefix_reported_tokens_total.collect(), "mesh_prefix_reported_tokens")
    # the proxy's serving series (built in the lifespan): the prompt tokens of every answer with a usage
    prompt = _by_target(gateway.proxy.series.families(), "mesh_prompt_tokens") if gateway.proxy is not None else {}
    targets = {tid: {"predicted": predicted.get(tid, 0.0), "reported": reported.get(tid, 0.0),
                     "prompt": prompt.get(tid, 0.0)}
               for tid in sorted(set(predicted) | set(reported) | set(prompt))}
    return {"predicted": sum(predicted.values()), "reported": sum(reported.values()), "prompt": sum(prompt.values()),
            "targets": targets}


def _sessions(gateway: Gateway, mono: float, wall: float) -> dict[str, Any]:
    table = gateway.sessions
    return {
        "live": len(table),
        "max_sessions": table.max_sessions,
        "idle_ttl_s": table.idle_ttl_s,
        "created": table.created,
        "expired": table.expired,
        "evicted": table.evicted,
        "moves": table.moves,
        "next_expiries": [{"session": sid[:SESSION_CHARS], "target": target, "at": wall + (at - mono)}
                          for sid, target, at in table.next_expiries(EXPIRIES_SHOWN)],
    }


def _decisions(gateway: Gateway, mono: float, wall: float) -> list[dict[str, Any]]:
    """The last committed decisions, newest first."""
    recent = list(gateway.router.recent)[-DECISIONS_SHOWN:]
    return [{"at": wall + (now - mono), "model": model, "session": sid[:SESSION_CHARS] if sid else None,
             "target": target, "reason": reason, "cached_blocks": blocks, "retry": retry}
            for now, model, sid, target, reason, blocks, retry in reversed(recent)]
