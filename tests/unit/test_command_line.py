"""``mesh.commands.command_line``: the command a report came from, for its header."""

from __future__ import annotations

import shlex

from mesh.cli import build_parser
from mesh.commands.command_line import command_line


def test_the_command_line_holds_the_positionals_and_the_flags_off_their_defaults() -> None:
    argv = ["simulate", "traces/weka", "traces/more dir", "--workers", "2,4", "--policy", "kv_aware", "--policy",
            "round_robin", "--prompt-scale", "16", "--no-spill-hint", "--seed", "0"]
    line = command_line(build_parser().parse_args(argv))
    assert line == ("mesh simulate traces/weka 'traces/more dir' --workers 2,4 --policy kv_aware --policy round_robin "
                    "--prompt-scale 16 --no-spill-hint")  # in the parser's order; --seed 0 is the default: left out
    again = build_parser().parse_args(shlex.split(line)[1:])
    assert vars(again) == vars(build_parser().parse_args(argv))  # what to type to run it again
