"""Prefill/decode disaggregation vs mixed workers on the same GPU(s), under a mixed load of
long prompts and ongoing decodes: decode inter-token latency (ITL) and time to first token.

Two configurations, each measured in the same run on the same devices:
- ``mixed``: one mixed ``mesh worker`` per device; every request goes to the worker with the fewest
  requests in flight (long prefills interleave with decode steps in the same batches);
- ``disagg``: a prefill worker on the first device and a decode worker on the last one (the same
  device when only one is given: two processes share it); every request goes through the gateway
  relay (``mesh.gateway.disagg_relay.relay_disaggregated``): prefill there, KV moved, decode here. On one host
  with CUDA the KV moves GPU to GPU over CUDA IPC (``workers.transfer.kv_ipc``);
- ``disagg-tcp``: the same with ``--kv-transfer-ipc off``: the KV is pulled over TCP, as between
  hosts.

Load: ``--decoders`` closed-loop streams (short prompt, ``--decode-tokens`` greedy tokens each,
one after another) whose token gaps are the ITL samples, plus long prompts (``--long-prompt``
tokens, 8 output tokens) arriving as a Poisson process at ``--long-rate`` per second. After
``--warmup`` seconds, ``--duration`` seconds are measured. Random-weight presets (no download),
random token prompts, ignore_eos. Ratios are disagg / mixed (below 1 is better).

    python bench/disagg.py --preset llama3-8b --devices cuda:0,cuda:1 [--json bench/results/disagg.json]
    python bench/disagg.py --smoke            # tiny preset on CPU, a few seconds: checks the harness
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import argparse
import asyncio
import json
import os
import random
import secrets
import statistics
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import httpx

from mesh.core.keys import block_keys, namespace_seed
from mesh.core.router import Router
from mesh.gateway.disagg_relay import DecodeQueue, RelayConfig, RelayError, relay_disaggregated
from policies import create_policy
from policies.base import RequestInfo, Role, TargetState
from workers.transfer.auth import SECRET_ENV

REPO = Path(__file__).resolve().parents[1]
BS = 16
BENCH_SECRET = secrets.token_hex(16)  # the workers sign their kv_transfer_params (and may use CUDA IPC)


@dataclass
class Samples:
    itl: list[float] = field(default_factory=list)  # seconds between a decode stream's tokens
    decode_ttft: list[float] = field(default_factory=list)
    long_ttft: list[float] = field(default_factory=list)
    long_latency: list[float] = field(default_factory=list)
    tokens: int = 0
    errors: int = 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_worker(args: argparse.Namespace, role: str, device: str, log_dir: Path, name: str,
                 extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "workers.server.cli", "--preset", args.preset, "--host", "127.0.0.1", "--port", str(port),
           "--device", device, "--role", role, "--num-kv-blocks", str(args.kv_blocks),
           "--max-num-batched-tokens", str(args.max_batched_tokens), "--log-level", "warning"]
    if device == "cpu":
        cmd += ["--cpu-threads", "1"]
    cmd += list(extra)
    log = open(log_dir / f"{name}.log", "wb")  # noqa: SIM115 (the child owns it)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                                 SECRET_ENV: BENCH_SECRET})
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(urls: list[str], procs: list[subprocess.Popen[bytes]], timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    for url, proc in zip(urls, procs, strict=True):
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"worker {url} exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} not healthy")
            time.sleep(0.5)


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    import signal

    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)


class Target:
    """Where a request goes: ``mixed`` (least in flight), ``disagg``/``disagg-tcp`` (the relay),
    ``disagg-local`` (the relay, except prompts the decode worker would prefill in at most
    ``--local-prefill-tokens`` uncached tokens: those go to it directly)."""

    def __init__(self, mode: str, urls: dict[str, str], model: str, client: httpx.AsyncClient,
                 local_prefill_tokens: int = 0) -> None:
        self.mode, self.urls, self.model, self.client = mode, urls, model, client
        self.in_flight = {u: 0 for u in urls.values()}
        self.queue = DecodeQueue(256)
        self.local_requests = 0
        if mode != "mixed":
            targets = {n: TargetState(id=n, worker=n, url=u, role=Role(n.rstrip("0123456789")), models=frozenset({model}),
                                      block_size=BS) for n, u in urls.items()}
            params: dict[str, Any] = {"profiles": {"prefill": {"scorers": ["prefill_load"]}, "decode": {"scorers": ["load"]}}}
            if mode == "disagg-local":
                params["local_prefill_tokens"] = local_prefill_tokens
            self.router = Router(create_policy({"name": "pipeline", "params": params}), targets)

    async def stream(self, prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
        """Send one streaming request; (time to first token, arrival time of every token event)."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        t0 = time.perf_counter()
        if self.mode == "mixed":
            arrivals = await self._direct(min(self.in_flight, key=self.in_flight.__getitem__), body)
        else:
            keys = block_keys(prompt, BS, namespace_seed(self.model))
            info = RequestInfo(self.model, keys, BS, len(prompt), max_tokens)
            decision = self.router.decide(info, time.monotonic())
            if decision.decode_target is None:  # conditional disaggregation: prefilled where it decodes
                self.local_requests += 1
                arrivals = await self._direct(self.urls[decision.target], body)
            else:
                arrivals = await self._relayed(info, body, decision)
        if not arrivals:
            raise RuntimeError("no token arrived")
        return arrivals[0] - t0, arrivals

    async def _direct(self, url: str, body: dict[str, Any]) -> list[float]:
        arrivals: list[float] = []
        self.in_flight[url] += 1
        try:
            async with self.client.stream("POST", f"{url}/v1/completions", json=body, timeout=3600) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        arrivals.append(time.perf_counter())
        finally:
            self.in_flight[url] -= 1
        return arrivals

    async def _relayed(self, info: RequestInfo, body: dict[str, Any], decision: Any) -> list[float]:
        arrivals: list[float] = []
        resp = await relay_disaggregated(self.client, self.router, info, body, decision, queue=self.queue,
                                         config=RelayConfig(timeout_s=3600, queue_wait_s=600))
        try:
            buf = b""
            async for chunk in resp.body():
                now = time.perf_counter()
                buf += chunk
                *lines, buf = buf.split(b"\n")
                arrivals += [now for ln in lines if ln.startswith(b"data: {")]
        finally:
            await resp.aclose()
        return arrivals


