"""``mesh serve [--config mesh.yaml] [--worker-urls URL ...] [--policy P] [--admin-key K]``: run the
gateway (uvicorn). Flags and environment variables override the file (``mesh.commands.serve_flags``).

Uses uvloop and httptools when installed; access log off by default (``--access-log json``: one
JSON line per request, written by a background thread, ``mesh.gateway.access_log``). SIGHUP re-reads the config file (a broken file keeps the old one).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
from typing import Any

from mesh.commands.graceful import add_argument as add_shutdown_argument
from mesh.commands.serve_flags import add_arguments as add_flag_arguments


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="run the gateway (from a YAML config file, flags, or both)",
                              description="Runs the gateway. Without --config: the defaults (docs/config.md) "
                                          "with what the flags give, e.g. `mesh serve --worker-urls "
                                          "http://127.0.0.1:8001 http://127.0.0.1:8002 --policy kv_aware`.")
    p.add_argument("--config", "-c", help="YAML config file (none: the defaults, no workers)")
    p.add_argument("--host", help="listen address, overrides server.host (127.0.0.1 when unset)")
    p.add_argument("--port", type=int, help="listen port, overrides server.port (8000 when unset)")
    add_flag_arguments(p)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log level")
    add_access_log_argument(p)
    add_shutdown_argument(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import dataclasses
    import os

    from mesh.commands.config import load_or_report
    from mesh.commands.serve_flags import from_args
    from mesh.config import ConfigError
    from mesh.config.checks import config_warnings, print_warnings
    from mesh.gateway.app import create_app
    from policies.registry import PluginError

    config = load_or_report(args.config)
    if config is None:
        return 2
    try:
        overrides = from_args(args, os.environ)
        if args.access_log == "json":  # kept across reloads, as every flag
            overrides = dataclasses.replace(overrides, server={**overrides.server, "access_log": "json"})
        config = overrides.apply(config)
        check_discovery(config)
    except (ConfigError, PluginError) as exc:  # --port 99999, a bad --worker-urls URL, an unreadable key file
        lines = exc.errors if isinstance(exc, ConfigError) else [f"--policy: {exc}"]
        print(f"mesh serve: error: {'; '.join(lines)}", file=sys.stderr)
        return 2
    if args.shutdown_timeout < 0:
        print(f"mesh serve: error: --shutdown-timeout must be >= 0, not {args.shutdown_timeout:g}", file=sys.stderr)
        return 2
    warnings = config_warnings(config)
    if any(level == "warning" for level, _, _ in warnings):
        print("mesh serve: WARNING " + "=" * 60, file=sys.stderr)
    print_warnings(warnings, sys.stderr)
    app = create_app(config, config_path=args.config, handle_sighup=True, overrides=overrides.apply)
    return serve_app(app, config.server.host, config.server.port, log_level=args.log_level,
                     access_log=args.access_log == "text", shutdown_timeout_s=args.shutdown_timeout)


def check_discovery(config: Any) -> None:
    """Raise ``ConfigError`` for a ``discovery.kubernetes`` that names no API server outside a pod
    (else the gateway would fail in its startup, with a traceback instead of this line)."""
    import os

    from mesh.cluster.kube_api import api_server_url

    if config.discovery.kubernetes is not None:
        api_server_url(config.discovery.kubernetes, os.environ)


def add_access_log_argument(p: argparse.ArgumentParser) -> None:
    """``--access-log [text|json]`` (``mesh serve``, ``mesh up``)."""
    p.add_argument("--access-log", nargs="?", const="text", choices=["text", "json"], default=None,
                   help="log every request: json = one JSON line per request on stdout (request id, status, "
                        "model, worker, tokens, TTFT, duration; server.access_log), written off the request "
                        "path; text (the flag alone) = uvicorn's access log")


def uvicorn_config(app: Any, host: str, port: int, *, log_level: str = "info", access_log: bool = False,
                   server: Any = None) -> Any:
    """uvicorn's config for the gateway; ``server``: the ``ServerConfig`` whose head bounds apply
    (``mesh.gateway.http_protocol``), else the defaults."""
    import uvicorn

    from mesh.config import ServerConfig
    from mesh.gateway.http_protocol import protocol_class

    server = server or ServerConfig()
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    raise_open_files_limit()
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
        http=protocol_class(server.max_head_bytes, server.head_timeout_s),
        ws="none",  # no WebSocket route: an Upgrade is a 400 (the protocol class)
        lifespan="on",
        access_log=access_log,
        log_level=log_level,
        server_header=False,
        proxy_headers=False,  # per-request cost; the gateway does not trust X-Forwarded-* anyway
        timeout_keep_alive=75,  # clients and load balancers reuse connections; do not race them
        backlog=4096,
    )


def raise_open_files_limit() -> None:
    """Lift the soft limit on open descriptors to the hard one: each client and upstream
    connection is one, and a soft limit of 1,024 let a burst of slow clients refuse everyone."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    if soft != resource.RLIM_INFINITY and soft < 4096:
        logging.getLogger("mesh.serve").warning(
            "open files limit is %d (hard limit): the gateway can hold fewer than %d connections; raise it "
            "(ulimit -Hn, LimitNOFILE= in systemd)", soft, soft)


def gateway_server(app: Any, config: Any, shutdown_timeout_s: float, name: str = "mesh serve") -> Any:
    """The gateway's uvicorn server, with a bounded drain (mesh.commands.graceful): at the
    timeout, the gateway's upstream connections close, so each request still in flight ends with
    a clean error (an error event ending its stream)."""
    from mesh.commands.graceful import GracefulServer
    from mesh.gateway.app import end_in_flight

    return GracefulServer(config, name=name, shutdown_timeout_s=shutdown_timeout_s,
                          on_timeout=lambda: end_in_flight(app.state.gateway))


def serve_app(app: Any, host: str, port: int, *, log_level: str = "info", access_log: bool = False,
              shutdown_timeout_s: float | None = None) -> int:
    """Serve until stopped; the exit status: 0 after a drain, 1 after a forced stop, 3 when it
    could not start (uvicorn's: the address in use, say)."""
    from mesh.commands.graceful import DEFAULT_SHUTDOWN_TIMEOUT_S

    config = uvicorn_config(app, host, port, log_level=log_level, access_log=access_log,
                            server=app.state.gateway.config.server)
    server = gateway_server(app, config, DEFAULT_SHUTDOWN_TIMEOUT_S if shutdown_timeout_s is None else shutdown_timeout_s)
    server.run()
    return server.exit_code if server.started else 3


def main(argv: list[str] | None = None) -> int:
    """Run without the full ``mesh`` CLI (``python -m mesh.commands.serve``)."""
    parser = argparse.ArgumentParser(prog="mesh")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
