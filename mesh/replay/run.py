"""One replay, end to end, for the CLI and for in-process callers (``bench/e2e_routing.py``).

    setup = prepare(ReplaySetup(traces=["trace.jsonl"], sessions=8))   # load, build prompts, plan
    summary, play = asyncio.run(replay(setup, ClientOptions(url=..., model=...), "mesh"))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mesh.replay.client import ClientOptions, PlayResult, play
from mesh.replay.prompts import IdealHitRate, PromptBuilder, ideal_hit_rate
from mesh.replay.report import summarize_replay
from mesh.replay.schedule import Plan, build_plan
from simulator.traces import LoadOptions, Trace, load_traces


@dataclass(frozen=True, slots=True)
class ReplaySetup:
    traces: Sequence[str]
    sessions: int | None = None  # first N session groups (LoadOptions.max_sessions)
    max_requests: int | None = None
    max_turns: int | None = None  # per session group
    time_scale: float = 0.01
    max_think_s: float = 2.0
    session_start_spread_s: float = 0.0
    seed: int = 0
    prompt_scale: float = 16.0
    prompt_format: str = "text"
    token_vocab: int = 256
    output_tokens: int | None = 32  # None: the trace's output / prompt_scale
    max_output_tokens: int = 256
    max_prompt_tokens: int | None = None  # longer requests (and their dependents) are dropped
    block_size: int | None = None
    trace_block_size: int | None = None
    engine_block_size: int = 16  # for the ideal hit rate


@dataclass
class Prepared:
    setup: ReplaySetup
    trace: Trace
    builder: PromptBuilder
    plan: Plan
    ideal: IdealHitRate
    warnings: list[str] = field(default_factory=list)

    def trace_info(self) -> dict[str, Any]:
        s = self.setup
        return {
            "files": self.trace.files, "formats": self.trace.formats, "requests": len(self.plan.turns),
            "sessions": self.plan.sessions, "session_groups": len(self.plan.groups),
            "block_size": self.trace.block_size, "warnings": self.warnings, "time_scale": s.time_scale,
            "session_start_spread_s": s.session_start_spread_s, "max_think_s": s.max_think_s,
            "prompt_scale": s.prompt_scale, "prompt_format": s.prompt_format,
            "units_per_block": self.builder.units_per_block, "prompt_units": self.ideal.prompt_units,
            "output_tokens": "trace" if s.output_tokens is None else s.output_tokens,
            "dropped": self.plan.dropped, "engine_block_size": s.engine_block_size,
        }

    def reference(self) -> dict[str, Any]:
        return {"ideal_hit_rate": self.ideal.session, "ideal_hit_rate_global": self.ideal.global_,
                "definition": "prompt units found in an earlier request's prefix (same session group; global: any), "
                              f"in whole {self.setup.engine_block_size}-unit engine blocks, at most prompt - 1"}


def prepare(setup: ReplaySetup) -> Prepared:
    """Load the traces and plan the replay (``TraceError``/``ValueError`` on bad input)."""
    trace = load_traces(setup.traces, LoadOptions(
        block_size=setup.block_size, trace_block_size=setup.trace_block_size, time_scale=setup.time_scale,
        max_sessions=setup.sessions, max_requests=setup.max_requests,
        session_start_spread=setup.session_start_spread_s, seed=setup.seed))
    builder = PromptBuilder(trace, prompt_scale=setup.prompt_scale, fmt=setup.prompt_format,
                            token_vocab=setup.token_vocab)
    plan = build_plan(trace, builder, max_think_s=setup.max_think_s, max_turns=setup.max_turns,
                      max_prompt_units=setup.max_prompt_tokens, fixed_output=setup.output_tokens,
                      max_output_tokens=setup.max_output_tokens)
    if not plan.turns:
        raise ValueError("no request left to replay (every one was dropped: "
                         + ", ".join(f"{n} {why}" for why, n in plan.dropped.items()) + ")")
    ideal = ideal_hit_rate([t.request for t in plan.turns], [t.group for t in plan.turns], builder,
                           setup.engine_block_size)
    warnings = [*trace.warnings, *builder.warnings]
    warnings += [f"{n:,} requests dropped: {why}" for why, n in plan.dropped.items()]
    return Prepared(setup, trace, builder, plan, ideal, warnings)


async def replay(prep: Prepared, opts: ClientOptions, label: str = "replay",
                 progress: Callable[[int, int, float], None] | None = None,
                 spec: Any = None) -> tuple[dict[str, Any], PlayResult]:
    """Play the plan against ``opts.url``; returns (the run's summary, the raw outcomes)."""
    result = await play(prep.plan, prep.builder, opts, progress)
    summary = summarize_replay(prep.plan, result, label, prep.ideal, spec, sessions=opts.session_header is not None)
    summary["ideal_hit_rate_served"] = served_ideal(prep, result)
    return summary, result


def served_ideal(prep: Prepared, result: PlayResult) -> float:
    """The ideal (same-session) hit rate of the requests this run served: a run cut by its
    duration serves each session's first turns only, whose ideal is below the whole trace's."""
    served = [t for t, o in zip(prep.plan.turns, result.outcomes, strict=True) if o.sent and o.error is None]
    if not served:
        return 0.0
    return ideal_hit_rate([t.request for t in served], [t.group for t in served], prep.builder,
                          prep.setup.engine_block_size).session
