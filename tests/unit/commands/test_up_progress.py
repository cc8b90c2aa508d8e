"""``mesh up``'s start-up display: each worker's phase and seconds, as lines when the output is no
terminal (a file, a pipe, CI), and a status line rewritten in place on a terminal."""

from __future__ import annotations

import io
from pathlib import Path

from mesh.commands.up_progress import LOADING, READY, StartupDisplay, worker_phase
from tests.procs import free_port


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_without_a_terminal_every_phase_change_is_a_line_with_its_seconds() -> None:
    out, clock = io.StringIO(), Clock()
    display = StartupDisplay(["worker-0", "worker-1"], stream=out, tty=False, interval_s=5, clock=clock)
    clock.now += 1.5
    display.set("worker-0", LOADING)
    display.set("worker-0", LOADING)  # no change, no line
    display.tick()  # under interval_s since the last line: quiet
    clock.now += 2.25
    display.set("worker-1", READY)
    display.set("worker-0", READY)
    display.done()
    display.close()
    assert out.getvalue().splitlines() == [
        "mesh up: starting 2 workers (worker-0, worker-1)",
        "mesh up: worker-0 loading model (1.5 s)",
        "mesh up: worker-1 ready (3.8 s)",
        "mesh up: worker-0 ready (3.8 s)",
        "mesh up: 2 workers ready in 3.8 s; starting the gateway",
    ]
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_without_a_terminal_a_long_wait_still_prints_each_pending_worker() -> None:
    out, clock = io.StringIO(), Clock()
    display = StartupDisplay(["worker-0", "worker-1"], stream=out, tty=False, interval_s=5, clock=clock)
    display.set("worker-1", LOADING)
    clock.now += 12
    display.tick()
    display.tick()  # once per interval
    lines = out.getvalue().splitlines()
    assert lines[-1] == "mesh up: waiting 12 s: worker-0 starting, worker-1 loading model"
    assert sum(line.startswith("mesh up: waiting") for line in lines) == 1


def test_on_a_terminal_the_status_line_is_rewritten_and_cleared_before_each_line() -> None:
    out, clock = io.StringIO(), Clock()
    display = StartupDisplay(["worker-0"], stream=out, tty=True, clock=clock)
    clock.now += 3
    display.tick()
    display.set("worker-0", READY)
    display.close()
    text = out.getvalue()
    assert "\r\x1b[2K  waiting 3 s: worker-0 starting" in text
    assert text.endswith("\r\x1b[2Kmesh up: worker-0 ready (3.0 s)\n")


def test_a_worker_is_loading_once_its_log_says_so(tmp_path: Path) -> None:
    log, port = tmp_path / "w.log", free_port()  # nothing listens on port: not ready
    assert worker_phase(port, log, "starting") == "starting"  # no log yet
    log.write_text("some import warning\nmesh worker: loading model (preset demo)\n")
    assert worker_phase(port, log, "starting") == LOADING