async def run_load(target: Target, args: argparse.Namespace, vocab: int) -> Samples:
    rng = random.Random(0)
    samples = Samples()
    start = time.perf_counter()
    measure_from, stop_at = start + args.warmup, start + args.warmup + args.duration

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(n)]

    async def decoder() -> None:
        while time.perf_counter() < stop_at:
            try:
                ttft, arrivals = await target.stream(prompt(args.decode_prompt), args.decode_tokens)
            except (httpx.HTTPError, RelayError, RuntimeError):
                samples.errors += 1
                continue
            if arrivals[0] >= measure_from and arrivals[-1] <= stop_at:
                samples.decode_ttft.append(ttft)
            samples.itl += [b - a for a, b in zip(arrivals, arrivals[1:]) if measure_from <= a and b <= stop_at]
            samples.tokens += len(arrivals)

    async def long_one() -> None:
        t0 = time.perf_counter()
        try:
            ttft, arrivals = await target.stream(prompt(args.long_prompt), 8)
        except (httpx.HTTPError, RelayError, RuntimeError):
            samples.errors += 1
            return
        if t0 >= measure_from:
            samples.long_ttft.append(ttft)
            samples.long_latency.append(arrivals[-1] - t0)

    async def arrivals() -> None:
        tasks = []
        while time.perf_counter() < stop_at:
            await asyncio.sleep(rng.expovariate(args.long_rate))
            tasks.append(asyncio.create_task(long_one()))
        await asyncio.gather(*tasks)

    await asyncio.gather(*(decoder() for _ in range(args.decoders)), arrivals())
    return samples


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def summarize(s: Samples) -> dict[str, float]:
    return {
        "itl_p50_ms": pct(s.itl, 50) * 1e3, "itl_p99_ms": pct(s.itl, 99) * 1e3,
        "itl_p999_ms": pct(s.itl, 99.9) * 1e3, "itl_max_ms": max(s.itl, default=float("nan")) * 1e3,
        # prefill stalls are rare per token (a few steps per long prompt): count them directly
        "itl_over_100ms": sum(x > 0.1 for x in s.itl),
        "decode_ttft_p50_ms": pct(s.decode_ttft, 50) * 1e3,
        "long_ttft_p50_ms": pct(s.long_ttft, 50) * 1e3, "long_ttft_p99_ms": pct(s.long_ttft, 99) * 1e3,
        "long_latency_p50_ms": pct(s.long_latency, 50) * 1e3,
        "itl_samples": len(s.itl), "long_requests": len(s.long_ttft), "errors": s.errors,
        "itl_mean_ms": statistics.fmean(s.itl) * 1e3 if s.itl else float("nan"),
    }


def transfer_counters(url: str) -> dict[str, float]:
    """The decode worker's KV transfer counters (how many blocks came over IPC vs the network)."""
    with urllib.request.urlopen(f"{url}/kv_transfer/status", timeout=30) as r:
        d = json.load(r)
    return {k: d[k] for k in ("decode_blocks_pulled", "decode_blocks_copied_ipc", "decode_bytes_pulled",
                              "decode_blocks_local", "leaked_blocks") if k in d}


