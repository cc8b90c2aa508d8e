"""Fidelity of ``mesh simulate``: a real replay through Mesh and bundled workers vs the simulated one.

One run, on one machine (the GPU for the real numbers; ``--smoke`` on CPU to test the plumbing):

1. starts ``--workers`` bundled workers (``python3 -m mesh worker --preset P --device D`` with KV
   events) and the gateway (``python3 -m mesh serve`` on a generated config, default policy) as
   subprocesses and waits until the gateway sees every worker healthy;
2. runs ``mesh calibrate`` against worker 0 (before any traffic) and keeps the profile it writes;
3. replays a scaled-down agent trace for real through the gateway: the WEKA sessions committed in
   ``examples/traces/weka-fidelity/`` (derived from ``/work/shared/traces/weka`` by
   ``--make-slice``: token counts scaled down by re-blocking, long idle gaps capped, session
   starts staggered), closed loop per session (a turn is sent when its predecessor finished plus
   the scaled think time), each hash id turned into a fixed pseudo-random block of token ids,
   prompts sent as token ids to ``/v1/completions`` (streaming, ``ignore_eos``, ``max_tokens`` =
   the trace's ``out`` capped at ``--max-out``), the session id in ``x-session-id``;
4. simulates the same trace (same loader and dependency semantics, the real output lengths,
   the same worker count, KV capacity and default policy) with the calibrated profile, in-process;
5. prints real vs simulated TTFT p50/p90, throughput, hit rate and the relative errors (target:
   TTFT p50 and throughput within 15%), writes ``--json`` and, when ``$OUT`` is set, the logs,
   the profile and a per-request file under it.

    python bench/fidelity.py --smoke                 # CPU, tiny preset, 2 workers, 3 sessions
    python bench/fidelity.py                          # GPU: qwen2-0.5b, 2 workers, 16 sessions
    python bench/fidelity.py --make-slice /work/shared/traces/weka   # rewrite the committed slice
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

import argparse
import asyncio
import gzip
import json
import math
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from bench._procs import free_port, stop_group

SLICE = ROOT / "examples" / "traces" / "weka-fidelity"
TARGET_REL_ERR = 0.15
_EPS = 1e-6


# ============================================================================ the trace slice
def rescale_doc(doc: dict[str, Any], tokens_per_id: int, think_cap_s: float | None = None,
                offset_s: float = 0.0) -> dict[str, Any]:
    """A WEKA session re-blocked to ``tokens_per_id`` tokens per hash id (prompt lengths scale by
    ``tokens_per_id / block_size``; ids, and so the prefix structure, are unchanged), with idle
    gaps between turns capped at ``think_cap_s`` and every time shifted by ``offset_s``.

    Gaps keep the loader's semantics (``simulator.traces``): a turn recorded before its
    predecessor's ``api_time`` ended stays concurrent (same gap after its start); any other turn
    starts ``min(think, cap)`` after the predecessor's end. Sub-agents are not supported here.
    """
    block = int(doc["block_size"])
    out_reqs: list[dict[str, Any]] = []
    prev_t_old = prev_t_new = prev_api = 0.0
    for i, r in enumerate(doc["requests"]):
        if r.get("type") == "subagent":
            raise ValueError(f"{doc.get('id')}: sessions with sub-agents are not supported by the slice maker")
        ids = list(r.get("hash_ids") or [])
        api = float(r.get("api_time", 0.0))
        t_old = float(r["t"])
        if i == 0:
            t_new = offset_s + t_old
        else:
            gap = t_old - prev_t_old
            if gap + _EPS < prev_api:  # concurrent with its predecessor: keep the recorded gap
                t_new = prev_t_new + gap
            else:
                think = gap - prev_api
                if think_cap_s is not None:
                    think = min(think, think_cap_s)
                t_new = prev_t_new + prev_api + think
        out_reqs.append({
            "t": round(t_new, 6), "type": r.get("type", "n"), "in": scaled_prompt(int(r["in"]), len(ids), block, tokens_per_id),
            "out": int(r.get("out", 0)), "api_time": api, "hash_ids": ids,
        })
        prev_t_old, prev_t_new, prev_api = t_old, t_new, api
    return {"id": doc["id"], "block_size": tokens_per_id, "hash_id_scope": doc.get("hash_id_scope", "local"),
            "requests": out_reqs,
            "derived": {"from": doc.get("derived", {}).get("from", doc["id"]), "tokens_per_id": tokens_per_id,
                        "think_cap_s": think_cap_s, "offset_s": offset_s}}


def scaled_prompt(tokens: int, n_ids: int, block: int, new_block: int) -> int:
    """Prompt length at ``new_block`` tokens per id that keeps ``n_ids`` a valid hash chain
    (``floor(n / new_block) <= n_ids <= ceil(n / new_block)``)."""
    n = max(1, math.ceil(tokens * new_block / block))
    if n_ids:
        n = min(max(n, new_block * (n_ids - 1) + 1), new_block * (n_ids + 1) - 1)
    return n


def _read_doc(path: Path) -> dict[str, Any]:
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    return json.loads(raw)


def _write_doc(doc: dict[str, Any], path: Path) -> None:
    # id and block_size first: the format is detected from the document's head
    path.write_bytes(gzip.compress(json.dumps(doc, separators=(",", ":")).encode(), mtime=0))


def make_slice(src: Path, out: Path, sessions: int, tokens_per_id: int, think_cap_s: float,
               stagger_s: float, max_prompt: int) -> list[str]:
    """Pick the ``sessions`` smallest (total input) WEKA sessions without sub-agents whose
    longest prompt fits ``max_prompt`` after scaling, and write them rescaled to ``out``."""
    cands = []
    for f in sorted(src.iterdir()):
        if not f.is_file() or f.name.startswith("."):
            continue
        doc = _read_doc(f)
        reqs = doc["requests"]
        if any(r.get("type") == "subagent" for r in reqs):
            continue
        scale = tokens_per_id / int(doc["block_size"])
        if max(r["in"] for r in reqs) * scale > max_prompt:
            continue
        cands.append((sum(r["in"] for r in reqs), f.name, doc))
    cands.sort(key=lambda c: (c[0], c[1]))
    if len(cands) < sessions:
        raise SystemExit(f"only {len(cands)} sessions of {src} qualify; asked for {sessions}")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    names = []
    for k, (_, name, doc) in enumerate(cands[:sessions]):
        _write_doc(rescale_doc(doc, tokens_per_id, think_cap_s, k * stagger_s), out / name)
        names.append(name)
    return names


def rescaled_copy(src: Path, tokens_per_id: int, tmp: Path) -> Path:
    """The slice at another token scale (a temporary directory), e.g. for the CPU smoke run."""
    out = tmp / f"slice-{tokens_per_id}"
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.is_file() and not f.name.startswith("."):
            _write_doc(rescale_doc(_read_doc(f), tokens_per_id), out / f.name)
    return out


# ============================================================================ prompts
class PromptBook:
    """Token-id prompts of a loaded trace: hash id ``h`` of session file ``f`` is always the same
    ``tokens_per_id`` pseudo-random token ids (seeded by ``(f, h)``), so equal id prefixes give
    equal token prefixes and the engines' prefix caches see exactly the trace's reuse. Tokens past
    the last id (a prompt longer than its ids cover) are unique to the request."""

    def __init__(self, files: list[str], vocab: int) -> None:
        self.vocab = vocab
        self.ids: dict[tuple[str, str], list[int]] = {}  # (file, "$.requests[i]") -> ids
        self.block: dict[str, int] = {}
        self.seed: dict[str, int] = {}
        for f in files:
            doc = _read_doc(Path(f))
            self.block[f] = int(doc["block_size"])
            self.seed[f] = xxhash.xxh3_64_intdigest(str(doc["id"]).encode())
            for i, r in enumerate(doc["requests"]):
                if r.get("type") == "subagent":
                    for j, inner in enumerate(r.get("requests") or []):
                        self.ids[(f, f"$.requests[{i}].requests[{j}]")] = list(inner.get("hash_ids") or [])
                else:
                    self.ids[(f, f"$.requests[{i}]")] = list(r.get("hash_ids") or [])
        self._cache: dict[tuple[str, int], np.ndarray] = {}

    def _tokens_of(self, f: str, h: int) -> np.ndarray:
        got = self._cache.get((f, h))
        if got is None:
            rng = np.random.Generator(np.random.PCG64([self.seed[f], h]))
            got = self._cache[(f, h)] = rng.integers(0, self.vocab, self.block[f], dtype=np.int64)
        return got

    def prompt(self, source: str, n_tokens: int, idx: int) -> list[int]:
        f, _, path = source.partition(": ")
        ids = self.ids[(f, path)]
        parts = [self._tokens_of(f, h) for h in ids]
        toks = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        if toks.size < n_tokens:
            rng = np.random.Generator(np.random.PCG64([self.seed[f], 1 << 40, idx]))
            toks = np.concatenate([toks, rng.integers(0, self.vocab, n_tokens - toks.size, dtype=np.int64)])
        return toks[:n_tokens].tolist()


# ============================================================================ the cluster
@dataclass
class Proc:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    port: int
    kv_ports: tuple[int, int] | None = None

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def spawn(name: str, cmd: list[str], log: Path, port: int, env: dict[str, str] | None = None,
          kv_ports: tuple[int, int] | None = None) -> Proc:
    fh = open(log, "wb")  # noqa: SIM115  (owned by the child)
    fh.write((" ".join(cmd) + "\n").encode())
    fh.flush()
    proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                            env={**os.environ, **(env or {})})
    return Proc(name, proc, log, port, kv_ports)


def stop(p: Proc, timeout_s: float = 10.0) -> None:
    """SIGTERM the child's process group, SIGKILL it if it lingers (only processes we started)."""
    stop_group(p.proc, timeout_s)


