"""KV pull throughput of the two transports a worker offers: raw TCP vs HTTP (uvicorn streaming
body, httpx client), on one host (loopback) or across a veth pair (``--netns``).

The sender is a separate process serving one pinned transfer with the real ``serve_pull`` /
``serve_tcp`` code over a stub engine (pages from a preallocated host array: this measures the
wire path, not the GPU gather). The receiver runs the real ``pull_blocks`` (framing, key check,
xxh3 verification, copy into import-ready arrays). Block size: one 16-token block of the chosen
model shape (``llama3-8b``: 2 MiB per block). The peer in the same run is the other transport;
the ratio is TCP / HTTP. A third row, ``raw``, is the ceiling of this host's socket path: the same
bytes over plain TCP with no framing, no checksum and one reused receive buffer.

    python bench/kv_transfer.py [--shape llama3-8b] [--blocks 256] [--repeat 5] [--json PATH]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import time
from typing import Any

import numpy as np

from workers.config import get_preset
from workers.transfer.kv_layout import Layout
from workers.transfer.kv_transfer import Faults, PullRequest, pull_blocks, serve_pull, serve_tcp
from workers.transfer.registry import TransferRegistry

TID = "bench"


class _StubOps:
    def __init__(self, pages: np.ndarray) -> None:
        self.pages = pages

    def gather(self, block_ids: Any) -> np.ndarray:
        return self.pages[list(block_ids)]


class _StubEngine:
    """What ``serve_pull`` needs of a ``TransferEngine``: a layout and engine-thread calls."""

    def __init__(self, layout: Layout, blocks: int) -> None:
        self.layout = layout
        rng = np.random.default_rng(0)
        self.ops = _StubOps(rng.integers(0, 256, size=(blocks, layout.block_bytes), dtype=np.uint8))

    async def call(self, fn: Any, *args: Any) -> Any:
        return fn(*args)


def _layout(shape: str) -> Layout:
    m = get_preset(shape)
    return Layout(m.name, m.dtype, m.num_layers, m.num_kv_heads, m.head_dim, 16)


def serve(args: argparse.Namespace) -> None:
    """The sender process: HTTP on ``--port``, TCP on ``--port + 1``; prints READY."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    layout = _layout(args.shape)
    engine = _StubEngine(layout, args.blocks)
    registry = TransferRegistry(lambda _: None, ttl_s=1e9)
    registry.add(TID, range(args.blocks), [i + 1 for i in range(args.blocks)], ["decode"], 0.0)
    faults = Faults()

    async def pull(request: Request) -> StreamingResponse:
        req = PullRequest.parse(await request.json())
        return StreamingResponse(serve_pull(engine, registry, req, faults), media_type="application/octet-stream")

    app = Starlette(routes=[Route("/kv_transfer/pull", pull, methods=["POST"])])

    async def raw(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(4)
        for i in range(args.blocks):
            writer.write(memoryview(engine.ops.pages[i]))
            if writer.transport.get_write_buffer_size() > 8 << 20:
                await writer.drain()
        await writer.drain()
        writer.close()

    async def main() -> None:
        await serve_tcp(engine, registry, faults, args.host, args.port + 1)
        await asyncio.start_server(raw, args.host, args.port + 2)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", access_log=False)
        server = uvicorn.Server(config)
        print("READY", flush=True)
        await server.serve()

    asyncio.run(main())


async def _pull_once(params: dict[str, Any], keys: list[int], layout: Layout, client: Any) -> float:
    t0 = time.perf_counter()
    n = 0
    async for _, ks, data in pull_blocks(params, 0, keys, layout, http=client, timeout=60):
        n += len(ks)
        assert data.shape[1] == layout.block_bytes
    if n != len(keys):
        raise RuntimeError(f"pulled {n} of {len(keys)} blocks")
    return time.perf_counter() - t0


async def measure(args: argparse.Namespace, host: str) -> dict[str, Any]:
    import httpx

    layout = _layout(args.shape)
    keys = [i + 1 for i in range(args.blocks)]
    base = {"transfer_id": TID, "remote_host": host, "remote_port": args.port, "remote_tcp_port": args.port + 1}
    out: dict[str, Any] = {}
    async with httpx.AsyncClient() as client:
        for transport in ("tcp", "http"):
            params = {**base, "transport": transport}
            await _pull_once(params, keys[:8], layout, client)  # warm up
            times = [await _pull_once(params, keys, layout, client) for _ in range(args.repeat)]
            nbytes = args.blocks * layout.block_bytes
            out[transport] = {"seconds_median": statistics.median(times), "gbytes_per_s": nbytes / statistics.median(times) / 1e9,
                              "bytes": nbytes, "runs": times}
    times = [await _raw_once(host, args.port + 2, args.blocks * layout.block_bytes) for _ in range(args.repeat)]
    nbytes = args.blocks * layout.block_bytes
    out["raw"] = {"seconds_median": statistics.median(times), "gbytes_per_s": nbytes / statistics.median(times) / 1e9,
                  "bytes": nbytes, "runs": times}
    out["ratio_tcp_over_http"] = out["tcp"]["gbytes_per_s"] / out["http"]["gbytes_per_s"]
    out["ratio_tcp_over_raw"] = out["tcp"]["gbytes_per_s"] / out["raw"]["gbytes_per_s"]
    return out


async def _raw_once(host: str, port: int, nbytes: int) -> float:
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port, limit=1 << 22)
    writer.write(b"pull")
    buf = bytearray(1 << 20)
    got = 0
    while got < nbytes:
        data = await reader.read(1 << 20)
        if not data:
            break
        buf[: len(data)] = data
        got += len(data)
    writer.close()
    if got != nbytes:
        raise RuntimeError(f"raw: {got} of {nbytes} bytes")
    return time.perf_counter() - t0


