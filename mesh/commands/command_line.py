"""The command a report came from, rebuilt from its parsed arguments for the report's header.

``command_line(args)`` is ``mesh <command>``, the positional arguments, then every flag whose value
differs from its default, in the parser's order (a repeated flag once per value, a list flag
comma-joined): what to type to run it again. Flags at their defaults are left out.
"""

from __future__ import annotations

import argparse
import shlex
from typing import Any


def command_line(args: argparse.Namespace) -> str:
    from mesh.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[args.command]
    words, flags = ["mesh", args.command], []
    for action in sub._actions:
        if not hasattr(args, action.dest) or action.dest == "help":
            continue
        value = getattr(args, action.dest)
        if not action.option_strings:
            words += [str(v) for v in (value if isinstance(value, list) else [value])]
        elif value != action.default:
            flags += _flag_words(action, value)
    return shlex.join(words + flags)


def _flag_words(action: argparse.Action, value: Any) -> list[str]:
    flag = action.option_strings[-1] if action.option_strings[-1].startswith("--") else action.option_strings[0]
    if action.nargs == 0:  # store_true / store_false
        return [flag]
    if isinstance(action, argparse._AppendAction):
        return [w for v in value for w in (flag, str(v))]
    if isinstance(value, list):
        return [flag, ",".join(str(v) for v in value)]
    return [flag, f"{value:g}" if isinstance(value, float) else str(value)]
