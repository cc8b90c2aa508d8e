"""``server.client_write_timeout_s``: a client that stops reading is abandoned once one write to it
has waited that long, in the ordinary and the disaggregated path, over real processes.

A hung client (socket open, never reading) does not hold its worker's slot (in-flight count,
context tokens, an admission slot) until ``request_timeout_s``, an hour by default: the write that
blocks past the timeout ends the request:
the upstream exchange is closed (the worker stops generating), the lease ends (the load returns to
zero), the client's connection is dropped, ``mesh_client_write_timeouts_total`` counts it and a
warning is logged; the worker's health is untouched (the client was slow, not the worker). A
client that reads slowly but keeps reading is served whole, however long its stream takes.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.fakes import streaming_worker
from tests.procs import PYTHON, Proc, ProcessGroup, free_port, stalled_client, wait_http, wait_until
from tests.support.pd_gateway import PD_POLICY
from tests.support.write_timeout import WORD, Gateway, dropped, write_timeout_gateway


@dataclass
class Workers:
    fake: Proc  # tests/fakes/streaming_worker.py: "flood" streams without end; /count says how many floods were closed
    echo: Proc  # echoes each word of the prompt 400 times: a 1 KiB word makes a ~0.5 MB stream
    prefill: Proc
    decode: Proc  # the same echo, as a decode worker


@pytest.fixture(scope="module")
def workers(module_procs: ProcessGroup) -> Workers:
    script = module_procs.log_dir / "fake_worker.py"
    script.write_text(streaming_worker.SCRIPT)
    port = free_port()
    fake = module_procs.start([PYTHON, str(script), str(port)], name="fake", port=port)
    echo = module_procs.echo_worker("echo", "--model", "m", "--repeat", "400")
    prefill = module_procs.echo_worker("p0", "--model", "m")
    decode = module_procs.echo_worker("d0", "--model", "m", "--repeat", "400")
    wait_http(fake.url + "/count", proc=fake)
    return Workers(fake, echo, prefill, decode)


@pytest.fixture(scope="module")
def mixed(workers: Workers, module_procs: ProcessGroup) -> Iterator[Gateway]:
    yield from write_timeout_gateway(module_procs, "gateway", [{"name": "fake", "url": workers.fake.url, "models": ["f"]},
                                                  {"name": "echo", "url": workers.echo.url, "models": ["m"]}])


@pytest.fixture(scope="module")
def disagg(workers: Workers, module_procs: ProcessGroup) -> Iterator[Gateway]:
    yield from write_timeout_gateway(module_procs, "gateway-pd", [
        {"name": "p0", "url": workers.prefill.url, "models": ["m"], "role": "prefill"},
        {"name": "d0", "url": workers.decode.url, "models": ["m"], "role": "decode"},
    ], policy=PD_POLICY)


def _flood_closed(workers: Workers) -> int:
    return int(httpx.get(workers.fake.url + "/count", timeout=10).json()["flood_closed"])


def _read_slowly(sock: socket.socket) -> bytes:
    """A client that reads 16 KiB every 50 ms until the end of a chunked response: never stalled
    for long, but the whole stream takes seconds (well past the write timeout)."""
    sock.settimeout(30)
    data = b""
    while not data.endswith(b"\r\n0\r\n\r\n"):
        more = sock.recv(16 << 10)
        assert more, f"connection closed before the end of the response: {data[-300:]!r}"
        data += more
        time.sleep(0.05)
    return data


def _events(raw: bytes) -> list[str]:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    out, rest = b"", body
    while True:  # de-chunk
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        out, rest = out + rest[:n], rest[n + 2:]
    return [e.removeprefix("data: ") for e in out.decode().split("\n\n") if e]


def test_a_stalled_client_frees_its_worker_within_the_write_timeout(mixed: Gateway, workers: Workers) -> None:
    closed, before = _flood_closed(workers), mixed.write_timeouts()
    sock = stalled_client(mixed.proc.port, {"model": "f", "prompt": "flood", "stream": True})
    with sock:
        # the stream has no end: only the write timeout can stop it (the request timeout is 60 s)
        wait_until(lambda: _flood_closed(workers) > closed, timeout_s=20, what="the worker's stream closed")
        wait_until(mixed.idle, timeout_s=10, what=f"load back to zero: {mixed.load()}")
        assert mixed.write_timeouts() == before + 1
        assert dropped(sock)
    mixed.healthy("fake")  # the client's fault: the worker's circuit stays closed
    assert mixed.http.post("/v1/completions", json={"model": "f", "prompt": "ok"}).status_code == 200
    log = mixed.proc.log_tail()
    assert "client write timeout" in log and "ASGI" not in log, log  # a warning, and no unfinished-response error


def test_a_slow_client_that_keeps_reading_is_served_whole(mixed: Gateway) -> None:
    before = mixed.write_timeouts()
    words = 2
    sock = stalled_client(mixed.proc.port, {"model": "m", "prompt": f"{WORD}a {WORD}b", "stream": True,
                                            "max_tokens": 400 * words})
    with sock:
        events = _events(_read_slowly(sock))
    assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), events[-2:]
    texts = [json.loads(e)["choices"][0]["text"] for e in events[:-1]]
    assert len(texts) == 400 * words + 1 and texts[-1] == ""  # every word, then the final (empty) chunk
    assert sum(len(t) for t in texts) > 800_000  # a stream the socket buffers could not absorb
    assert mixed.write_timeouts() == before
    assert mixed.idle()
    mixed.healthy("echo")


def test_a_stalled_client_frees_the_prefill_and_decode_workers_of_a_disaggregated_request(
        disagg: Gateway, workers: Workers) -> None:
    before = disagg.write_timeouts()
    served = int(httpx.post(workers.decode.url + "/admin/faults", json={}, timeout=10).json()["served"])
    # 20 words x 400 repeats of 1 KiB: an 8 MB stream, far past what the buffers on the way absorb
    body = {"model": "m", "prompt": " ".join(f"{WORD}{i}" for i in range(20)), "stream": True, "max_tokens": 8000}
    sock = stalled_client(disagg.proc.port, body)
    with sock:
        assert sock.recv(64).startswith(b"HTTP/1.1 200")
        after = lambda: int(httpx.post(workers.decode.url + "/admin/faults", json={}, timeout=10).json()["served"])  # noqa: E731
        wait_until(lambda: after() > served, what="the decode worker streaming")
        wait_until(lambda: disagg.write_timeouts() == before + 1, timeout_s=20, what="the write timeout")
        wait_until(disagg.idle, timeout_s=10, what=f"prefill and decode load back to zero: {disagg.load()}")
        assert dropped(sock)
    disagg.healthy("d0")
    disagg.healthy("p0")
    log = disagg.proc.log_tail()
    assert "client write timeout" in log and "ASGI" not in log, log
    with disagg.http.stream("POST", "/v1/completions", json={"model": "m", "prompt": "again", "stream": True}) as resp:
        assert resp.status_code == 200 and resp.headers["x-mesh-worker"] == "d0"
        assert resp.read().endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("value", [0, -1, float("inf"), float("nan"), "soon"])
def test_a_write_timeout_that_is_not_a_positive_finite_number_is_a_config_error(value: object) -> None:
    from mesh.config import ConfigError, parse_config

    with pytest.raises(ConfigError) as caught:
        parse_config({"server": {"client_write_timeout_s": value}})
    assert caught.value.errors[0].startswith("server.client_write_timeout_s:"), caught.value.errors
    assert parse_config({}).server.client_write_timeout_s == 30.0
