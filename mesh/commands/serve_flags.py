"""What ``mesh serve``'s flags and environment set over the YAML config (or over the defaults).

Precedence, per setting: a flag, else its environment variable, else the YAML file, else the
default. The keys:

- API keys (data plane): ``--api-key KEY`` (repeatable) and ``--api-key-file F``; else
  ``MESH_API_KEYS`` (comma-separated) and ``MESH_API_KEYS_FILE``; else ``server.api_keys`` and
  ``server.api_keys_file``.
- The admin key: ``--admin-key KEY`` or ``--admin-key-file F``; else ``MESH_ADMIN_KEY`` or
  ``MESH_ADMIN_KEY_FILE``; else ``server.admin_key`` or ``server.admin_key_file``.

A key file holds one key a line (blank lines and ``#`` comments skipped) and is read again at
every reload. ``--worker-urls`` replaces the file's workers, ``--policy`` its policy;
``--service-discovery`` turns on ``discovery.kubernetes`` (``--selector k=v ...``,
``--service-discovery-port``, ``--service-discovery-namespace`` set its keys, as sglang-router's
flags of those names do). The result
is validated as a whole (``mesh.config.parse_config``): a bad flag is a config error with its path.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

ENV_API_KEYS = "MESH_API_KEYS"
ENV_API_KEYS_FILE = "MESH_API_KEYS_FILE"
ENV_ADMIN_KEY = "MESH_ADMIN_KEY"
ENV_ADMIN_KEY_FILE = "MESH_ADMIN_KEY_FILE"
_UNSET = object()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--worker-urls", nargs="+", metavar="URL", default=None,
                   help="workers to route to, replacing the config's (named worker-0, worker-1, ...); "
                        "e.g. --worker-urls http://10.0.0.5:8000 http://10.0.0.6:8000")
    p.add_argument("--policy", metavar="NAME_OR_YAML", default=None,
                   help="routing policy, replacing the config's: a built-in name (session_sticky, kv_aware, "
                        "cache_aware, pipeline, least_load, power_of_two, round_robin, random), module:Class, "
                        "or a YAML file with a 'policy:' key")
    p.add_argument("--api-key", action="append", metavar="KEY", default=None,
                   help=f"a data-plane API key (repeatable); replaces server.api_keys and ${ENV_API_KEYS} "
                        f"(comma-separated)")
    p.add_argument("--api-key-file", metavar="FILE", default=None,
                   help=f"a file of API keys, one a line, re-read at reload (env: ${ENV_API_KEYS_FILE})")
    p.add_argument("--admin-key", metavar="KEY", default=None,
                   help=f"the admin API key (/workers, /admin/*); env: ${ENV_ADMIN_KEY}; without one the "
                        "admin API is disabled")
    p.add_argument("--admin-key-file", metavar="FILE", default=None,
                   help=f"a file holding the admin key, re-read at reload (env: ${ENV_ADMIN_KEY_FILE})")
    p.add_argument("--service-discovery", action="store_true",
                   help="discover workers from the Kubernetes API (discovery.kubernetes): the ready endpoints of "
                        "the EndpointSlices matching --selector")
    p.add_argument("--selector", nargs="+", metavar="KEY=VALUE", default=None,
                   help="label selector of --service-discovery, e.g. --selector app=mesh-worker "
                        "(replaces discovery.kubernetes.selector)")
    p.add_argument("--service-discovery-port", metavar="NAME_OR_NUMBER", default=None,
                   help="the workers' HTTP port of --service-discovery: a port name or number (default: http)")
    p.add_argument("--service-discovery-namespace", metavar="NS", default=None,
                   help="namespace of --service-discovery (default: the gateway pod's own)")


@dataclass(frozen=True)
class Overrides:
    """Settings the command line gives, applied over a loaded config by ``apply``."""

    server: dict[str, Any] = field(default_factory=dict)  # server fields replaced
    workers: list[dict[str, Any]] | None = None  # None: the file's workers
    policy: Any = _UNSET  # _UNSET: the file's policy
    kubernetes: dict[str, Any] | None = None  # discovery.kubernetes fields replaced (None: the file's)

    def apply(self, config: Any) -> Any:
        """``config`` with the overrides, validated again (raises ``ConfigError``)."""
        from mesh.config import parse_config

        if not self.server and self.workers is None and self.policy is _UNSET and self.kubernetes is None:
            return config
        data = config.model_dump(mode="python", exclude_defaults=True)
        data["server"] = {**data.get("server", {}), **self.server}
        if self.workers is not None:
            data["workers"] = self.workers
        if self.policy is not _UNSET:
            data["policy"] = self.policy
        if self.kubernetes is not None:
            discovery = data.get("discovery", {})
            data["discovery"] = {**discovery, "kubernetes": {**(discovery.get("kubernetes") or {}), **self.kubernetes}}
        return parse_config(data, "the command line")


def from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> Overrides:
    """The overrides of ``mesh serve``'s parsed flags and ``environ``; raises ``PluginError`` for a
    ``--policy`` file that cannot be read."""
    server: dict[str, Any] = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    server.update(_api_keys(args, environ))
    server.update(_admin_key(args, environ))
    workers = None
    if args.worker_urls:
        workers = [{"name": f"worker-{i}", "url": url} for i, url in enumerate(args.worker_urls)]
    policy: Any = _UNSET
    if args.policy:
        from mesh.commands.policy_arg import load_policy_arg

        policy = load_policy_arg(args.policy)[1]
    return Overrides(server, workers, policy, _kubernetes(args))


def from_environment(environ: Mapping[str, str]) -> Overrides:
    """The overrides ``environ`` alone gives (no flags), as ``mesh config show`` applies them."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    return from_args(parser.parse_args([], argparse.Namespace(host=None, port=None)), environ)


