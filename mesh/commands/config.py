"""``mesh config validate FILE`` | ``mesh config show [--config FILE]`` | ``mesh config reference``.

- ``validate``: OK (its worker count and policy) and the warnings of a config that will not do
  what it seems to (``mesh.config.checks``), or every error with its YAML path (exit 1).
- ``show``: the effective config as ``mesh serve`` would run it (the file, the ``MESH_*``
  environment variables over it, every default filled in) as YAML, secrets redacted.
- ``reference``: the config reference page (``mesh.config.reference``; docs/config.md).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

REDACTED = "***"


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("config", help="work with config files: validate, show, reference")
    sub = p.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    v = sub.add_parser("validate", help="validate a YAML config file",
                       description="Loads FILE as `mesh serve` would (workers, policy plugins, sessions, state) "
                                   "and prints OK with its worker count and policy and any warnings (an empty "
                                   "file, no workers, a policy routing to roles no worker has), or every error "
                                   "with its YAML path (exit 1). Nothing is started or contacted.")
    v.add_argument("file", metavar="FILE", help="the deployment's YAML config (e.g. mesh.yaml or examples/*.yaml)")
    v.set_defaults(func=validate)
    s = sub.add_parser("show", help="print the effective config (defaults filled in, secrets redacted)",
                       description="Prints the config `mesh serve --config FILE` would run as YAML: the file, "
                                   "the MESH_API_KEYS / MESH_ADMIN_KEY(_FILE) environment variables over it, "
                                   "every default filled in; keys and passwords shown as ***.")
    s.add_argument("--config", "-c", metavar="FILE", default=None, help="YAML config file (none: the defaults)")
    s.set_defaults(func=show)
    r = sub.add_parser("reference", help="print the config reference page (docs/config.md) as Markdown")
    r.set_defaults(func=print_reference)


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
    from mesh.config.checks import config_warnings, print_warnings

    config = load_or_report(args.file)
    if config is None:
        return 1
    print(f"OK: {args.file} ({len(config.workers)} workers, policy {policy_name(config.policy)})")
    if is_empty(args.file):
        print(f"warning: {args.file}: the file is empty: every setting is its default (no workers, no keys)",
              file=sys.stderr)
    print_warnings(config_warnings(config), sys.stderr)
    return 0


def policy_name(policy: Any) -> str:
    if isinstance(policy, str):
        return policy
    name = policy.get("name") if isinstance(policy, dict) else None  # a {name, params} spec: its name
    return name if isinstance(name, str) else "custom"


def is_empty(path: str) -> bool:
    """The file holds no YAML value (nothing, or only comments): it loaded as all defaults."""
    import yaml

    from mesh.config import MAX_FILE_BYTES
    from mesh.files import read_regular_file

    return yaml.safe_load(read_regular_file(path, MAX_FILE_BYTES).decode("utf-8")) is None


def show(args: argparse.Namespace) -> int:
    import os

    import yaml

    from mesh.commands.serve_flags import from_environment
    from mesh.config import ConfigError

    config = load_or_report(args.config)
    if config is None:
        return 1
    try:
        config = from_environment(os.environ).apply(config)
    except ConfigError as exc:
        print(f"the environment: {len(exc.errors)} error(s)", file=sys.stderr)
        for line in exc.errors:
            print(f"  {line}", file=sys.stderr)
        return 1
    sys.stdout.write(yaml.safe_dump(redacted(config.model_dump(mode="json")), sort_keys=False, width=120))
    return 0


def redacted(data: dict[str, Any]) -> dict[str, Any]:
    """A dumped config with every secret replaced: API and admin keys, worker keys, Redis passwords."""
    from mesh.config import redact_url

    server = data["server"]
    server["api_keys"] = [REDACTED for _ in server["api_keys"]]
    if server["admin_key"] is not None:
        server["admin_key"] = REDACTED
    for worker in data["workers"]:
        if worker.get("api_key") is not None:
            worker["api_key"] = REDACTED
    if data["state"].get("url"):
        data["state"]["url"] = redact_url(data["state"]["url"])
    return data


def print_reference(args: argparse.Namespace) -> int:
    from mesh.config.reference import reference

    sys.stdout.write(reference())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mesh")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["config", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
