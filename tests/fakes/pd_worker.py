"""A raw-socket worker in a prefill/decode role, for tests of the disaggregated path's load
accounting. argv: name, role, port. Roles:

- ``prefill``: a completion with ``kv_transfer_params``, held until ``GET /release``;
- ``prefill-now``: the same, answered at once;
- ``decode``: a completion whose text is ``"from NAME"``;
- ``full``: a decode worker refusing admission (a 429, code ``kv_admission_full``).

``GET /v1/models`` lists model ``m``; any other GET answers ``{"posts": N}``. A test writes
``SCRIPT`` to a file and runs it.
"""

from __future__ import annotations

SCRIPT = r'''
import asyncio, json, sys

name, role, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
release = asyncio.Event()
posts = 0


def answer(body):
    data = json.dumps(body).encode()
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(data), data)


async def handle(reader, writer):
    global posts
    try:
        while True:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            method, path = head[0].split(" ")[:2]
            size = next((int(l.split(":")[1]) for l in head if l.lower().startswith("content-length:")), 0)
            if size:
                await reader.readexactly(size)
            if method == "GET":
                if path == "/v1/models":
                    out = {"object": "list", "data": [{"id": "m", "object": "model"}]}
                elif path == "/release":
                    release.set()
                    out = {}
                else:
                    out = {"posts": posts}
            else:
                posts += 1
                out = {"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": "from " + name}]}
                if role == "prefill":  # held until the test says so
                    await release.wait()
                if role in ("prefill", "prefill-now"):
                    out["kv_transfer_params"] = {"remote_block_ids": []}
                if role == "full":  # a decode worker refusing admission
                    data = json.dumps({"error": {"message": "full", "type": "x", "param": None, "code": "kv_admission_full"}}).encode()
                    writer.write(b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n"
                                 b"retry-after: 0\r\ncontent-length: %d\r\n\r\n%s" % (len(data), data))
                    await writer.drain()
                    continue
            writer.write(answer(out))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


asyncio.run(main())
'''
