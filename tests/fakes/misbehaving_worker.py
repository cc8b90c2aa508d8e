"""A raw-socket worker that answers ``/health`` and ``/v1/models`` like a good one but
misbehaves on completions, by mode (argv):

- ``good``: a JSON answer, or an event stream of three events and ``[DONE]``;
- ``mute``: a ``200`` head (chunked), then nothing: the connection stays open, silent;
- ``stall``: a stream's head and two events, then nothing (a non-stream request: a good answer);
- ``garbage``: ``200 text/html`` with an HTML page, fast;
- ``html_as_json``: ``200 application/json`` whose body is an HTML page.

``GET /count`` says how many completions it was asked for (``{"posts": N}``).
"""

from __future__ import annotations

from tests.fakes.http_worker import start_fake
from tests.procs import Proc, ProcessGroup

SCRIPT = r'''
posts = {"posts": 0}
HTML = b"<html><body>502 Bad Gateway</body></html>"


def event(text):
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
    return b"data: %s\n\n" % json.dumps({"id": "x", "object": "text_completion", "created": 0, "model": "m",
                                         "choices": [choice]}).encode()


def chunk(data):
    return b"%x\r\n%s\r\n" % (len(data), data)


async def on_request(method, path, body, reader, writer):
    if method == "GET":
        out = posts if path == "/count" else {"object": "list", "data": [{"id": "m", "object": "model"}]}
        writer.write(answer(b"200 OK", b"application/json", json.dumps(out).encode()))
        return True
    posts["posts"] += 1
    stream = bool(body.get("stream"))
    if mode == "garbage":
        writer.write(answer(b"200 OK", b"text/html", HTML))
        return True
    if mode == "html_as_json":
        writer.write(answer(b"200 OK", b"application/json", HTML))
        return True
    if mode == "mute" or (mode == "stall" and stream):
        ctype = b"text/event-stream" if stream else b"application/json"
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ntransfer-encoding: chunked\r\n\r\n" % ctype)
        if mode == "stall":
            writer.write(chunk(event("t0 ")) + chunk(event("t1 ")))
        await writer.drain()
        await asyncio.sleep(3600)  # silent, the connection open
        return False
    if not stream:
        out = {"id": "x", "object": "text_completion", "model": "m",
               "choices": [{"index": 0, "text": "ok from " + name, "finish_reason": "stop"}]}
        writer.write(answer(b"200 OK", b"application/json", json.dumps(out).encode()))
        return True
    data = event("t0 ") + event("t1 ") + event("t2 ") + b"data: [DONE]\n\n"
    writer.write(answer(b"200 OK", b"text/event-stream", data))
    return True


serve(on_request)
'''


def misbehaving(procs: ProcessGroup, name: str, mode: str) -> Proc:
    """Start the fake as worker ``name`` in ``mode`` (the module docstring); ready once it answers."""
    return start_fake(procs, "misbehaving_worker", SCRIPT, name, mode, "/count")


def posts(proc: Proc) -> int:
    """How many completions the fake was asked for."""
    import httpx

    return int(httpx.get(f"{proc.url}/count", timeout=5).json()["posts"])
