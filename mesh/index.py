"""The prefix index: which target holds which block, on which tier.

REFERENCE IMPLEMENTATION (simple and correct); the optimized index replaces the internals and
keeps this API and its semantics:

- Keys are router block keys (``mesh.keys``): a key names a whole prefix.
- ``match(keys)`` returns, per target, its longest *consecutive* cached prefix of ``keys``
  (``Overlap.gpu_blocks`` leading blocks on the GPU, then ``cpu_blocks`` from the CPU tier).
- Speculative entries (``store_speculative``) count as GPU blocks until they expire or the
  engine's own event confirms them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from policies.base import Overlap, Tier


class PrefixIndex:
    def __init__(self, max_keys: int = 0) -> None:
        self.max_keys = max_keys  # 0 = unbounded
        self._holders: dict[int, dict[str, Tier]] = {}
        self._by_target: dict[str, set[int]] = {}

    # -- key layer (used by the simulator and by the event layer below) --
    def store(self, target: str, keys: Sequence[int], tier: Tier = Tier.GPU) -> None:
        owned = self._by_target.setdefault(target, set())
        for key in keys:
            holders = self._holders.setdefault(key, {})
            if holders.get(target) is not Tier.GPU or tier is Tier.GPU:
                holders[target] = tier
            owned.add(key)

    def remove(self, target: str, keys: Sequence[int]) -> None:
        owned = self._by_target.get(target)
        for key in keys:
            holders = self._holders.get(key)
            if holders and holders.pop(target, None) is not None and not holders:
                del self._holders[key]
            if owned is not None:
                owned.discard(key)

    def clear_target(self, target: str) -> None:
        self.remove(target, list(self._by_target.pop(target, ())))

    def match(self, keys: Sequence[int]) -> Mapping[str, Overlap]:
        gpu: dict[str, int] = {}
        cpu: dict[str, int] = {}
        active: set[str] | None = None
        for depth, key in enumerate(keys):
            holders = self._holders.get(key)
            if not holders:
                break
            alive = set(holders) if active is None else active & holders.keys()
            for target in alive:
                if holders[target] is Tier.GPU and cpu.get(target, 0) == 0:
                    gpu[target] = depth + 1
                else:
                    cpu[target] = depth + 1 - gpu.get(target, 0)
            active = alive
            if not active:
                break
        return {t: Overlap(gpu.get(t, 0), cpu.get(t, 0)) for t in set(gpu) | set(cpu)}

    def holds(self, target: str, key: int) -> Tier | None:
        return self._holders.get(key, {}).get(target)

    def keys_of(self, target: str) -> set[int]:
        return set(self._by_target.get(target, ()))

    def __len__(self) -> int:
        return len(self._holders)
