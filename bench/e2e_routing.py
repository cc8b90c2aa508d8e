"""End-to-end routing: real routers in front of the same real bundled workers, on agent traces.

Per worker configuration (GPU KV blocks x CPU tier), N bundled workers are started once
(``python -m mesh worker --preset P --device D --num-kv-blocks K --cpu-offload-blocks C`` with
their KV event streams bound) and warmed up (``--warmup-s`` of round robin, not recorded); then,
per load level (concurrent sessions) and repeat, every
router in turn runs the same replay cold (every worker's prefix cache reset on both tiers, a new
router process):

- ``round_robin``: Mesh with ``policy: round_robin`` (the floor);
- ``sglang``: the real sglang-router, ``python -m sglang_router.launch_router --policy cache_aware``;
- ``mesh_kv_aware``: Mesh ``kv_aware``, the replay sending no session ids;
- ``mesh_default``: Mesh's default policy (session_sticky over kv_aware), with session ids;
- ``mesh_cache_aware``: Mesh's ``cache_aware`` (sglang-router's algorithm inside Mesh).

A Mesh run is accepted only once every worker's KV event stream is live
(``mesh_kv_events_healthy`` = 1 for each on the gateway's ``/metrics``), checked again after the
run; the gateway's predicted and reported cached tokens (``mesh_prefix_predicted_tokens_total``,
``mesh_prefix_reported_tokens_total``) are recorded. The replay is ``mesh replay``'s, in-process
(``mesh.replay``): closed-loop sessions, prompts built from the trace's block ids (text: one
letter per token of the bundled byte-level tokenizer), streamed ``/v1/completions``. The
workers' own ``/metrics`` give a second hit rate (their ``prompt_cached_tokens``) and, for
sglang-router (which names no worker in its responses), the router's ``/metrics`` give its
requests per worker.

The default trace, ``bench/data/weka-routing/`` (0.8 MB), is the first 48 WEKA agent sessions of
``/work/shared/traces/weka`` (kv-cache-tester's traces, Apache-2.0) whose longest prompt is at
most 256k tokens, copied unchanged by ``--make-slice``: 3,176 requests, 64-token blocks, so at
``--prompt-scale 16`` prompts of 6.3k tokens on average (16.3k at most) and an ideal
(same-session) hit rate of 96%.

``--budget-s`` sizes every run (a fixed duration per matrix point, the same for each router)
so that the whole matrix fits; ``--run-s`` fixes it (0: replay the whole slice). Every process
runs in its own process group and is killed on exit; one that dies is named with its log tail.

    python bench/e2e_routing.py                                   # H200: 4 x llama3-8b, full matrix
    python bench/e2e_routing.py --kv-blocks 4000 --cpu-blocks 0 --concurrency 16,24   # one config
    python bench/e2e_routing.py --preset tiny --device cpu --workers 2 --kv-blocks 512 \\
        --concurrency 2 --cpu-blocks 0 --sessions 2 --max-turns 3 --run-s 0 --prompt-scale 64
    python bench/e2e_routing.py --make-slice /work/shared/traces/weka  # rewrite the default slice
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

import argparse
import asyncio
import atexit
import gzip
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from bench._procs import free_port, free_ports, stop_group

SLICE = ROOT / "bench" / "data" / "weka-routing"
ROUTERS = ("round_robin", "sglang", "mesh_kv_aware", "mesh_default", "mesh_cache_aware")
BASELINE = "sglang"


@dataclass(frozen=True)
class RouterSpec:
    name: str
    kind: str  # "mesh" | "sglang"
    policy: Any = None  # Mesh policy spec; None: the default
    session_ids: bool = True
    worker: dict[str, Any] = field(default_factory=dict)  # Mesh: fields of every worker entry (max_in_flight)
    config: dict[str, Any] = field(default_factory=dict)  # Mesh: more top-level config sections (admission)


SPECS = {
    "round_robin": RouterSpec("round_robin", "mesh", "round_robin"),
    "sglang": RouterSpec("sglang", "sglang", "cache_aware"),
    "mesh_kv_aware": RouterSpec("mesh_kv_aware", "mesh", "kv_aware", session_ids=False),
    "mesh_default": RouterSpec("mesh_default", "mesh", None),
    "mesh_cache_aware": RouterSpec("mesh_cache_aware", "mesh", "cache_aware"),
}


class BenchError(RuntimeError):
    """Stops the benchmark: a worker died or never came up (the message names it)."""


def log(msg: str) -> None:
    print(f"[e2e_routing {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ============================================================================ the trace slice
def make_slice(src: Path, out: Path, sessions: int, max_prompt: int) -> list[str]:
    """The first ``sessions`` WEKA files of ``src`` (sorted) whose longest prompt is at most
    ``max_prompt`` tokens, copied unchanged (gzipped JSON) into ``out``."""
    picked = []
    for f in sorted(p for p in src.iterdir() if p.is_file() and not p.name.startswith(".")):
        raw = f.read_bytes()
        doc = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)

        def prompts(reqs: list[dict[str, Any]]) -> list[int]:
            return [x for r in reqs for x in (prompts(r.get("requests") or []) if r.get("type") == "subagent"
                                               else [int(r["in"])])]

        if max(prompts(doc["requests"]), default=0) <= max_prompt:
            picked.append((f.name, raw if raw[:2] == b"\x1f\x8b" else gzip.compress(raw, mtime=0)))
        if len(picked) == sessions:
            break
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for name, data in picked:
        (out / (name if name.endswith(".gz") else name + ".gz")).write_bytes(data)
    return [n for n, _ in picked]


# ============================================================================ processes
@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    port: int
    extra: dict[str, int] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def death(self) -> str:
        return f"{self.name} (pid {self.popen.pid}) exited with code {self.popen.returncode}; log {self.log}:\n{self.tail()}"


class Procs:
    """Every process this benchmark started, each in its own process group; all killed on exit."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[Proc] = []
        atexit.register(self.stop_all)

    def spawn(self, name: str, cmd: list[str], port: int, env: dict[str, str] | None = None,
              **extra: int) -> Proc:
        path = self.log_dir / f"{name}.log"
        with open(path, "wb") as fh:
            fh.write((" ".join(cmd) + "\n").encode())
            fh.flush()
            popen = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        proc = Proc(name, popen, path, port, dict(extra))
        self.procs.append(proc)
        return proc

    def stop(self, proc: Proc, timeout_s: float = 15.0) -> None:
        stop_group(proc.popen, timeout_s)
        if proc in self.procs:
            self.procs.remove(proc)

    def stop_all(self) -> None:
        for proc in reversed(list(self.procs)):
            self.stop(proc, timeout_s=10.0)


