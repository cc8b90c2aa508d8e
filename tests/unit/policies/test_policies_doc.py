"""docs/policies.md names only parameters the built-in plugins really take."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from policies.registry import resolve

DOC = Path(__file__).resolve().parents[3] / "docs" / "policies.md"


def test_the_plugin_table_names_real_parameters() -> None:
    """Every parameter the plugin table names is one its plugin takes (admission_headroom, for
    one, takes no `max_in_flight`: it reads the worker's own, and a config setting it fails)."""
    rows = [line for line in DOC.read_text().splitlines() if re.match(r"\| (filter|scorer|picker) \|", line)]
    assert len(rows) == 3
    checked = 0
    for row in rows:
        kind = row.split("|")[1].strip()
        for name, inside in re.findall(r"`(\w+)` \(([^)]*)\)", row):
            params = inspect.signature(resolve(kind, name)).parameters
            for param in re.findall(r"`(\w+)(?::[^`]*)?`", inside):
                assert param in params, f"docs/policies.md: {kind} {name!r} has no parameter {param!r}"
                checked += 1
    assert checked >= 3  # role's roles, admission_headroom's, softmax's temperature