def get_json(url: str, timeout: float = 2.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.load(resp)


def post_json(url: str, body: dict[str, Any] | None = None, timeout: float = 10.0) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body or {}).encode(), method="POST",
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.load(resp)


def wait_for(what: str, check: Any, procs: list[Proc], timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        for p in procs:
            if p.proc.poll() is not None:
                raise RuntimeError(f"{p.name} exited with code {p.proc.returncode} while waiting for {what}:\n{p.tail()}")
        try:
            got = check()
            if got:
                return got
        except Exception:  # noqa: BLE001  (not up yet)
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.2)


def worker_cmd(args: argparse.Namespace, device: str, port: int, kv: tuple[int, int]) -> list[str]:
    cmd = [sys.executable, "-m", "mesh", "worker", "--preset", args.preset, "--device", device,
           "--host", "127.0.0.1", "--port", str(port), "--block-size", str(args.block_size),
           "--num-kv-blocks", str(args.kv_blocks), "--max-model-len", str(args.max_model_len),
           "--kv-events-endpoint", f"tcp://*:{kv[0]}", "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{kv[1]}",
           "--log-level", "warning"]
    if args.cpu_threads:
        cmd += ["--cpu-threads", str(args.cpu_threads)]
    return cmd


def gateway_config(workers: list[Proc], port: int, block_size: int) -> dict[str, Any]:
    """The gateway's config: these workers with their KV event streams; policy left at the default."""
    return {
        "server": {"host": "127.0.0.1", "port": port, "request_timeout_s": 600},
        "workers": [{"name": w.name, "url": f"http://127.0.0.1:{w.port}", "block_size": block_size,
                     "kv_events": {"endpoint": f"tcp://127.0.0.1:{w.kv_ports[0]}",  # type: ignore[index]
                                   "replay_endpoint": f"tcp://127.0.0.1:{w.kv_ports[1]}"}}  # type: ignore[index]
                    for w in workers],
        "health": {"interval_s": 1.0},
    }


