"""``server.client_write_timeout_s``, over real processes.

A non-streamed answer is written to the client in one ASGI message: the write returns at once
(the transport buffers it) and the handler ends, so no write waits and a watch on writes alone
never sees the client, which could then pin the whole answer (up to 64 MB) in the gateway's
memory, and its connection, for as long as its socket stays open: uvicorn's keep-alive close
waits for the buffer to drain, forever. So a response whose bytes are still buffered when its
handler ends is watched until they drain; a connection that takes none of them for the write
timeout is dropped.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.procs import ProcessGroup, stalled_client, wait_until
from tests.support.write_timeout import WORD, Gateway, dropped, write_timeout_gateway


@pytest.fixture(scope="module")
def gateway(module_procs: ProcessGroup) -> Iterator[Gateway]:
    echo = module_procs.echo_worker("echo", "--model", "m", "--repeat", "400")
    yield from write_timeout_gateway(module_procs, "gateway", [{"name": "echo", "url": echo.url, "models": ["m"]}])


def test_a_stalled_client_of_a_large_non_streamed_answer_is_dropped(gateway: Gateway) -> None:
    before = gateway.write_timeouts()
    # 20 words x 400 repeats of 1 KiB: an 8 MB JSON answer, far past what the socket buffers absorb
    body = {"model": "m", "prompt": " ".join(f"{WORD}{i}" for i in range(20)), "max_tokens": 8000}
    sock = stalled_client(gateway.proc.port, body)
    with sock:
        assert sock.recv(64).startswith(b"HTTP/1.1 200")
        wait_until(lambda: gateway.write_timeouts() == before + 1, timeout_s=20,
                   what="the stalled connection dropped (its answer was held in the gateway)")
        assert dropped(sock)
    assert gateway.idle()
    gateway.healthy("echo")
    log = gateway.proc.log_tail()
    assert "client write timeout" in log and "ASGI" not in log, log


def test_a_client_that_reads_a_large_non_streamed_answer_gets_it_whole(gateway: Gateway) -> None:
    before = gateway.write_timeouts()
    body = {"model": "m", "prompt": " ".join(f"{WORD}{i}" for i in range(4)), "max_tokens": 1600}
    resp = gateway.http.post("/v1/completions", json=body)
    assert resp.status_code == 200
    assert len(resp.json()["choices"][0]["text"]) > 1_600_000
    assert gateway.write_timeouts() == before
