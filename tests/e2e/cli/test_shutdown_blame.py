"""A stream cut by the gateway's own shutdown timeout is not blamed on its worker.

``end_in_flight`` ends what is still in flight by closing the upstream pool; the proxy, which
sees a broken upstream, ends the stream with the gateway's shutdown error, not "worker w0 failed
mid-stream", and charges no circuit breaker (w0's would open here, with ``failure_threshold: 1``).
Real ``mesh serve``
and echo worker processes, a real SIGTERM.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from tests.procs import PYTHON, ProcessGroup, free_port, wait_until
from tests.support.shutdown import LONG, StreamReader, refused


def test_a_stream_ended_by_the_shutdown_timeout_blames_the_gateway_not_the_worker(
        procs: ProcessGroup, tmp_path: Path) -> None:
    worker = procs.echo_worker("w0", "--token-delay-s", "0.2", "--repeat", "200")
    port = free_port()
    config = tmp_path / "mesh.yaml"
    config.write_text(f"server: {{port: {port}}}\ncircuit_breaker: {{failure_threshold: 1}}\n"
                      f"workers:\n  - {{name: w0, url: '{worker.url}'}}\n")
    cmd = [PYTHON, "-m", "mesh", "serve", "--config", str(config), "--log-level", "warning", "--shutdown-timeout", "1"]
    gateway = procs.start_http(cmd, name="gateway", port=port, ready_path="/ready")
    long = StreamReader(f"{gateway.url}/v1/completions", LONG)
    assert long.started.wait(20)
    os.kill(gateway.pid, signal.SIGTERM)
    wait_until(lambda: refused(port), what="new connections refused")
    assert gateway.popen.wait(30) == 0, gateway.log_tail()
    long.thread.join(30)
    assert long.error is None, f"the stream was cut off: {long.error!r}"
    assert long.lines[-1] == "data: [DONE]"
    events = long.events()
    assert any(e.get("choices") for e in events)  # it was mid-answer
    errors = [e["error"]["message"] for e in events if "error" in e]
    assert len(errors) == 1, long.lines[-3:]
    assert "gateway is shutting down" in errors[0] and "w0" not in errors[0], errors
    log = gateway.log_tail()
    assert "ending 1 request(s) with an error" in log
    assert "circuit opened" not in log, log  # w0 did nothing wrong
