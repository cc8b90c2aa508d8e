"""Where hybrid targets hold recurrent-state checkpoints (``Checkpoints``, part of ``PrefixIndex``).

A hybrid model (recurrent layers beside full attention) resumes a cached prefix only where a
checkpoint of its recurrent state exists: attention blocks alone are not a hit. A target is
hybrid once marked (the gateway's ``workers[].hybrid``, or the first checkpoint its events
announce: a store of a recurrent KV cache group, ``mesh.events.wire.RECURRENT_KINDS``). For a
hybrid target ``PrefixIndex.match`` cuts the attention overlap back to the deepest block whose
router key holds a checkpoint (``resumable``); a hybrid target without one is no match at all.

Checkpoints are keyed like blocks: the router key of the last block a checkpoint covers. Per
target, engine hash -> router key (for removals) and key -> the number of engine hashes naming it.
Bounded per target by ``MAX_PER_TARGET`` (the oldest forgotten first: an under-claim, never an
over-claim). Ownership: the index's thread only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from mesh.core.keys import block_keys
from policies.base import Overlap

MAX_PER_TARGET = 1 << 20


class Checkpoints:
    __slots__ = ("_hashes", "_keys", "hybrid")

    def __init__(self) -> None:
        self._hashes: dict[str, dict[int, int]] = {}  # target -> engine hash -> key
        self._keys: dict[str, dict[int, int]] = {}  # target -> key -> engine hashes naming it
        self.hybrid: set[str] = set()

    def store(self, target: str, engine_hashes: Sequence[int], keys: Sequence[int]) -> int:
        self.hybrid.add(target)
        hashes = self._hashes.setdefault(target, {})
        held = self._keys.setdefault(target, {})
        for h, key in zip(engine_hashes, keys, strict=True):
            old = hashes.get(h)
            if old == key:
                continue
            if old is not None:  # the hash names another checkpoint now
                self._drop(held, old)
            hashes[h] = key
            held[key] = held.get(key, 0) + 1
        while len(hashes) > MAX_PER_TARGET:
            self._drop(held, hashes.pop(next(iter(hashes))))
        return len(engine_hashes)

    def store_span(
        self, target: str, engine_hashes: Sequence[int], token_ids: Sequence[int], block_size: int, parent_key: int
    ) -> int:
        """Checkpoints after the last ``len(engine_hashes)`` blocks of ``token_ids``, keyed as a
        chain from ``parent_key`` (``PrefixIndex.apply_state_stored``)."""
        n = len(engine_hashes)
        if block_size <= 0 or len(token_ids) % block_size or len(token_ids) < n * block_size:
            raise ValueError(f"a state BlockStored carries {len(token_ids)} tokens for {n} blocks of {block_size}")
        keys = block_keys(token_ids, block_size, parent_key)
        return self.store(target, engine_hashes, keys[len(keys) - n :])

    def remove(self, target: str, engine_hashes: Iterable[int]) -> int:
        hashes, held = self._hashes.get(target), self._keys.get(target)
        if not hashes or held is None:
            return 0
        done = 0
        for h in engine_hashes:
            key = hashes.pop(h, None)
            if key is not None:
                self._drop(held, key)
                done += 1
        return done

    @staticmethod
    def _drop(held: dict[int, int], key: int) -> None:
        n = held.get(key, 0) - 1
        if n > 0:
            held[key] = n
        else:
            held.pop(key, None)

    def clear(self, target: str) -> None:
        """Forget ``target``'s checkpoints (its engine's reset); it stays hybrid."""
        self._hashes.pop(target, None)
        self._keys.pop(target, None)

    def forget(self, target: str) -> None:
        self.clear(target)
        self.hybrid.discard(target)

    def keys_of(self, target: str) -> set[int]:
        return set(self._keys.get(target, ()))

    def resumable(self, target: str, keys: Sequence[int], depth: int) -> int:
        """The deepest ``d <= depth`` whose block ``keys[d - 1]`` holds a checkpoint (0: none)."""
        held = self._keys.get(target)
        if not held:
            return 0
        for d in range(min(depth, len(keys)), 0, -1):
            if keys[d - 1] in held:
                return d
        return 0

    def cut(self, keys: Sequence[int], out: dict[str, Overlap]) -> dict[str, Overlap]:
        """``out`` (a match of ``keys``) with hybrid targets' overlaps cut to their deepest
        checkpoint, and those with none dropped."""
        for target in self.hybrid.intersection(out):
            ov = out[target]
            d = self.resumable(target, keys, ov.blocks)
            if d == 0:
                del out[target]
            elif d < ov.blocks:
                gpu = min(ov.gpu_blocks, d)
                out[target] = Overlap(gpu, d - gpu)
        return out

    def count(self) -> int:
        return sum(map(len, self._hashes.values()))
