"""The ``mesh`` CLI's argparse classes: every parser shows each flag's default in its help.

``MeshArgumentParser`` is the root parser's class, so every subcommand's parser is one too
(argparse builds subparsers with the parent's class) and formats with ``DefaultsHelpFormatter``:
``(default: X)`` after a flag's help unless the help already says its default, or there is none
to say (None, False, a flag that is off unless given).
"""

from __future__ import annotations

import argparse
from typing import Any


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return super()._get_help_string(action)


class MeshArgumentParser(argparse.ArgumentParser):
    def __init__(self, *args: Any, formatter_class: Any = DefaultsHelpFormatter, **kwargs: Any) -> None:
        super().__init__(*args, formatter_class=formatter_class, **kwargs)
