"""Mesh's processes under real signals, as an operator drives them.

``mesh serve``, ``mesh up`` and ``mesh worker`` drain on SIGTERM for a bounded time, then end what
is still in flight with a clean error (a stream's error event and [DONE]; a 503), exit 0, and a
second signal stops them at once (exit 1); ``mesh up`` leaves no worker behind, even when it is
SIGKILLed, and stops the whole cluster, naming the worker, when one of its workers dies.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import httpx

from tests.procs import PYTHON, ProcessGroup, free_port, wait_http, wait_until
from tests.support.shutdown import LONG, StreamReader, refused


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (forked by its main thread)."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def in_flight(url: str) -> float:
    """Requests the worker runs or queues, from its /metrics (vLLM's names)."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
            total += float(line.rsplit(" ", 1)[1])
    return total


def assert_ended_with_error(reader: StreamReader) -> None:
    reader.join()
    assert reader.error is None, f"the stream was cut off: {reader.error!r}"
    assert reader.status == 200
    assert reader.lines[-1] == "data: [DONE]"
    assert any("error" in e for e in reader.events()), reader.lines[-3:]
    assert any(e.get("choices") for e in reader.events())  # it was mid-answer


def serve_gateway(procs: ProcessGroup, tmp_path: Path, *extra: str) -> tuple[Any, int]:
    worker = procs.echo_worker("w0", "--token-delay-s", "0.2", "--repeat", "200")
    port = free_port()
    config = tmp_path / "mesh.yaml"
    config.write_text(f"server: {{port: {port}}}\nworkers:\n  - {{name: w0, url: '{worker.url}'}}\n")
    cmd = [PYTHON, "-m", "mesh", "serve", "--config", str(config), "--log-level", "warning", *extra]
    return procs.start_http(cmd, name="gateway", port=port, ready_path="/ready"), port


def test_serve_sigterm_drains_then_ends_a_long_stream_cleanly_and_exits_0(procs: ProcessGroup, tmp_path: Path) -> None:
    """A SIGTERM'd gateway waited for a long stream for as long as it lasted (uvicorn has no
    bound) and then exited by the signal (status -15), not 0."""
    gateway, port = serve_gateway(procs, tmp_path, "--shutdown-timeout", "1")
    short = StreamReader(f"{gateway.url}/v1/completions", {**LONG, "max_tokens": 3})
    long = StreamReader(f"{gateway.url}/v1/completions", LONG)
    assert long.started.wait(20) and short.started.wait(20)
    os.kill(gateway.pid, signal.SIGTERM)
    wait_until(lambda: refused(port), what="new connections refused")
    assert gateway.popen.wait(30) == 0, gateway.log_tail()
    short.join()
    assert short.error is None and short.lines[-1] == "data: [DONE]"
    assert not any("error" in e for e in short.events())  # finished within the drain
    assert_ended_with_error(long)
    assert "ending 1 request(s) with an error" in gateway.log_tail()


def test_serve_second_sigterm_stops_at_once(procs: ProcessGroup, tmp_path: Path) -> None:
    """Only a second SIGINT forced uvicorn out of a drain; a second SIGTERM did nothing."""
    gateway, _ = serve_gateway(procs, tmp_path, "--shutdown-timeout", "120")
    long = StreamReader(f"{gateway.url}/v1/completions", LONG)
    assert long.started.wait(20)
    os.kill(gateway.pid, signal.SIGTERM)
    wait_until(lambda: "send it again to stop now" in gateway.log_tail(), what="the drain announced")
    os.kill(gateway.pid, signal.SIGTERM)
    assert gateway.popen.wait(30) == 1, gateway.log_tail()  # well before the 120 s drain
    assert "SIGTERM again: stopping now" in gateway.log_tail()


def start_up(procs: ProcessGroup, *extra: str, env: dict[str, str] | None = None) -> tuple[Any, list[int]]:
    port = free_port()
    cmd = [PYTHON, "-m", "mesh", "up", "--engine", "echo", "--workers", "2", "--port", str(port), *extra]
    up = procs.start(cmd, name="up", port=port, env=env)
    wait_http(f"http://127.0.0.1:{port}/ready", proc=up, timeout_s=60)
    workers = children(up.pid)
    assert len(workers) == 2, workers
    return up, workers


def test_up_sigterm_with_a_stream_in_flight_stops_everything(procs: ProcessGroup) -> None:
    up, workers = start_up(procs, "--shutdown-timeout", "1",
                           env={"MESH_ECHO_TOKEN_DELAY_S": "0.2", "MESH_ECHO_REPEAT": "200"})
    long = StreamReader(f"{up.url}/v1/completions", LONG)
    assert long.started.wait(20)
    os.kill(up.pid, signal.SIGTERM)
    assert up.popen.wait(30) == 0, up.log_tail()
    assert_ended_with_error(long)
    assert not [pid for pid in workers if running(pid)]


def test_up_sigkilled_leaves_no_worker_running(procs: ProcessGroup) -> None:
    """A SIGKILLed ``mesh up`` runs no finally, yet its workers die with it (none left running,
    ports held)."""
    up, workers = start_up(procs)
    os.kill(up.pid, signal.SIGKILL)
    up.popen.wait(10)
    wait_until(lambda: not any(running(pid) for pid in workers), what="the workers gone with mesh up")


def test_up_stops_the_cluster_and_names_a_worker_that_died(procs: ProcessGroup) -> None:
    """A worker killed under ``mesh up`` stops the cluster (exit 1), naming the worker, instead of
    the cluster running on one worker short."""
    up, workers = start_up(procs)
    os.kill(workers[1], signal.SIGKILL)
    assert up.popen.wait(30) == 1, up.log_tail()
    log = up.log_tail()
    assert "worker-1 (pid %d" % workers[1] in log and "was killed by SIGKILL" in log
    assert "its log: " in log and "worker-1.log" in log
    assert not running(workers[0])


def test_worker_sigterm_ends_requests_in_flight_cleanly_and_frees_its_ports(procs: ProcessGroup) -> None:
    """``mesh worker`` drains for a bounded time (a long generation does not hold a SIGTERM for as
    long as it runs) and exits 0, not -15; at the timeout every request gets an error, and a worker
    restarted at once binds the same HTTP and KV event ports."""
    port, events, replay = free_port(), free_port(), free_port()
    cmd = [PYTHON, "-m", "mesh", "worker", "--preset", "tiny", "--host", "127.0.0.1", "--port", str(port),
           "--kv-events-endpoint", f"tcp://*:{events}", "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}",
           "--log-level", "warning", "--shutdown-timeout", "0.5"]
    worker = procs.start_http(cmd, name="worker", port=port, timeout_s=120)
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 4000, "ignore_eos": True}
    stream = StreamReader(f"{worker.url}/v1/completions", {**body, "stream": True})
    plain: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: plain.update(r=httpx.post(f"{worker.url}/v1/completions", json=body, timeout=60)))
    thread.start()
    assert stream.started.wait(30)
    wait_until(lambda: in_flight(worker.url) >= 2, timeout_s=30, what="both requests on the worker")
    os.kill(worker.pid, signal.SIGTERM)
    assert worker.popen.wait(30) == 0, worker.log_tail()
    assert_ended_with_error(stream)
    thread.join(30)
    assert plain["r"].status_code == 503 and "shutting down" in plain["r"].text
    again = procs.start_http(cmd, name="worker-again", port=port, timeout_s=120)
    assert again.alive()
