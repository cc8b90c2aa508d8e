"""Model discovery: a worker's base models and LoRA adapters, read from its ``/v1/models``.

Used for workers whose config names no ``models`` (``Worker.discovered_models`` and
``discovered_loras``; the registry writes them, and bumps its version when they change).
Discovery never raises but for cancellation: a worker that cannot say answers None, and its
last discovered lists stay.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from mesh.cluster.worker import Worker
    from mesh.gateway.upstream import UpstreamPool

log = logging.getLogger("mesh.cluster.registry")  # the registry's log channel


async def discover_models(
    pool: UpstreamPool, worker: Worker, timeout_s: float
) -> tuple[frozenset[str], dict[str, str]] | None:
    """(base models, LoRA adapter -> base) from the worker's ``/v1/models``; None when it cannot say."""
    try:
        status, body = await pool.get(worker.url + "/v1/models", worker.headers, timeout_s)
        if status != 200:
            return None
        data = msgspec.json.decode(body)
        found = split_models(data.get("data", []) if isinstance(data, dict) else [])
        return found if found[0] or found[1] else None
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.warning("model discovery failed for worker %s: %s", worker.name, exc)
        return None


def split_models(entries: Any) -> tuple[frozenset[str], dict[str, str]]:
    """/v1/models entries -> (base models, LoRA adapter -> base).

    vLLM lists an adapter under its own id with ``parent`` = the base model's id (and ``root`` =
    the adapter path); a base model has ``parent`` null. An entry whose parent is not another
    listed id (or is itself) is taken as a base model: nothing serves the base it names here.
    """
    rows = [m for m in entries if isinstance(m, dict) and isinstance(m.get("id"), str) and m["id"]] \
        if isinstance(entries, list) else []
    ids = {m["id"] for m in rows}
    loras = {m["id"]: m["parent"] for m in rows
             if isinstance(m.get("parent"), str) and m["parent"] in ids and m["parent"] != m["id"]}
    loras = {a: b for a, b in loras.items() if b not in loras}  # an adapter's parent is a base model
    return frozenset(ids - loras.keys()), loras
