"""A raw-socket worker that breaks an answer anywhere, for the gateway's streaming, load and
write-timeout tests: the first word of a request's prompt picks what it does.

- ``partial``: one event and the first bytes of the next, then the socket dies;
- ``flood``: an endless stream, as fast as it is read (``flood_closed`` counts the ones cut);
- ``donenofinal``: a whole stream with ``[DONE]``, then a FIN without the last chunk;
- ``double``: a second, unrequested response right behind the answer;
- ``early103``: an informational response before the answer;
- ``empty200`` / ``close200``: a 200 with an empty body / with no length, then the close;
- ``err500``: a 500 in the OpenAI shape; anything else: a completion, ``"fake"``.

``GET /v1/models`` lists models ``m`` and ``f``; any other GET answers ``{"posts": N,
"flood_closed": N}``. A test writes ``SCRIPT`` to a file and runs it with the port as argv.
"""

from __future__ import annotations

SCRIPT = r'''
import asyncio, json, sys

EV = b'data: {"id":"x","object":"text_completion","choices":[{"index":0,"text":"a","finish_reason":null}]}\n\n'
SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
posts = 0
flood_closed = 0


def chunk(data):
    return b"%x\r\n%s\r\n" % (len(data), data)


def answer(status, body, extra=b""):
    return b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (status, len(body), extra, body)


async def handle(reader, writer):
    global posts, flood_closed
    try:
        while True:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            method, path = head[0].split(" ")[:2]
            size = next((int(l.split(":")[1]) for l in head if l.lower().startswith("content-length:")), 0)
            body = await reader.readexactly(size) if size else b""
            if method == "GET":
                if path == "/v1/models":
                    out = json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}, {"id": "f", "object": "model"}]})
                else:
                    out = json.dumps({"posts": posts, "flood_closed": flood_closed})
                writer.write(answer(b"200 OK", out.encode()))
                await writer.drain()
                continue
            posts += 1
            mode = json.loads(body)["prompt"].split()[0]
            if mode == "partial":  # one event, the first bytes of the next, then the socket dies
                writer.write(SSE_HEAD + chunk(EV) + chunk(EV[:30]))
                await writer.drain()
                await asyncio.sleep(0.3)
                writer.transport.abort()
                return
            if mode == "flood":  # an endless stream, as fast as it is read
                writer.write(SSE_HEAD)
                try:
                    while True:
                        writer.write(chunk(EV * 64))
                        await writer.drain()
                except ConnectionError:
                    flood_closed += 1
                    return
            if mode == "donenofinal":  # a whole stream with [DONE], then a FIN without the last chunk
                writer.write(SSE_HEAD + chunk(EV) + chunk(b"data: [DONE]\n\n"))
                await writer.drain()
                await asyncio.sleep(0.3)
                writer.close()
                return
            if mode == "double":  # a second, unrequested response right behind the answer
                writer.write(answer(b"200 OK", b'{"id":"one","object":"text_completion","choices":[]}') +
                             answer(b"200 OK", b'{"id":"two","object":"text_completion","choices":[]}'))
            elif mode == "early103":  # an informational response before the answer
                writer.write(b"HTTP/1.1 103 Early Hints\r\nlink: </x>; rel=preload\r\n\r\n")
                await writer.drain()
                await asyncio.sleep(0.2)
                writer.write(answer(b"200 OK", b'{"id":"hinted","object":"text_completion","choices":[]}'))
            elif mode == "empty200":
                writer.write(answer(b"200 OK", b""))
            elif mode == "close200":  # a 200 head with no length, then the connection closes
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n")
                await writer.drain()
                writer.close()
                return
            elif mode == "err500":
                writer.write(answer(b"500 Internal Server Error", b'{"error":{"message":"boom","type":"server_error","param":null,"code":null}}'))
            else:
                writer.write(answer(b"200 OK", b'{"id":"x","object":"text_completion","choices":[{"index":0,"text":"fake"}]}'))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def main(port):
    server = await asyncio.start_server(handle, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


asyncio.run(main(int(sys.argv[1])))
'''
