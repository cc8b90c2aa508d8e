"""``mesh up [--workers N] [--port P] [--engine echo|bundled]``: a local cluster on embedded defaults.

Starts N local workers as subprocesses (each in its own process group, and each ended by the
kernel if this process dies, even by SIGKILL), waits until each answers ``/health``, then runs the
gateway in this process, prints the URL and a ready-to-paste curl, and on Ctrl-C or SIGTERM stops
the gateway (requests in flight finish, up to ``--shutdown-timeout``; a second signal stops at
once) and then every worker. A worker that exits while the cluster runs stops the whole cluster:
its name, exit status and log are printed and ``mesh up`` exits 1 (a cluster silently short of a
worker is the worse surprise).

- ``bundled`` (default): ``mesh worker --preset demo`` (``--preset`` picks another), the bundled
  engine (needs the ``engine`` extra, i.e. torch) on CPU with no download, with its KV events
  published on local ZMQ ports that the gateway config names per worker, so the default policy
  (session-sticky over precise KV-aware routing) routes on the engines' real caches. The demo
  preset is tiny's random-weight model whose next token comes from a script
  (``workers.engine.demo_sampler``): readable answers saying which worker served the request and
  how many prompt tokens its prefix cache held, through the real engine.

While the workers start, each one's phase (starting, loading model, ready) and seconds are shown
(``mesh.commands.up_progress``), as lines when the output is no terminal.
- ``echo``: ``python -m mesh.echo_worker`` (no model, instant, no KV events).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mesh.commands.graceful import add_argument as add_shutdown_argument
from mesh.commands.serve import add_access_log_argument
from mesh.commands.up_progress import wait_healthy
from workers.transfer.auth import SECRET_ENV  # no torch: a constant and hmac helpers

READY_TIMEOUT_S = {"echo": 60.0, "bundled": 600.0}
MAX_LOCAL_WORKERS = 64  # processes on this one machine (a huge count would start them one by one for hours)


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("up", help="start a local cluster: N workers and the gateway")
    p.add_argument("--workers", type=int, default=2, help="number of local workers (default 2)")
    p.add_argument("--port", type=int, default=8000, help="gateway port (default 8000)")
    p.add_argument("--host", default="127.0.0.1",
                   help="gateway listen address (the workers, their KV event publishers and KV transfers "
                        "listen on 127.0.0.1 whatever it is)")
    p.add_argument("--engine", choices=["echo", "bundled"], default="bundled",
                   help="bundled: the bundled engine on CPU with KV events (default); echo: instant echo workers")
    p.add_argument("--preset", default="demo",
                   help="the bundled workers' preset: demo (tiny's model, scripted readable answers; default), "
                        "tiny (the raw random-weight model's bytes), or any mesh worker --preset")
    p.add_argument("--policy", default=None, metavar="NAME_OR_YAML",
                   help="routing policy: a built-in name, module:Class, or a YAML file with a 'policy:' key, "
                        "e.g. examples/pipeline.yaml (default: session_sticky over kv_aware)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"], help="gateway log level")
    p.add_argument("--base-port", type=int, default=None, metavar="N",
                   help="pin the worker ports: worker i listens on N+i (bundled: its KV events on N+W+2i and "
                        "N+W+2i+1, W workers); default: free ports picked at start")
    p.add_argument("--prefill", type=int, default=0, help="disaggregated: N prefill workers (bundled engine)")
    p.add_argument("--decode", type=int, default=0, help="disaggregated: M decode workers (bundled engine)")
    add_access_log_argument(p)
    add_shutdown_argument(p)
    p.set_defaults(func=run)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# ``mesh up --prefill N --decode M``: prefill and decode profiles (examples/pipeline_pd.yaml).
PD_POLICY: dict[str, Any] = {"name": "pipeline", "params": {"profiles": {
    "prefill": {"scorers": [{"name": "prefix", "weight": 2}, {"name": "prefill_load", "weight": 1}]},
    "decode": {"filters": ["healthy", "model_match", "admission_headroom"],
               "scorers": [{"name": "load", "weight": 1}, {"name": "kv_utilization", "weight": 1}]},
}}}


def worker_command(engine: str, port: int, name: str, kv_ports: tuple[int, int] | None = None, role: str = "mixed",
                   preset: str = "demo") -> list[str]:
    if engine == "echo":
        return [sys.executable, "-m", "mesh.echo_worker", "--port", str(port), "--name", name]
    cmd = [sys.executable, "-m", "workers.server.cli", "--preset", preset, "--worker-name", name,
           "--host", "127.0.0.1", "--port", str(port)]
    if role != "mixed":
        cmd += ["--role", role]
    if kv_ports is not None:
        # vLLM's convention (workers.server.kv_events): the publisher binds a wildcard address and
        # connects to any other; the gateway's subscriber connects to 127.0.0.1.
        cmd += ["--kv-events-endpoint", f"tcp://*:{kv_ports[0]}",
                "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{kv_ports[1]}"]  # fmt: skip
    return cmd


@dataclass
class LocalWorker:
    name: str
    port: int
    proc: subprocess.Popen[bytes]
    kv_ports: tuple[int, int] | None = None  # (events, replay) for the bundled engine
    role: str = "mixed"

    def config(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "url": f"http://127.0.0.1:{self.port}"}
        if self.role != "mixed":
            out["role"] = self.role
        if self.kv_ports is not None:
            out["kv_events"] = {
                "endpoint": f"tcp://127.0.0.1:{self.kv_ports[0]}",
                "replay_endpoint": f"tcp://127.0.0.1:{self.kv_ports[1]}",
            }
        return out


def worker_ports(engine: str, n: int, base_port: int | None) -> list[tuple[int, tuple[int, int] | None]]:
    """Each worker's HTTP port and (bundled) KV event ports: free ones, or pinned from ``base_port``
    (worker i on base+i; its events on base+n+2i and base+n+2i+1)."""
    out: list[tuple[int, tuple[int, int] | None]] = []
    for i in range(n):
        if base_port is None:
            out.append((free_port(), (free_port(), free_port()) if engine == "bundled" else None))
        else:
            kv = base_port + n + 2 * i
            out.append((base_port + i, (kv, kv + 1) if engine == "bundled" else None))
    return out


def pinned_ports(engine: str, n: int, base_port: int) -> list[int]:
    return [p for port, kv in worker_ports(engine, n, base_port) for p in (port, *(kv or ()))]


def start_workers(engine: str, n: int, log_dir: Path, roles: list[str] | None = None,
                  base_port: int | None = None, preset: str = "demo") -> list[LocalWorker]:
    # one secret per local cluster: its workers sign and check kv_transfer_params (workers.transfer.auth)
    env = {**os.environ, SECRET_ENV: os.environ.get(SECRET_ENV) or secrets.token_hex(32)}
    out = []
    roles = roles or ["mixed"] * n
    for i, (role, (port, kv_ports)) in enumerate(zip(roles, worker_ports(engine, len(roles), base_port), strict=True)):
        name = f"worker-{i}" if role == "mixed" else f"{role}-{i}"
        log = open(log_dir / f"{name}.log", "wb")  # noqa: SIM115  (owned by the child)
        proc = subprocess.Popen(
            worker_command(engine, port, name, kv_ports, role, preset), stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, env=env, preexec_fn=_die_with_parent(os.getpid()),
        )
        out.append(LocalWorker(name, port, proc, kv_ports, role))
    return out


def _die_with_parent(parent: int) -> Any:
    """A preexec_fn: the kernel SIGTERMs the worker when ``mesh up`` dies, however it dies (a
    SIGKILL runs no finally: without this its workers would run on, holding their ports). Linux only."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # loaded here: nothing to import after fork

    def arm() -> None:
        prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the line above
            os.kill(os.getpid(), signal.SIGTERM)

    return arm


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 5.0) -> None:
    """SIGTERM the process group, SIGKILL it if it lingers."""
    stop_processes([proc], timeout_s)


