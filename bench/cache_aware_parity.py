"""cache_aware parity: Mesh's ``cache_aware`` against the real sglang-router, decision by decision.

Both routers run as real processes in front of the same Mesh echo workers (``mesh.echo_worker``)
and are sent the same deterministic agentic workload, one router after the other:

1. ``sequential``: shared system prompts, multi-turn sessions whose every turn extends the previous
   prompt, new sessions now and then; one request at a time, so every load is 0;
2. ``burst``: requests sent one by one while the earlier ones are still in flight (the workers
   hold each request ``--burst-delay`` seconds), so the load of every worker at each decision is
   exact and the same for both routers; more than ``balance_abs_threshold`` (64) requests pile
   onto one holder, which triggers the load-balance branch;
3. ``after``: sequential again, over the trees the burst left (nodes held by several workers).

Which worker served a request is read from the echo workers' own counters (``POST /admin/faults``
with ``{}`` answers ``served``), not from the router. The worker order matters (both routers
break ties by taking the first least-loaded worker), and sglang-router registers its
``--worker-urls`` concurrently, so its order changes from one start to the next: the harness reads
the order from the peer's ``GET /workers`` and configures Mesh with its workers in that order.

Two request kinds: ``completions`` (the routed text is the prompt for both routers) and ``chat``
(both route on the message contents joined by spaces, sglang-router's
``extract_text_for_routing``; see docs/policies.md).

    python bench/cache_aware_parity.py [--workers 3] [--sequential 60] [--burst 80] [--after 30]
        [--kinds completions chat] [--seed 0] [--json bench/results/cache_aware_parity.json]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

import argparse
import asyncio
import json
import random
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import yaml

from bench._procs import free_ports
from bench._table import print_table

MODEL = "echo"
ADMIN_KEY = "parity-admin"
PHASES = ("sequential", "burst", "after")


# -- workload --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    phase: str  # one of PHASES
    session: int
    body: dict[str, Any]


_WORDS = ("plan", "read", "file", "tool", "call", "patch", "test", "diff", "error", "fix", "agent", "step",
          "search", "result", "context", "token", "cache", "route", "worker", "prompt", "reply", "build")


def _sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words)) + "."


class _Session:
    def __init__(self, sid: int, system: str, rng: random.Random) -> None:
        self.sid = sid
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system},
                                               {"role": "user", "content": f"task {sid}: " + _sentence(rng, rng.randint(6, 30))}]

    def next_turn(self, rng: random.Random) -> None:
        self.messages.append({"role": "assistant", "content": _sentence(rng, rng.randint(4, 25))})
        self.messages.append({"role": "user", "content": _sentence(rng, rng.randint(3, 20))})


def _body(messages: list[dict[str, str]], kind: str) -> dict[str, Any]:
    if kind == "chat":
        return {"model": MODEL, "messages": [dict(m) for m in messages], "max_tokens": 1}
    # a completion prompt is the routed text itself, for both routers
    return {"model": MODEL, "prompt": "\n".join(f"{m['role']}: {m['content']}" for m in messages), "max_tokens": 1}


def workload(seed: int, kind: str, sequential: int, burst: int, after: int) -> list[Request]:
    """The fixed request sequence: agentic sessions over two shared system prompts."""
    rng = random.Random(seed)
    systems = [f"You are agent {i}. " + _sentence(rng, 60) for i in range(2)]
    sessions: list[_Session] = []
    out: list[Request] = []

    def new_session() -> _Session:
        s = _Session(len(sessions), rng.choice(systems), rng)
        sessions.append(s)
        return s

    for phase, n in zip(PHASES, (sequential, burst, after)):
        for _ in range(n):
            if not sessions or rng.random() < (0.25 if phase != "burst" else 0.1):
                s = new_session()
            else:
                # the burst piles onto few sessions (a hot agent), so one holder's load runs away
                pool = sessions[:3] if phase == "burst" and rng.random() < 0.8 else sessions
                s = rng.choice(pool)
                s.next_turn(rng)
            out.append(Request(phase, s.sid, _body(s.messages, kind)))
    return out


# -- processes -------------------------------------------------------------------------------


def _spawn(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop one process we started (by its own pid)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait(check: Any, proc: subprocess.Popen[bytes], log: Path, what: str, timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what}: process exited with {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
        try:
            got = check()
            if got:
                return got
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{what} not ready within {timeout_s} s; log {log}:\n{log.read_text(errors='replace')[-3000:]}")


@dataclass
class Cluster:
    """Echo workers (name -> URL) and the processes this harness started."""

    log_dir: Path
    workers: dict[str, str] = field(default_factory=dict)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start_workers(self, n: int) -> None:
        for i, port in enumerate(free_ports(n)):
            name = f"w{i}"
            log = self.log_dir / f"{name}.log"
            proc = _spawn([sys.executable, "-m", "mesh.echo_worker", "--port", str(port), "--name", name], log)
            self.procs.append(proc)
            self.workers[name] = f"http://127.0.0.1:{port}"
            url = self.workers[name]
            _wait(lambda: httpx.get(url + "/health", timeout=2).status_code == 200, proc, log, name, 30)

    def start_sglang(self, urls: Sequence[str]) -> tuple[subprocess.Popen[bytes], str, list[str]]:
        """sglang-router (cache_aware, its CLI defaults) over ``urls``; returns (process, URL, the
        worker names in the order the router keeps them)."""
        (port,) = free_ports(1)
        log = self.log_dir / "sglang-router.log"
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
               "--policy", "cache_aware", "--log-level", "warn", "--worker-urls", *urls]
        proc = _spawn(cmd, log)
        self.procs.append(proc)
        base = f"http://127.0.0.1:{port}"

        def registered() -> list[str] | None:
            ws = httpx.get(base + "/workers", timeout=2).json()["workers"]
            if len(ws) == len(urls) and all(w["is_healthy"] for w in ws):
                return [w["url"] for w in ws]
            return None

        order = _wait(registered, proc, log, "sglang-router", 60)
        by_url = {u: n for n, u in self.workers.items()}
        return proc, base, [by_url[u] for u in order]

    def start_mesh(self, order: Sequence[str], policy: Any = "cache_aware") -> tuple[subprocess.Popen[bytes], str]:
        """A Mesh gateway with the workers in ``order`` (config order is Mesh's target order)."""
        (port,) = free_ports(1)
        cfg = {
            "server": {"host": "127.0.0.1", "admin_key": ADMIN_KEY},
            "workers": [{"name": n, "url": self.workers[n], "models": [MODEL]} for n in order],
            "retries": {"max_attempts": 1},
            "policy": policy,
        }
        path = self.log_dir / "mesh.yaml"
        path.write_text(yaml.safe_dump(cfg))
        log = self.log_dir / "mesh.log"
        proc = _spawn([sys.executable, "-m", "mesh.commands.serve", "--config", str(path), "--port", str(port),
                       "--log-level", "warning"], log)
        self.procs.append(proc)
        base = f"http://127.0.0.1:{port}"
        _wait(lambda: httpx.get(base + "/ready", timeout=2).status_code == 200, proc, log, "mesh", 60)
        return proc, base

    def stop(self) -> None:
        for proc in reversed(self.procs):
            _stop(proc)
        self.procs.clear()


@contextmanager
def cluster(n_workers: int, log_dir: Path | None = None) -> Iterator[Cluster]:
    c = Cluster(log_dir or Path(tempfile.mkdtemp(prefix="mesh-parity-")))
    try:
        c.start_workers(n_workers)
        yield c
    finally:
        c.stop()


# -- driver ----------------------------------------------------------------------------------


class Driver:
    """Sends requests to one router and tells, from the workers' own counters, who served each."""

    def __init__(self, base: str, workers: dict[str, str], in_flight: Any) -> None:
        self.base = base
        self.workers = workers
        self.in_flight = in_flight  # () -> total in-flight requests the router itself counts
        self.http = httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=512))

    async def served(self) -> dict[str, int]:
        got = await asyncio.gather(*(self.http.post(u + "/admin/faults", json={}) for u in self.workers.values()))
        return {n: int(r.json()["served"]) for n, r in zip(self.workers, got)}

    async def delay(self, seconds: float) -> None:
        await asyncio.gather(*(self.http.post(u + "/admin/faults", json={"first_token_delay_s": seconds})
                               for u in self.workers.values()))

    async def _send(self, body: dict[str, Any]) -> httpx.Response:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        return await self.http.post(self.base + path, json=body)

    async def _who(self, before: dict[str, int], timeout_s: float = 20.0) -> tuple[str, dict[str, int]]:
        deadline = time.monotonic() + timeout_s
        while True:
            now = await self.served()
            moved = [n for n in now if now[n] != before[n]]
            if moved:
                if len(moved) != 1 or now[moved[0]] != before[moved[0]] + 1:
                    raise RuntimeError(f"more than one request served at once: {before} -> {now}")
                return moved[0], now
            if time.monotonic() > deadline:
                raise TimeoutError("no worker received the request")
            await asyncio.sleep(0.002)

    async def _idle(self, timeout_s: float = 20.0) -> None:
        """Until the router itself counts no request in flight (it may decrement after answering)."""
        deadline = time.monotonic() + timeout_s
        while await asyncio.to_thread(self.in_flight) != 0:
            if time.monotonic() > deadline:
                raise TimeoutError("router still counts requests in flight")
            await asyncio.sleep(0.01)

    async def run(self, requests: Sequence[Request], burst_delay_s: float) -> list[str]:
        picks: list[str] = []
        counts = await self.served()
        i = 0
        while i < len(requests):
            phase = requests[i].phase
            j = i
            while j < len(requests) and requests[j].phase == phase:
                j += 1
            if phase == "burst":
                got, counts = await self._burst(requests[i:j], counts, burst_delay_s)
                picks += got
            else:
                for r in requests[i:j]:
                    resp = await self._send(r.body)
                    if resp.status_code != 200:
                        raise RuntimeError(f"{self.base}: {resp.status_code} {resp.text[:300]}")
                    who, counts = await self._who(counts)
                    picks.append(who)
                    await self._idle()
            i = j
        return picks

    async def _burst(self, requests: Sequence[Request], counts: dict[str, int],
                     delay_s: float) -> tuple[list[str], dict[str, int]]:
        """One request at a time, each sent once the previous one reached its worker; every one
        stays in flight (the workers hold it ``delay_s``) until the last is placed."""
        await self.delay(delay_s)
        picks: list[str] = []
        tasks: list[asyncio.Task[httpx.Response]] = []
        try:
            for r in requests:
                tasks.append(asyncio.create_task(self._send(r.body)))
                who, counts = await self._who(counts)
                picks.append(who)
                if any(t.done() for t in tasks):
                    raise RuntimeError(f"a burst request finished before the burst was placed: raise the "
                                       f"burst delay ({delay_s} s)")
            for resp in await asyncio.gather(*tasks):
                if resp.status_code != 200:
                    raise RuntimeError(f"{self.base}: {resp.status_code} {resp.text[:300]}")
        finally:
            await self.delay(0.0)
            await asyncio.gather(*tasks, return_exceptions=True)
        await self._idle()
        return picks, counts

    async def close(self) -> None:
        await self.http.aclose()


