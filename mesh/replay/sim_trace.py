"""A replay plan as a simulator trace: ``mesh simulate`` runs exactly what ``mesh replay`` sends.

Each planned turn becomes one ``simulator.traces.TraceRequest`` (index = the turn's position):

- its prompt is the replay's, in tokens: ``PromptBuilder.units`` (one unit per token at the
  bundled workers' byte level), and its output the turn's ``max_tokens``;
- its block keys are those of the engine's blocks over the built prompt: the replay spells every
  trace block as ``units_per_block`` units derived from the block's chained key, so an engine
  block of ``engine_block`` units is equal in two prompts exactly when the trace blocks it
  covers (up to the last it touches, and its offset there) are; ``simulator.trace_keys.
  chain_keys`` over the trace keys at ``units_per_block`` tokens per block computes such keys.
  Blocks that reach into the prompt's partial tail (units unique to the request) get no key:
  they never hit, as on the engine;
- arrivals, dependencies and capped think times are the plan's, and ``Trace.groups`` its
  session groups, for the simulator's closed-loop admission (``simulator.session_gate``).

Pure: no I/O, no torch.
"""

from __future__ import annotations

from dataclasses import replace

from mesh.replay.prompts import PromptBuilder
from mesh.replay.schedule import Plan
from simulator.trace_keys import chain_keys, scope_seed
from simulator.traces import Trace, TraceRequest


def plan_trace(trace: Trace, plan: Plan, builder: PromptBuilder, engine_block: int, *,
               session_ids: bool = True, namespace: str = "mesh-replay") -> Trace:
    """The simulator's trace of ``plan`` (built from ``trace`` by ``build_plan`` with ``builder``),
    keyed in ``engine_block``-token blocks; ``session_ids=False``: no request carries a session
    (as a replay that sends no session header)."""
    if engine_block < 1:
        raise ValueError(f"engine block size must be >= 1, got {engine_block}")
    seed = scope_seed(namespace, "prompts")
    upb = builder.units_per_block
    requests = []
    for turn in plan.turns:
        r = turn.request
        covered = min(turn.units, int(r.keys.size) * upb)  # units spelled from the trace blocks
        keys = chain_keys(r.keys, covered, upb, engine_block, seed)
        requests.append(TraceRequest(
            idx=turn.pos, session=turn.session if session_ids else None, arrival=turn.arrival,
            deps=turn.deps, prompt_tokens=turn.units, output_tokens=turn.max_tokens, keys=keys,
            source=r.source))
    warnings = [*trace.warnings, *builder.warnings]
    return replace(trace, requests=requests, block_size=engine_block, warnings=warnings,
                   groups=[t.group for t in plan.turns])