def measure(mode: str, args: argparse.Namespace, devices: list[str], log_dir: Path) -> dict[str, float]:
    from workers.config import get_preset

    if mode == "mixed":
        roles = [("mixed", d, f"mixed{i}", ()) for i, d in enumerate(devices)]
    else:
        ipc = ("--kv-transfer-ipc", "off" if mode == "disagg-tcp" else "auto")  # disagg, disagg-local: IPC
        roles = [("prefill", devices[0], "prefill0", ()), ("decode", devices[-1], "decode0", ipc)]
    started = [start_worker(args, role, dev, log_dir, name, extra) for role, dev, name, extra in roles]
    procs, urls = [p for p, _ in started], [u for _, u in started]
    try:
        wait_healthy(urls, procs)
        vocab = min(get_preset(args.preset).vocab_size, 32000)

        async def main() -> Samples:
            limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200)
            async with httpx.AsyncClient(limits=limits, timeout=3600) as client:
                target = Target(mode, {n: u for (_, _, n, _), u in zip(roles, urls, strict=True)}, args.preset, client,
                                args.local_prefill_tokens)
                samples = await run_load(target, args, vocab)
                local[0] = target.local_requests
                return samples

        local = [0]
        out = summarize(asyncio.run(main()))
        out["local_prefills"] = local[0]
        if mode != "mixed":
            out.update(transfer_counters(urls[-1]))
        return out
    finally:
        stop(procs)


def parse_args() -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The parser (for later errors) and the arguments, ``--smoke``'s sizes applied."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama3-8b")
    p.add_argument("--devices", default="cuda:0,cuda:1", help="comma-separated; one device: both workers share it")
    p.add_argument("--decoders", type=int, default=32)
    p.add_argument("--decode-prompt", type=int, default=256)
    p.add_argument("--decode-tokens", type=int, default=256)
    p.add_argument("--long-prompt", type=int, default=16384)
    p.add_argument("--long-rate", type=float, default=0.5, help="long prompts per second (Poisson)")
    p.add_argument("--warmup", type=float, default=20.0)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--kv-blocks", type=int, default=16384)
    p.add_argument("--max-batched-tokens", type=int, default=8192)
    p.add_argument("--smoke", action="store_true", help="tiny preset on CPU, seconds (checks the harness)")
    p.add_argument("--modes", default="mixed,disagg,disagg-tcp",
                   help="configurations to measure (mixed first; also disagg-local: conditional disaggregation)")
    p.add_argument("--local-prefill-tokens", type=int, default=2048,
                   help="disagg-local: prompts with at most this many uncached tokens prefill on the decode worker")
    p.add_argument("--json", default="bench/results/disagg.json")
    args = p.parse_args()
    if args.smoke:
        args.preset, args.devices, args.decoders, args.decode_prompt, args.decode_tokens = "tiny", "cpu", 2, 32, 24
        args.long_prompt, args.long_rate, args.warmup, args.duration, args.kv_blocks = 600, 1.0, 2.0, 6.0, 1024
    return p, args


KEYS = ("itl_p50_ms", "itl_p99_ms", "itl_p999_ms", "long_ttft_p50_ms", "long_ttft_p99_ms", "decode_ttft_p50_ms")


def measure_all(modes: list[str], args: argparse.Namespace, devices: list[str], log_dir: Path) -> dict[str, Any]:
    from rich.progress import Progress

    results: dict[str, Any] = {}
    with Progress() as progress:
        task = progress.add_task("configurations", total=len(modes))
        for mode in modes:
            progress.update(task, description=f"{mode} ({args.warmup + args.duration:.0f} s)")
            results[mode] = measure(mode, args, devices, log_dir)
            progress.advance(task)
    return results


def print_results(args: argparse.Namespace, devices: list[str], modes: list[str], results: dict[str, Any],
                  ratios: dict[str, dict[str, float]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{args.preset}: {args.decoders} decode streams + {args.long_prompt}-token prompts at "
                        f"{args.long_rate}/s on {', '.join(devices)}")
    cols = ["config", "ITL p50 ms", "ITL p99 ms", "ITL p99.9 ms", "long TTFT p50 ms", "long TTFT p99 ms",
            "decode TTFT p50 ms", "errors"]
    for c in cols:
        table.add_column(c, no_wrap=c == "config")
    for mode in modes:
        r = results[mode]
        table.add_row(mode, *(f"{r[k]:.1f}" for k in KEYS), str(r["errors"]))
    for mode, ratio in ratios.items():
        table.add_row(f"{mode}/mixed", *(f"{ratio.get(k, float('nan')):.2f}" for k in KEYS), "")
    Console().print(table)


def write_results(args: argparse.Namespace, devices: list[str], results: dict[str, Any],
                  ratios: dict[str, dict[str, float]]) -> None:
    out = {"config": vars(args), "devices": devices, "results": results, "ratios_over_mixed": ratios}
    try:
        import torch

        out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 (informational)
        out["gpus"] = []
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))


def main() -> int:
    p, args = parse_args()
    devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    log_dir = Path(os.environ.get("OUT", "/tmp")) / "disagg-bench-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or modes[0] != "mixed" or not set(modes) <= {"mixed", "disagg", "disagg-tcp", "disagg-local"}:
        p.error("--modes: mixed first, then any of disagg, disagg-tcp, disagg-local")
    results = measure_all(modes, args, devices, log_dir)
    ratios = {m: {k: results[m][k] / results["mixed"][k] for k in KEYS if results["mixed"][k]} for m in modes[1:]}
    print_results(args, devices, modes, results, ratios)
    write_results(args, devices, results, ratios)
    return 0


if __name__ == "__main__":
    sys.exit(main())