def sglang_in_flight(base: str) -> int:
    return sum(int(w["load"]) for w in httpx.get(base + "/workers", timeout=5).json()["workers"])


def mesh_in_flight(base: str) -> int:
    ws = httpx.get(base + "/workers", headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=5).json()["workers"]
    return sum(int(t["in_flight"]) for w in ws for t in w["targets"])


def drive(base: str, workers: dict[str, str], requests: Sequence[Request], burst_delay_s: float,
          in_flight: Any) -> list[str]:
    async def go() -> list[str]:
        d = Driver(base, workers, lambda: in_flight(base))
        try:
            return await d.run(requests, burst_delay_s)
        finally:
            await d.close()

    return asyncio.run(go())


@dataclass
class Parity:
    kind: str
    order: list[str]
    requests: list[Request]
    sglang: list[str]
    mesh: list[str]

    def agreement(self, phase: str | None = None) -> tuple[int, int]:
        idx = [i for i, r in enumerate(self.requests) if phase is None or r.phase == phase]
        return sum(self.sglang[i] == self.mesh[i] for i in idx), len(idx)

    def first_difference(self) -> int | None:
        return next((i for i, (a, b) in enumerate(zip(self.sglang, self.mesh)) if a != b), None)

    def summary(self) -> dict[str, Any]:
        phases = {}
        for p in (*PHASES, None):
            same, n = self.agreement(p)
            if n:
                idx = [i for i, r in enumerate(self.requests) if p is None or r.phase == p]
                phases[p or "all"] = {
                    "requests": n, "agree": same, "agreement": same / n,
                    "sglang_counts": dict(sorted(Counter(self.sglang[i] for i in idx).items())),
                    "mesh_counts": dict(sorted(Counter(self.mesh[i] for i in idx).items())),
                }
        return {"kind": self.kind, "worker_order": self.order, "phases": phases,
                "first_difference": self.first_difference(), "sglang": self.sglang, "mesh": self.mesh}