def devices(args: argparse.Namespace) -> list[str]:
    if args.device_list:
        devs = [d.strip() for d in args.device_list.split(",") if d.strip()]
    elif args.smoke:
        devs = ["cpu"]
    else:
        try:
            import torch

            n = torch.cuda.device_count()
        except ImportError:
            n = 0
        devs = [f"cuda:{i}" for i in range(n)] or ["cpu"]
    return [devs[i % len(devs)] for i in range(args.workers)]


# ============================================================================ calibration
def run_calibrate(args: argparse.Namespace, url: str, out: Path, log: Path) -> float:
    """``mesh calibrate`` through the gateway, pinned to one worker by a session id: the profile
    then holds what a request costs on its way through Mesh, not only inside the engine."""
    cmd = [sys.executable, "-m", "mesh", "calibrate", "--url", url, "--out", str(out), "--session", "mesh-calibrate",
           "--block-size", str(args.block_size), "--kv-blocks", str(args.kv_blocks),
           "--max-prompt", str(args.calibrate_max_prompt), "--max-batch", str(args.calibrate_max_batch),
           "--repeats", str(args.calibrate_repeats), "--timeout", "300",
           "--token-ids", str(args.vocab)]  # the replay sends token ids: measure that path
    t0 = time.perf_counter()
    with open(log, "wb") as fh:
        fh.write((" ".join(cmd) + "\n").encode())
        fh.flush()
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, "COLUMNS": "160"}, timeout=args.calibrate_timeout).returncode
    if rc != 0:
        raise RuntimeError(f"mesh calibrate failed (exit {rc}):\n{log.read_text(errors='replace')[-3000:]}")
    return time.perf_counter() - t0


# ============================================================================ the real replay
@dataclass
class RealRun:
    arrival: np.ndarray  # release (send) time, s from the replay's start
    first: np.ndarray
    finish: np.ndarray
    prompt: np.ndarray
    output: np.ndarray
    cached: np.ndarray
    worker: list[str]
    errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0


async def replay(trace: Any, bodies: list[bytes], url: str, progress: Any = None) -> RealRun:
    """Send every request of ``trace`` through ``url`` with the trace's release semantics: a
    request without dependencies at its arrival time; one with dependencies when the last of them
    fires (``START``: predecessor sent + delay; ``DONE``: predecessor finished + delay)."""
    import httpx

    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    client = httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits)
    flight = _Replay(trace, bodies, client, progress)
    started = time.perf_counter()
    try:
        for r in trace.requests:
            if not r.deps:
                flight.spawn(r.idx, r.arrival or 0.0)
        await flight.done.wait()
    finally:
        for t in list(flight.tasks):
            t.cancel()
        await client.aclose()
    flight.run.wall_s = time.perf_counter() - started
    return flight.run


