"""Signed ``kv_transfer_params``: a decode worker trusts transfer parameters only from a prefill
worker of its own deployment.

Why: the parameters tell a decode worker where to pull KV from (host, ports, transfer id) and,
on one GPU host, which CUDA IPC allocation to map. Unsigned, any client that can reach a decode
worker could point it at its own server and plant KV of its choosing in the prefix cache under
keys of its choosing (served later to other tenants with the same prompt prefix), or make it map
another process's GPU memory.

How: every worker of a deployment shares a secret (``MESH_KV_TRANSFER_SECRET``; ``mesh up``
generates one for its cluster). A prefill worker adds ``signature`` = HMAC-SHA256 over the
canonical JSON of the parameters it issues; a decode worker with a secret refuses parameters
whose signature is missing or wrong (403). The gateway relays the parameters unchanged. Without a
secret a worker accepts unsigned parameters (a private network is then the only protection) but
never maps CUDA IPC exports from them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Any

SECRET_ENV = "MESH_KV_TRANSFER_SECRET"
SIGNATURE = "signature"


def secret_from_env() -> bytes | None:
    value = os.environ.get(SECRET_ENV, "")
    return value.encode() if value else None


def _canonical(params: dict[str, Any]) -> bytes:
    body = {k: v for k, v in params.items() if k != SIGNATURE}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sign(params: dict[str, Any], secret: bytes) -> str:
    return hmac.new(secret, _canonical(params), hashlib.sha256).hexdigest()


def verify(params: dict[str, Any], secret: bytes) -> bool:
    """Whether ``params`` carry a valid signature (constant-time comparison)."""
    given = params.get(SIGNATURE)
    if not isinstance(given, str):
        return False
    try:
        expected = sign(params, secret)
    except (TypeError, ValueError):  # not JSON-serializable: never issued by a prefill worker
        return False
    return hmac.compare_digest(given, expected)