def http_json(method: str, url: str, body: Any = None, timeout: float = 5.0) -> tuple[int, Any]:
    import httpx

    resp = httpx.request(method, url, json=body, timeout=timeout)
    try:
        return resp.status_code, resp.json()
    except ValueError:
        return resp.status_code, resp.text


def http_text(url: str, timeout: float = 5.0) -> str:
    import httpx

    return httpx.get(url, timeout=timeout).text


def samples(text: str, name: str) -> dict[str, float]:
    """Every sample of metric ``name`` in a Prometheus text page: label text -> value."""
    out = {}
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            head, value = line.rsplit(" ", 1)
            out[head[len(name):].strip("{}")] = float(value)
    return out


def label(labels: str, key: str) -> str:
    for part in labels.split(","):
        k, _, v = part.partition("=")
        if k.strip() == key:
            return v.strip().strip('"')
    return labels


def wait_for(what: str, check: Any, watch: list[Proc], timeout_s: float, interval_s: float = 0.25) -> Any:
    """Poll ``check`` until truthy; BenchError naming a watched process that died."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        for p in watch:
            if not p.alive():
                raise BenchError(f"{p.death()}\n(while waiting for {what})")
        try:
            got = check()
            if got:
                return got
        except Exception as exc:  # noqa: BLE001 - not up yet
            last = f"{type(exc).__name__}: {exc}"
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f} s{f' (last: {last})' if last else ''}")
        time.sleep(interval_s)


# ============================================================================ workers
WORKER_COUNTERS = ("prompt_tokens", "prompt_cached_tokens", "prefill_computed_tokens", "generation_tokens",
                   "preemptions", "blocks_evicted", "cpu_prefix_cache_hits", "cpu_blocks_restored", "cpu_blocks_saved")


def start_workers(procs: Procs, args: argparse.Namespace, kv_blocks: int, cpu_blocks: int) -> list[Proc]:
    devices = [d.strip() for d in args.device.split(",") if d.strip()]
    workers = []
    for i in range(args.workers):
        port, kv, replay = free_ports(3)
        cmd = [sys.executable, "-m", "mesh", "worker", "--preset", args.preset, "--device", devices[i % len(devices)],
               "--host", "127.0.0.1", "--port", str(port), "--block-size", str(args.block_size),
               "--num-kv-blocks", str(kv_blocks), "--cpu-offload-blocks", str(cpu_blocks),
               "--max-model-len", str(args.max_model_len), "--seed", str(i),
               "--kv-events-endpoint", f"tcp://*:{kv}", "--kv-events-replay-endpoint", f"tcp://*:{replay}",
               "--log-level", "warning", *args.worker_arg]
        if args.cpu_threads:
            cmd += ["--cpu-threads", str(args.cpu_threads)]
        workers.append(procs.spawn(f"w{i}-kv{kv_blocks}-cpu{cpu_blocks}", cmd, port, kv=kv, replay=replay))
    return workers


def health(w: Proc) -> dict[str, Any] | None:
    status, body = http_json("GET", w.url + "/health")
    return body if status == 200 and isinstance(body, dict) else None


def worker_counters(w: Proc) -> dict[str, float]:
    text = http_text(w.url + "/metrics", timeout=10)
    out = {}
    for key in WORKER_COUNTERS:
        got = samples(text, f"mesh_worker_{key}_total") or samples(text, f"mesh_worker_{key}")
        out[key] = sum(got.values())
    return out


def reset_caches(workers: list[Proc], timeout_s: float = 60.0) -> list[str]:
    """Both tiers of every worker's prefix cache forgotten (refused while blocks are in use:
    requests of the previous run may still be ending); the workers that refused until the end."""
    refused = []
    for i, w in enumerate(workers):
        try:
            wait_for(f"{w.name}: prefix cache reset",
                     lambda w=w: http_json("POST", w.url + "/reset_prefix_cache")[0] == 200, workers, timeout_s, 0.5)
        except TimeoutError:
            refused.append(f"w{i}")
    return refused


# ============================================================================ routers
def mesh_config(workers: list[Proc], spec: RouterSpec, block_size: int, port: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": port, "admin_key": "bench", "request_timeout_s": 900},
        "workers": [{"name": f"w{i}", "url": w.url, "block_size": block_size,
                     "kv_events": {"endpoint": f"tcp://127.0.0.1:{w.extra['kv']}",
                                   "replay_endpoint": f"tcp://127.0.0.1:{w.extra['replay']}"}, **spec.worker}
                    for i, w in enumerate(workers)],
        "health": {"interval_s": 1.0, "timeout_s": 5, "unhealthy_threshold": 3},
        **spec.config,
    }
    if spec.policy is not None:
        cfg["policy"] = spec.policy
    return cfg


@dataclass
class Router:
    spec: RouterSpec
    proc: Proc
    metrics_url: str  # the router's own /metrics
    worker_names: dict[str, str]  # worker URL -> name


def start_router(procs: Procs, spec: RouterSpec, workers: list[Proc], args: argparse.Namespace, tag: str) -> Router:
    import yaml

    names = {w.url: f"w{i}" for i, w in enumerate(workers)}
    if spec.kind == "mesh":
        port = free_port()
        path = procs.log_dir / f"{spec.name}-{tag}.yaml"
        path.write_text(yaml.safe_dump(mesh_config(workers, spec, args.block_size, port), sort_keys=False))
        proc = procs.spawn(f"{spec.name}-{tag}", [sys.executable, "-m", "mesh", "serve", "--config", str(path),
                                                  "--log-level", "warning"], port)
        return Router(spec, proc, proc.url + "/metrics", names)
    port, prom = free_ports(2)
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
           "--policy", "cache_aware", "--log-level", "warn", "--prometheus-host", "127.0.0.1",
           "--prometheus-port", str(prom), "--request-timeout-secs", "900", "--worker-urls",
           *(w.url for w in workers)]
    proc = procs.spawn(f"{spec.name}-{tag}", cmd, port)
    return Router(spec, proc, f"http://127.0.0.1:{prom}/metrics", names)


def events_live(router: Router) -> dict[str, float]:
    return samples(http_text(router.metrics_url), "mesh_kv_events_healthy")


def wait_router(router: Router, workers: list[Proc], model: str, timeout_s: float) -> dict[str, Any]:
    """Up, every worker healthy (and for Mesh every KV event stream live); what was checked."""
    n = len(workers)
    watch = [router.proc, *workers]
    t0 = time.monotonic()
    if router.spec.kind == "mesh":
        wait_for(f"{router.proc.name}: {n} healthy workers",
                 lambda: http_json("GET", router.proc.url + "/health")[1].get("healthy_workers") == n, watch, timeout_s)
        wait_for(f"{router.proc.name}: model {model}",
                 lambda: model in [m["id"] for m in http_json("GET", router.proc.url + "/v1/models")[1]["data"]],
                 watch, timeout_s)
        def live() -> dict[str, float] | None:
            streams = events_live(router)
            return streams if len(streams) == n and all(v == 1.0 for v in streams.values()) else None

        try:
            streams = wait_for(f"{router.proc.name}: {n} live KV event streams (mesh_kv_events_healthy)", live, watch,
                               timeout_s)
        except TimeoutError as exc:
            return {"ok": False, "error": str(exc), "streams": events_live(router), "ready_s": time.monotonic() - t0}
        return {"ok": True, "streams": {label(k, "worker"): v for k, v in streams.items()},
                "ready_s": time.monotonic() - t0}

    def registered() -> bool:
        ws = http_json("GET", router.proc.url + "/workers")[1]["workers"]
        return len(ws) == n and all(w["is_healthy"] for w in ws)

    wait_for(f"{router.proc.name}: {n} healthy workers", registered, watch, timeout_s)
    return {"ok": True, "ready_s": time.monotonic() - t0}


def router_counts(router: Router) -> dict[str, Any]:
    """After a run: Mesh's predicted/reported cached tokens and event health; sglang-router's
    requests per worker (its circuit breaker's outcomes)."""
    text = http_text(router.metrics_url, timeout=10)
    if router.spec.kind == "mesh":
        pred = samples(text, "mesh_prefix_predicted_tokens_total")
        rep = samples(text, "mesh_prefix_reported_tokens_total")
        streams = samples(text, "mesh_kv_events_healthy")
        return {
            "prefix_tokens": {"predicted": sum(pred.values()), "reported": sum(rep.values()),
                              "per_target": {label(k, "target"): {"predicted": v, "reported": rep.get(k, 0.0)}
                                             for k, v in pred.items()}},
            "events_live_after": bool(streams) and all(v == 1.0 for v in streams.values()),
            "streams_after": {label(k, "worker"): v for k, v in streams.items()},
        }
    outcomes = samples(text, "smg_worker_cb_outcomes_total")
    per: dict[str, int] = {}
    for labels, v in outcomes.items():
        name = router.worker_names.get(label(labels, "worker"), label(labels, "worker"))
        per[name] = per.get(name, 0) + int(v)
    return {"router_requests_per_worker": dict(sorted(per.items()))}


# ============================================================================ one run
async def _replay_watched(prep: Any, opts: Any, label_: str, watch: list[Proc], progress: Any) -> Any:
    """The replay, cancelled when a watched process dies (BenchError names it)."""
    from mesh.replay.run import replay

    task = asyncio.ensure_future(replay(prep, opts, label_, progress))
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if done:
            break
        dead = next((p for p in watch if not p.alive()), None)
        if dead is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise BenchError(dead.death())
    return task.result()


def run_one(procs: Procs, spec: RouterSpec, workers: list[Proc], prep: Any, args: argparse.Namespace, model: str,
            concurrency: int, run_s: float | None, tag: str) -> dict[str, Any]:
    t0 = time.monotonic()
    row: dict[str, Any] = {"router": spec.name, "kind": spec.kind, "policy": spec.policy or "session_sticky (default)",
                           "session_ids": spec.session_ids, "ok": False, "error": None}
    refused = reset_caches(workers)
    if refused:
        row["not_cold"] = refused
        log(f"warning: {spec.name}: the prefix caches of {', '.join(refused)} could not be reset (blocks in use)")
    before = {f"w{i}": worker_counters(w) for i, w in enumerate(workers)}
    router = start_router(procs, spec, workers, args, tag)
    try:
        if not _router_ready(router, row, workers, model, args.startup_timeout):
            return row
        summary = _replay_through(router, row, workers, prep, args, model, concurrency, run_s, tag)
        if summary is None:
            return row
        row.update(router_counts(router))
    finally:
        procs.stop(router.proc)
    after = {f"w{i}": worker_counters(w) for i, w in enumerate(workers)}
    _add_results(row, summary, before, after, t0)
    return row


def _router_ready(router: Router, row: dict[str, Any], workers: list[Proc], model: str, timeout_s: float) -> bool:
    """Whether the router came up ready to run (else ``row["error"]`` says why); a dead worker raises."""
    spec = router.spec
    try:
        ready = wait_router(router, workers, model, timeout_s)
    except (TimeoutError, BenchError) as exc:
        if any(not w.alive() for w in workers):
            raise
        row["error"] = f"{spec.name} did not come up: {exc}"
        if not router.proc.alive():
            row["error"] = router.proc.death()
        log(row["error"])
        return False
    row["ready"] = ready
    if not ready["ok"]:
        row["error"] = f"run refused: {ready['error']}"
        log(f"{spec.name}: {row['error']}")
        return False
    return True


def _replay_through(router: Router, row: dict[str, Any], workers: list[Proc], prep: Any, args: argparse.Namespace,
                    model: str, concurrency: int, run_s: float | None, tag: str) -> dict[str, Any] | None:
    """The replay's summary through ``router``; None (``row["error"]`` set) when the router died."""
    from mesh.replay.client import ClientOptions
    from mesh.replay.progress import ProgressLine

    spec = router.spec
    opts = ClientOptions(url=router.proc.url, model=model, session_header="x-session-id" if spec.session_ids else None,
                         concurrency=concurrency, duration_s=run_s or None, timeout_s=args.request_timeout)
    progress = ProgressLine(len(prep.plan.turns), prefix=f"  {tag} {spec.name}", interval_s=args.progress_s)
    try:
        summary, _ = asyncio.run(_replay_watched(prep, opts, spec.name, [router.proc, *workers], progress))
    except BenchError as exc:
        if any(not w.alive() for w in workers):
            raise
        row["error"] = str(exc)
        log(f"{spec.name} died during the run: {exc}")
        return None
    finally:
        progress.close()
    return summary


def _add_results(row: dict[str, Any], summary: dict[str, Any], before: dict[str, dict[str, float]],
                 after: dict[str, dict[str, float]], t0: float) -> None:
    """The run's results into ``row``: the replay's summary and the workers' counter deltas."""
    deltas = {w: {k: after[w][k] - before[w][k] for k in WORKER_COUNTERS} for w in after}
    prompt = sum(d["prompt_tokens"] for d in deltas.values())
    cached = sum(d["prompt_cached_tokens"] for d in deltas.values())
    per_worker = summary["requests_per_worker"]
    source = "x-mesh-worker"
    if set(per_worker) <= {"unknown"} and row.get("router_requests_per_worker"):
        per_worker, source = row["router_requests_per_worker"], "router metrics"
    row.update({
        "ok": summary["requests"] > 0, "requests": summary["requests"], "errors": summary["errors"],
        "not_sent": summary["not_sent"], "ttft_ms": summary["ttft_ms"], "itl_ms": summary["itl_ms"],
        "e2e_ms": summary["e2e_ms"], "hit_rate": summary["hit_rate"],
        "ideal_hit_rate_served": summary.get("ideal_hit_rate_served"),
        "worker_hit_rate": cached / prompt if prompt else 0.0, "throughput_req_s": summary["throughput_req_s"],
        "throughput_tok_s": summary["throughput_tok_s"], "session_moves": summary["session_moves"],
        "requests_per_worker": per_worker, "requests_per_worker_source": source,
        "worker_prompt_tokens": {w: d["prompt_tokens"] for w, d in deltas.items()}, "worker_deltas": deltas,
        "error_samples": summary["error_samples"], "wall_s": time.monotonic() - t0, "summary": summary,
    })
    if summary["requests"] == 0:
        row["error"] = "no request was served: " + "; ".join(summary["error_samples"][:2])


# ============================================================================ the matrix
def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


@dataclass
class Budget:
    """Sizes the runs of each matrix point so that the whole matrix fits ``total_s``."""

    total_s: float
    started: float = field(default_factory=time.monotonic)
    startup_s: list[float] = field(default_factory=list)  # worker start-ups measured
    overhead_s: list[float] = field(default_factory=list)  # per run: reset + router start + drain

    def left(self) -> float:
        return self.total_s - (time.monotonic() - self.started)

    def overhead(self) -> float:
        return (sum(self.overhead_s) / len(self.overhead_s)) if self.overhead_s else 15.0

    def run_s(self, runs_left: int, starts_left: int, lo: float, hi: float) -> float:
        startup = max(self.startup_s) if self.startup_s else 90.0
        overhead = self.overhead()
        spare = self.left() - starts_left * startup - runs_left * overhead - 10.0
        return max(lo, min(hi, spare / max(1, runs_left)))


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def combine(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A router's repeats in one row: latencies and rates averaged, counts summed."""
    ok = [r for r in rows if r.get("ok")]
    if not ok:
        return {**rows[0], "repeats": len(rows)}
    if len(ok) == 1:
        return {**ok[0], "repeats": len(rows)}
    out = {k: ok[0][k] for k in ("router", "kind", "policy", "session_ids")}
    for key in ("ttft_ms", "itl_ms", "e2e_ms"):
        out[key] = {q: _mean([r[key][q] for r in ok]) for q in ok[0][key]}
    for key in ("hit_rate", "worker_hit_rate", "throughput_req_s", "throughput_tok_s"):
        out[key] = _mean([r[key] for r in ok])
    for key in ("requests", "errors", "not_sent"):
        out[key] = sum(r[key] for r in ok)
    moves = [r["session_moves"] for r in ok if r["session_moves"] is not None]
    out["session_moves"] = sum(moves) if moves else None
    per: dict[str, int] = {}
    for r in ok:
        for w, n in r["requests_per_worker"].items():
            per[w] = per.get(w, 0) + n
    out.update({"requests_per_worker": per, "requests_per_worker_source": ok[0]["requests_per_worker_source"],
                "ok": True, "error": None, "repeats": len(rows), "ok_repeats": len(ok)})
    if "prefix_tokens" in ok[0]:
        out["prefix_tokens"] = {k: sum(r["prefix_tokens"][k] for r in ok) for k in ("predicted", "reported")}
        out["events_live_after"] = all(r.get("events_live_after") for r in ok)
    return out


def add_ratios(routers: dict[str, dict[str, Any]]) -> None:
    base = routers.get(BASELINE)
    for row in routers.values():
        for key, q in (("ttft_mean_vs_sglang", "mean"), ("ttft_p99_vs_sglang", "p99")):
            ok = base is not None and base.get("ok") and row.get("ok") and base["ttft_ms"][q] > 0
            row[key] = row["ttft_ms"][q] / base["ttft_ms"][q] if ok else None  # type: ignore[index]


def print_point(point: dict[str, Any], width: int) -> None:
    from bench._table import print_table

    def ms(v: float) -> str:
        return f"{v / 1000:.2f} s" if v >= 10_000 else f"{v:.1f} ms"

    def ratio(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}x"

    rows = []
    for name, r in point["routers"].items():
        if not r.get("ok"):
            rows.append([name, "failed", *["-"] * 11, (r.get("error") or "")[:60]])
            continue
        pt = r.get("prefix_tokens")
        rows.append([
            name, f"{r['requests']:,}", f"{r['errors']:,}", ms(r["ttft_ms"]["mean"]), ms(r["ttft_ms"]["p50"]),
            ms(r["ttft_ms"]["p99"]), f"{r['hit_rate']:.1%}", f"{r['worker_hit_rate']:.1%}",
            "-" if r.get("ideal_hit_rate_served") is None else f"{r['ideal_hit_rate_served']:.1%}",
            ratio(r.get("ttft_mean_vs_sglang")), ratio(r.get("ttft_p99_vs_sglang")),
            "-" if r["session_moves"] is None else f"{r['session_moves']:,}",
            " ".join(f"{w}:{n}" for w, n in sorted(r["requests_per_worker"].items())),
            "-" if not pt else f"{pt['predicted']:,.0f}/{pt['reported']:,.0f}",
            "" if r["kind"] != "mesh" else ("events live" if r.get("events_live_after") else "EVENTS NOT LIVE"),
        ])
    title = (f"kv {point['kv_blocks']} blocks/worker, cpu tier {point['cpu_blocks']} blocks, "
             f"{point['concurrency']} sessions, {point['run_s'] or 'whole slice'}"
             f"{' s' if point['run_s'] else ''} per run, ideal hit of the whole slice {point['ideal_hit_rate']:.1%}")
    print_table(title, ["router", "requests", "errors", "TTFT mean", "TTFT p50", "TTFT p99", "hit rate", "worker hit",
                        "ideal (served)", "mean/sglang", "p99/sglang", "moves", "per worker", "pred/reported", "notes"], rows,
                width=width, left=["router", "per worker", "notes"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_matrix_args(ap)
    _add_budget_args(ap)
    _add_replay_args(ap)
    _add_worker_args(ap)
    _add_output_args(ap)
    args = ap.parse_args(argv)
    _check_args(ap, args)
    return args


def _add_matrix_args(ap: argparse.ArgumentParser) -> None:
    """The trace, the workers and what is measured: worker configs x loads x routers x repeats."""
    ap.add_argument("--trace", nargs="+", default=[str(SLICE)], help=f"trace files or directories (default {SLICE.relative_to(ROOT)})")
    ap.add_argument("--preset", default="llama3-8b", help="bundled worker preset (default llama3-8b)")
    ap.add_argument("--device", default="cuda", help="worker device, or a comma list assigned round robin (default cuda)")
    ap.add_argument("--workers", type=int, default=4, help="bundled workers (default 4)")
    ap.add_argument("--kv-blocks", default="4000,2000", help="GPU KV blocks per worker, a comma list (default 4000,2000)")
    ap.add_argument("--cpu-blocks", default="0,4000",
                    help="CPU offload tier blocks per worker (0: off), a comma list (default 0,4000)")
    ap.add_argument("--concurrency", default="16,24", help="concurrent sessions, a comma list (default 16,24)")
    ap.add_argument("--routers", default=",".join(ROUTERS), help=f"comma list of {', '.join(ROUTERS)} (default all)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per router and matrix point (default 1); odd repeats run the routers in reverse order")


def _add_budget_args(ap: argparse.ArgumentParser) -> None:
    """How long each run lasts."""
    ap.add_argument("--budget-s", type=float, default=540.0, help="the whole run's time budget (default 540: 9 min)")
    ap.add_argument("--run-s", type=float, help="fixed seconds per run (0: replay the whole slice); default: from the budget")
    ap.add_argument("--min-run-s", type=float, default=10.0, help="shortest run the budget may size (default 10)")
    ap.add_argument("--max-run-s", type=float, default=120.0, help="longest run the budget may size (default 120)")


def _add_replay_args(ap: argparse.ArgumentParser) -> None:
    """How the trace is replayed."""
    ap.add_argument("--sessions", type=int, help="the first N sessions of the trace")
    ap.add_argument("--max-turns", type=int, help="at most N requests per session")
    ap.add_argument("--prompt-scale", type=float, default=16.0, help="trace tokens per prompt token (default 16)")
    ap.add_argument("--output-tokens", type=int, default=32, help="max_tokens of every request (default 32)")
    ap.add_argument("--time-scale", type=float, default=0.01, help="think-time multiplier (default 0.01)")
    ap.add_argument("--max-think-s", type=float, default=2.0, help="cap of a scaled think time (default 2)")


def _add_worker_args(ap: argparse.ArgumentParser) -> None:
    """The workers' settings, timeouts and progress."""
    ap.add_argument("--block-size", type=int, default=16, help="the workers' and Mesh's KV block size (default 16)")
    ap.add_argument("--max-model-len", type=int, default=32768, help="worker --max-model-len (default 32768); longer "
                                                                      "requests are not replayed")
    ap.add_argument("--cpu-threads", type=int, help="worker --cpu-threads (CPU runs)")
    ap.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                    help="one more argument for every worker (repeatable), e.g. --worker-arg=--no-cuda-graphs")
    ap.add_argument("--warmup-s", type=float, default=15.0,
                    help="untimed round-robin traffic on fresh workers before the first run (default 15; 0: none)")
    ap.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for workers / a router")
    ap.add_argument("--request-timeout", type=float, default=300.0, help="per-request timeout (default 300)")
    ap.add_argument("--progress-s", type=float, default=10.0, help="seconds between progress lines (default 10)")


def _add_output_args(ap: argparse.ArgumentParser) -> None:
    """Where results go, extra routers, and the slice writer."""
    ap.add_argument("--json", dest="json_out", default=None,
                    help="write the results (default $OUT/e2e_routing.json, else bench/results/e2e_routing.json)")
    ap.add_argument("--out-dir", help="process logs (default $OUT/e2e_routing_logs, else a temporary directory)")
    ap.add_argument("--width", type=int, default=200, help="table width")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                    help="an extra Mesh router NAME with session ids: a policy spec (JSON), or {policy, worker, config} "
                         "(worker fields, e.g. max_in_flight, and config sections, e.g. admission); name it in --routers")
    ap.add_argument("--calibrate", action="store_true",
                    help="before the routers, run mesh calibrate on the idle workers (one alone, then all at once) "
                         "and record the profiles in the JSON (the simulator's twin of this run)")
    ap.add_argument("--make-slice", type=Path, metavar="WEKA_DIR", help="write the default slice from WEKA_DIR and exit")
    ap.add_argument("--slice-sessions", type=int, default=48)
    ap.add_argument("--slice-max-prompt", type=int, default=262_144, help="longest raw prompt of a slice session (tokens)")


def _variant_spec(name: str, spec: Any) -> RouterSpec:
    """A ``--variant``: a policy spec, or ``{"policy": SPEC, "worker": {FIELDS}, "config": {SECTIONS},
    "session_ids": BOOL}`` (e.g. ``{"worker": {"max_in_flight": 3}}``, ``{"config": {"admission": ...}}``)."""
    keys = {"policy", "worker", "config", "session_ids"}
    if isinstance(spec, dict) and "name" not in spec and spec.keys() & keys:  # not a policy spec's map
        if not spec.keys() <= keys:
            raise ValueError(f"unknown keys {sorted(spec.keys() - keys)}")
        return RouterSpec(name, "mesh", spec.get("policy"), session_ids=bool(spec.get("session_ids", True)),
                          worker=dict(spec.get("worker") or {}), config=dict(spec.get("config") or {}))
    return RouterSpec(name, "mesh", spec)


def _check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Registers the --variant routers, parses the comma lists (``*_list``), checks them, and defaults --json."""
    for variant in args.variant:
        name, _, spec = variant.partition("=")
        try:
            SPECS[name] = _variant_spec(name, json.loads(spec))
        except ValueError:
            ap.error(f"--variant takes NAME=JSON (a policy spec, or {{policy, worker, config}}), got {variant!r}")
    args.routers_list = [r.strip() for r in args.routers.split(",") if r.strip()]
    bad = [r for r in args.routers_list if r not in SPECS]
    if bad:
        ap.error(f"unknown router(s) {', '.join(bad)}; choose from {', '.join(ROUTERS)}")
    try:
        args.kv_list, args.cpu_list, args.conc_list = _ints(args.kv_blocks), _ints(args.cpu_blocks), _ints(args.concurrency)
    except ValueError:
        ap.error("--kv-blocks, --cpu-blocks and --concurrency take comma lists of integers")
    if not (args.kv_list and args.cpu_list and args.conc_list) or min(args.kv_list) < 1 or min(args.conc_list) < 1 \
            or min(args.cpu_list) < 0:
        ap.error("--kv-blocks and --concurrency need values >= 1, --cpu-blocks >= 0")
    if args.workers < 1 or args.repeats < 1:
        ap.error("--workers and --repeats must be >= 1")
    if args.json_out is None:
        args.json_out = str(Path(os.environ["OUT"]) / "e2e_routing.json") if os.environ.get("OUT") else \
            str(ROOT / "bench" / "results" / "e2e_routing.json")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.make_slice:
        names = make_slice(args.make_slice, SLICE, args.slice_sessions, args.slice_max_prompt)
        size = sum(p.stat().st_size for p in SLICE.iterdir())
        print(f"wrote {len(names)} sessions ({size / 1e6:.2f} MB) to {SLICE}: {names[0]} .. {names[-1]}")
        return 0
    out_dir = Path(args.out_dir) if args.out_dir else (
        Path(os.environ["OUT"]) / "e2e_routing_logs" if os.environ.get("OUT") else Path(tempfile.mkdtemp(prefix="e2e-routing-")))
    out_dir.mkdir(parents=True, exist_ok=True)

    def on_signal(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)  # the finally below kills every process group

    signal.signal(signal.SIGTERM, on_signal)
    procs = Procs(out_dir)
    try:
        return run(args, procs, out_dir)
    finally:
        procs.stop_all()


@dataclass
class _Matrix:
    """What one invocation's matrix shares: its settings, the trace, the budget, the JSON payload and tallies."""

    args: argparse.Namespace
    procs: Procs
    prep: Any
    budget: Budget
    payload: dict[str, Any]
    configs: list[tuple[int, int]]
    runs_total: int
    runs_done: int = 0
    exit_code: int = 0


def run(args: argparse.Namespace, procs: Procs, out_dir: Path) -> int:
    from simulator.report import write_json

    budget, prep = _prepare(args)
    if prep is None:
        return 2
    plan = prep.plan
    log(f"trace: {len(plan.turns):,} requests in {len(plan.groups)} sessions, {prep.ideal.prompt_units:,} prompt tokens "
        f"at scale {args.prompt_scale:g}, ideal hit rate {prep.ideal.session:.1%}; logs in {out_dir}")
    for warning in prep.warnings:
        log(f"warning: {warning}")
    configs = [(kv, cpu) for kv in args.kv_list for cpu in args.cpu_list]
    n_points = len(configs) * len(args.conc_list)
    runs_total = n_points * len(args.routers_list) * args.repeats
    payload: dict[str, Any] = {
        "bench": "e2e_routing", "version": 1,
        "config": {k: v for k, v in vars(args).items() if k not in ("make_slice",)},
        "trace": prep.trace_info(), "reference": prep.reference(), "points": [], "warnings": [], "ok": False,
    }
    m = _Matrix(args, procs, prep, budget, payload, configs, runs_total)
    if args.run_s is None:
        _warn_if_over_budget(m)
    try:
        for ci in range(len(configs)):
            _run_config(m, ci)
    except (BenchError, TimeoutError) as exc:
        log(f"stopped: {exc}")
        payload["warnings"].append(f"stopped: {exc}"[:4000])
        m.exit_code = 1
    payload["ok"] = m.exit_code == 0 and bool(payload["points"])
    payload["wall_s"] = time.monotonic() - budget.started
    write_json(args.json_out, payload)
    log(f"wrote {args.json_out} ({m.runs_done}/{runs_total} runs, {payload['wall_s']:.0f} s)")
    return m.exit_code


def _prepare(args: argparse.Namespace) -> tuple[Budget, Any]:
    """The run's budget (started now) and the replay's preparation of the trace; None for the latter (the error
    printed) when the trace cannot be read."""
    from mesh.replay.run import ReplaySetup, prepare
    from simulator.traces import TraceError

    budget = Budget(args.budget_s)
    try:
        return budget, prepare(ReplaySetup(
            traces=args.trace, sessions=args.sessions, max_turns=args.max_turns, time_scale=args.time_scale,
            max_think_s=args.max_think_s, prompt_scale=args.prompt_scale, output_tokens=args.output_tokens,
            max_prompt_tokens=args.max_model_len - args.output_tokens - 1, engine_block_size=args.block_size))
    except (TraceError, ValueError, OSError) as exc:
        print(f"e2e_routing: error: {exc}", file=sys.stderr)
        return budget, None


def _warn_if_over_budget(m: _Matrix) -> None:
    args, configs = m.args, m.configs
    need = len(configs) * 90.0 + m.runs_total * (15.0 + args.min_run_s)
    if need > args.budget_s:
        m.payload["warnings"].append(
            f"the matrix ({len(configs)} worker configs x {len(args.conc_list)} loads x {len(args.routers_list)} "
            f"routers x {args.repeats}) needs about {need:.0f} s at --min-run-s {args.min_run_s:g} > --budget-s "
            f"{args.budget_s:g}: later points will be skipped; run one worker config per invocation "
            "(e.g. --kv-blocks 4000 --cpu-blocks 0)")
        log(f"warning: {m.payload['warnings'][-1]}")


def _run_config(m: _Matrix, ci: int) -> None:
    """One worker configuration: its workers started, every load level run, the workers stopped."""
    args, budget = m.args, m.budget
    kv, cpu = m.configs[ci]
    t_start = time.monotonic()
    log(f"config {ci + 1}/{len(m.configs)}: starting {args.workers} x {args.preset} workers on {args.device}, "
        f"{kv} KV blocks, CPU tier {cpu} blocks")
    workers = start_workers(m.procs, args, kv, cpu)
    infos = [wait_for(f"{w.name} /health", lambda w=w: health(w), workers, args.startup_timeout, 0.5)
             for w in workers]
    model = http_json("GET", workers[0].url + "/v1/models")[1]["data"][0]["id"]
    budget.startup_s.append(time.monotonic() - t_start)
    log(f"workers up in {budget.startup_s[-1]:.0f} s: {infos[0].get('num_kv_blocks')} KV blocks of "
        f"{infos[0].get('block_size')}, {infos[0].get('attention_backend')} attention, model {model}")
    if args.calibrate:
        m.payload.setdefault("calibration", []).append(calibrate_workers(m.procs, workers, args, kv, cpu))
    if args.warmup_s > 0:
        warm_up(m, workers, model, kv, cpu)
    for conc in args.conc_list:
        run_s = _point_run_s(m, len(m.configs) - ci - 1, kv, cpu, conc)
        if run_s is None:
            continue
        point = {"kv_blocks": kv, "cpu_blocks": cpu, "concurrency": conc, "run_s": run_s,
                 "ideal_hit_rate": m.prep.ideal.session, "worker_info": infos[0], "runs": [], "routers": {}}
        _run_point(m, point, workers, model)
    for w in workers:
        m.procs.stop(w)


def warm_up(m: _Matrix, workers: list[Proc], model: str, kv: int, cpu: int) -> None:
    """Untimed traffic through round robin before the first measured run: fresh workers compile their
    kernels and grow their allocators on the first requests of each shape, and without this the
    first router of a configuration paid for it (TTFT up to 1.6x its later repeat). Not recorded;
    ``run_one`` resets the prefix caches before every measured run."""
    args = m.args
    t0 = time.monotonic()
    row = run_one(m.procs, SPECS["round_robin"], workers, m.prep, args, model, max(args.conc_list), args.warmup_s,
                  f"kv{kv}-cpu{cpu}-warmup")
    if not row.get("ok"):
        raise BenchError(f"warm-up failed: {row.get('error')}")
    m.budget.startup_s[-1] += time.monotonic() - t0  # the budget sizes runs from the startup it saw
    log(f"warmed up in {time.monotonic() - t0:.0f} s ({row['requests']} requests through round robin, not recorded)")


def _point_run_s(m: _Matrix, starts_left: int, kv: int, cpu: int, conc: int) -> float | None:
    """Seconds per run at this matrix point (fixed, or sized by the budget); None: the budget is spent (skipped)."""
    args, budget = m.args, m.budget
    if args.run_s is not None:
        return args.run_s
    run_s = budget.run_s(m.runs_total - m.runs_done, starts_left, args.min_run_s, args.max_run_s)
    point_runs = len(args.routers_list) * args.repeats
    if budget.left() < point_runs * (args.min_run_s + budget.overhead()):
        m.payload["warnings"].append(f"budget exhausted before kv {kv} cpu {cpu} conc {conc}: skipped")
        log(m.payload["warnings"][-1])
        return None
    return run_s


def calibrate_workers(procs: Procs, workers: list[Proc], args: argparse.Namespace, kv: int, cpu: int) -> dict[str, Any]:
    """``mesh calibrate`` on the idle workers, before any traffic: worker 0 alone (the other workers
    idle), then every worker at once (each measured while the others run the same probes: the
    timings of workers that share one GPU). The profiles' YAML texts, keyed "alone" and "shared"."""
    out = procs.log_dir
    top = min(16384, args.max_model_len // 2)

    def cmd(w: Proc, path: Path) -> list[str]:
        return [sys.executable, "-m", "mesh", "calibrate", "--url", w.url, "--out", str(path), "--kv-blocks", str(kv),
                "--block-size", str(args.block_size), "--max-prompt", str(top), "--max-batch", "16",
                "--timeout", str(args.request_timeout)]

    def finish(runs: list[tuple[subprocess.Popen[bytes], Path]]) -> list[str]:
        texts = []
        for proc, path in runs:
            if proc.wait(timeout=900) != 0 or not path.exists():
                raise BenchError(f"mesh calibrate failed (exit {proc.returncode}); see {path.with_suffix('.log')}")
            texts.append(path.read_text())
        return texts

    def launch(w: Proc, name: str) -> tuple[subprocess.Popen[bytes], Path]:
        path = out / f"profile-kv{kv}-cpu{cpu}-{name}.yaml"
        with open(path.with_suffix(".log"), "wb") as logf:
            return subprocess.Popen(cmd(w, path), stdout=logf, stderr=subprocess.STDOUT, cwd=ROOT), path

    t0 = time.monotonic()
    log(f"calibrating {workers[0].name} alone")
    alone = finish([launch(workers[0], "alone")])[0]
    log(f"calibrating all {len(workers)} workers at once ({time.monotonic() - t0:.0f} s so far)")
    shared = finish([launch(w, f"shared-{w.name}") for w in workers])
    log(f"calibration done in {time.monotonic() - t0:.0f} s")
    reset_caches(workers)
    return {"kv_blocks": kv, "cpu_blocks": cpu, "alone": alone, "shared": shared}


def _run_point(m: _Matrix, point: dict[str, Any], workers: list[Proc], model: str) -> None:
    """Every router's repeats at one matrix point; the point combined, printed and written to the JSON."""
    from simulator.report import write_json

    args, budget = m.args, m.budget
    kv, cpu, conc, run_s = point["kv_blocks"], point["cpu_blocks"], point["concurrency"], point["run_s"]
    log(f"point kv {kv} cpu {cpu} conc {conc}: {len(args.routers_list)} routers x {args.repeats}, "
        f"{f'{run_s:.0f} s' if run_s else 'the whole slice'} per run ({budget.left():.0f} s of budget left)")
    per_router: dict[str, list[dict[str, Any]]] = {r: [] for r in args.routers_list}
    for rep in range(args.repeats):
        # odd repeats run the routers in reverse (A B, B A, ...): a drift over the point's runs
        # (the GPU warming, the workers' memory) weighs on every router alike
        for name in (args.routers_list if rep % 2 == 0 else args.routers_list[::-1]):
            t_run = time.monotonic()
            tag = f"kv{kv}-cpu{cpu}-c{conc}-r{rep}"
            row = run_one(m.procs, SPECS[name], workers, m.prep, args, model, conc, run_s, tag)
            row["repeat"] = rep
            m.runs_done += 1
            took = time.monotonic() - t_run
            budget.overhead_s.append(max(0.0, took - (run_s or 0.0)))
            per_router[name].append(row)
            point["runs"].append({k: v for k, v in row.items() if k != "summary"})
            if row.get("ok"):
                log(f"  {name}: {row['requests']:,} requests, {row['errors']} errors, TTFT mean "
                    f"{row['ttft_ms']['mean']:.1f} ms, p99 {row['ttft_ms']['p99']:.1f} ms, hit "
                    f"{row['hit_rate']:.1%} (workers {row['worker_hit_rate']:.1%}), {took:.0f} s")
            else:
                m.exit_code = 1
    point["routers"] = {name: combine(rows) for name, rows in per_router.items()}
    add_ratios(point["routers"])
    m.payload["points"].append(point)
    print_point(point, args.width)
    write_json(args.json_out, m.payload)


if __name__ == "__main__":
    sys.exit(main())
