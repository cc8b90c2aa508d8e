"""The pool's silence bounds (``UpstreamPool.request``'s ``first_byte_s`` / ``idle_s``) and
``abort_unanswered``, against a raw in-process server that misbehaves on cue."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest

from mesh.gateway.upstream import UpstreamAborted, UpstreamPool, UpstreamStalled

Behaviour = Callable[[asyncio.StreamWriter], Awaitable[None]]
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def serve(behaviour: Behaviour) -> tuple[asyncio.Server, str]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        try:
            await behaviour(writer)
        except ConnectionError:
            pass

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}/v1/completions"


async def silent_after_head(writer: asyncio.StreamWriter) -> None:
    writer.write(HEAD)
    await asyncio.sleep(30)


async def two_chunks_then_silent(writer: asyncio.StreamWriter) -> None:
    writer.write(HEAD + chunk(b"data: 1\n\n"))
    await asyncio.sleep(0.05)
    writer.write(chunk(b"data: 2\n\n"))
    await asyncio.sleep(30)


async def steady(writer: asyncio.StreamWriter) -> None:
    writer.write(HEAD)
    for i in range(8):
        writer.write(chunk(b"data: %d\n\n" % i))
        await writer.drain()
        await asyncio.sleep(0.05)
    writer.write(b"0\r\n\r\n")
    await writer.drain()


async def read_all(resp: object) -> bytes:
    return await resp.read()  # type: ignore[attr-defined,no-any-return]


async def test_no_first_body_byte_within_the_bound_is_a_first_byte_stall() -> None:
    server, url = await serve(silent_after_head)
    pool = UpstreamPool()
    try:
        start = time.monotonic()
        resp = await pool.request("POST", url, body=b"{}", timeout_s=30, first_byte_s=0.3, idle_s=5)
        with pytest.raises(UpstreamStalled) as err:
            await resp.read_chunk()
        resp.close()
        assert err.value.phase == "first_byte" and 0.25 < time.monotonic() - start < 3
    finally:
        await pool.close()
        server.close()


async def test_silence_after_the_first_bytes_is_an_idle_stall() -> None:
    server, url = await serve(two_chunks_then_silent)
    pool = UpstreamPool()
    try:
        start = time.monotonic()
        resp = await pool.request("POST", url, body=b"{}", timeout_s=30, first_byte_s=5, idle_s=0.3)
        got = b""
        with pytest.raises(UpstreamStalled) as err:
            while True:
                got += await resp.read_chunk()
        resp.close()
        assert err.value.phase == "idle" and b"data: 2" in got
        assert time.monotonic() - start < 3  # the idle bound, not the (longer) first-byte one
    finally:
        await pool.close()
        server.close()


async def test_a_reader_that_falls_behind_is_not_the_workers_silence() -> None:
    # The reader takes nothing for longer than idle_s while the worker keeps sending: no stall.
    server, url = await serve(steady)
    pool = UpstreamPool()
    try:
        resp = await pool.request("POST", url, body=b"{}", timeout_s=30, first_byte_s=5, idle_s=0.2)
        await asyncio.sleep(0.6)  # bytes wait unread meanwhile
        body = await read_all(resp)
        resp.close()
        assert body.count(b"data: ") == 8
    finally:
        await pool.close()
        server.close()


async def test_abort_unanswered_fails_only_unsettled_exchanges_with_that_worker() -> None:
    server, url = await serve(two_chunks_then_silent)
    pool = UpstreamPool()
    try:
        waiting = await pool.request("POST", url, body=b"{}", timeout_s=30, abortable=True)
        settled = await pool.request("POST", url, body=b"{}", timeout_s=30, abortable=True)
        settled.settle()
        assert pool.abort_unanswered(url.rsplit("/v1", 1)[0], "unhealthy") == 1
        with pytest.raises(UpstreamAborted):
            await read_all(waiting)
        assert await asyncio.wait_for(settled.read_chunk(), 5)  # untouched: still reading
        waiting.close()
        settled.close()
    finally:
        await pool.close()
        server.close()