def stop_processes(procs: list[subprocess.Popen[bytes]], timeout_s: float = 5.0) -> None:
    """SIGTERM every process group at once, then SIGKILL those still there after ``timeout_s``
    (one deadline for all: stopping 64 workers took up to 64 times 5 s, one after the other)."""
    for proc in procs:
        _killpg(proc, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _killpg(proc, signal.SIGKILL)
            proc.wait()


def _killpg(proc: subprocess.Popen[bytes], sig: int) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass


def exited(workers: list[LocalWorker], log_dir: Path) -> str | None:
    """How the first worker that exited did, in one line and its log's tail; None while all run."""
    for w in workers:
        code = w.proc.poll()
        if code is not None:
            how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            log = log_dir / f"{w.name}.log"
            tail = "".join(f"  | {line}\n" for line in _tail_lines(log, 5))
            return f"mesh up: {w.name} (pid {w.proc.pid}, port {w.port}) {how}; its log: {log}\n{tail}"
    return None


def _tail_lines(path: Path, n: int) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return []


async def watch_workers(workers: list[LocalWorker], log_dir: Path, server: Any, failures: list[str]) -> None:
    """While the cluster runs: the first worker to exit is reported and stops the cluster."""
    import asyncio

    while not server.should_exit:
        report = exited(workers, log_dir)
        if report is not None:
            failures.append(report)
            print(report + "mesh up: stopping the cluster", file=sys.stderr, flush=True)
            server.stop()
            return
        await asyncio.sleep(0.2)


def run(args: argparse.Namespace) -> int:
    roles = ["prefill"] * args.prefill + ["decode"] * args.decode
    if roles:
        args.engine = "bundled"  # only the bundled engine transfers KV
    problem = args_problem(args, roles)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    log_dir = Path(tempfile.mkdtemp(prefix="mesh-up-"))
    workers = start_workers(args.engine, len(roles) or args.workers, log_dir, roles or None, args.base_port,
                            args.preset)
    # SIGTERM behaves like Ctrl-C: unwind through the finally below, which stops the workers.
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        try:
            wait_healthy(workers, READY_TIMEOUT_S[args.engine], log_dir)
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        return serve_cluster(args, roles, workers, log_dir)
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        stop_processes([w.proc for w in workers])
        print("mesh up: stopped", file=sys.stderr)


def args_problem(args: argparse.Namespace, roles: list[str]) -> str | None:
    """The first reason not to start (a bad flag, a config or address the gateway cannot use, no
    torch for the bundled engine), found before any worker starts; None when there is none."""
    if roles and (args.prefill < 1 or args.decode < 1):
        return "a disaggregated cluster needs --prefill >= 1 and --decode >= 1"
    if args.shutdown_timeout < 0:
        return f"--shutdown-timeout must be >= 0, not {args.shutdown_timeout:g}"
    if args.workers < 1:
        return "--workers must be at least 1"
    if max(args.workers, len(roles)) > MAX_LOCAL_WORKERS:
        return (f"--workers must be <= {MAX_LOCAL_WORKERS} (and --prefill + --decode too): a local cluster "
                f"on one machine; use `mesh serve` with a config for more")
    problem = preflight(args, roles) or base_port_problem(args, roles)  # before any worker starts (minutes)
    if problem is not None:
        return problem
    if args.engine == "bundled":
        from workers.config import PRESETS  # no torch: the model shapes only

        if args.preset not in PRESETS:
            return f"--preset {args.preset!r}: unknown (known: {', '.join(sorted(PRESETS))})"
    if args.engine == "bundled" and importlib.util.find_spec("torch") is None:
        return "the bundled engine needs torch: pip install -e '.[engine]' (or run `mesh up --engine echo`)"
    return None


def serve_cluster(args: argparse.Namespace, roles: list[str], workers: list[LocalWorker], log_dir: Path) -> int:
    """Run the gateway over the healthy ``workers`` until it stops; the exit status (1 when a
    worker exited meanwhile, or the gateway never started)."""
    import asyncio

    from mesh.commands.serve import gateway_server, uvicorn_config
    from mesh.config import parse_config
    from mesh.gateway.app import create_app

    admin_key = secrets.token_urlsafe(16)
    data: dict[str, Any] = {
        "server": {"host": args.host, "port": args.port, "admin_key": admin_key,
                   "access_log": "json" if args.access_log == "json" else "off"},
        "workers": [w.config() for w in workers],
    }
    data.update(policy_data(args, roles))
    config = parse_config(data, "mesh up")
    app = create_app(config)
    uv_config = uvicorn_config(app, args.host, args.port, log_level=args.log_level, server=config.server,
                               access_log=args.access_log == "text")
    server = gateway_server(app, uv_config, args.shutdown_timeout, name="mesh up")
    failures: list[str] = []

    async def serve() -> None:
        task = asyncio.create_task(server.serve())
        watch = asyncio.create_task(watch_workers(workers, log_dir, server, failures))
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started and not server.should_exit:
            await asyncio.to_thread(_banner, args, workers, admin_key, log_dir)
        await task
        watch.cancel()

    asyncio.run(serve())
    return 1 if failures or not server.started else server.exit_code


def policy_data(args: argparse.Namespace, roles: list[str]) -> dict[str, Any]:
    if args.policy:
        from mesh.commands.policy_arg import load_policy_arg

        return {"policy": load_policy_arg(args.policy)[1]}  # a YAML file's spec, not its path as a policy name
    return {"policy": PD_POLICY} if roles else {}


def preflight(args: argparse.Namespace, roles: list[str]) -> str | None:
    """What would stop the gateway from starting (config, address), found before any worker
    starts; None when nothing. One line (``policy: ...``, ``cannot listen on ...``)."""
    from mesh.config import ConfigError, parse_config
    from policies.registry import PluginError

    try:
        parse_config({"server": {"host": args.host, "port": args.port}, **policy_data(args, roles)}, "mesh up")
    except ConfigError as exc:
        return "; ".join(exc.errors)
    except PluginError as exc:
        return f"--policy: {exc}"
    return bind_problem(args.host, args.port)


def base_port_problem(args: argparse.Namespace, roles: list[str]) -> str | None:
    """Why the pinned worker ports (``--base-port``) cannot be used: out of range, the gateway's
    port among them, or one already taken."""
    if args.base_port is None:
        return None
    ports = pinned_ports(args.engine, len(roles) or args.workers, args.base_port)
    if args.base_port < 1 or max(ports) > 65535:
        return f"--base-port {args.base_port}: the worker ports {min(ports)}-{max(ports)} must lie in 1-65535"
    if args.port in ports:
        return f"--base-port {args.base_port}: the worker ports {min(ports)}-{max(ports)} include the gateway's --port {args.port}"
    for port in ports:
        problem = bind_problem("127.0.0.1", port)
        if problem is not None:
            return f"--base-port {args.base_port}: {problem}"
    return None


def bind_problem(host: str, port: int) -> str | None:
    """Why the gateway could not listen on ``host:port`` (probed as uvicorn binds: SO_REUSEADDR)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        return f"--host {host!r}: {exc}"
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as exc:
            return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return None


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def first_model(port: int) -> str:
    """The first model id a worker serves (for the banner's curl)."""
    import json

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as resp:
            return str(json.load(resp)["data"][0]["id"])
    except Exception:  # noqa: BLE001
        return "MODEL"


def _banner(args: argparse.Namespace, workers: list[LocalWorker], admin_key: str, log_dir: Path) -> None:
    url = f"http://{args.host}:{args.port}"
    model = first_model(workers[0].port)
    preset = f", preset {args.preset}" if args.engine == "bundled" else ""
    demo = ("The demo preset's answers are scripted (random weights): they say which worker served the request\n"
            "and how many prompt tokens came from its prefix cache; send the curl twice.\n\n"
            if args.engine == "bundled" and args.preset == "demo" else "")
    print(
        f"\nMesh is up at {url} with {len(workers)} {args.engine} workers{preset} "
        f"({', '.join(f'{w.name}:{w.port}' for w in workers)}); worker logs in {log_dir}\n"
        f"Admin key: {admin_key}\n\n"
        f"  curl {url}/v1/chat/completions -H 'content-type: application/json' -H 'x-session-id: demo' \\\n"
        f"    -d '{{\"model\": \"{model}\", \"max_tokens\": 300, "
        f"\"messages\": [{{\"role\": \"user\", \"content\": \"hello mesh\"}}]}}'\n\n"
        f"{demo}"
        f"Why that worker: the same body to {url}/debug/route (per-worker prefix overlap and cost)\n"
        f"Metrics: {url}/metrics   Workers: curl -H 'authorization: Bearer {admin_key}' {url}/workers\n"
        "Press Ctrl-C to stop.\n",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mesh")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["up", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
