"""The pinned upstream wheels, fetched once per session (``tests.support.upstream``)."""

from __future__ import annotations

import pytest

from tests.support.upstream import Upstream, fetch


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
