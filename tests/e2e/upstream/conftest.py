"""The pinned upstream wheels, fetched once per session (``tests.support.upstream``), and the
driver processes that run them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.upstream import Upstream, fetch
from tests.support.upstream_driver import Driver


def _fetched(name: str) -> Upstream:
    try:
        return fetch(name)
    except Exception as exc:  # no skip: a missing upstream is a failure of this suite
        pytest.fail(f"the upstream {name} wheel is not available: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def vllm_wheel() -> Upstream:
    return _fetched("vllm")


@pytest.fixture(scope="session")
def sglang_wheel() -> Upstream:
    return _fetched("sglang")


@pytest.fixture(scope="module")
def vllm_driver(vllm_wheel: Upstream) -> Iterator[Driver]:
    """One vLLM driver process per module (its imports take seconds); each test starts engines."""
    driver = Driver("tests.fakes.vllm_engine", vllm_wheel.root)
    yield driver
    driver.close()


@pytest.fixture(scope="module")
def sglang_driver(sglang_wheel: Upstream) -> Iterator[Driver]:
    driver = Driver("tests.fakes.sglang_engine", sglang_wheel.root)
    yield driver
    driver.close()
