"""The CLI's self-description: ``mesh --version``, and help text with defaults on every flag of
every subcommand (the parser walked, so a flag added without help fails here)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tomllib

import pytest

from mesh.cli import build_parser
from tests.procs import REPO

SKIP = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)


def parsers(parser: argparse.ArgumentParser, name: str = "mesh") -> list[tuple[str, argparse.ArgumentParser]]:
    out = [(name, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                out += parsers(sub, f"{name} {sub_name}")
    return out


ALL = parsers(build_parser())


def test_version_is_the_package_version() -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    proc = subprocess.run([sys.executable, "-m", "mesh", "--version"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0 and proc.stdout.strip() == f"mesh {version}", proc.stdout + proc.stderr


@pytest.mark.parametrize(("name", "parser"), ALL, ids=[name for name, _ in ALL])
def test_every_flag_has_help_and_shows_its_default(name: str, parser: argparse.ArgumentParser) -> None:
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, SKIP):
            continue
        flag = "/".join(action.option_strings) or action.dest
        assert action.help and action.help != argparse.SUPPRESS, f"{name} {flag}: no help text"
        shown = formatter._get_help_string(action) or ""  # what --help prints, before %-formatting
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
            assert "default" in shown, f"{name} {flag}: its default {action.default!r} is not shown"


def test_the_subcommands_are_all_there() -> None:
    names = {name for name, _ in ALL}
    assert {"mesh serve", "mesh up", "mesh worker", "mesh config validate", "mesh config show",
            "mesh config reference", "mesh simulate"} <= names
    up_help = " ".join(dict(ALL)["mesh up"].format_help().split())  # unwrapped
    assert "--base-port N" in up_help and "(default: 127.0.0.1)" in up_help, up_help


def test_serve_policy_help_names_every_built_in_policy() -> None:
    from policies.registry import names

    policy = next(a for a in dict(ALL)["mesh serve"]._actions if "--policy" in a.option_strings)
    assert all(name in (policy.help or "") for name in names("policy")), policy.help
