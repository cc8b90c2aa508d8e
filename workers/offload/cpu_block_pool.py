"""The CPU offload tier's bookkeeping: which KV blocks sit in which slot of the host page pool.

Ownership: the ``BlockManager`` owns this pool (engine thread only) and decides what to save and
restore; ``workers.offload.kv_offload.CpuKVCache`` holds the pages and copies them. No torch here.

Blocks are keyed like the GPU prefix cache (``mesh.core.keys`` chained keys) and kept in LRU order:
the front of ``blocks`` is evicted first. A lookup verifies the parent key and the tokens, as a
GPU hit does, so a restore never serves another prefix's pages.

Invariants (``check()``):
- every slot is free or holds exactly one block: ``len(free_slots) + len(blocks) == num_blocks``;
- a block's key is the chained key of its tokens from its parent key;
- a pinned block (a restore being planned inside one allocation) is never evicted.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from mesh.core.keys import block_keys


@dataclass(slots=True)
class CpuBlock:
    slot: int  # row of the host page pool
    parent_key: int  # the namespace seed for a chain's first block
    token_ids: tuple[int, ...]


class CpuBlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size of the CPU pool must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks: OrderedDict[int, CpuBlock] = OrderedDict()  # key -> block, LRU first
        self.free_slots: deque[int] = deque(range(num_blocks))
        self.pinned: set[int] = set()  # keys that must not be evicted right now
        self.num_stored = 0  # blocks saved into the pool
        self.num_evicted = 0  # blocks dropped from the pool to make room

    def __contains__(self, key: int) -> bool:
        return key in self.blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def lookup(self, key: int, parent_key: int, token_ids: tuple[int, ...]) -> CpuBlock | None:
        """The block for ``key`` if it holds exactly these tokens after this parent; pure."""
        block = self.blocks.get(key)
        if block is None or block.parent_key != parent_key or block.token_ids != token_ids:
            return None
        return block

    def touch(self, key: int) -> None:
        self.blocks.move_to_end(key)

    def store(self, key: int, parent_key: int, token_ids: tuple[int, ...]) -> tuple[int, int | None] | None:
        """A slot for a new block ``key`` (not in the pool): ``(slot, evicted key or None)``, or
        None when every block is pinned. The caller copies the pages into the slot."""
        if key in self.blocks:
            raise RuntimeError(f"CPU block {key:#x} stored twice")
        evicted = None
        if not self.free_slots:
            evicted = self._evict_lru()
            if evicted is None:
                return None
        slot = self.free_slots.popleft()
        self.blocks[key] = CpuBlock(slot, parent_key, token_ids)
        self.num_stored += 1
        return slot, evicted

    def _evict_lru(self) -> int | None:
        victim = next((k for k in self.blocks if k not in self.pinned), None)
        if victim is not None:
            self.free_slots.append(self.blocks.pop(victim).slot)
            self.num_evicted += 1
        return victim

    def clear(self) -> None:
        """Forget every block (the prefix cache reset); pins must be gone."""
        self.blocks.clear()
        self.pinned.clear()
        self.free_slots = deque(range(self.num_blocks))

    def check(self) -> list[str]:
        """Broken invariants, as messages (``BlockManager.check`` reports them)."""
        errors: list[str] = []
        slots = [b.slot for b in self.blocks.values()] + list(self.free_slots)
        if sorted(slots) != list(range(self.num_blocks)):
            errors.append(f"CPU pool slots are not a partition of 0..{self.num_blocks - 1}")
        for key, b in self.blocks.items():
            if len(b.token_ids) != self.block_size:
                errors.append(f"CPU block {key:#x} holds {len(b.token_ids)} tokens")
            elif block_keys(b.token_ids, self.block_size, 0, parent=b.parent_key)[0] != key:
                errors.append(f"CPU block {key:#x}: key does not match its tokens and parent")
        if not self.pinned <= self.blocks.keys():
            errors.append("a pinned CPU block is not in the pool")
        return errors