def compare(c: Cluster, requests: list[Request], kind: str, burst_delay_s: float, policy: Any = "cache_aware") -> Parity:
    """Run ``requests`` through a fresh sglang-router, then a fresh Mesh gateway in its order."""
    sgl, sgl_base, order = c.start_sglang(list(c.workers.values()))
    try:
        ordered = {n: c.workers[n] for n in order}
        got_sgl = drive(sgl_base, ordered, requests, burst_delay_s, sglang_in_flight)
    finally:
        _stop(sgl)
    mesh, mesh_base = c.start_mesh(order, policy)
    try:
        got_mesh = drive(mesh_base, ordered, requests, burst_delay_s, mesh_in_flight)
    finally:
        _stop(mesh)
    return Parity(kind, order, requests, got_sgl, got_mesh)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--sequential", type=int, default=60)
    p.add_argument("--burst", type=int, default=80)
    p.add_argument("--after", type=int, default=30)
    p.add_argument("--burst-delay", type=float, default=5.0, help="seconds each worker holds a burst request")
    p.add_argument("--kinds", nargs="+", default=["completions", "chat"], choices=["completions", "chat"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "cache_aware_parity.json"))
    args = p.parse_args(argv)
    if min(args.workers, args.sequential, args.after) < 1 or args.burst < 0 or args.burst_delay <= 0:
        p.error("--workers, --sequential, --after must be >= 1, --burst >= 0, --burst-delay > 0")

    results: list[dict[str, Any]] = []
    with cluster(args.workers) as c:
        for kind in args.kinds:
            reqs = workload(args.seed, kind, args.sequential, args.burst, args.after)
            print(f"{kind}: {len(reqs)} requests through sglang-router, then Mesh (logs: {c.log_dir})")
            results.append(compare(c, reqs, kind, args.burst_delay).summary())
    rows = []
    for r in results:
        for phase, s in r["phases"].items():
            rows.append([r["kind"], phase, str(s["requests"]), f"{100 * s['agreement']:.1f}%",
                         " ".join(f"{k}:{v}" for k, v in s["sglang_counts"].items()),
                         " ".join(f"{k}:{v}" for k, v in s["mesh_counts"].items())])
    print_table("cache_aware: Mesh vs sglang-router, same requests, same worker order",
                ["kind", "phase", "requests", "agreement", "sglang-router per worker", "Mesh per worker"], rows,
                left=["kind", "phase", "sglang-router per worker", "Mesh per worker"])
    out = {"bench": "cache_aware_parity", "args": vars(args), "results": results}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
