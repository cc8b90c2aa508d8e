"""Shared fixtures: free ports and real processes that are always torn down."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `tests.procs` under any runner
# Triton kernels built in this suite run under Triton's interpreter (on the CPU): the variable is
# read when a kernel is defined, so it is set before any test module imports one
os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.procs import ProcessGroup, free_port  # noqa: E402


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[ProcessGroup]:
    """Processes for one test; all stopped (process group SIGTERM, then SIGKILL) at teardown."""
    group = ProcessGroup(tmp_path)
    try:
        yield group
    finally:
        group.stop_all()


@pytest.fixture(scope="module")
def module_procs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcessGroup]:
    """Like ``procs``, shared by the tests of one module."""
    group = ProcessGroup(tmp_path_factory.mktemp("procs"))
    try:
        yield group
    finally:
        group.stop_all()


_E2E = Path(__file__).resolve().parent / "e2e"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test under ``tests/e2e/`` is marked ``e2e`` (real processes): ``-m "not e2e"`` runs
    the in-process tests alone, in about a minute."""
    for item in items:
        if _E2E in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.e2e)
