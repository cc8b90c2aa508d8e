"""``mesh config validate FILE``: prints OK, or every error with its YAML path (exit 1)."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("config", help="work with config files")
    sub = p.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    v = sub.add_parser("validate", help="validate a YAML config file",
                       description="Loads FILE as `mesh serve` would (workers, policy plugins, sessions, state) "
                                   "and prints OK with its worker count and policy, or every error with its "
                                   "YAML path (exit 1). Nothing is started or contacted.")
    v.add_argument("file", metavar="FILE", help="the deployment's YAML config (e.g. mesh.yaml or examples/*.yaml)")
    v.set_defaults(func=validate)


def load_or_report(path: str | None) -> Any:
    """The config at ``path`` (embedded defaults for None), or None after printing every error
    with its YAML path to stderr (shared by ``mesh config validate`` and ``mesh serve``)."""
    from mesh.config import ConfigError, load_config

    try:
        return load_config(path)
    except ConfigError as exc:
        print(f"{path}: {len(exc.errors)} error(s)", file=sys.stderr)
        for line in exc.errors:
            print(f"  {line}", file=sys.stderr)
        return None


def validate(args: argparse.Namespace) -> int:
    config = load_or_report(args.file)
    if config is None:
        return 1
    policy = config.policy if isinstance(config.policy, str) else None
    if policy is None:  # a {name, params} spec: its name ("custom" said nothing)
        name = config.policy.get("name") if isinstance(config.policy, dict) else None
        policy = name if isinstance(name, str) else "custom"
    print(f"OK: {args.file} ({len(config.workers)} workers, policy {policy})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mesh")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["config", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
