"""``mesh simulate``'s modelling, checked in-process and through the CLI:

- KV usage: the engines' ``kv_cache_usage`` is the fraction of blocks held by requests; cached
  blocks no request references sit in the free pool, so a warm idle worker does not read ~0.96
  and ``admission_headroom`` admits requests the cluster has room for.
- A prefill/decode pair's first token comes from the decode worker after the KV transfer (the
  prefill's token is discarded): the transfer is in TTFT, not ITL (tests/e2e/simulator/test_simulator_oracles.py
  has the formula oracles, and of the transfer charging only the blocks the decode worker lacks).
- ``--prefill-workers`` with a policy that never picks a pair warns.
- WEKA sessions all start at t=0: ``--session-start-spread`` spreads them.
- The table shows TTFT and ITL percentiles (p50, p99) and explains "moves" in a footnote.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from simulator.engine import SimConfig, Simulator
from simulator.profile import DecodeTiming, PrefillTiming, Profile
from simulator.traces import LoadOptions, TraceError, load_traces
from tests.procs import SHARED_TRACES

ROOT = Path(__file__).resolve().parents[3]
SYNTHETIC = SHARED_TRACES / "mooncake" / "synthetic_trace.jsonl"
WEKA = SHARED_TRACES / "weka"


def mesh(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "mesh", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def session_trace(path: Path, rows: list[dict[str, Any]]) -> Path:
    head = {"format": "mesh-sessions", "version": 1, "block_size": 16}
    path.write_text("\n".join(json.dumps(r) for r in [head, *rows]) + "\n")
    return path


# ------------------------------------------------------------------------------ KV usage
KV = Profile(name="kv", block_size=16, kv_blocks=100, max_num_seqs=8, max_batched_tokens=1024,
             prefill=PrefillTiming(base_ms=5.0, per_token_ms=0.01), decode=DecodeTiming(base_ms=10.0))
HEADROOM_0 = {"name": "pipeline", "params": {"filters": [{"name": "admission_headroom",
                                                          "params": {"max_kv_usage": 0.0}}], "scorers": ["load"]}}


def test_kv_usage_is_the_blocks_requests_hold_not_what_the_cache_keeps(tmp_path: Path) -> None:
    """A and B (4 blocks each, 3 shared) prefill together (6.28 ms), then decode for 20 ms; C
    arrives mid-decode, D a second later on an idle worker whose cache still holds A's and B's
    blocks. The usage a policy sees: 0 before the first step, (5 shared-once cached + 2 private
    blocks) / 100 while A and B run, 0 once nothing runs: D is admitted under max_kv_usage 0,
    C is not (D's worker does not read its 5 cached blocks as used)."""
    rows = [
        {"session": "a", "t": 0.0, "input_tokens": 64, "output_tokens": 3, "hash_ids": [1, 2, 3, 4]},
        {"session": "b", "t": 0.0, "input_tokens": 64, "output_tokens": 3, "hash_ids": [1, 2, 3, 9]},
        {"session": "c", "t": 0.010, "input_tokens": 64, "output_tokens": 3, "hash_ids": [7, 8, 9, 10]},
        {"session": "d", "t": 1.0, "input_tokens": 64, "output_tokens": 1, "hash_ids": [1, 2, 3, 4]},
    ]
    trace = load_traces([session_trace(tmp_path / "t.jsonl", rows)])
    sim = Simulator(trace, HEADROOM_0, SimConfig(workers=1, profile=KV))
    seen: list[float] = []
    decide = sim.router.decide  # the one decision per request (the simulator never decides again)

    def sampled(info: Any, t: float, *args: Any, **kwargs: Any) -> Any:
        seen.append(sim.workers[0].state.kv_usage)
        return decide(info, t, *args, **kwargs)

    sim.router.decide = sampled  # type: ignore[method-assign]
    result = sim.run()
    assert seen == [0.0, 0.0, 7 / 100, 0.0]
    assert result.rejected == 1 and list(result.worker) == [0, 0, -1, 0]
    w = sim.workers[0]
    w.check()
    assert w.cached_blocks == 5 and w.used_blocks == 0 and w.state.kv_usage == 0.0


def test_the_example_pipeline_admits_requests_after_warm_up() -> None:
    """examples/pipeline.yaml (admission_headroom max_kv_usage 0.95) on the Mooncake synthetic
    trace: the cluster has room, so nothing is rejected (a warm worker reading its cached blocks as
    used, ~0.96, would reject 347 of the first 600)."""
    proc = mesh("simulate", str(SYNTHETIC), "--max-requests", "600", "--workers", "4", "--quiet",
                "--policy", "examples/pipeline.yaml", "--json", "/dev/stdout")
    assert proc.returncode == 0, proc.stderr
    s = json.loads(proc.stdout)["policies"]["pipeline"]
    assert s["rejected"] == 0 and s["requests"] == 600
    assert "rejected" not in proc.stderr


# ------------------------------------------------------------------------------ prefill/decode
def test_a_slow_kv_transfer_moves_ttft_not_itl(tmp_path: Path) -> None:
    """A 2 s transfer (slowpd) against a free one. Every pair request's TTFT grows by 2 s, so the
    mean by 2 s x pairs / requests; ITL stays put (with the transfer in ITL, its p99 would go from
    7.6 ms to 2,007 ms)."""
    reports = {}
    for name, base in (("fast", 0.0), ("slow", 2000.0)):
        profile = tmp_path / f"{name}.yaml"
        profile.write_text(f"base: h200-8b\nkv_blocks: 0\npd: {{transfer_base_ms: {base}, transfer_ms_per_block: 0.0}}\n")
        out = tmp_path / f"{name}.json"
        proc = mesh("simulate", str(SYNTHETIC), "--max-requests", "300", "--workers", "4", "--prefill-workers", "2",
                    "--policy", "examples/pipeline_pd.yaml", "--profile", str(profile), "--quiet", "--json", str(out))
        assert proc.returncode == 0, proc.stderr
        reports[name] = json.loads(out.read_text())["policies"]["pipeline_pd"]
    fast, slow = reports["fast"], reports["slow"]
    assert fast["rejected"] == slow["rejected"] == 0
    pairs = slow["pd_pairs"]
    # local_prefill_tokens keeps short prompts off pairs: about as many pairs either way (the
    # transfer's time moves load, and so a few tie-breaks and which decode worker holds a prefix)
    assert 0 < pairs < 300 and abs(fast["pd_pairs"] - pairs) <= 0.05 * pairs
    moved = slow["ttft_ms"]["mean"] - fast["ttft_ms"]["mean"]
    assert moved == pytest.approx(2000.0 * pairs / 300, rel=0.1)
    assert slow["itl_ms"]["p99"] < 2 * fast["itl_ms"]["p99"] and slow["itl_ms"]["mean"] < fast["itl_ms"]["mean"] + 1


def test_decode_workers_carry_the_pairs_load_and_sessions(tmp_path: Path) -> None:
    """As the relay accounts a pair: a prefill lease on the prefill worker until its answer, then
    a decode lease on the decode worker, which the session is bound to. The decode workers' load
    is charged (their in_flight is not 0 for the decode profile's load scorer)."""
    rows = [{"session": "s", "t": 0.0, "input_tokens": 256, "output_tokens": 40, "hash_ids": list(range(16))},
            {"session": "s", "think_s": 0.1, "input_tokens": 512, "output_tokens": 4, "hash_ids": list(range(32))}]
    trace = load_traces([session_trace(tmp_path / "t.jsonl", rows)])
    policy = {"name": "pipeline", "params": {"profiles": {"prefill": {"scorers": ["prefix"]},
                                                          "decode": {"scorers": ["load"]}}}}
    sim = Simulator(trace, policy, SimConfig(workers=3, profile=KV, prefill_workers=1))
    peaks: dict[str, int] = {}
    finished = sim.finished

    def watch(req: Any, t: float) -> None:
        for tid, st in sim.targets.items():
            peaks[tid] = max(peaks.get(tid, 0), st.in_flight)
        finished(req, t)

    sim.finished = watch  # type: ignore[method-assign]
    result = sim.run()
    assert result.pairs == 2 and (result.worker == 0).all()
    assert peaks["w0"] == 0  # its lease ended with the prefill
    assert max(peaks["w1"], peaks["w2"]) == 1  # the decode worker's lease was still held
    decode = sim.sessions.bound_target("t/s", result.finish[1])  # type: ignore[union-attr]
    assert decode in {"w1", "w2"} and result.session_moves == 0
    assert all(st.in_flight == 0 and st.prefill_tokens == 0 and st.decode_tokens == 0 for st in sim.targets.values())


def test_a_request_that_takes_no_pair_never_runs_on_a_prefill_worker() -> None:
    """The first decision is committed, never decided again (a second decision's random tie-break
    could return a pair, which would run whole on its prefill worker: 7 of 205 requests here), and
    a pair reaching the ordinary path is served by its decode worker."""
    import yaml

    from simulator.profile import load_profile

    spec = yaml.safe_load((ROOT / "examples" / "pipeline_pd.yaml").read_text())["policy"]
    trace = load_traces(sorted(str(p) for p in WEKA.glob("*.gz")), LoadOptions(max_sessions=8, session_start_spread=300))
    sim = Simulator(trace, spec, SimConfig(workers=4, prefill_workers=2, profile=load_profile(None, kv_blocks=60000)))
    result = sim.run()
    assert len(sim.reqs) == 205 and 0 < result.pairs < 205 and result.rejected == 0
    whole = [r for r in sim.reqs if r.decode_to < 0]
    assert len(whole) == 205 - result.pairs
    assert all(r.worker >= 2 for r in whole), [r.idx for r in whole if r.worker < 2]


def test_per_block_transfer_and_reload_costs_are_per_profile_block(tmp_path: Path) -> None:
    """``pd.transfer_ms_per_block`` and ``cpu.load_ms_per_block`` are per profile block (16
    tokens), converted by tokens to the trace's blocks (charged per trace block, Mooncake's 512
    tokens would be 32x too cheap). The same 1,025-token prompt exports 1,024 tokens at 16- and at
    64-token trace blocks: the same transfer (64 ms at 1 ms per 16 tokens), so the same TTFT (not
    84 vs 36 ms)."""
    from simulator.profile import CpuTier, PdTransfer

    profile = Profile(name="hand", block_size=16, kv_blocks=1000, max_num_seqs=8, max_batched_tokens=4096,
                      prefill=PrefillTiming(base_ms=10.0, per_token_ms=0.0), decode=DecodeTiming(base_ms=5.0),
                      cpu=CpuTier(blocks=100, load_ms_per_block=0.5),
                      pd=PdTransfer(transfer_base_ms=0.0, transfer_ms_per_block=1.0))
    policy = {"name": "pipeline", "params": {"profiles": {"prefill": {"scorers": ["prefix"]},
                                                          "decode": {"scorers": ["load"]}}}}
    ttft, reload_per_token = {}, {}
    for bs in (16, 64):
        path = tmp_path / f"b{bs}.jsonl"
        rows = [{"format": "mesh-sessions", "version": 1, "block_size": bs},
                {"t": 0.0, "input_tokens": 1025, "output_tokens": 1, "hash_ids": list(range(1024 // bs + 1))}]
        path.write_text("\n".join(map(json.dumps, rows)) + "\n")
        trace = load_traces([path])
        assert trace.block_size == bs
        sim = Simulator(trace, policy, SimConfig(workers=2, profile=profile, prefill_workers=1))
        result = sim.run()
        assert result.pairs == 1
        ttft[bs] = (result.first_token[0] - result.arrival[0]) * 1e3
        reload_per_token[bs] = sim.workers[1]._cpu_load_s / bs
    assert ttft[16] == pytest.approx(ttft[64]) and ttft[16] == pytest.approx(10.0 + 64.0 + 10.0)
    assert reload_per_token[16] == pytest.approx(reload_per_token[64]) == pytest.approx(0.5e-3 / 16)


def test_prefill_workers_with_a_policy_that_never_pairs_warn(tmp_path: Path) -> None:
    """kv_aware never picks a pair: with --prefill-workers the run warns that it is a mixed
    cluster's, not silently."""
    trace = session_trace(tmp_path / "t.jsonl", [
        {"session": f"s{i}", "t": i * 0.01, "input_tokens": 2048, "output_tokens": 8, "hash_ids": list(range(i, i + 128))}
        for i in range(6)])
    out = tmp_path / "r.json"
    proc = mesh("simulate", str(trace), "--workers", "3", "--prefill-workers", "1", "--profile", "unit",
                "--policy", "kv_aware", "--policy", "examples/pipeline_pd.yaml", "--json", str(out), "--quiet")
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "prefill/decode pair" in line]
    assert len(lines) == 1 and lines[0].startswith("warning: kv_aware: --prefill-workers 1 but no request")
    assert "no prefill/decode profiles" in lines[0]
    report = json.loads(out.read_text())
    assert [w for w in report["warnings"] if "pair" in w] == [lines[0].removeprefix("warning: ")]
    assert report["policies"]["kv_aware"]["pd_pairs"] == 0 and report["policies"]["pipeline_pd"]["pd_pairs"] == 6


# ------------------------------------------------------------------------------ session starts
def test_session_start_spread_shifts_each_session_by_a_seeded_offset() -> None:
    files = sorted(WEKA.glob("*.json.gz"))[:6]
    burst = load_traces(files)
    spread = load_traces(files, LoadOptions(session_start_spread=100.0, seed=4))
    again = load_traces(files, LoadOptions(session_start_spread=100.0, seed=4))
    other = load_traces(files, LoadOptions(session_start_spread=100.0, seed=5))
    roots = [r for r in burst.requests if r.arrival is not None]
    assert len(roots) == 6 and {r.arrival for r in roots} == {0.0}  # the start-up burst
    shifted = [r.arrival for r in spread.requests if r.arrival is not None]
    assert len(set(shifted)) == 6 and all(0.0 <= a < 100.0 for a in shifted)  # type: ignore[operator]
    assert shifted == [r.arrival for r in again.requests if r.arrival is not None]
    assert shifted != [r.arrival for r in other.requests if r.arrival is not None]
    # later turns are released by their predecessors, as before: the whole session moves
    assert [r.deps for r in spread.requests] == [r.deps for r in burst.requests]
    with pytest.raises(TraceError, match="session-start-spread must be"):
        load_traces(files, LoadOptions(session_start_spread=-1.0))


def test_session_start_spread_through_the_cli(tmp_path: Path) -> None:
    files = [str(p) for p in sorted(WEKA.glob("*.json.gz"))[:8]]
    ttft = {}
    for spread in ("0", "600"):
        out = tmp_path / f"{spread}.json"
        proc = mesh("simulate", *files, "--workers", "2", "--kv-blocks", "60000", "--policy", "round_robin",
                    "--session-start-spread", spread, "--quiet", "--json", str(out))
        assert proc.returncode == 0, proc.stderr
        report = json.loads(out.read_text())
        assert report["trace"]["session_start_spread_s"] == float(spread)
        ttft[spread] = report["policies"]["round_robin"]["ttft_ms"]["p99"]
    assert ttft["600"] < ttft["0"]  # the burst was the tail
    bad = mesh("simulate", files[0], "--session-start-spread", "nan", "--quiet")
    assert bad.returncode == 2 and "session-start-spread must be" in bad.stderr and "Traceback" not in bad.stderr
    assert "--session-start-spread" in mesh("simulate", "--help").stdout


# ------------------------------------------------------------------------------ the table
def test_the_table_shows_ttft_and_itl_percentiles_and_explains_moves(tmp_path: Path) -> None:
    from rich.console import Console

    from simulator.report import render_table

    out = tmp_path / "r.json"
    trace = session_trace(tmp_path / "t.jsonl", [
        {"session": f"s{i % 3}", **({"t": i * 0.02} if i < 3 else {"think_s": 0.01}), "input_tokens": 512,
         "output_tokens": 16 + i, "hash_ids": list(range(i % 3 * 100, i % 3 * 100 + 32))} for i in range(12)])
    proc = mesh("simulate", str(trace), "--quiet", "--profile", "unit", "--policy", "round_robin",
                "--policy", "kv_aware", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    summaries = json.loads(out.read_text())["policies"]
    for width in (80, 200):
        buf = io.StringIO()
        render_table(summaries, Console(file=buf, width=width, color_system=None), title="t")
        text = buf.getvalue()
        assert "…" not in text and max(map(len, text.splitlines())) <= width
        for label in ("TTFT p50", "TTFT p99", "ITL p50", "ITL p99"):
            assert label in text
        assert "moves: session turns sent to another worker" in " ".join(text.split())
    s = summaries["kv_aware"]
    assert f"{s['itl_ms']['p99']:.1f} ms" in text and f"{s['ttft_ms']['p99']:.1f} ms" in text
