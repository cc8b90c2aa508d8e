"""The dependency rule of the layout (DESIGN.md, "The layout").

- ``simulator/`` and ``policies/`` import, of ``mesh``, only ``mesh.core`` and the plain
  foundations (config, file helpers, errors, metrics-free helpers listed in ``FOUNDATIONS``).
- ``mesh.core`` imports nothing of the gateway, request, cluster, events or state packages.
- The gateway, the simulator and the CLI load without torch (only ``workers/`` needs it).
- No module imports a test module (``tests/**/test_*.py``): what tests share lives in
  ``tests/fakes/`` (fake workers and publishers), ``tests/support/`` and the other support modules.

Every import statement counts, also one inside a function or under ``if TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOUNDATIONS = ("mesh.config", "mesh.files")
MESH_ONLY_CORE = ("simulator", "policies")
CORE_FORBIDDEN = ("mesh.gateway", "mesh.request", "mesh.cluster", "mesh.events", "mesh.state", "mesh.commands")


def imported_modules(root: Path, path: Path) -> Iterator[tuple[int, str]]:
    """(line, module) for every import in ``path`` (under ``root``), relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            yield node.lineno, base
            for alias in node.names:  # `from mesh import gateway` names a package too
                yield node.lineno, f"{base}.{alias.name}"


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def violations(root: Path) -> list[str]:
    """Every import in the tree at ``root`` that breaks the rule, as ``file:line: module``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        top = rel.parts[0]
        in_core = rel.parts[:2] == ("mesh", "core")
        if top not in MESH_ONLY_CORE and not in_core:
            continue
        reported: set[int] = set()
        for line, module in imported_modules(root, path):
            if in_core:
                bad = _within(module, CORE_FORBIDDEN)
            else:
                bad = _within(module, ("mesh",)) and module != "mesh" and not _within(module, ("mesh.core", *FOUNDATIONS))
            if bad and line not in reported:  # one report per import statement
                reported.add(line)
                found.append(f"{rel}:{line}: {module}")
    return found


def imports_of_test_modules(root: Path) -> list[str]:
    """Every import, by a module under ``root/tests``, of a test module there, as ``file:line: module``."""
    tests = root / "tests"
    names = {".".join(p.relative_to(root).with_suffix("").parts) for p in tests.rglob("test_*.py")}
    found = []
    for path in sorted(tests.rglob("*.py")):
        reported: set[int] = set()
        for line, module in imported_modules(root, path):
            if module in names and line not in reported:  # one report per import statement
                reported.add(line)
                found.append(f"{path.relative_to(root)}:{line}: {module}")
    return found


def _copy_tree(dest: Path) -> Path:
    for name in ("mesh", "policies", "simulator"):
        shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def test_the_tree_keeps_the_dependency_rule() -> None:
    assert violations(ROOT) == []


def test_a_planted_gateway_import_in_the_simulator_is_reported(tmp_path: Path) -> None:
    root = _copy_tree(tmp_path)
    engine = root / "simulator" / "engine.py"
    engine.write_text(engine.read_text() + "\n\ndef _planted():\n    from mesh.gateway.proxy import Proxy\n")
    assert [v for v in violations(root) if "mesh.gateway.proxy" in v] == [
        f"simulator/engine.py:{len(engine.read_text().splitlines())}: mesh.gateway.proxy"]


def test_a_planted_events_import_in_the_core_is_reported(tmp_path: Path) -> None:
    root = _copy_tree(tmp_path)
    router = root / "mesh" / "core" / "router.py"
    router.write_text("from mesh.events import wire\n" + router.read_text())
    assert "mesh/core/router.py:1: mesh.events" in violations(root)


def test_a_relative_import_of_the_request_package_in_the_core_is_reported(tmp_path: Path) -> None:
    root = _copy_tree(tmp_path)
    keys = root / "mesh" / "core" / "keys.py"
    keys.write_text("from ..request import prompt\n" + keys.read_text())
    assert "mesh/core/keys.py:1: mesh.request" in violations(root)


def test_the_gateway_the_simulator_and_the_cli_load_without_torch() -> None:
    code = ("import sys, mesh.cli, mesh.gateway.app, mesh.commands.simulate, simulator.engine; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_no_module_imports_a_test_module() -> None:
    assert imports_of_test_modules(ROOT) == []


def _copy_tests(dest: Path) -> Path:
    shutil.copytree(ROOT / "tests", dest / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def test_a_planted_import_of_one_test_module_by_another_is_reported(tmp_path: Path) -> None:
    root = _copy_tests(tmp_path)
    health = root / "tests" / "e2e" / "disagg" / "test_disagg_health.py"
    health.write_text(health.read_text() + "\n\ndef _planted():\n    from tests.e2e.disagg.test_disagg_5xx import BODY\n")
    assert imports_of_test_modules(root) == [
        f"tests/e2e/disagg/test_disagg_health.py:{len(health.read_text().splitlines())}: tests.e2e.disagg.test_disagg_5xx"]


def test_a_relative_import_of_a_test_module_by_a_support_module_is_reported(tmp_path: Path) -> None:
    root = _copy_tests(tmp_path)
    engine = root / "tests" / "unit" / "events" / "toy_engine.py"
    engine.write_text("from . import test_subscriber\n")
    assert imports_of_test_modules(root) == ["tests/unit/events/toy_engine.py:1: tests.unit.events.test_subscriber"]
