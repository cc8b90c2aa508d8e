"""Warnings about a valid config that will not do what it seems to (``mesh config validate``,
``mesh serve`` at start): a gateway that can never get a worker, a policy that routes to roles
no worker has. Each is ``(level, path, message)``; level ``warning`` or ``note``. Pure."""

from __future__ import annotations

from typing import Any

from mesh.config import MeshConfig
from policies.base import Role

NO_WORKER_FIX = ("list workers under `workers:`, or pass `mesh serve --worker-urls URL ...`, or set an admin key "
                 "(server.admin_key, --admin-key, $MESH_ADMIN_KEY) to add them with POST /workers")


def config_warnings(config: MeshConfig) -> list[tuple[str, str, str]]:
    return [*_pool_warnings(config), *_role_warnings(config), *_disagg_warnings(config),
            *_local_prefill_warnings(config)]


def _pool_warnings(config: MeshConfig) -> list[tuple[str, str, str]]:
    if config.workers:
        return []
    if config.discovery.kubernetes is not None:
        return [("note", "workers", "0 static workers: they come from Kubernetes discovery (discovery.kubernetes)")]
    if config.server.admin_key is None:
        return [("warning", "workers", "0 workers and no admin key: this gateway can never get a worker and answers "
                                       f"every request 503; {NO_WORKER_FIX}")]
    return [("note", "workers", "0 static workers: add them with POST /workers (admin key) before requests can be served")]


def _role_warnings(config: MeshConfig) -> list[tuple[str, str, str]]:
    from policies.spec_check import named_roles

    if not config.workers:  # said above; the workers added later have the roles they are given
        return []
    have = {w.role for w in config.workers}
    out = []
    for path, roles in named_roles(config.policy):
        if not roles & have:
            wanted = " or ".join(sorted(r.value for r in roles))
            out.append(("warning", path, f"no worker has role {wanted} (workers' roles: "
                                         f"{', '.join(sorted(r.value for r in have))}): {_fallback(path)}"))
    return out


def _disagg_warnings(config: MeshConfig) -> list[tuple[str, str, str]]:
    """A bootstrap port is SGLang's: under the vllm protocol (the worker's ``disagg_protocol``, else
    ``disagg.protocol``) nothing reads it; under sglang only a prefill worker's is (a decode or
    mixed worker's is never a pair's prefill side)."""
    out = []
    for i, w in enumerate(config.workers):
        if w.bootstrap_port is None:
            continue
        if (w.disagg_protocol or config.disagg.protocol) != "sglang":
            out.append(("warning", f"workers[{i}].bootstrap_port", f"{w.name}: a bootstrap port is used by "
                                   "the sglang protocol only (this worker's is vllm): it is ignored"))
        elif w.role != Role.PREFILL:
            out.append(("warning", f"workers[{i}].bootstrap_port", f"{w.name} has role {w.role.value}: only a "
                                   "prefill worker's bootstrap port is sent to a pair: it is ignored"))
    return out


def _local_prefill_warnings(config: MeshConfig) -> list[tuple[str, str, str]]:
    """An SGLang decode worker never prefills alone (it refuses a request without a bootstrap
    room), so a short prompt the policy serves on it alone fails there."""
    from policies.spec_check import local_prefills

    sglang = [w.name for w in config.workers
              if w.role == Role.DECODE and (w.disagg_protocol or config.disagg.protocol) == "sglang"]
    if not sglang:
        return []
    return [("warning", path, f"prompts of up to {tokens} uncached tokens go to the decode worker alone, but SGLang "
                              f"decode workers ({', '.join(sglang)}) refuse a request without a bootstrap room: "
                              "those requests fail there; set it to 0 for an SGLang pool")
            for path, tokens in local_prefills(config.policy)]


def _fallback(path: str) -> str:
    if ".profiles." in path and not path.endswith("]"):
        return "no prefill/decode pair can form; every request runs the prefill profile over mixed-role workers"
    return "this filter leaves no candidate and every request it sees fails"


def format_warning(item: tuple[str, str, str]) -> str:
    level, path, message = item
    return f"{level}: {path}: {message}"


def print_warnings(items: list[tuple[str, str, str]], stream: Any) -> None:
    for item in items:
        print(format_warning(item), file=stream)
