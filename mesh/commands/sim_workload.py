"""What ``mesh simulate`` replays: the traces as loaded, or what ``mesh replay`` would send.

The replay's knobs (``--prompt-scale``, ``--output-tokens``, ``--max-think-s``, ``--concurrency``,
``--run-s``) switch to the replay's plan: the traces planned by ``mesh.replay`` itself (prompts
of ``PromptBuilder``'s length and block boundaries, turns released by the plan's dependencies
with think times capped, keyed in the engine's blocks: ``mesh.replay.sim_trace``), at most
``--concurrency`` session groups in flight and nothing sent after ``--run-s`` seconds
(``simulator.session_gate``), as a live replay's client plays it. A knob left out changes
nothing (prompt scale 1, the trace's output lengths, no cap, no limit, no end). Without any of
them the traces replay at their own times and lengths.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
from typing import Any

REPLAY_KNOBS = ("prompt_scale", "output_tokens", "max_think_s", "concurrency", "run_s")


def add_workload_args(sim: argparse.ArgumentParser) -> None:
    g = sim.add_argument_group("as mesh replay plays it (any of these: the replay's plan, bench/e2e_routing.py's workload)")
    g.add_argument("--prompt-scale", type=float, metavar="F",
                   help="trace tokens per simulated token, the prompts built as mesh replay builds them (16: the benchmark)")
    g.add_argument("--output-tokens", type=int, metavar="N", help="every request's output tokens (default: the trace's, "
                                                                  "scaled like its prompt)")
    g.add_argument("--max-think-s", type=float, metavar="S", help="cap of a (time-scaled) think time, as mesh replay's")
    g.add_argument("--concurrency", type=int, metavar="N",
                   help="at most N session groups in flight, the next one starting when one ends (0: no limit)")
    g.add_argument("--run-s", type=float, metavar="S", help="send nothing after S simulated seconds; requests in "
                                                           "flight finish (mesh replay's --duration-s)")
    sim.add_argument("--no-session-ids", action="store_true",
                     help="requests carry no session id (as mesh replay --no-session-ids)")
    sim.add_argument("--workers-per-device", type=int, default=1, metavar="N",
                     help="workers that time-share one device (workers 0..N-1 the first; the profile's shared_* "
                          "timings say how much they slow each other down)")
    sim.add_argument("--no-spill-hint", action="store_true",
                     help="without the gateway's retention hint (its config retention.spill_hint: false)")


def replay_mode(args: argparse.Namespace) -> bool:
    return any(getattr(args, k) is not None for k in REPLAY_KNOBS)


def workload_problem(args: argparse.Namespace) -> str | None:
    """The first bad replay knob (None: all fine)."""
    if args.prompt_scale is not None and not (math.isfinite(args.prompt_scale) and args.prompt_scale > 0):
        return f"--prompt-scale must be a number > 0, got {args.prompt_scale}"
    if args.output_tokens is not None and args.output_tokens < 1:
        return f"--output-tokens must be >= 1, got {args.output_tokens}"
    if args.max_think_s is not None and not args.max_think_s >= 0:
        return f"--max-think-s must be >= 0, got {args.max_think_s}"
    return None


def load_workload(args: argparse.Namespace, engine_block: int) -> tuple[Any, dict[str, Any]]:
    """(the trace to simulate, what the report says about it beyond the trace's own fields)."""
    if not replay_mode(args):
        return _loaded(args), {}
    from mesh.replay.run import ReplaySetup, prepare
    from mesh.replay.sim_trace import plan_trace

    prep = prepare(ReplaySetup(
        traces=args.traces, sessions=args.max_sessions, max_requests=args.max_requests, time_scale=args.time_scale,
        max_think_s=math.inf if args.max_think_s is None else args.max_think_s,
        session_start_spread_s=args.session_start_spread, seed=args.seed,
        prompt_scale=1.0 if args.prompt_scale is None else args.prompt_scale, output_tokens=args.output_tokens,
        max_output_tokens=2**31 - 1, block_size=None, trace_block_size=args.trace_block_size,
        engine_block_size=engine_block))
    trace = plan_trace(prep.trace, prep.plan, prep.builder, engine_block, session_ids=not args.no_session_ids)
    info = {"replay_plan": {k: v for k, v in prep.trace_info().items() if k not in ("files", "formats")},
            "ideal_hit_rate": prep.ideal.session, "ideal_hit_rate_global": prep.ideal.global_}
    return trace, info


def _loaded(args: argparse.Namespace) -> Any:
    from simulator.traces import LoadOptions, load_traces

    trace = load_traces(args.traces, LoadOptions(
        block_size=args.block_size, trace_block_size=args.trace_block_size, time_scale=args.time_scale,
        max_sessions=args.max_sessions, max_requests=args.max_requests,
        session_start_spread=args.session_start_spread, seed=args.seed,
    ))
    if args.no_session_ids:
        trace = replace(trace, requests=[replace(r, session=None) for r in trace.requests])
    return trace
