"""One decision core: the simulator and the gateway run the same Router, policy and index.

The simulator records every call the gateway would make on the decision core (route, KV event
applied to the index, first token, completion, and the workers' KV usage it would have scraped),
in order. A separate harness written the way the gateway drives the core (fresh Router, fresh
policy object built from the same spec and seed, fresh PrefixIndex fed only by the events, fresh
SessionTable) replays that sequence, and must reach the same decision for every request.
"""

from __future__ import annotations

from typing import Any

import pytest

from mesh.core.index import PrefixIndex
from mesh.core.router import Router
from mesh.core.sessions import SessionTable
from policies import create_policy
from policies.base import RequestInfo, TargetState
from simulator.engine import SimConfig, Simulator, apply_event
from simulator.profile import BUILTIN, with_overrides
from simulator.traces import LoadOptions, load_traces
from simulator.worker_model import OP_DROP_CPU, OP_OFFLOAD, OP_RELOAD, OP_STORE
from tests.procs import SHARED_TRACES

WEKA = SHARED_TRACES / "weka"


class Recorder:
    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.sim: Simulator | None = None

    def route(self, t: float, info: RequestInfo, decision: Any) -> None:
        usage = {tid: ts.kv_usage for tid, ts in self.sim.targets.items()}  # type: ignore[union-attr]
        self.log.append(("route", t, info.request_id, list(info.block_keys), info.prompt_tokens,
                         info.max_tokens, info.session_id, usage, decision.target,
                         sum(o.blocks for o in decision.overlaps.values())))

    def event(self, t: float, op: int, target: str, keys: list[int], parent: int | None) -> None:
        self.log.append(("event", t, op, target, list(keys), parent))

    def first_token(self, t: float, idx: int) -> None:
        self.log.append(("first", t, str(idx)))

    def finish(self, t: float, idx: int) -> None:
        self.log.append(("finish", t, str(idx)))


def gateway_replay(log: list[tuple[Any, ...]], spec: Any, workers: int, block_size: int, seed: int) -> list[str]:
    """Drive a fresh decision core as the gateway does; return its decisions in order."""
    targets = {f"w{i}": TargetState(id=f"w{i}", worker=f"w{i}", block_size=block_size,
                                    models=frozenset({"sim-model"})) for i in range(workers)}
    index = PrefixIndex()
    router = Router(create_policy(spec), targets, index=index,
                    sessions=SessionTable(600.0, 1_000_000), speculative_ttl_s=2.0, seed=seed)
    leases: dict[str, Any] = {}
    decisions = []
    for entry in log:
        kind, t = entry[0], entry[1]
        if kind == "route":
            _, _, rid, keys, prompt, max_tokens, session, usage, _target, _ov = entry
            for tid, u in usage.items():  # the registry's last metrics scrape
                targets[tid].kv_usage = u
            info = RequestInfo(model="sim-model", block_keys=keys, block_size=block_size, prompt_tokens=prompt,
                               max_tokens=max_tokens, session_id=session, request_id=rid)
            decision, lease = router.route(info, t)
            leases[rid] = lease
            decisions.append(decision.target)
        elif kind == "event":  # the KV event subscriber
            _, _, op, target, keys, parent = entry
            apply_event(index, op, target, keys, parent)
        elif kind == "first":  # the proxy saw the first streamed token
            leases[entry[2]].first_token()
        elif kind == "finish":
            leases[entry[2]].finish(t)
    return decisions


PIPELINE = {"name": "pipeline", "params": {"scorers": [
    {"name": "prefix", "weight": 2.0}, {"name": "prefill_load", "weight": 1.0},
    {"name": "kv_utilization", "weight": 0.5}, {"name": "load", "weight": 1.0}]}}


# sessions of moderate context (the largest prompt fits the small capacity below)
FILES = ["trace_0006", "trace_0011", "trace_0086", "trace_0121", "trace_0166", "trace_0266", "trace_0291",
         "trace_0331", "trace_0426"]


@pytest.mark.parametrize("spec", ["session_sticky", PIPELINE], ids=["session_sticky", "pipeline"])
def test_gateway_replay_reproduces_simulated_decisions(spec: Any) -> None:
    trace = load_traces([WEKA / f"{name}.json.gz" for name in FILES],
                        LoadOptions(block_size=256, max_requests=300, time_scale=0.05))
    profile = with_overrides(BUILTIN["dynamo-mocker"], kv_blocks=2000, event_lag_ms=30.0,
                             **{"cpu.blocks": 4000, "cpu.load_ms_per_block": 0.02})
    recorder = Recorder()
    sim = Simulator(trace, spec, SimConfig(workers=3, profile=profile, seed=3), recorder=recorder)
    recorder.sim = sim
    result = sim.run()
    simulated = [e[8] for e in recorder.log if e[0] == "route"]
    assert len(simulated) == len(trace.requests) == 300
    # the run exercised what a decision can depend on: overlaps, evictions to and reloads from
    # the CPU tier, CPU drops, preemptions, every worker
    ops = {e[2] for e in recorder.log if e[0] == "event"}
    assert ops == {OP_STORE, OP_OFFLOAD, OP_RELOAD, OP_DROP_CPU}
    assert len(set(simulated)) == 3 and any(e[9] > 0 for e in recorder.log if e[0] == "route")
    assert result.cpu_hit.sum() > 0 and result.preemptions > 0
    replayed = gateway_replay(recorder.log, spec, workers=3, block_size=trace.block_size, seed=3)
    assert replayed == simulated
    if spec is PIPELINE:  # and the decisions really depend on the index the events feed
        blind = gateway_replay([e for e in recorder.log if e[0] != "event"], spec, 3, trace.block_size, 3)
        assert blind != simulated
