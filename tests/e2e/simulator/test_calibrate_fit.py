"""``mesh calibrate`` against a real echo worker whose TTFT grows with the prompt: every cost it
reports is fitted or named as not fitted, and the per-token prefill cost is the worker's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from tests.procs import ProcessGroup

ROOT = Path(__file__).resolve().parents[3]
PER_TOKEN_S = 0.0002  # the echo worker's wait per prompt token (its tokens: bytes)


def test_calibrate_fits_the_per_token_prefill_and_names_what_it_could_not_fit(procs: ProcessGroup,
                                                                              tmp_path: Path) -> None:
    worker = procs.echo_worker("echo-cal", "--prompt-token-delay-s", str(PER_TOKEN_S), "--first-token-delay-s", "0.01",
                               "--token-delay-s", "0.002")
    out = tmp_path / "echo.yaml"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    proc = subprocess.run([sys.executable, "-m", "mesh", "calibrate", "--url", f"http://127.0.0.1:{worker.port}",
                           "--out", str(out), "--quick"], capture_output=True, text=True, timeout=180, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr
    data = yaml.safe_load(out.read_text())
    prefill, decode = data["profile"]["prefill"], data["profile"]["decode"]
    unfitted = data["calibration"]["unfitted"]
    # TTFT rose with the prompt: a positive per-token cost near the worker's (0.2 ms/token; the
    # rest of the rise may go to the quadratic term on a loaded machine)
    assert 0.02 < prefill["per_token_ms"] < 1.0, prefill
    assert "prefill.per_token" not in unfitted
    # every cost is fitted (> 0) or named with the reason it is not, never a silent 0
    for section, terms in (("prefill", prefill), ("decode", decode)):
        for key, value in terms.items():
            if key == "per_ctx_token2_ms":  # not a calibrated term
                continue
            name = f"{section}.{key.removesuffix('_ms')}"
            assert value > 0 or unfitted.get(name), (name, value, unfitted)
    assert unfitted["prefill.per_hit_token"].startswith("not measured")  # it reports no cached tokens
    assert "not fitted (0 in the profile): prefill.per_hit_token: not measured" in proc.stderr
    assert "0.00 us/token" not in proc.stderr
    # an echo worker reports no KV capacity: said loudly, and the profile says whose it kept
    assert "the worker reported no KV capacity" in proc.stderr
    assert data["calibration"]["kv_capacity_source"].startswith("base profile h200-8b's")


def test_calibrate_against_a_bundled_worker_takes_its_kv_capacity_and_a_positive_prefill_cost(
        procs: ProcessGroup, tmp_path: Path) -> None:
    """A real bundled worker (tiny model on CPU) with 16,384 KV blocks: the profile records its
    capacity from its /metrics, not the base profile's 52,000 blocks, and its TTFT, which rises
    with the prompt, gets a positive per-token cost (the joint fit once put it all on the
    quadratic term and printed 'prefill 0.00 us/token')."""
    from tests.e2e_bundled import start_workers

    worker = start_workers(procs, ["cal"], num_kv_blocks=16384)["cal"]
    out = tmp_path / "bundled.yaml"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    proc = subprocess.run([sys.executable, "-m", "mesh", "calibrate", "--url", worker.proc.url, "--out", str(out),
                           "--quick"], capture_output=True, text=True, timeout=180, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr
    data = yaml.safe_load(out.read_text())
    assert data["profile"]["kv_blocks"] == 16384 and data["profile"]["block_size"] == 16
    assert data["calibration"]["kv_capacity_source"].startswith("the worker's /metrics")
    assert "KV capacity: 16,384 blocks of 16 tokens" in proc.stderr
    cold = data["calibration"]["points"]["prefill"]
    assert cold[-1][1] > cold[0][1]  # TTFT rose over the sweep ...
    assert data["profile"]["prefill"]["per_token_ms"] > 0  # ... and the fit says so
