"""mesh.gateway.upstream: keep-alive reuse, stale sockets, chunked bodies, timeouts, early close, connect errors.

A scripted HTTP server on a real loopback socket plays the worker.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from mesh.gateway.upstream import ConnectError, UpstreamError, UpstreamPool, UpstreamTimeout
from tests.procs import free_port

Handler = Callable[[bytes, asyncio.StreamWriter], "asyncio.Future[None] | object"]


class Server:
    """Reads one request head (+ content-length body) at a time; ``script`` answers it."""

    def __init__(self, script: Callable[[int, bytes, asyncio.StreamWriter], object]) -> None:
        self.script = script
        self.connections = 0
        self.requests: list[bytes] = []
        self.disconnects = asyncio.Event()
        self.reader: asyncio.StreamReader | None = None

    async def until_client_leaves(self) -> None:
        """Stand still (answer nothing more) until the client closes the connection."""
        assert self.reader is not None
        await self.reader.read()
        self.disconnects.set()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.reader = reader
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                result = self.script(len(self.requests), head + body, writer)
                if asyncio.iscoroutine(result):
                    await result
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            self.disconnects.set()
        finally:
            writer.close()


@pytest.fixture
async def pool() -> AsyncIterator[UpstreamPool]:
    p = UpstreamPool(connect_timeout_s=1.0)
    yield p
    await p.close()


async def serve(script: Callable[[int, bytes, asyncio.StreamWriter], object]) -> tuple[Server, str, asyncio.Server]:
    server = Server(script)
    port = free_port()
    srv = await asyncio.start_server(server.handle, "127.0.0.1", port)
    return server, f"http://127.0.0.1:{port}", srv


def ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)


async def test_keep_alive_reuses_one_connection(pool: UpstreamPool) -> None:
    server, url, srv = await serve(lambda n, req, w: w.write(ok(b'{"n":%d}' % n)))
    async with srv:
        for i in range(1, 6):
            resp = await pool.request("POST", url + "/v1/x", [b"x-a: 1\r\n"], b'{"q":1}', timeout_s=5)
            assert resp.status == 200 and await resp.read() == b'{"n":%d}' % i
            assert (b"content-type", b"application/json") in resp.headers
            resp.close()
        assert server.connections == 1
        first = server.requests[0]
        assert first.startswith(b"POST /v1/x HTTP/1.1\r\nhost: 127.0.0.1:") and b"x-a: 1\r\n" in first
        assert first.endswith(b'content-length: 7\r\n\r\n{"q":1}')


async def test_prune_closes_expired_idle_connections(pool: UpstreamPool, monkeypatch: pytest.MonkeyPatch) -> None:
    import mesh.gateway.upstream

    server, url, srv = await serve(lambda n, req, w: w.write(ok(b"{}")))
    async with srv:
        await pool.get(url + "/a")
        assert pool.idle_connections == 1 and pool.prune() == 0
        monkeypatch.setattr(mesh.gateway.upstream, "IDLE_TIMEOUT_S", 0.0)
        assert pool.prune() == 1 and pool.idle_connections == 0
        await asyncio.wait_for(server.disconnects.wait(), 2)


async def test_chunked_body_is_read_in_pieces(pool: UpstreamPool) -> None:
    async def script(n: int, req: bytes, w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for part in (b"data: 1\n\n", b"data: 2\n\n"):
            w.write(b"%x\r\n%s\r\n" % (len(part), part))
            await w.drain()
            await asyncio.sleep(0.05)
        w.write(b"0\r\n\r\n")

    server, url, srv = await serve(script)
    async with srv:
        resp = await pool.request("POST", url + "/s", body=b"{}", timeout_s=5)
        first = await resp.read_chunk()
        assert first == b"data: 1\n\n"  # arrives before the rest of the stream exists
        rest = await resp.read()
        assert rest == b"data: 2\n\n" and await resp.read_chunk() == b""
        resp.close()
        resp2 = await pool.request("GET", url + "/again", timeout_s=5)
        await resp2.read()
        resp2.close()
        assert server.connections == 1


async def test_stale_keep_alive_socket_is_retried_once(pool: UpstreamPool) -> None:
    async def script(n: int, req: bytes, w: asyncio.StreamWriter) -> None:
        w.write(ok(b"fine"))
        await w.drain()
        w.close()  # the server drops the idle connection right after answering

    server, url, srv = await serve(script)
    async with srv:
        for _ in range(3):
            status, body = await pool.get(url + "/h")
            assert (status, body) == (200, b"fine")
        assert server.connections == 3


async def test_timeout_bounds_the_whole_exchange(pool: UpstreamPool) -> None:
    async def script(n: int, req: bytes, w: asyncio.StreamWriter) -> None:
        await server.until_client_leaves()

    server, url, srv = await serve(script)
    async with srv:
        with pytest.raises(UpstreamTimeout):
            await pool.request("POST", url + "/slow", body=b"{}", timeout_s=0.2)
        await asyncio.wait_for(server.disconnects.wait(), 2)  # the socket was closed


async def test_early_close_aborts_the_upstream(pool: UpstreamPool) -> None:
    async def script(n: int, req: bytes, w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await w.drain()
        await server.until_client_leaves()

    server, url, srv = await serve(script)
    async with srv:
        resp = await pool.request("POST", url + "/s", body=b"{}", timeout_s=10)
        assert await resp.read_chunk() == b"hello"
        resp.close()  # before the end: the connection must not go back to the pool
        await asyncio.wait_for(server.disconnects.wait(), 2)


async def test_worker_dying_mid_body_is_an_error(pool: UpstreamPool) -> None:
    def script(n: int, req: bytes, w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
        w.transport.abort()

    server, url, srv = await serve(script)
    async with srv:
        resp = await pool.request("POST", url + "/s", body=b"{}", timeout_s=5)
        with pytest.raises(UpstreamError) as info:
            await resp.read()
        assert info.value.got_response
        resp.close()


async def test_connect_error_when_nobody_listens(pool: UpstreamPool) -> None:
    with pytest.raises(ConnectError):
        await pool.request("POST", f"http://127.0.0.1:{free_port()}/x", body=b"{}")


async def test_body_until_close_without_length(pool: UpstreamPool) -> None:
    def script(n: int, req: bytes, w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it")
        w.close()

    server, url, srv = await serve(script)
    async with srv:
        status, body = await pool.get(url + "/x")
        assert (status, body) == (200, b"all of it")
