"""The skeleton of the raw-socket fake workers some tests start as scripts (a worker that must
misbehave in ways no framework lets it: hang, cut a body, answer anything).

A test's script is ``SKELETON`` followed by its own ``async def on_request(method, path, body,
reader, writer)``, which writes one answer (``answer``) and returns False to close the
connection; the script ends with ``serve(on_request)``. argv: name, mode, port.
"""

from __future__ import annotations

from tests.procs import PYTHON, Proc, ProcessGroup, free_port

SKELETON = r'''
import asyncio, json, sys

name, mode, port = sys.argv[1], sys.argv[2], int(sys.argv[3])


def answer(status, ctype, data, extra=b""):
    return b"HTTP/1.1 %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n%s\r\n%s" % (status, ctype, len(data), extra, data)


async def read_request(reader):
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    method, path = head[0].split(" ")[:2]
    size = next((int(l.split(":")[1]) for l in head if l.lower().startswith("content-length:")), 0)
    return method, path, json.loads(await reader.readexactly(size)) if size else {}


def serve(on_request):
    async def handle(reader, writer):
        try:
            while True:
                method, path, body = await read_request(reader)
                if await on_request(method, path, body, reader, writer) is False:
                    return
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


def start_fake(procs: ProcessGroup, stem: str, script: str, name: str, mode: str, ready_path: str) -> Proc:
    """Run ``SKELETON + script`` (written to ``<log dir>/<stem>.py``) as worker ``name`` in ``mode``."""
    path = procs.log_dir / f"{stem}.py"
    path.write_text(SKELETON + script)
    port = free_port()
    return procs.start_http([PYTHON, str(path), name, mode, str(port)], name=name, port=port, ready_path=ready_path)
