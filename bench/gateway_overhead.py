"""Gateway overhead: Mesh vs sglang-router vs direct-to-worker, measured in one run.

Fake workers (raw asyncio, one process, N ports) answer OpenAI chat completions instantly, so
everything measured is the gateway. A raw asyncio load generator (pre-built requests, httptools
response parser) drives, per target:

- added latency: open loop at ``--rate`` req/s (default 200), p50/p99 minus direct-to-worker;
- max rate: closed loop at ``--concurrency`` (default 64) for ``--duration`` seconds;

each for non-streaming and streaming requests, and reports ratios Mesh/sglang-router and the
gateway's CPU time per request (from /proc). Everything shares the machine's cores, as in
REFERENCE.md section 4. Targets are measured in ``--rounds`` interleaved rounds (direct, Mesh,
sglang-router, then again) and each number is the median over rounds, so a burst of load from
another process hits one round of every target rather than one target.

    python bench/gateway_overhead.py [--rounds 3] [--duration 4] [--rate 200] [--concurrency 64] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODEL = "bench-model"

# -- fake worker ---------------------------------------------------------------------------

_JSON_BODY = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi there"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14},
    }
).encode()
_JSON_RESP = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
    len(_JSON_BODY),
    _JSON_BODY,
)


def _sse_response(n_events: int = 8) -> bytes:
    events = []
    for i in range(n_events):
        chunk = {
            "id": "chatcmpl-bench",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": MODEL,
            "choices": [{"index": 0, "delta": {"content": f"tok{i} "}, "finish_reason": None}],
        }
        events.append(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    body = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"
    return b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n" + body


_SSE_RESP = _sse_response()
_MODELS_BODY = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()
_MODELS_RESP = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
    len(_MODELS_BODY),
    _MODELS_BODY,
)
_HEALTH_RESP = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


class _FakeWorker(asyncio.Protocol):
    """HTTP/1.1 keep-alive, one request at a time per connection (enough for a proxy's pool)."""

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.buf = b""
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end]
            length = 0
            lower = head.lower()
            at = lower.find(b"content-length:")
            if at >= 0:
                length = int(lower[at + 15 :].split(b"\r\n", 1)[0])
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4 : end + 4 + length]
            self.buf = self.buf[end + 4 + length :]
            line = head.split(b"\r\n", 1)[0]
            if line.startswith(b"GET /health"):
                self.transport.write(_HEALTH_RESP)
            elif line.startswith(b"GET /v1/models") or line.startswith(b"GET /models"):
                self.transport.write(_MODELS_RESP)
            elif b'"stream":true' in body or b'"stream": true' in body:
                self.transport.write(_SSE_RESP)
            else:
                self.transport.write(_JSON_RESP)


async def _serve_fake(ports: list[int]) -> None:
    loop = asyncio.get_running_loop()
    servers = [await loop.create_server(_FakeWorker, "127.0.0.1", p, backlog=4096) for p in ports]
    await asyncio.gather(*(s.serve_forever() for s in servers))


def fake_worker_main(ports: list[int]) -> None:
    _run(_serve_fake(ports))


def start_fake_workers(ports: list[int]) -> subprocess.Popen[bytes]:
    """One process serving fake workers on ``ports``, once every one answers its health check."""
    proc = subprocess.Popen(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
         f"from bench.gateway_overhead import fake_worker_main; fake_worker_main({ports!r})"],
        start_new_session=True,
    )  # fmt: skip
    for port in ports:
        wait_ok(f"http://127.0.0.1:{port}/health", 15, proc)
    return proc


def _run(coro: Any) -> Any:
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


# -- load generator --------------------------------------------------------------------------


class _Conn(asyncio.Protocol):
    def __init__(self) -> None:
        import httptools

        self.parser = httptools.HttpResponseParser(self)
        self.done: asyncio.Future[int] | None = None
        self.first: float = 0.0
        self.closed = False

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.first == 0.0:
            self.first = time.perf_counter()
        try:
            self.parser.feed_data(data)
        except Exception as exc:  # noqa: BLE001
            if self.done and not self.done.done():
                self.done.set_exception(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.done and not self.done.done():
            self.done.set_exception(ConnectionError("connection lost"))

    def on_message_complete(self) -> None:
        if self.done and not self.done.done():
            self.done.set_result(self.parser.get_status_code())

    async def request(self, data: bytes) -> tuple[int, float, float]:
        """(status, latency, time to first byte) of one request on this connection."""
        self.done = asyncio.get_running_loop().create_future()
        self.first = 0.0
        start = time.perf_counter()
        self.transport.write(data)
        status = await self.done
        end = time.perf_counter()
        return status, end - start, self.first - start


def _request_bytes(port: int, stream: bool, i: int) -> bytes:
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": f"Request {i}: say hi."},
            ],
            "max_tokens": 8,
            "stream": stream,
        },
        separators=(",", ":"),
    ).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:%d\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (port, len(body), body)
    )


