"""``mesh``: one CLI, one module per subcommand.

Each subcommand module exposes ``add_parser(subparsers)``, which registers its parser and sets
``func`` (a callable taking the parsed args and returning an exit code). Modules import their
heavy dependencies (torch, uvicorn, ...) inside ``func``, so ``mesh --help`` stays instant and the
gateway never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from mesh import __version__
from mesh.commands.help_format import MeshArgumentParser

SUBCOMMAND_MODULES = (
    "mesh.commands.serve",  # mesh serve [--config mesh.yaml] [--worker-urls URL ...]
    "mesh.commands.up",  # mesh up [--workers N]
    "mesh.commands.config",  # mesh config validate FILE | show | reference
    "workers.server.cli",  # mesh worker [--preset NAME | --model DIR]
    "mesh.commands.simulate",  # mesh simulate TRACE ... / mesh calibrate
    "mesh.commands.replay",  # mesh replay URL TRACE ...
)


DESCRIPTION = (
    "Mesh: a cache-aware router for LLM serving. `mesh up` runs a gateway with bundled workers, "
    "`mesh serve` a gateway from a config, `mesh worker` one inference worker, `mesh simulate` "
    "replays agent traces against a model of a cluster, `mesh replay` against a live endpoint."
)


def build_parser() -> argparse.ArgumentParser:
    parser = MeshArgumentParser(prog="mesh", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"mesh {__version__}", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # name the subcommand's own usage, not the root's
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