class _Replay:
    """One real replay in flight. Request ``i`` is released once each of its ``remaining[i]``
    dependencies fired, at the latest of their fire times (``release[i]``, s from ``t0``); it
    records its times, tokens and worker into ``run`` at index ``i``; ``done`` is set when the
    last request finished. Every time is ``loop.time() - t0``, ``t0`` 0.2 s after construction."""

    def __init__(self, trace: Any, bodies: list[bytes], client: Any, progress: Any) -> None:
        self.reqs = trace.requests
        n = len(self.reqs)
        self.bodies = bodies
        self.client = client
        self.progress = progress
        self.run = RealRun(*(np.full(n, np.nan) for _ in range(3)), np.zeros(n, np.int64),
                           np.zeros(n, np.int64), np.zeros(n, np.int64), [""] * n)
        self.succ: list[list[tuple[int, int, float]]] = [[] for _ in range(n)]  # (dependent, trigger, delay)
        for r in self.reqs:
            for p, trig, delay in r.deps:
                self.succ[p].append((r.idx, trig, delay))
        self.remaining = [len(r.deps) for r in self.reqs]
        self.release = [0.0] * n
        self.loop = asyncio.get_running_loop()
        self.tasks: set[asyncio.Task[None]] = set()
        self.done = asyncio.Event()
        self.finished = 0
        self.t0 = self.loop.time() + 0.2

    def spawn(self, i: int, at: float) -> None:
        task = self.loop.create_task(self._send(i, at))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _fire(self, j: int, when: float) -> None:
        self.release[j] = max(self.release[j], when)
        self.remaining[j] -= 1
        if self.remaining[j] == 0:
            self.spawn(j, self.release[j])

    def _fire_dependents(self, i: int, trigger: int, at: float) -> None:
        for j, trig, d in self.succ[i]:
            if trig == trigger:
                self._fire(j, at + d)

    async def _send(self, i: int, at: float) -> None:
        """Request ``i`` at ``at``: its ``START`` dependents fire when it is sent, its ``DONE``
        dependents when it finished (also when it failed: the error is recorded)."""
        from simulator.traces import DONE, START

        run = self.run
        delay = self.t0 + at - self.loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        start = self.loop.time() - self.t0
        run.arrival[i] = start
        self._fire_dependents(i, START, start)
        try:
            await self._stream(i)
        except Exception as exc:  # noqa: BLE001  (recorded; dependents still run)
            run.errors.append(f"request {i} ({self.reqs[i].source}): {type(exc).__name__}: {exc}")
        end = self.loop.time() - self.t0
        run.finish[i] = end
        if math.isnan(run.first[i]):
            run.first[i] = end
        self.finished += 1
        if self.progress is not None:
            self.progress(self.finished)
        self._fire_dependents(i, DONE, end)
        if self.finished == len(self.reqs):
            self.done.set()

    async def _stream(self, i: int) -> None:
        headers = {"content-type": "application/json"}
        if self.reqs[i].session is not None:
            headers["x-session-id"] = self.reqs[i].session
        async with self.client.stream("POST", "/v1/completions", content=self.bodies[i], headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:300]
                raise RuntimeError(f"HTTP {resp.status_code}: {text}")
            self.run.worker[i] = resp.headers.get("x-mesh-worker", "")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                self._record_event(i, data)

    def _record_event(self, i: int, data: str) -> None:
        """One SSE payload of request ``i``: the first choice's time, the usage, or an error."""
        run = self.run
        if math.isnan(run.first[i]) and '"choices":[{' in data:
            run.first[i] = self.loop.time() - self.t0
        if '"usage":{' in data:
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            usage = chunk.get("usage") or {}
            run.prompt[i] = usage.get("prompt_tokens", 0)
            run.output[i] = usage.get("completion_tokens", 0)
            run.cached[i] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        elif data.startswith('{"error"'):
            raise RuntimeError(f"stream error: {data[:300]}")


def build_bodies(trace: Any, book: PromptBook, model: str, max_out: int) -> list[bytes]:
    out = []
    for r in trace.requests:
        ids = book.prompt(r.source, r.prompt_tokens, r.idx)
        out.append(json.dumps({
            "model": model, "prompt": ids, "max_tokens": max(1, min(r.output_tokens, max_out)), "stream": True,
            "temperature": 0.0, "ignore_eos": True, "stream_options": {"include_usage": True},
        }, separators=(",", ":")).encode())
    return out


def real_result(run: RealRun, workers: list[str], block_size: int, spec: Any) -> Any:
    """The real replay as a simulator ``RunResult``, so both are summarized by one function."""
    from simulator.engine import RunResult

    index = {w: i for i, w in enumerate(workers)}
    wid = np.array([index.get(w.split("@")[0], -1) for w in run.worker], dtype=np.int64)
    return RunResult(
        policy="real", policy_spec=spec, workers=workers, block_size=block_size,
        arrival=run.arrival, first_token=run.first, finish=run.finish, prompt=run.prompt,
        output=run.output, hit=run.cached, cpu_hit=np.zeros_like(run.cached), worker=wid,
        preemptions=0, rejected=0, session_moves=0, router_session_moves=0,
        busy_s=[0.0] * len(workers), steps=[0] * len(workers), queue_t=np.zeros(0), queue_len=np.zeros(0),
        running=np.zeros(0), wall_s=run.wall_s, sessions_enabled=True,
    )


def session_moves(trace: Any, worker: list[str] | np.ndarray) -> int:
    last: dict[str, Any] = {}
    moves = 0
    for r in trace.requests:
        if r.session is None:
            continue
        w = worker[r.idx]
        if r.session in last and last[r.session] != w:
            moves += 1
        last[r.session] = w
    return moves