async def _connect(port: int) -> _Conn:
    loop = asyncio.get_running_loop()
    _, proto = await loop.create_connection(_Conn, "127.0.0.1", port)
    return proto


@dataclass
class PhaseResult:
    requests: int = 0
    errors: int = 0
    seconds: float = 0.0
    latencies_ms: list[float] = field(default_factory=list, repr=False)
    cpu_s: float = 0.0  # gateway CPU time during the phase

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0

    def pct(self, q: float) -> float:
        if not self.latencies_ms:
            return float("nan")
        xs = sorted(self.latencies_ms)
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    def summary(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "errors": self.errors,
            "seconds": round(self.seconds, 3),
            "rate": round(self.rate, 1),
            "p50_ms": round(self.pct(0.50), 4),
            "p99_ms": round(self.pct(0.99), 4),
            "cpu_us_per_request": round(self.cpu_s / self.requests * 1e6, 1) if self.requests and self.cpu_s else None,
        }


async def closed_loop(ports: list[int], stream: bool, concurrency: int, duration: float) -> PhaseResult:
    conns = [await _connect(ports[i % len(ports)]) for i in range(concurrency)]
    reqs = [_request_bytes(ports[i % len(ports)], stream, i) for i in range(concurrency)]
    result = PhaseResult()
    stop = time.perf_counter() + duration

    async def worker(i: int) -> None:
        conn = conns[i]
        while time.perf_counter() < stop:
            try:
                status, lat, _ = await conn.request(reqs[i])
            except Exception:  # noqa: BLE001
                result.errors += 1
                conn = conns[i] = await _connect(ports[i % len(ports)])
                continue
            if status == 200:
                result.requests += 1
            else:
                result.errors += 1

    start = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    result.seconds = time.perf_counter() - start
    for c in conns:
        c.transport.close()
    return result


async def open_loop(ports: list[int], stream: bool, rate: float, duration: float) -> PhaseResult:
    """Requests at a fixed rate (evenly spaced); latency runs from the moment each is sent (the
    event loop's timers are 1 ms coarse, so the scheduled time would add the generator's lag)."""
    idle: dict[int, list[_Conn]] = {p: [await _connect(p) for _ in range(8)] for p in ports}
    result = PhaseResult()
    n = int(rate * duration)
    start = time.perf_counter()
    tasks = []

    async def one(i: int, at: float) -> None:
        port = ports[i % len(ports)]
        pool = idle[port]
        conn = pool.pop() if pool else await _connect(port)
        try:
            status, lat, _ = await conn.request(_request_bytes(port, stream, i))
        except Exception:  # noqa: BLE001
            result.errors += 1
            return
        result.latencies_ms.append((time.perf_counter() - at) * 1e3)
        if status == 200:
            result.requests += 1
        else:
            result.errors += 1
        if not conn.closed:
            pool.append(conn)

    for i in range(n):
        at = start + i / rate
        delay = at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(i, time.perf_counter())))
    await asyncio.gather(*tasks)
    result.seconds = time.perf_counter() - start
    for pool in idle.values():
        for c in pool:
            c.transport.close()
    return result


# -- processes -------------------------------------------------------------------------------


