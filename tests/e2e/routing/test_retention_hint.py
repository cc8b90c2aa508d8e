"""Session-aware retention end to end: a real gateway in front of one bundled tiny worker whose KV
cache holds two of three sessions. The junior session's requests carry ``x-mesh-retention: spill``
(counted by the worker), and its blocks are evicted first: the senior sessions keep more of their
prefixes than with the hint off, measured by the cached tokens the worker reports. Sessions that
finished stop holding room after three of their think gaps (``retention.idle_factor``), so a new
session that fits beside the ones still working is not marked."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.procs import PYTHON, ProcessGroup, free_port, wait_http, wait_until

BLOCKS = 64  # of 16 tokens: 1,024 tokens, two sessions of ~420 fit, three do not
PROMPT = {s: (s * 7 + " ") * 50 for s in ("a", "b", "c")}  # 400 tokens each (27 blocks with the output), no shared prefix


@pytest.fixture(scope="module")
def worker(module_procs: ProcessGroup) -> Iterator[str]:
    port = free_port()
    cmd = [PYTHON, "-m", "mesh", "worker", "--preset", "tiny", "--device", "cpu", "--port", str(port),
           "--num-kv-blocks", str(BLOCKS), "--block-size", "16", "--max-model-len", "1024", "--log-level", "warning"]
    proc = module_procs.start(cmd, name="tiny", port=port)
    wait_http(proc.url + "/health", proc=proc, timeout_s=120)
    yield proc.url


def _gateway(procs: ProcessGroup, worker: str, spill_hint: bool, path: Path, retention: dict[str, float] | None = None) -> str:
    path.write_text(yaml.safe_dump({
        "server": {"admin_key": "adm"},
        "workers": [{"name": "w0", "url": worker, "block_size": 16}],
        "health": {"interval_s": 0.3},
        "retention": {"spill_hint": spill_hint, "fill": 0.9, **(retention or {})},
    }))
    gw = procs.gateway(path, port=free_port(), name=f"gateway-{path.stem}-hint-{spill_hint}", ready_path="/ready")
    wait_until(lambda: httpx.get(gw.url + "/workers", headers={"authorization": "Bearer adm"}, timeout=5)
               .json()["workers"][0]["targets"][0].get("kv_capacity_blocks"), what="the worker's KV capacity known")
    return gw.url


def _turn(url: str, session: str, turn: int) -> int:
    """One turn of ``session`` (its prompt, extended by the turn); the cached tokens reported."""
    body = {"model": "tiny", "prompt": PROMPT[session] + f" turn {turn}" * turn, "max_tokens": 4, "temperature": 0}
    resp = httpx.post(url + "/v1/completions", json=body, headers={"x-session-id": session}, timeout=120)
    assert resp.status_code == 200, resp.text
    return int(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def _counter(worker: str, name: str) -> float:
    for line in httpx.get(worker + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "_total "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not on the worker's /metrics")


def _senior_hits(url: str, worker: str) -> int:
    """Three rounds of a, b, c (the three do not fit; c is the junior): the cached tokens of the
    senior sessions' later turns. Without the hint an LRU evicts, turn after turn, the blocks of
    the session that comes next."""
    assert httpx.post(worker + "/reset_prefix_cache", timeout=10).status_code == 200
    hits = 0
    for turn in range(3):
        for s in ("a", "b", "c"):
            cached = _turn(url, s, turn)
            hits += cached if turn and s != "c" else 0
    return hits


def test_the_junior_session_spills_and_the_seniors_keep_their_prefixes(
        module_procs: ProcessGroup, worker: str, tmp_path: Path) -> None:
    spilled_before = _counter(worker, "mesh_worker_evict_first_requests")
    with_hint = _senior_hits(_gateway(module_procs, worker, True, tmp_path / "hint.yaml"), worker)
    assert _counter(worker, "mesh_worker_evict_first_requests") == spilled_before + 3  # c's requests alone
    without = _senior_hits(_gateway(module_procs, worker, False, tmp_path / "nohint.yaml"), worker)
    assert _counter(worker, "mesh_worker_evict_first_requests") == spilled_before + 3
    assert with_hint - without >= 10 * 16, (with_hint, without)  # at least ten blocks more reused


def _finished_sessions_then_new(url: str) -> None:
    """Sessions a and b take two quick turns each and finish; after an idle time well past three
    of their think gaps (measured from their turns' durations), session c's first turn."""
    longest = 0.0
    for turn in range(2):
        for s in ("a", "b"):
            started = time.monotonic()
            _turn(url, s, turn)
            longest = max(longest, time.monotonic() - started)
    time.sleep(4 * longest + 1.0)  # a's gap is at most b's turn (and the client's overhead)
    _turn(url, "c", 0)


def test_a_finished_session_stops_holding_room_after_three_of_its_think_gaps(
        module_procs: ProcessGroup, worker: str, tmp_path: Path) -> None:
    def spilled_by(idle_factor: float, name: str) -> float:
        path = tmp_path / f"{name}.yaml"
        url = _gateway(module_procs, worker, True, path, retention={"idle_factor": idle_factor, "active_s": 120})
        before = _counter(worker, "mesh_worker_evict_first_requests")
        _finished_sessions_then_new(url)
        return _counter(worker, "mesh_worker_evict_first_requests") - before

    assert spilled_by(3.0, "gaps") == 0  # a and b left the plan: c fits
    assert spilled_by(0.0, "active_s") == 1  # a and b count for active_s: c does not fit beside them
