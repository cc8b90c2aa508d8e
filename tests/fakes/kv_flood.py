"""A KV event flood publisher: one ZMQ PUB socket, bound as vLLM's publisher binds, sending vLLM
batches of one BlockStored each (a new 16-token block, no parent, every block distinct) at a
paced rate (events/s, sent every millisecond) or unpaced (``--rate 0``), for ``--seconds``.
Prints the number of frames sent when done.

    python -m tests.fakes.kv_flood --port PORT --rate 30000 --seconds 5
"""

from __future__ import annotations

import argparse
import time

import msgspec
import zmq

BLOCK = 16


def payload(n: int, base: int) -> bytes:
    tokens = [7] * BLOCK
    tokens[0], tokens[1] = 32_000 + (n & 0xFFFF), 32_000 + (n >> 16)
    return msgspec.msgpack.encode([0.0, [["BlockStored", [base + n], None, tokens, BLOCK, None, "GPU"]]])


def flood(port: int, rate: float, seconds: float) -> int:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUB)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.bind(f"tcp://127.0.0.1:{port}")
    time.sleep(0.5)  # the gateway's SUB socket reconnects (ZMQ's slow joiner)
    base = (time.time_ns() & ((1 << 40) - 1)) << 20
    sent = 0
    start = time.perf_counter()
    while (now := time.perf_counter()) < start + seconds:
        due = int((now - start) * rate) if rate else sent + 256
        while sent < due:
            try:
                sock.send_multipart([b"", sent.to_bytes(8, "big"), payload(sent, base)], zmq.NOBLOCK)
            except zmq.Again:
                pass  # past the HWM: dropped, as a PUB socket does
            sent += 1
        if rate:
            time.sleep(0.001)
    sock.close(linger=0)
    ctx.term()
    return sent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--rate", type=float, default=30_000)
    ap.add_argument("--seconds", type=float, default=5.0)
    args = ap.parse_args()
    print(flood(args.port, args.rate, args.seconds), flush=True)


if __name__ == "__main__":
    main()
