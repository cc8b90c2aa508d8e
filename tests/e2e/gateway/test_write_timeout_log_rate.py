"""Client write timeouts are logged at most once per ``LOG_EVERY_S`` (10 s).

Not one warning per timed-out client, with no limit (many hung clients would flood the gateway's
log): the first is logged in full; the ones within the next 10 s are counted, and one line says how
many once that time is up. ``mesh_client_write_timeouts_total`` still counts every one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import pytest

from mesh.log_limit import LOG_EVERY_S, RateLimitedWarning
from tests.procs import ProcessGroup, stalled_client, wait_until
from tests.support.write_timeout import WORD, Gateway, dropped, write_timeout_gateway

STALLED = 4


@pytest.fixture(scope="module")
def gateway(module_procs: ProcessGroup) -> Iterator[Gateway]:
    echo = module_procs.echo_worker("echo", "--model", "m", "--repeat", "400")
    yield from write_timeout_gateway(module_procs, "gateway", [{"name": "echo", "url": echo.url, "models": ["m"]}])


def test_many_stalled_clients_are_each_counted_and_logged_once(gateway: Gateway) -> None:
    before = gateway.write_timeouts()
    # 20 words x 400 repeats of 1 KiB: an 8 MB stream each, far past what the socket buffers absorb
    body = {"model": "m", "prompt": " ".join(f"{WORD}{i}" for i in range(20)), "stream": True, "max_tokens": 8000}
    socks = [stalled_client(gateway.proc.port, body) for _ in range(STALLED)]
    try:
        # all within ~1.25 s (write timeout 1 s), far inside one LOG_EVERY_S
        wait_until(lambda: gateway.write_timeouts() == before + STALLED, timeout_s=20, what="every write timeout")
        for sock in socks:
            assert dropped(sock)
    finally:
        for sock in socks:
            sock.close()
    log = gateway.proc.log_path.read_text(errors="replace")
    lines = [line for line in log.splitlines() if "client write timeout:" in line]  # not the summary's "timeouts:"
    assert len(lines) == 1, lines  # the rest are held for the summary line, LOG_EVERY_S later
    assert "waited" in lines[0] and "ASGI" not in log, log
    gateway.healthy("echo")


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "test.rate"]


def test_held_warnings_are_summed_up_in_one_line_per_period(caplog: pytest.LogCaptureFixture) -> None:
    assert LOG_EVERY_S == 10.0
    clock = _Clock()
    limited = RateLimitedWarning(logging.getLogger("test.rate"), "client write timeouts", every_s=10.0, clock=clock)
    caplog.set_level(logging.WARNING, logger="test.rate")
    limited.warning("client write timeout: %s", "first")
    for _ in range(5):
        clock.now += 1.0
        limited.warning("client write timeout: %s", "held")
    assert _messages(caplog) == ["client write timeout: first"]
    clock.now += 10.0  # past the period; no event loop ran the summary's timer: the next call writes it
    limited.warning("client write timeout: %s", "after")
    msgs = _messages(caplog)
    assert len(msgs) == 2 and msgs[1].startswith("client write timeouts: 5 more in the last 15 s"), msgs
    clock.now += 10.0  # that last one was held behind the summary: summed up at the period's end
    limited.flush()
    assert _messages(caplog)[2].startswith("client write timeouts: 1 more in the last 10 s"), _messages(caplog)
    clock.now += 100.0  # after a quiet period, the next one is logged in full
    limited.warning("client write timeout: %s", "quiet")
    assert _messages(caplog)[3:] == ["client write timeout: quiet"], _messages(caplog)


def test_the_summary_line_comes_without_a_further_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="test.rate")

    async def main() -> None:
        limited = RateLimitedWarning(logging.getLogger("test.rate"), "client write timeouts", every_s=0.05)
        for _ in range(3):
            limited.warning("client write timeout: one")
        for _ in range(200):  # the summary's timer, on the running loop
            if len(_messages(caplog)) == 2:
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    msgs = _messages(caplog)
    assert msgs[0] == "client write timeout: one" and msgs[1].startswith("client write timeouts: 2 more"), msgs