def free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def wait_ok(url: str, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except Exception:  # noqa: BLE001
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready after {timeout} s")


def start(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    out = open(log, "wb")  # noqa: SIM115
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(5)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and all its threads (and reaped children)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    return sum(int(x) for x in fields[11:15]) / ticks


def start_mesh(worker_ports: list[int], port: int, policy: str, tmp: Path) -> subprocess.Popen[bytes]:
    import yaml

    cfg = {
        "server": {"host": "127.0.0.1", "port": port},
        "workers": [{"name": f"w{i}", "url": f"http://127.0.0.1:{p}", "models": [MODEL]} for i, p in enumerate(worker_ports)],
        "policy": policy,
    }
    path = tmp / "mesh.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = start([sys.executable, "-m", "mesh.commands.serve", "--config", str(path), "--log-level", "warning"], tmp / "mesh.log")
    wait_ok(f"http://127.0.0.1:{port}/ready", 30, proc)
    return proc


def start_sglang(worker_ports: list[int], port: int, tmp: Path) -> subprocess.Popen[bytes] | None:
    cmd = [
        sys.executable, "-m", "sglang_router.launch_router",
        "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin", "--log-level", "warn",
        "--worker-urls", *[f"http://127.0.0.1:{p}" for p in worker_ports],
    ]  # fmt: skip
    proc = start(cmd, tmp / "sglang.log")
    try:
        wait_ok(f"http://127.0.0.1:{port}/health", 60, proc)
    except RuntimeError as exc:
        print(f"sglang-router did not start: {exc}; log: {tmp / 'sglang.log'}")
        stop(proc)
        return None
    return proc


# -- driver ----------------------------------------------------------------------------------


def latency_buckets(metrics_url: str) -> dict[float, float]:
    """Mesh's own ``mesh_request_latency_seconds`` buckets (chat route): le -> cumulative count."""
    with urllib.request.urlopen(metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("mesh_request_latency_seconds_bucket{") and 'route="chat"' in line:
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out[float("inf") if le == "+Inf" else float(le)] = float(line.rsplit(" ", 1)[1])
    return out


def internal_shares(before: dict[float, float], after: dict[float, float]) -> dict[str, float]:
    """Share of requests whose time inside Mesh (request in to last byte out, the worker's own time
    included) was under 1 / 2 ms."""
    total = after.get(float("inf"), 0) - before.get(float("inf"), 0)
    if total <= 0:
        return {}
    share = lambda le: round(100 * (after.get(le, 0) - before.get(le, 0)) / total, 2)  # noqa: E731
    return {"inside_mesh_under_1ms_pct": share(0.001), "inside_mesh_under_2ms_pct": share(0.002)}


async def measure(
    ports: list[int], pid: int | None, args: argparse.Namespace, progress: Any, task: Any, metrics_url: str | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # warm up: connections, pools, caches
    await closed_loop(ports, False, 8, 0.5)
    await closed_loop(ports, True, 8, 0.5)
    for stream in (False, True):
        kind = "stream" if stream else "json"
        before = latency_buckets(metrics_url) if metrics_url and not stream else None
        r = await open_loop(ports, stream, args.rate, args.duration)
        out[f"latency_{kind}"] = r.summary()
        if before is not None and metrics_url:
            out[f"latency_{kind}"].update(internal_shares(before, latency_buckets(metrics_url)))
        progress.advance(task)
        c0 = cpu_seconds(pid) if pid else 0.0
        r = await closed_loop(ports, stream, args.concurrency, args.duration)
        r.cpu_s = (cpu_seconds(pid) - c0) if pid else 0.0
        out[f"max_{kind}"] = r.summary()
        progress.advance(task)
    return out


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.progress import Progress

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--duration", type=float, default=4.0, help="seconds per phase")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; numbers are medians over rounds")
    p.add_argument("--rate", type=float, default=200.0, help="open-loop rate for the latency phases")
    p.add_argument("--concurrency", type=int, default=64, help="closed-loop concurrency for the max-rate phases")
    p.add_argument("--mesh-policy", default="round_robin", help="Mesh policy (sglang-router runs round_robin)")
    p.add_argument("--skip-sglang", action="store_true")
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "gateway_overhead.json"))
    args = p.parse_args(argv)
    if args.concurrency < 1 or args.duration <= 0 or args.rate <= 0 or args.rounds < 1:
        p.error("--concurrency, --duration, --rate and --rounds must be positive")

    console = Console()
    tmp = Path(tempfile.mkdtemp(prefix="mesh-bench-"))
    worker_ports = free_ports(args.workers)
    mesh_port, sglang_port = free_ports(2)
    procs: list[subprocess.Popen[bytes]] = [start_fake_workers(worker_ports)]
    results: dict[str, Any] = {}
    try:
        targets: list[tuple[str, list[int], int | None]] = [("direct", worker_ports, None)]
        mesh = start_mesh(worker_ports, mesh_port, args.mesh_policy, tmp)
        procs.append(mesh)
        targets.append(("mesh", [mesh_port], mesh.pid))
        if not args.skip_sglang:
            sgl = start_sglang(worker_ports, sglang_port, tmp)
            if sgl is not None:
                procs.append(sgl)
                targets.append(("sglang-router", [sglang_port], sgl.pid))
        rounds: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in targets}
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("measuring", total=4 * len(targets) * args.rounds)
            for r in range(args.rounds):
                for name, ports, pid in targets:
                    progress.update(task, description=f"round {r + 1}/{args.rounds}: {name}")
                    metrics_url = f"http://127.0.0.1:{ports[0]}/metrics" if name == "mesh" else None
                    rounds[name].append(_run(measure(ports, pid, args, progress, task, metrics_url)))
        results = {name: median_of_rounds(rs) for name, rs in rounds.items()}
    finally:
        for proc in reversed(procs):
            stop(proc)  # type: ignore[arg-type]
    report = build_report(results, args)
    print_report(console, report)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    console.print(f"JSON written to {path}")
    return 0


