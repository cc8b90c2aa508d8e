"""Recurrent-state slots and checkpoints of a hybrid model (bookkeeping only; no torch).

A recurrent layer's state is not rebuilt from nearby tokens: a cached prefix of attention blocks
is resumable only where a checkpoint of the recurrent state exists. This module owns the slots
of the model runner's state tensor ``[recurrent layers, num_slots, heads, d_k, d_v]``:

    [0, R)          one running state per running sequence (R = max_num_seqs)
    [R, 2R)         each running slot's boundary buffer: the state at the sequence's last block
                    boundary passed (promoted to a checkpoint when the sequence ends its turn)
    [2R, 2R + C)    the checkpoint pool (C = num_state_checkpoints), LRU, keyed by the chained
                    block key (``mesh.core.keys``, the prefix cache's and the router's key) of
                    the last block a checkpoint covers

Checkpoints are taken at block-aligned positions: every multiple of the interval (written into
the pool by the step that computes that position), and at the end of each turn (the boundary
buffer promoted on finish, abort or preemption). A prefix hit resumes at the deepest matched
block whose key holds a checkpoint; the state is copied into the sequence's running slot.

Copies between slots (restore, promotion) are queued in order and run by the engine before the
next forward pass (``take_copies``), so a restore reads a pool slot before a later write reuses
it, and a promotion reads a boundary buffer before its next owner's forward pass writes it.
Snapshot destinations of a step (``plan``) are written by that step's forward pass.

Events (drained by the block manager after the step's attention events): a checkpoint stored is a ``BlockStored`` of the recurrent KV cache group (``GROUP``,
kind ``"mamba"``: vLLM's ``KVCacheSpecKind.MAMBA``) naming the one block it covers, with that
block's parent key and tokens; an evicted checkpoint is a ``BlockRemoved`` of that group.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from workers.engine.block_manager import KVEvent
    from workers.engine.sequence import Sequence

ATTENTION_GROUP, GROUP = 0, 1  # KV cache groups of a hybrid model: full attention, recurrent state
ATTENTION_KIND, KIND = "full_attention", "mamba"  # vLLM's KVCacheSpecKind values


class StateCopy(NamedTuple):
    src: int
    dst: int


def num_state_slots(max_num_seqs: int, num_checkpoints: int) -> int:
    return 2 * max_num_seqs + num_checkpoints


class StateCheckpoints:
    def __init__(self, max_num_seqs: int, num_checkpoints: int, interval: int, block_size: int) -> None:
        self.num_running = max_num_seqs
        self.num_checkpoints = num_checkpoints
        self.interval = interval  # tokens, a multiple of block_size; 0: no interval checkpoints
        self.block_size = block_size
        # checkpoint events of the current step; the block manager drains them after its own
        # (a checkpoint's parent block is announced by the same step's commit)
        self.events: list[KVEvent] = []
        self._free_running = list(range(max_num_seqs - 1, -1, -1))
        self._free_pool = list(range(2 * max_num_seqs + num_checkpoints - 1, 2 * max_num_seqs - 1, -1))
        self.pool: OrderedDict[int, int] = OrderedDict()  # key -> slot; front = least recently used
        self.copies: list[StateCopy] = []
        self.num_saved = 0  # checkpoints written (interval and end of turn)
        self.num_promoted = 0  # of which end-of-turn (boundary buffer -> pool)
        self.num_restored = 0  # prefix hits resumed from a checkpoint
        self.num_evicted = 0

    @property
    def num_slots(self) -> int:
        return num_state_slots(self.num_running, self.num_checkpoints)

    def __contains__(self, key: int) -> bool:
        return key in self.pool

    def __len__(self) -> int:
        return len(self.pool)

    # ---- resumable prefix --------------------------------------------------------------------

    def resumable(self, hits: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The longest leading part of ``hits`` (matched ``(block id, key)`` pairs) whose last
        block holds a checkpoint: the deepest position attention blocks and a state both exist."""
        for j in range(len(hits), 0, -1):
            if hits[j - 1][1] in self.pool:
                return hits[:j]
        return []

    # ---- a sequence's life ---------------------------------------------------------------------

    def acquire(self, seq: Sequence, resume_key: int | None) -> None:
        """A running slot for ``seq``; with ``resume_key``, that checkpoint's state copied into it."""
        if seq.state_slot is not None:
            raise RuntimeError(f"sequence {seq.seq_id} already holds state slot {seq.state_slot}")
        if not self._free_running:
            raise RuntimeError("no free recurrent state slot (more running sequences than max_num_seqs)")
        seq.state_slot = self._free_running.pop()
        seq.state_boundary = 0
        if resume_key is not None:
            self.copies.append(StateCopy(self.pool[resume_key], seq.state_slot))
            self.pool.move_to_end(resume_key)
            self.num_restored += 1

    def release(self, seq: Sequence) -> None:
        """``seq`` leaves the running set: its last boundary state becomes a checkpoint (end of
        turn), its slots return to the free lists."""
        slot = seq.state_slot
        if slot is None:
            return
        p = seq.state_boundary
        if p and self.num_checkpoints:
            key = seq.keys_upto(p // self.block_size)[-1]
            if key in self.pool:
                self.pool.move_to_end(key)
            else:
                self.copies.append(StateCopy(self.num_running + slot, self._store(seq, p)))
                self.num_promoted += 1
        seq.state_slot, seq.state_boundary = None, 0
        self._free_running.append(slot)

    def plan(self, seq: Sequence, start: int, n: int) -> list[tuple[int, int]]:
        """Snapshot destinations of a step that computes positions ``[start, start + n)`` of
        ``seq``: ``(tokens after start, slot)`` for each interval checkpoint passed, and the last
        block boundary passed into the boundary buffer."""
        if not self.num_checkpoints or seq.state_slot is None:
            return []
        bs = self.block_size
        first = (start // bs + 1) * bs
        last = (start + n) // bs * bs
        if last < first:
            return []
        out: list[tuple[int, int]] = []
        if self.interval:
            for p in range(-(-first // self.interval) * self.interval, last + 1, self.interval):
                key = seq.keys_upto(p // bs)[-1]
                if key in self.pool:
                    self.pool.move_to_end(key)
                else:
                    out.append((p - start, self._store(seq, p)))
        out.append((last - start, self.num_running + seq.state_slot))
        seq.state_boundary = last
        return out

    def take_copies(self) -> list[StateCopy]:
        copies, self.copies = self.copies, []
        return copies

    def clear(self) -> None:
        """Forget every checkpoint (the prefix cache's reset; its AllBlocksCleared covers them)."""
        self._free_pool += list(self.pool.values())
        self.pool.clear()
        self.copies = [c for c in self.copies if c.dst < 2 * self.num_running]

    # ---- the pool ------------------------------------------------------------------------------

    def _store(self, seq: Sequence, position: int) -> int:
        """A pool slot for the checkpoint of ``seq`` at block-aligned ``position`` (the LRU one
        evicted when the pool is full), registered and announced now; the caller writes it."""
        from workers.engine.block_manager import BlockRemoved, BlockStored, salt_extra_keys

        if not self._free_pool:
            old, slot = self.pool.popitem(last=False)
            self.events.append(BlockRemoved([old], group_idx=GROUP))
            self.num_evicted += 1
            self._free_pool.append(slot)
        i = position // self.block_size - 1
        keys = seq.keys_upto(i + 1)
        slot = self._free_pool.pop()
        self.pool[keys[i]] = slot
        self.num_saved += 1
        self.events.append(BlockStored(
            [keys[i]], keys[i - 1] if i else None, seq.block_tokens(i), self.block_size,
            extra_keys=salt_extra_keys(seq.cache_salt, i, 1), group_idx=GROUP, kind=KIND,
        ))
        return slot

    def check(self) -> list[str]:
        errors = []
        slots = list(self.pool.values())
        if len(set(slots)) != len(slots) or set(slots) & set(self._free_pool):
            errors.append("a checkpoint pool slot is held twice")
        if len(slots) + len(self._free_pool) != self.num_checkpoints:
            errors.append(f"checkpoint pool slots leaked: {len(slots)} held + {len(self._free_pool)} free")
        return errors
