"""A stand-in for an SGLang worker in a prefill/decode disaggregation mode, built from SGLang's
scheduler rules (``sglang/srt/managers/scheduler.py``, ``sglang/srt/disaggregation/``), as a real
HTTP process. argv: name, role (``prefill`` | ``decode``), port, bootstrap port (prefill; 0 for
decode), mode, wait seconds.

- A POST without ``bootstrap_room`` is refused as SGLang's scheduler refuses it: 400,
  ``{"object": "error", "message": "Invalid request: Disaggregated request received without
  bootstrap room id. ...", "type": "BadRequest", "param": null, "code": 400}``.
- The prefill side "computes" the prompt and holds its KV under the request's room, then waits
  (up to the wait seconds) for the decode side to take it through its bootstrap server (HTTP on
  the bootstrap port, ``GET /transfer/ROOM``); it answers one token after the transfer, or aborts
  (500, SGLang's transfer failure) when nobody came; a client that leaves first aborts it. Mode ``fail:STATUS``: every POST is
  answered STATUS at once (SGLang's error shape), the room never filled; mode ``hold``: every
  request is held, its room never filled, until its client closes the connection (``aborted``).
- The decode side bootstraps with ``bootstrap_host:bootstrap_port`` of its body and waits (up to
  the wait seconds) for the room's KV; it answers ``"decoded by NAME with kv from PREFILL"`` (a
  stream of events or a JSON completion) or, when the transfer failed, SGLang's abort: a 500
  error (non-stream) or a 200 stream opening with an error event. A client that closes its
  connection while the decode waits aborts it (``aborted``), as SGLang aborts a request whose
  client left.
- ``GET /state``: what it counted (posts, rooms, refused, aborted, served, failed transfers,
  bodies that differed between the two sides, requests open now); ``GET /v1/models``: model
  ``m``; any other GET: 200 (health).
"""

from __future__ import annotations

from tests.procs import PYTHON, Proc, ProcessGroup, free_port

