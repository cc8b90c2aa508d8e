"""The bundled worker's publisher follows vLLM's ZMQ rule (a wildcard, ipc or inproc address binds,
anything else connects) and says so loudly when it connects: a gateway that connects to the
worker then never hears it."""

from __future__ import annotations

import logging

import pytest

from workers.server.kv_events import _bind_or_connect


class Sock:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def bind(self, endpoint: str) -> None:
        self.calls.append(("bind", endpoint))

    def connect(self, endpoint: str) -> None:
        self.calls.append(("connect", endpoint))


@pytest.mark.parametrize("endpoint", ["tcp://*:5557", "ipc:///tmp/kv", "inproc://kv", "tcp://[::]:5557"])
def test_a_wildcard_address_binds_quietly(endpoint: str, caplog: pytest.LogCaptureFixture) -> None:
    sock = Sock()
    with caplog.at_level(logging.WARNING):
        _bind_or_connect(sock, endpoint)
    assert sock.calls == [("bind", endpoint)] and not caplog.records


def test_a_concrete_address_connects_with_a_warning_naming_the_fix(caplog: pytest.LogCaptureFixture) -> None:
    sock = Sock()
    with caplog.at_level(logging.WARNING):
        _bind_or_connect(sock, "tcp://127.0.0.1:5557")
    assert sock.calls == [("connect", "tcp://127.0.0.1:5557")]
    assert any("CONNECTS" in r.getMessage() and "tcp://*:5557" in r.getMessage() for r in caplog.records)
