"""Event media map onto the index's tiers: SGLang HiCache's host tier (``CPU_PINNED``) is the CPU
tier, as vLLM's ``CPU`` is; an unknown medium is no tier (the event is filtered, not misfiled)."""

from __future__ import annotations

import msgspec

from mesh.events.apply import TIERS
from mesh.events.wire import decode_batch
from policies.base import Tier


def test_sglang_cpu_pinned_is_the_cpu_tier() -> None:
    payload = msgspec.msgpack.encode([0.0, [["BlockStored", [7], None, [], 16, None, "cpu_pinned"]]])
    (stored,) = decode_batch(payload).events  # type: ignore[union-attr]
    assert stored.medium == "CPU_PINNED"
    assert TIERS[stored.medium] is Tier.CPU and TIERS["CPU"] is Tier.CPU and TIERS["GPU"] is Tier.GPU
    assert TIERS.get("NVME") is None
