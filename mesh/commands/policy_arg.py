"""A ``--policy`` value of ``mesh simulate`` and ``mesh up``: a policy name, ``module:Class``, or a
YAML/JSON file whose top-level ``policy:`` key holds the spec (as in ``mesh.yaml``, so every
config in ``examples/`` can be passed as it is)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_policy_arg(arg: str) -> tuple[str, Any]:
    """``(label, spec)``: a file's stem and its ``policy:`` value, or the name itself; raises
    ``policies.registry.PluginError`` for a file that is missing, unreadable or has no ``policy:``."""
    path = Path(arg)
    if path.suffix not in (".yaml", ".yml", ".json") and not path.is_file():
        return arg, arg
    import yaml

    from mesh.config import document_problem
    from policies.registry import PluginError

    if not path.is_file():
        raise PluginError(f"{arg}: no such policy file")
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError, RecursionError) as exc:
        raise PluginError(f"{arg}: not a readable YAML file: {exc}") from None
    if not isinstance(data, dict) or "policy" not in data:
        raise PluginError(f"{arg}: a policy file needs a top-level 'policy:' key with a policy spec")
    problem = document_problem(data)  # an alias bomb's error message would repr its expansion
    if problem is not None:
        raise PluginError(f"{arg}: {problem}")
    return path.stem, data["policy"]
