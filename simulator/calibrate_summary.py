"""What a ``mesh calibrate`` profile holds, said plainly: the KV capacity and where it came from
(``resolve_capacity``), every cost fitted and every one not fitted with the reason
(``summary_lines``)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from simulator.profile import Profile


@dataclass(frozen=True, slots=True)
class WorkerCapacity:
    """The KV capacity a worker reports (``mesh.commands.calibrate_capacity`` reads it)."""

    kv_blocks: int
    block_size: int | None  # tokens per reported block; None: not reported
    source: str  # where it was read, for the profile and the summary


def resolve_capacity(args: argparse.Namespace, base: Profile, capacity: WorkerCapacity | None) -> tuple[int, int, str]:
    """(block size, KV blocks of that size, where the capacity came from): ``--kv-blocks`` over
    the worker's report over the base profile's (the last a loud warning: not this worker's)."""
    reported = capacity.block_size if capacity is not None and (capacity.block_size or 0) > 1 else None  # 1: tokens
    block_size = args.block_size or reported or base.block_size
    if args.kv_blocks is not None:
        return block_size, args.kv_blocks, "--kv-blocks"
    if capacity is not None and capacity.kv_blocks > 0:
        return block_size, capacity.kv_blocks * (capacity.block_size or block_size) // block_size, capacity.source
    return block_size, base.kv_blocks, f"base profile {base.name}'s: the worker reported no KV capacity"


# (section, term, label, unit scale from ms, unit) of every cost the summary prints
_TERMS = (
    ("prefill", "base_ms", "base", 1.0, "ms"), ("prefill", "per_token_ms", "per token", 1e3, "us"),
    ("prefill", "per_token2_ms", "per token^2", 1e6, "ns"), ("prefill", "per_token_ctx_ms", "per token x context", 1e6, "ns"),
    ("prefill", "per_hit_token_ms", "per cached token", 1e3, "us"), ("prefill", "mixed_ms", "mixed step", 1.0, "ms"),
    ("prefill", "mixed_per_seq_ms", "mixed per decoding seq", 1.0, "ms"),
    ("prefill", "mixed_per_token_ms", "mixed per prompt token", 1e3, "us"),
    ("decode", "base_ms", "base", 1.0, "ms"), ("decode", "per_seq_ms", "per sequence", 1.0, "ms"),
    ("decode", "per_ctx_token_ms", "per context token", 1e3, "us"),
)


def summary_lines(profile: Profile, unfitted: dict[str, str], capacity_source: str) -> list[str]:
    """What the profile holds: every fitted cost, every one not fitted and why, the capacity."""
    lines = [f"KV capacity: {profile.kv_blocks:,} blocks of {profile.block_size} tokens ({capacity_source})"]
    for section in ("prefill", "decode"):
        timing = getattr(profile, section)
        fitted = [f"{label} {getattr(timing, term) * scale:.3g} {unit}" for sec, term, label, scale, unit in _TERMS
                  if sec == section and f"{section}.{term[:-3]}" not in unfitted]
        lines.append(f"{section}: {', '.join(fitted) or 'nothing fitted'}")
    lines += [f"not fitted (0 in the profile): {term}: {why}" for term, why in unfitted.items()]
    return lines