def _netns_sender(args: argparse.Namespace) -> tuple[Any, str, Any]:
    from tests.netns import Topology

    topo = Topology.create("kvb", 1)
    ns = topo.nodes[0]
    cmd = topo.exec_args(ns) + [sys.executable, __file__, "--serve", "--host", ns.address, "--port", str(args.port),
                                "--shape", args.shape, "--blocks", str(args.blocks)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")]))}), ns.address, topo


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--blocks", type=int, default=256)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=18950)
    p.add_argument("--netns", action="store_true", help="sender in its own network namespace (root)")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", default="bench/results/kv_transfer.json")
    args = p.parse_args()
    if args.serve:
        serve(args)
        return 0
    from rich.console import Console
    from rich.table import Table

    topo = None
    if args.netns:
        proc, host, topo = _netns_sender(args)
    else:
        proc = subprocess.Popen([sys.executable, __file__, "--serve", "--host", args.host, "--port", str(args.port),
                                 "--shape", args.shape, "--blocks", str(args.blocks)], stdout=subprocess.PIPE, text=True)
        host = args.host
    try:
        if proc.stdout is None or proc.stdout.readline().strip() != "READY":
            raise RuntimeError("sender did not start")
        time.sleep(0.3)
        result = asyncio.run(measure(args, host))
    finally:
        proc.terminate()
        proc.wait(10)
        if topo is not None:
            topo.destroy()
    layout = _layout(args.shape)
    result.update({"shape": args.shape, "block_bytes": layout.block_bytes, "blocks": args.blocks,
                   "path": "veth (netns)" if args.netns else "loopback", "cpus": os.cpu_count()})
    table = Table(title=f"KV pull, {args.blocks} blocks x {layout.block_bytes >> 10} KiB ({result['path']})")
    for col in ("transport", "median s", "GB/s"):
        table.add_column(col)
    for t in ("tcp", "http", "raw"):
        table.add_row(t, f"{result[t]['seconds_median']:.3f}", f"{result[t]['gbytes_per_s']:.2f}")
    Console().print(table)
    Console().print(f"TCP / HTTP throughput: {result['ratio_tcp_over_http']:.2f}x; "
                    f"TCP / raw socket ceiling: {result['ratio_tcp_over_raw']:.2f}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