def _kubernetes(args: argparse.Namespace) -> dict[str, Any] | None:
    """discovery.kubernetes as --service-discovery and its flags set it (raises ``ConfigError``)."""
    from mesh.config import ConfigError

    given = {"--selector": args.selector, "--service-discovery-port": args.service_discovery_port,
             "--service-discovery-namespace": args.service_discovery_namespace}
    if not args.service_discovery:
        if any(v is not None for v in given.values()):
            flags = ", ".join(f for f, v in given.items() if v is not None)
            raise ConfigError([f"{flags}: only with --service-discovery"])
        return None
    out: dict[str, Any] = {}
    if args.selector:
        pairs = [term.partition("=") for term in args.selector]
        bad = [term for term, (k, eq, _) in zip(args.selector, pairs, strict=True) if not k or not eq]
        if bad:
            raise ConfigError([f"--selector: {bad[0]!r} is not KEY=VALUE"])
        out["selector"] = {k: v for k, _, v in pairs}
    port = args.service_discovery_port
    if port is not None:
        out["port"] = int(port) if port.isdigit() else port
    if args.service_discovery_namespace is not None:
        out["namespace"] = args.service_discovery_namespace
    return out


def _api_keys(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, Any]:
    if args.api_key or args.api_key_file:
        return {"api_keys": list(args.api_key or []), "api_keys_file": args.api_key_file}
    keys = [k.strip() for k in environ.get(ENV_API_KEYS, "").split(",") if k.strip()]
    if keys or environ.get(ENV_API_KEYS_FILE):
        return {"api_keys": keys, "api_keys_file": environ.get(ENV_API_KEYS_FILE) or None}
    return {}


def _admin_key(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, Any]:
    if args.admin_key or args.admin_key_file:
        return {"admin_key": args.admin_key, "admin_key_file": args.admin_key_file}
    if environ.get(ENV_ADMIN_KEY) or environ.get(ENV_ADMIN_KEY_FILE):
        return {"admin_key": environ.get(ENV_ADMIN_KEY) or None, "admin_key_file": environ.get(ENV_ADMIN_KEY_FILE) or None}
    return {}