SCRIPT = r'''
import asyncio, hashlib, json, sys

name, role, port, bootstrap_port, mode, wait_s = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], float(sys.argv[6])
state = {"posts": 0, "rooms": [], "refused": 0, "aborted": 0, "served": 0, "failed_transfers": 0, "mismatched": 0, "open": 0}
kv = {}  # prefill: room -> {"digest", "body_sha", "taken": Event}


def head(status, ctype, length=None):
    extra = b"content-length: %d\r\n" % length if length is not None else b"connection: close\r\n"
    return b"HTTP/1.1 %s\r\ncontent-type: %s\r\n%s\r\n" % (status, ctype, extra)


def whole(status, out):
    data = json.dumps(out).encode()
    return head(status, b"application/json", len(data)) + data


def sglang_error(message, status, kind):
    return {"object": "error", "message": message, "type": kind, "param": None, "code": status}


def sha(body):
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


async def read_request(reader):
    lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    method, path = lines[0].split(" ")[:2]
    size = next((int(l.split(":")[1]) for l in lines if l.lower().startswith("content-length:")), 0)
    return method, path, json.loads(await reader.readexactly(size)) if size else {}


def completion(body, text):
    if body.get("stream"):
        events = [{"id": "s", "object": "text_completion", "choices": [{"index": 0, "text": word + " "}]} for word in text.split()]
        data = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
        return head(b"200 OK", b"text/event-stream") + data, False
    return whole(b"200 OK", {"id": "s", "object": "text_completion", "choices": [{"index": 0, "text": text}]}), True


def aborted(body, message):
    """SGLang's abort with a 500: an error answer, or a stream opening with an error event."""
    err = sglang_error(message, 500, "INTERNAL_SERVER_ERROR")
    if body.get("stream"):
        return head(b"200 OK", b"text/event-stream") + b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n", False
    return whole(b"500 Internal Server Error", err), True


async def prefill(body, reader):
    room = body["bootstrap_room"]
    if mode == "hold":  # a prefill that never ends: held until its client leaves
        await reader.read(1)
        state["aborted"] += 1
        return None, False
    entry = kv[room] = {"digest": sha(body.get("prompt") or body.get("messages")), "body_sha": sha(body), "taken": asyncio.Event()}
    taken = asyncio.ensure_future(entry["taken"].wait())
    gone = asyncio.ensure_future(reader.read(1))  # b"": the client closed its connection
    try:
        done, _ = await asyncio.wait({taken, gone}, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        kv.pop(room, None)
        taken.cancel()
        gone.cancel()
    if taken not in done and gone in done:  # once its KV was taken the request is served, client or not
        state["aborted"] += 1
        return None, False
    if taken not in done:
        state["failed_transfers"] += 1
        return aborted(body, "KV transfer failed for request rid=x bootstrap_room=%d: no decode peer" % room)
    state["served"] += 1
    return completion(body, "p")


async def bootstrap(host, bport, room):
    r, w = await asyncio.open_connection(host, bport)
    try:
        w.write(b"GET /transfer/%d HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n" % room)
        await w.drain()
        lines = (await r.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        size = next(int(l.split(":")[1]) for l in lines if l.lower().startswith("content-length:"))
        return lines[0].split(" ")[1] == "200", json.loads(await r.readexactly(size))
    finally:
        w.close()


async def decode(body, reader):
    room = body["bootstrap_room"]
    fetch = asyncio.ensure_future(asyncio.wait_for(bootstrap(body["bootstrap_host"], body["bootstrap_port"], room), wait_s))
    gone = asyncio.ensure_future(reader.read(1))  # b"": the client closed its connection
    done, _ = await asyncio.wait({fetch, gone}, return_when=asyncio.FIRST_COMPLETED)
    if fetch not in done:
        fetch.cancel()
        state["aborted"] += 1
        return None, False
    gone.cancel()
    try:
        ok, got = fetch.result()
    except (OSError, TimeoutError, asyncio.IncompleteReadError):
        ok, got = False, {}
    if not ok:
        state["failed_transfers"] += 1
        return aborted(body, "Decode transfer failed for request rank=0 bootstrap_room=%d" % room)
    if got["body_sha"] != sha(body):
        state["mismatched"] += 1
    state["served"] += 1
    return completion(body, "decoded by %s with kv from %s" % (name, got["from"]))


async def handle(reader, writer):
    try:
        while True:
            method, path, body = await read_request(reader)
            if method == "GET":
                if path == "/state":
                    out = {**state, "open": state["open"]}
                elif path == "/v1/models":
                    out = {"object": "list", "data": [{"id": "m", "object": "model"}]}
                else:
                    out = {}
                writer.write(whole(b"200 OK", out))
                await writer.drain()
                continue
            state["posts"] += 1
            if mode.startswith("fail:"):
                status = mode.split(":")[1]
                writer.write(whole(status.encode() + b" Failed", sglang_error("failed by " + name, int(status), "x")))
                await writer.drain()
                continue
            room = body.get("bootstrap_room")
            if room is None:  # SGLang's scheduler, for a worker in a disaggregation mode
                state["refused"] += 1
                message = "Invalid request: Disaggregated request received without bootstrap room id. req.rid='x'"
                writer.write(whole(b"400 Bad Request", sglang_error(message, 400, "BadRequest")))
                await writer.drain()
                continue
            state["rooms"].append(room)
            state["open"] += 1
            try:
                data, keep = await (prefill(body, reader) if role == "prefill" else decode(body, reader))
            finally:
                state["open"] -= 1
            if data is None:
                return
            writer.write(data)
            await writer.drain()
            if not keep:
                return
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def serve_bootstrap(reader, writer):
    """The prefill's bootstrap server: GET /transfer/ROOM waits for that room's KV, then takes it."""
    try:
        method, path, _ = await read_request(reader)
        room = int(path.rsplit("/", 1)[1])
        for _ in range(int(wait_s * 100)):
            if room in kv:
                break
            await asyncio.sleep(0.01)
        entry = kv.get(room)
        if entry is None:
            writer.write(whole(b"404 Not Found", {"room": room}))
        else:
            entry["taken"].set()
            writer.write(whole(b"200 OK", {"from": name, "digest": entry["digest"], "body_sha": entry["body_sha"]}))
        await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, ValueError):
        pass
    finally:
        writer.close()


async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", port)
    servers = [server]
    if role == "prefill":
        servers.append(await asyncio.start_server(serve_bootstrap, "127.0.0.1", bootstrap_port))
    await asyncio.gather(*(s.serve_forever() for s in servers))


asyncio.run(main())
'''


def start_sglang_worker(procs: ProcessGroup, name: str, role: str, mode: str = "ok",
                        wait_s: float = 10.0) -> tuple[Proc, int]:
    """Start one stand-in worker; returns it and its bootstrap port (0 for a decode worker)."""
    path = procs.log_dir / "sglang_pd_worker.py"
    path.write_text(SCRIPT)
    port, bootstrap = free_port(), free_port() if role == "prefill" else 0
    cmd = [PYTHON, str(path), name, role, str(port), str(bootstrap), mode, str(wait_s)]
    return procs.start_http(cmd, name=name, port=port, ready_path="/state"), bootstrap
