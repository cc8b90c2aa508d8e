"""Decision latency of every built-in policy through ``Router.decide``, at 8, 64 and 512 targets.

The cluster is agentic: every target caches a shared system prompt, and each holds the
conversations of its sessions; 80% of requests continue a known session (longer by one turn),
20% start a new one. Prompts are 1-6k tokens at block size 16, so a request has 64-400 block keys.
Tokenization and key hashing happen before the clock starts (the keys are precomputed); each
request's text (what ``cache_aware`` matches) has 64 characters per block, 4-26k in all.

Two columns per policy: ``total`` (Router.decide with the real ``mesh.core.index.PrefixIndex``) and
``policy`` (the same decisions with the index's answer memoized, i.e. the policy and the router's
view alone). The peer in the same run is ``round_robin``: the floor cost of the Router itself;
ratios are against it.

    python bench/policies.py [--sizes 8 64 512] [--decisions 3000] [--json bench/results/policies.json]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import argparse
import gc
import json
import random
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from mesh.core.index import PrefixIndex
from mesh.core.router import Router
from mesh.core.sessions import SessionTable
from policies import create
from policies.base import Overlap, Policy, RequestInfo, TargetState
from policies.registry import names

BLOCK = 16
SYSTEM_BLOCKS = 64  # a 1k-token system prompt every target holds
SESSIONS_PER_TARGET = 8

SPECS: dict[str, Any] = {
    "round_robin": "round_robin",
    "random": "random",
    "least_load": "least_load",
    "power_of_two": "power_of_two",
    "pipeline": {  # llm-d's default weights
        "name": "pipeline",
        "params": {
            "scorers": [
                {"name": "prefix", "weight": 2},
                {"name": "kv_utilization", "weight": 1},
                {"name": "load", "weight": 1},
            ]
        },
    },
    "session_sticky": "session_sticky",
    "kv_aware": "kv_aware",
    "cache_aware": "cache_aware",
}


class MemoIndex:
    """The real index's answers, memoized per request: isolates the policy's own cost."""

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self.memo: dict[int, Mapping[str, Overlap]] = {}

    def match(self, keys: Sequence[int]) -> Mapping[str, Overlap]:
        got = self.memo.get(id(keys))
        if got is None:
            got = self.memo[id(keys)] = self.index.match(keys)
        return got


def build_cluster(n: int, rng: random.Random) -> tuple[dict[str, TargetState], PrefixIndex, list[RequestInfo]]:
    targets = {
        f"w{i}": TargetState(
            id=f"w{i}", worker=f"w{i}", models=frozenset({"m"}), in_flight=rng.randrange(0, 8),
            prefill_tokens=rng.randrange(0, 4000), kv_usage=rng.random() * 0.9, kv_capacity_blocks=20000,
        )
        for i in range(n)
    }
    index = PrefixIndex()
    next_key = iter(range(1, 1 << 62))
    system = [next(next_key) for _ in range(SYSTEM_BLOCKS)]
    sessions: list[tuple[str, str, list[int]]] = []
    for tid in targets:
        index.store(tid, system)
        for s in range(SESSIONS_PER_TARGET):
            convo = system + [next(next_key) for _ in range(rng.randrange(16, 300))]
            index.store(tid, convo)
            sessions.append((f"{tid}-s{s}", tid, convo))
    requests = []
    for i in range(2000):
        if rng.random() < 0.8:
            sid, _, convo = rng.choice(sessions)
            keys = convo + [next(next_key) for _ in range(rng.randrange(4, 40))]
        else:
            sid = f"new-{i}"
            keys = system + [next(next_key) for _ in range(rng.randrange(4, 100))]
        requests.append(RequestInfo(model="m", block_keys=keys, block_size=BLOCK, prompt_tokens=len(keys) * BLOCK + 7,
                                    max_tokens=256, session_id=sid, text=prompt_text(keys), request_id=str(i)))
    return targets, index, requests


def prompt_text(keys: Sequence[int]) -> str:
    """A prompt's text as cache_aware sees it: 64 characters per block (16 tokens of ~4 characters),
    the same characters for the same key, so shared prefixes are shared text."""
    return "".join(f"{k:016x}" * 4 for k in keys) + " the new turn."


def warm_sessions(router: Router, requests: list[RequestInfo], n: int) -> None:
    """Bind every known session once (as a live gateway would have), then release the load."""
    for req in requests[: min(n, len(requests))]:
        _, lease = router.route(req, 0.0)
        lease.finish(0.0)


def measure(policy: Policy, targets: dict[str, TargetState], index: Any, requests: list[RequestInfo],
            decisions: int) -> list[float]:
    sessions = SessionTable(idle_ttl_s=1e9, max_sessions=1_000_000)
    router = Router(policy, targets, index=index, sessions=sessions, speculative_ttl_s=0, seed=1)
    warm_sessions(router, requests, 500)
    out: list[float] = []
    gc.collect()
    clock = time.perf_counter_ns
    for i in range(decisions):
        req = requests[i % len(requests)]
        t0 = clock()
        router.decide(req, 1.0, explain=False)  # the request path (Router.route); /debug/route explains
        out.append((clock() - t0) / 1000.0)
    return out


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if q < 100 else max(xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 512])
    ap.add_argument("--decisions", type=int, default=3000)
    ap.add_argument("--policies", nargs="+", default=list(SPECS))
    ap.add_argument("--json", default="bench/results/policies.json")
    args = ap.parse_args()
    known = set(names("policy"))
    chosen = [p for p in args.policies if p in known]
    console = Console()
    rows: list[dict[str, Any]] = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("deciding", total=len(args.sizes) * len(chosen) * 2)
        for n in args.sizes:
            targets, index, requests = build_cluster(n, random.Random(n))
            memo = MemoIndex(index)
            for req in requests:  # prime: the 'policy' column never pays for a match
                memo.match(req.block_keys)
            decisions = max(300, args.decisions * 64 // max(n, 64))
            for name in chosen:
                row: dict[str, Any] = {"policy": name, "targets": n, "decisions": decisions}
                for label, idx in (("total", index), ("policy", memo)):
                    lat = measure(create("policy", SPECS[name]), targets, idx, requests, decisions)
                    row[f"{label}_p50_us"] = round(pct(lat, 50), 2)
                    row[f"{label}_p99_us"] = round(pct(lat, 99), 2)
                    progress.advance(task)
                rows.append(row)
    floor = {r["targets"]: r for r in rows if r["policy"] == "round_robin"}
    for r in rows:
        base = floor.get(r["targets"])
        r["policy_p50_vs_round_robin"] = round(r["policy_p50_us"] / base["policy_p50_us"], 2) if base else None
    table = Table(title="Router.decide latency (us); 'policy' = index answer memoized")
    for col in ("policy", "targets", "total p50", "total p99", "policy p50", "policy p99", "x round_robin"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["policy"], str(r["targets"]), f"{r['total_p50_us']:.1f}", f"{r['total_p99_us']:.1f}",
                      f"{r['policy_p50_us']:.1f}", f"{r['policy_p99_us']:.1f}", f"{r['policy_p50_vs_round_robin']}")
    console.print(table)
    missing = [p for p in args.policies if p not in known]
    if missing:
        console.print(f"not registered (skipped): {', '.join(missing)}")
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"block_size": BLOCK, "system_blocks": SYSTEM_BLOCKS, "sessions_per_target": SESSIONS_PER_TARGET,
            "index": f"{PrefixIndex.__module__}.{PrefixIndex.__name__}", "skipped": missing}
    path.write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