# ============================================================================ diagnostics
async def probe(worker_url: str, gw_url: str, model: str, vocab: int, sizes: list[int], repeats: int,
                seed: int = 7) -> list[dict[str, Any]]:
    """TTFT of a prompt whose first ``C`` tokens are cached plus 16 new ones, straight to worker 0
    and through the gateway, and the single-stream ITL at that context: what a cached context
    costs beyond the prefill of the new tokens (parsing, hashing, lookup, attention)."""
    import httpx

    rng = np.random.default_rng(seed)
    rows: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
        async def once(url: str, ids: list[int], max_tokens: int) -> tuple[float, list[float], int]:
            body = json.dumps({"model": model, "prompt": ids, "max_tokens": max_tokens, "stream": True,
                               "temperature": 0.0, "ignore_eos": True,
                               "stream_options": {"include_usage": True}}).encode()
            t0 = time.perf_counter()
            stamps: list[float] = []
            cached = 0
            async with client.stream("POST", f"{url}/v1/completions", content=body,
                                     headers={"content-type": "application/json"}) as resp:
                async for line in resp.aiter_lines():
                    if not line.startswith("data:") or line.endswith("[DONE]"):
                        continue
                    if '"choices":[{' in line:
                        stamps.append(time.perf_counter() - t0)
                    if '"cached_tokens"' in line:
                        cached = json.loads(line[5:])["usage"]["prompt_tokens_details"]["cached_tokens"]
            return stamps[0] if stamps else float("nan"), stamps, cached

        for c in sizes:
            for name, url in (("worker", worker_url), ("gateway", gw_url)):
                base = rng.integers(0, vocab, c).tolist()
                cold, _, _ = await once(url, base, 1)
                warm: dict[int, list[float]] = {1: [], 32: []}
                cached, itls = [], []
                for _ in range(repeats):
                    for mt in (1, 32):
                        t, stamps, k = await once(url, base + rng.integers(0, vocab, 16).tolist(), mt)
                        warm[mt].append(t)
                        cached.append(k)
                        if len(stamps) > 1:
                            itls.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
                rows.append({"context": c, "via": name, "cold_ttft_ms": cold * 1e3,
                             "warm_ttft_ms": float(np.median(warm[1])) * 1e3,
                             "warm_ttft_decoding_ms": float(np.median(warm[32])) * 1e3, "cached": sorted(set(cached)),
                             "itl_ms": float(np.median(itls)) * 1e3 if itls else None})
    return rows


# ============================================================================ comparison
def rel(sim: float, real: float) -> float | None:
    return (sim - real) / real if real else None