def median_of_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per phase and field, the median over rounds (errors and requests are summed)."""
    import statistics

    out: dict[str, Any] = {}
    for phase in rounds[0]:
        merged: dict[str, Any] = {}
        for key in rounds[0][phase]:
            values = [r[phase][key] for r in rounds if r[phase][key] is not None]
            if key in ("requests", "errors"):
                merged[key] = sum(values)
            else:
                merged[key] = round(statistics.median(values), 4) if values else None
        merged["per_round"] = [{k: r[phase][k] for k in ("rate", "p50_ms", "p99_ms")} for r in rounds]
        out[phase] = merged
    return out


def build_report(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    direct = results.get("direct", {})
    report: dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "machine": {"cpus": os.cpu_count(), "load_avg": os.getloadavg()},
        "results": results,
        "added_latency_ms": {},
        "ratios": {},
    }
    for name, res in results.items():
        if name == "direct":
            continue
        for kind in ("json", "stream"):
            lat, base = res[f"latency_{kind}"], direct[f"latency_{kind}"]
            report["added_latency_ms"][f"{name}/{kind}"] = {
                "p50": round(lat["p50_ms"] - base["p50_ms"], 4),
                "p99": round(lat["p99_ms"] - base["p99_ms"], 4),
            }
    if "mesh" in results and "sglang-router" in results:
        for kind in ("json", "stream"):
            m, s = results["mesh"][f"max_{kind}"]["rate"], results["sglang-router"][f"max_{kind}"]["rate"]
            report["ratios"][f"max_rate_{kind}_mesh_over_sglang"] = round(m / s, 3) if s else None
    return report


def print_report(console: Any, report: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title="Gateway overhead (fake workers on loopback)")
    for col in ("target", "kind", "p50 ms @rate", "p99 ms @rate", "added p50", "added p99", "max req/s", "CPU us/req", "errors"):
        table.add_column(col, justify="right")
    for name, res in report["results"].items():
        for kind in ("json", "stream"):
            lat, mx = res[f"latency_{kind}"], res[f"max_{kind}"]
            added = report["added_latency_ms"].get(f"{name}/{kind}", {})
            table.add_row(
                name,
                kind,
                f"{lat['p50_ms']:.3f}",
                f"{lat['p99_ms']:.3f}",
                f"{added['p50']:.3f}" if added else "-",
                f"{added['p99']:.3f}" if added else "-",
                f"{mx['rate']:.0f}",
                f"{mx['cpu_us_per_request']:.0f}" if mx.get("cpu_us_per_request") else "-",
                str(lat["errors"] + mx["errors"]),
            )
    console.print(table)
    for key, value in report["ratios"].items():
        console.print(f"{key}: {value}")
    inside = report["results"].get("mesh", {}).get("latency_json", {})
    if "inside_mesh_under_1ms_pct" in inside:
        console.print(
            f"mesh at {report['config']['rate']:g} req/s: {inside['inside_mesh_under_1ms_pct']}% of requests spent < 1 ms "
            f"inside the gateway, {inside['inside_mesh_under_2ms_pct']}% < 2 ms (its own histogram, worker time included)"
        )
    console.print(f"load average during run: {report['machine']['load_avg']}")


if __name__ == "__main__":
    random.seed(0)
    sys.exit(main())