def compare(real: dict[str, Any], sim: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []

    def add(metric: str, r: float, s: float, unit: str, target: bool = False) -> None:
        err = rel(s, r)
        rows.append({"metric": metric, "real": r, "sim": s, "unit": unit, "rel_err": err, "target": target,
                     "ok": (abs(err) <= TARGET_REL_ERR) if (target and err is not None) else None})

    add("TTFT p50", real["ttft_ms"]["p50"], sim["ttft_ms"]["p50"], "ms", target=True)
    add("TTFT p90", real["ttft_ms"]["p90"], sim["ttft_ms"]["p90"], "ms")
    add("TTFT mean", real["ttft_ms"]["mean"], sim["ttft_ms"]["mean"], "ms")
    add("ITL mean", real["itl_ms"]["mean"], sim["itl_ms"]["mean"], "ms")
    add("E2E p50", real["e2e_ms"]["p50"], sim["e2e_ms"]["p50"], "ms")
    total_r = real["throughput_tok_s"] + real["input_throughput_tok_s"]
    total_s = sim["throughput_tok_s"] + sim["input_throughput_tok_s"]
    add("throughput (in+out)", total_r, total_s, "tok/s", target=True)
    add("output throughput", real["throughput_tok_s"], sim["throughput_tok_s"], "tok/s")
    add("makespan", real["makespan_s"], sim["makespan_s"], "s")
    add("hit rate", real["hit_rate"], sim["hit_rate"], "")
    add("session moves", real["session_moves"], sim["session_moves"], "")
    return rows


def render(rows: list[dict[str, Any]], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=120)
    table = Table(title=title, header_style="bold")
    for col in ("metric", "real", "simulated", "sim/real - 1", "target"):
        table.add_column(col, justify="left" if col == "metric" else "right", no_wrap=True)
    for row in rows:
        fmt = _fmt(row["unit"])
        err = row["rel_err"]
        target = ""
        if row["target"]:
            target = "[green]within 15%[/]" if row["ok"] else "[red]outside 15%[/]"
        table.add_row(row["metric"], fmt(row["real"]), fmt(row["sim"]),
                      "-" if err is None else f"{err:+.1%}", target)
    console.print(table)


def _fmt(unit: str) -> Any:
    if unit == "":
        return lambda v: f"{v:.1%}" if isinstance(v, float) and v <= 1.0 else f"{v:,}"
    if unit == "ms":
        return lambda v: f"{v:,.1f} ms"
    if unit == "s":
        return lambda v: f"{v:,.2f} s"
    return lambda v: f"{v:,.0f} {unit}"


# ============================================================================ main
PRESET_DEFAULTS = {
    # (preset, kv blocks per worker, max model len, calibrate max prompt, max out, time scale)
    "gpu": ("qwen2-0.5b", 65_536, 32_768, 20_480, 128, 0.1),
    "smoke": ("tiny", 4_096, 8_192, 2_048, 16, 0.05),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny preset, 3 sessions at 2 tokens per id (plumbing test)")
    ap.add_argument("--preset", help="worker preset (default qwen2-0.5b; tiny with --smoke)")
    ap.add_argument("--workers", type=int, default=2, help="bundled workers (default 2)")
    ap.add_argument("--device-list", help="comma-separated devices, assigned round robin (default: every "
                                          "visible GPU, cuda:0 shared when fewer than workers; cpu with --smoke)")
    ap.add_argument("--trace", type=Path, default=SLICE, help=f"WEKA slice directory (default {SLICE.relative_to(ROOT)})")
    ap.add_argument("--sessions", type=int, help="replay the first N sessions (default: all 16; 3 with --smoke)")
    ap.add_argument("--max-requests", type=int, help="replay at most N requests")
    ap.add_argument("--time-scale", type=float, help="multiply arrival and think times (default 0.1; 0.05 with --smoke)")
    ap.add_argument("--tokens-per-id", type=int, help="re-block the slice to N tokens per hash id (default: the "
                                                      "slice's 16; 2 with --smoke)")
    ap.add_argument("--max-out", type=int, help="cap of max_tokens (default 128; 16 with --smoke)")
    ap.add_argument("--block-size", type=int, default=16, help="engine (and simulation) block size")
    ap.add_argument("--kv-blocks", type=int, help="KV blocks per worker (engine and profile)")
    ap.add_argument("--max-model-len", type=int, help="engine max model length")
    ap.add_argument("--cpu-threads", type=int, help="torch threads per worker (CPU)")
    ap.add_argument("--calibrate-max-prompt", type=int, help="mesh calibrate --max-prompt")
    ap.add_argument("--calibrate-max-batch", type=int, default=32)
    ap.add_argument("--calibrate-repeats", type=int, default=5, help="mesh calibrate --repeats (median of N per point)")
    ap.add_argument("--calibrate-timeout", type=float, default=300.0)
    ap.add_argument("--probe", action="store_true", help="also measure cached-context TTFT and ITL (worker vs gateway)")
    ap.add_argument("--profile", help="skip calibration and simulate with this profile (file or built-in name)")
    ap.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for workers and gateway")
    ap.add_argument("--json", dest="json_out", default=str(ROOT / "bench" / "results" / "fidelity.json"))
    ap.add_argument("--out-dir", help="logs, profile and per-request file (default $OUT, else a temp dir)")
    ap.add_argument("--make-slice", type=Path, metavar="WEKA_DIR", help="rewrite the slice from WEKA_DIR and exit")
    ap.add_argument("--slice-sessions", type=int, default=16)
    ap.add_argument("--slice-think-cap", type=float, default=30.0, help="cap of a think time in the slice, s")
    ap.add_argument("--slice-stagger", type=float, default=3.0, help="seconds between session starts in the slice")
    ap.add_argument("--slice-max-prompt", type=int, default=24_576, help="longest scaled prompt allowed in the slice")
    args = ap.parse_args(argv)
    preset, kv, mml, cal, max_out, ts = PRESET_DEFAULTS["smoke" if args.smoke else "gpu"]
    args.preset = args.preset or preset
    args.kv_blocks = args.kv_blocks or kv
    args.max_model_len = args.max_model_len or mml
    args.calibrate_max_prompt = args.calibrate_max_prompt or cal
    args.max_out = args.max_out or max_out
    args.time_scale = args.time_scale or ts
    args.sessions = args.sessions or (3 if args.smoke else None)
    args.tokens_per_id = args.tokens_per_id or (2 if args.smoke else None)
    if args.smoke:
        args.cpu_threads = args.cpu_threads or 1
        args.calibrate_max_batch = min(args.calibrate_max_batch, 4)
        args.calibrate_repeats = min(args.calibrate_repeats, 2)
    if args.workers < 1:
        ap.error("--workers must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.make_slice:
        names = make_slice(args.make_slice, args.trace, args.slice_sessions, 16, args.slice_think_cap,
                           args.slice_stagger, args.slice_max_prompt)
        print(f"wrote {len(names)} sessions to {args.trace}: {', '.join(names)}")
        return 0
    from rich.console import Console

    console = Console(stderr=True)
    out_dir = Path(args.out_dir or os.environ.get("OUT") or tempfile.mkdtemp(prefix="mesh-fidelity-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="mesh-fidelity-tmp-"))
    try:
        return run(args, out_dir, tmp, console)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_trace(args: argparse.Namespace, tmp: Path) -> Any:
    from simulator.traces import LoadOptions, load_traces

    src = args.trace
    if args.tokens_per_id:
        src = rescaled_copy(src, args.tokens_per_id, tmp)
    trace = load_traces([src], LoadOptions(block_size=args.block_size, time_scale=args.time_scale,
                                           max_sessions=args.sessions, max_requests=args.max_requests))
    for r in trace.requests:
        r.output_tokens = max(1, min(r.output_tokens, args.max_out))
    return trace


def run(args: argparse.Namespace, out_dir: Path, tmp: Path, console: Any) -> int:
    """Steps 1 to 5 of the module docstring; the exit code (1 on errors or a missed target,
    except with ``--smoke``). Every process started is stopped before the simulation."""
    from mesh.config import DEFAULT_POLICY

    t_start = time.perf_counter()
    trace, book = prepare_trace(args, tmp, console)
    devs = devices(args)
    procs: list[Proc] = []
    timings: dict[str, float] = {}
    try:
        cluster = start_cluster(args, devs, out_dir, procs, console)
        timings["startup_s"] = cluster.startup_s
        profile_src = calibrated_profile(args, cluster, out_dir, console, timings)
        probe_rows = probe_cached_context(args, cluster, console) if args.probe else []
        bodies = build_bodies(trace, book, cluster.model, args.max_out)
        real = replay_with_progress(trace, bodies, cluster.gw_url, console)
        timings["replay_s"] = real.wall_s
        console.log(f"real replay: {len(bodies)} requests in {real.wall_s:.1f} s, {len(real.errors)} errors")
    finally:
        for p in reversed(procs):
            stop(p)
    for e in real.errors[:10]:
        console.print(f"[red]error:[/] {e}")

    profile, sim_run, timings["simulate_s"] = simulate_replay(args, trace, real, profile_src, cluster)
    real_summary, sim_summary = summaries(trace, real, sim_run, cluster, args.block_size)
    rows = compare(real_summary, sim_summary)
    ok = all(r["ok"] for r in rows if r["target"]) and not real.errors
    render(rows, f"fidelity: {len(trace.requests)} requests, {trace.sessions} sessions, {len(cluster.workers)} x "
                 f"{args.preset} on {', '.join(sorted(set(devs)))}, policy {DEFAULT_POLICY}")
    timings["total_s"] = time.perf_counter() - t_start
    payload = {
        "bench": "fidelity", "ok": ok, "target_rel_err": TARGET_REL_ERR,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "devices": devs, "model": cluster.model, "policy": DEFAULT_POLICY,
        "trace": {"files": [Path(f).name for f in trace.files], "requests": len(trace.requests),
                  "sessions": trace.sessions, "prompt_tokens": trace.prompt_tokens, "block_size": trace.block_size},
        "profile": profile.to_dict(), "worker_info": cluster.infos, "timings": timings,
        "comparison": rows, "probe": probe_rows, "real": real_summary, "sim": sim_summary, "errors": real.errors,
    }
    write_outputs(args, out_dir, payload, trace, real, sim_run)
    console.log(f"wrote {args.json_out}; logs, profile and requests.jsonl in {out_dir}; "
                f"total {timings['total_s']:.1f} s")
    if real.errors:
        return 1
    return 0 if ok or args.smoke else 1  # on CPU (--smoke) the targets are informational


def prepare_trace(args: argparse.Namespace, tmp: Path, console: Any) -> tuple[Any, PromptBook]:
    """The trace to replay and its token-id prompts; sets ``args.vocab`` (the preset's vocabulary,
    which ``mesh calibrate`` samples its token ids from too)."""
    from workers.config import get_preset

    trace = load_trace(args, tmp)
    vocab = args.vocab = get_preset(args.preset).vocab_size
    book = PromptBook(trace.files, vocab)
    max_len = max(r.prompt_tokens + r.output_tokens for r in trace.requests)
    if max_len > args.max_model_len:
        raise SystemExit(f"a request needs {max_len} tokens > --max-model-len {args.max_model_len}")
    console.log(f"trace: {len(trace.requests)} requests, {trace.sessions} sessions, "
                f"{trace.prompt_tokens:,} prompt tokens, block {trace.block_size}, time scale {args.time_scale}")
    return trace, book


@dataclass
class Cluster:
    """The workers and the gateway of one run, all healthy; ``infos`` are the workers' /health."""
    workers: list[Proc]
    infos: list[dict[str, Any]]
    model: str
    gw_url: str
    startup_s: float


def start_cluster(args: argparse.Namespace, devs: list[str], out_dir: Path, procs: list[Proc],
                  console: Any) -> Cluster:
    """Step 1: one worker per device, then the gateway; each process is appended to ``procs`` as
    soon as it is started, so the caller stops it even when a later one fails."""
    t0 = time.perf_counter()
    workers = []
    for i, dev in enumerate(devs):
        port, kv = free_port(), (free_port(), free_port())
        env = {"PYTHONUNBUFFERED": "1"}
        p = spawn(f"worker-{i}", worker_cmd(args, dev, port, kv), out_dir / f"worker-{i}.log", port, env, kv)
        workers.append(p)
        procs.append(p)
    infos = [wait_for(f"{w.name} /health", lambda w=w: get_json(f"http://127.0.0.1:{w.port}/health"), procs,
                      args.startup_timeout) for w in workers]
    model = get_json(f"http://127.0.0.1:{workers[0].port}/v1/models")["data"][0]["id"]
    gw_url = start_gateway(args, workers, model, out_dir, procs)
    cluster = Cluster(workers, infos, model, gw_url, time.perf_counter() - t0)
    console.log(f"{len(workers)} workers ({', '.join(devs)}) and the gateway up in {cluster.startup_s:.1f} s; "
                f"{infos[0].get('num_kv_blocks')} KV blocks of {infos[0].get('block_size')} per worker, "
                f"{infos[0].get('attention_backend')} attention")
    return cluster


def start_gateway(args: argparse.Namespace, workers: list[Proc], model: str, out_dir: Path,
                  procs: list[Proc]) -> str:
    """``mesh serve`` in front of ``workers`` (appended to ``procs``); its URL once it sees every
    worker healthy and serves ``model``."""
    import yaml

    gw_port = free_port()
    cfg_path = out_dir / "gateway.yaml"
    cfg_path.write_text(yaml.safe_dump(gateway_config(workers, gw_port, args.block_size), sort_keys=False))
    gw = spawn("gateway", [sys.executable, "-m", "mesh", "serve", "--config", str(cfg_path), "--log-level", "warning"],
               out_dir / "gateway.log", gw_port, {"PYTHONUNBUFFERED": "1"})
    procs.append(gw)
    gw_url = f"http://127.0.0.1:{gw_port}"
    wait_for("gateway sees every worker healthy",
             lambda: get_json(f"{gw_url}/health").get("healthy_workers") == len(workers)
             and model in [m["id"] for m in get_json(f"{gw_url}/v1/models")["data"]], procs, args.startup_timeout)
    return gw_url


def reset_prefix_caches(workers: list[Proc]) -> None:
    for w in workers:
        try:
            post_json(f"http://127.0.0.1:{w.port}/reset_prefix_cache")
        except Exception:  # noqa: BLE001  (refused while blocks are in use: harmless)
            pass


def calibrated_profile(args: argparse.Namespace, cluster: Cluster, out_dir: Path, console: Any,
                       timings: dict[str, float]) -> str:
    """Step 2: the profile to simulate with, ``--profile`` or one calibrated now (its seconds in
    ``timings["calibrate_s"]``)."""
    if args.profile:
        return args.profile
    profile_src = str(out_dir / "profile.yaml")
    with console.status("mesh calibrate through the gateway (one session: one worker)"):
        timings["calibrate_s"] = run_calibrate(args, cluster.gw_url, Path(profile_src), out_dir / "calibrate.log")
    console.log(f"calibrated in {timings['calibrate_s']:.1f} s -> {profile_src}")
    reset_prefix_caches(cluster.workers)  # calibration prompts share nothing with the trace; start clean anyway
    return profile_src


def probe_cached_context(args: argparse.Namespace, cluster: Cluster, console: Any) -> list[dict[str, Any]]:
    """``--probe``: the cached-context rows of ``probe`` (logged), then clean prefix caches."""
    sizes = [c for c in (1024, 16384) if c + 64 < args.max_model_len] or [256]
    worker_url = f"http://127.0.0.1:{cluster.workers[0].port}"
    rows = asyncio.run(probe(worker_url, cluster.gw_url, cluster.model, args.vocab, sizes, 5))
    for row in rows:
        console.log(f"probe: {row['via']:>7} context {row['context']:>6}: cold {row['cold_ttft_ms']:.1f} ms, "
                    f"cached+16 TTFT {row['warm_ttft_ms']:.1f} ms (max_tokens 1), "
                    f"{row['warm_ttft_decoding_ms']:.1f} ms (max_tokens 32), cached {row['cached']}, "
                    f"ITL {row['itl_ms'] or 0:.2f} ms")
    reset_prefix_caches(cluster.workers)
    return rows


def replay_with_progress(trace: Any, bodies: list[bytes], gw_url: str, console: Any) -> RealRun:
    """Step 3 under a progress bar."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task("real replay through Mesh", total=len(bodies))
        real = asyncio.run(replay(trace, bodies, gw_url, lambda k: progress.update(task, completed=k)))
    return real


def simulate_replay(args: argparse.Namespace, trace: Any, real: RealRun, profile_src: str,
                    cluster: Cluster) -> tuple[Any, Any, float]:
    """Step 4: the simulator on the same trace with the real output lengths (written into
    ``trace``); the profile, the run and its seconds."""
    from mesh.config import DEFAULT_POLICY
    from simulator.engine import SimConfig, Simulator
    from simulator.profile import load_profile

    for r, n_out in zip(trace.requests, real.output.tolist(), strict=True):
        if n_out > 0:
            r.output_tokens = int(n_out)
    profile = load_profile(profile_src, kv_blocks=args.kv_blocks, block_size=args.block_size)
    t0 = time.perf_counter()
    sim_run = Simulator(trace, DEFAULT_POLICY, SimConfig(workers=len(cluster.workers), profile=profile,
                                                         model=cluster.model)).run()
    return profile, sim_run, time.perf_counter() - t0


def summaries(trace: Any, real: RealRun, sim_run: Any, cluster: Cluster,
              block_size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The real and the simulated run summarized by one function, session moves included."""
    from mesh.config import DEFAULT_POLICY
    from simulator.report import summarize

    worker_names = [w.name for w in cluster.workers]
    real_summary = summarize(real_result(real, worker_names, block_size, DEFAULT_POLICY))
    real_summary["session_moves"] = session_moves(trace, real.worker)
    return real_summary, summarize(sim_run)


def write_outputs(args: argparse.Namespace, out_dir: Path, payload: dict[str, Any], trace: Any, real: RealRun,
                  sim_run: Any) -> None:
    """Step 5's files: ``--json``, its copy in ``out_dir`` (unless ``--json`` is there) and requests.jsonl."""
    from simulator.report import write_json

    write_json(args.json_out, payload)
    if out_dir.resolve() != Path(args.json_out).resolve().parent:
        write_json(out_dir / "fidelity.json", payload)
    write_requests(out_dir / "requests.jsonl", trace, real, sim_run)


def write_requests(path: Path, trace: Any, real: RealRun, sim: Any) -> None:
    """One line per request: real and simulated times (s), tokens, hits and workers."""
    with open(path, "w") as fh:
        for r in trace.requests:
            i = r.idx
            fh.write(json.dumps({
                "i": i, "session": r.session, "prompt": int(r.prompt_tokens), "out": int(r.output_tokens),
                "real": {"t": _r(real.arrival[i]), "ttft": _r(real.first[i] - real.arrival[i]),
                         "e2e": _r(real.finish[i] - real.arrival[i]), "cached": int(real.cached[i]),
                         "out": int(real.output[i]), "worker": real.worker[i]},
                "sim": {"t": _r(sim.arrival[i]), "ttft": _r(sim.first_token[i] - sim.arrival[i]),
                        "e2e": _r(sim.finish[i] - sim.arrival[i]), "cached": int(sim.hit[i]),
                        "worker": f"w{int(sim.worker[i])}"},
            }) + "\n")


def _r(x: float) -> float | None:
    return None if x != x else round(float(x), 6)


if __name__ == "__main__":
    sys.exit(main())
