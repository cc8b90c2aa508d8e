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
the pool by the step that computes that position), with ``prompt_end`` at the position a KV
transfer resumes from (the prompt's last full block before its last token: a prefill worker's),
and at the end of each turn (the boundary buffer promoted on finish, abort or preemption). A
prefix hit resumes at the deepest matched block whose key holds a checkpoint; the state is
copied into the sequence's running slot. ``file`` adds one from outside (a transferred state).

Pins (``pin``/``unpin``, counted per key) keep a checkpoint in the pool while a KV transfer
reads or installs it: LRU eviction passes over pinned checkpoints; with every one pinned a new
checkpoint is not taken (an under-claim, never a wrong state). Each pin has one owner (a
prefill worker's transfer, a decode request's hold) that unpins it exactly once.

Copies between slots (restore, promotion) are queued in order and run by the engine before the
next forward pass (``take_copies``), so a restore reads a pool slot before a later write reuses
it, and a promotion reads a boundary buffer before its next owner's forward pass writes it.
Snapshot destinations of a step (``plan``) are written by that step's forward pass.

Events (drained by the block manager after the step's attention events): a checkpoint stored is a ``BlockStored`` of the recurrent KV cache group (``GROUP``,
kind ``"mamba"``: vLLM's ``KVCacheSpecKind.MAMBA``) naming the one block it covers, with that
block's parent key and tokens; an evicted checkpoint is a ``BlockRemoved`` of that group.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import TYPE_CHECKING, Any, NamedTuple

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
    def __init__(self, max_num_seqs: int, num_checkpoints: int, interval: int, block_size: int,
                 prompt_end: bool = False) -> None:
        self.num_running = max_num_seqs
        self.num_checkpoints = num_checkpoints
        self.interval = interval  # tokens, a multiple of block_size; 0: no interval checkpoints
        self.block_size = block_size
        self.prompt_end = prompt_end  # also checkpoint each prompt where a KV transfer resumes
        # checkpoint events of the current step; the block manager drains them after its own
        # (a checkpoint's parent block is announced by the same step's commit)
        self.events: list[KVEvent] = []
        self._free_running = list(range(max_num_seqs - 1, -1, -1))
        self._free_pool = list(range(2 * max_num_seqs + num_checkpoints - 1, 2 * max_num_seqs - 1, -1))
        self.pool: OrderedDict[int, int] = OrderedDict()  # key -> slot; front = least recently used
        self.pins: Counter[int] = Counter()  # key -> transfer pins (never evicted while pinned)
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
            elif (dst := self._store(seq, p)) is not None:
                self.copies.append(StateCopy(self.num_running + slot, dst))
                self.num_promoted += 1
        seq.state_slot, seq.state_boundary = None, 0
        self._free_running.append(slot)

    def plan(self, seq: Sequence, start: int, n: int) -> list[tuple[int, int]]:
        """Snapshot destinations of a step that computes positions ``[start, start + n)`` of
        ``seq``: ``(tokens after start, slot)`` for each checkpoint position passed (interval,
        prompt end), and the last block boundary passed into the boundary buffer."""
        if not self.num_checkpoints or seq.state_slot is None:
            return []
        bs = self.block_size
        first = (start // bs + 1) * bs
        last = (start + n) // bs * bs
        if last < first:
            return []
        out: list[tuple[int, int]] = []
        for p in self._positions(seq, first, last):
            key = seq.keys_upto(p // bs)[-1]
            if key in self.pool:
                self.pool.move_to_end(key)
            elif (slot := self._store(seq, p)) is not None:
                out.append((p - start, slot))
        out.append((last - start, self.num_running + seq.state_slot))
        seq.state_boundary = last
        return out

    def _positions(self, seq: Sequence, first: int, last: int) -> list[int]:
        """Checkpoint positions in ``[first, last]`` (block-aligned), ascending, each once."""
        out = list(range(-(-first // self.interval) * self.interval, last + 1, self.interval)) if self.interval else []
        end = (seq.num_prompt_tokens - 1) // self.block_size * self.block_size  # a transfer's resume point
        if self.prompt_end and first <= end <= last and end not in out:
            out = sorted([*out, end])
        return out

    def take_copies(self) -> list[StateCopy]:
        copies, self.copies = self.copies, []
        return copies

    def clear(self) -> None:
        """Forget every checkpoint (the prefix cache's reset; its AllBlocksCleared covers them).
        Never while one is pinned: a pin comes with pinned blocks, and those refuse the reset."""
        if self.pins:
            raise RuntimeError(f"reset with {len(self.pins)} pinned checkpoints")
        self._free_pool += list(self.pool.values())
        self.pool.clear()
        self.copies = [c for c in self.copies if c.dst < 2 * self.num_running]

    # ---- the pool ------------------------------------------------------------------------------

    def _store(self, seq: Sequence, position: int) -> int | None:
        """A pool slot for the checkpoint of ``seq`` at block-aligned ``position``, registered and
        announced now (the caller writes it); None when every checkpoint is pinned."""
        from workers.engine.block_manager import salt_extra_keys

        i = position // self.block_size - 1
        keys = seq.keys_upto(i + 1)
        return self.file(keys[i], keys[i - 1] if i else None, seq.block_tokens(i),
                         salt_extra_keys(seq.cache_salt, i, 1))

    def file(self, key: int, parent: int | None, tokens: list[int], extra_keys: Any = None) -> int | None:
        """Register a checkpoint under ``key`` (a block of ``tokens`` after ``parent``) in a pool
        slot, evicting the least recently used unpinned one when the pool is full, and announce
        it; returns the slot for the caller to write, None when every checkpoint is pinned."""
        from workers.engine.block_manager import BlockRemoved, BlockStored

        if key in self.pool:
            raise RuntimeError(f"checkpoint {key:#x} is already filed")
        if not self._free_pool:
            old = next((k for k in self.pool if not self.pins[k]), None)
            if old is None:
                return None
            self._free_pool.append(self.pool.pop(old))
            self.events.append(BlockRemoved([old], group_idx=GROUP))
            self.num_evicted += 1
        slot = self._free_pool.pop()
        self.pool[key] = slot
        self.num_saved += 1
        self.events.append(BlockStored([key], parent, list(tokens), self.block_size, extra_keys=extra_keys,
                                       group_idx=GROUP, kind=KIND))
        return slot

    # ---- pins (KV transfers) ----------------------------------------------------------------

    def pin(self, key: int) -> bool:
        """Keep the checkpoint under ``key`` in the pool until ``unpin``; False if there is none."""
        if key not in self.pool:
            return False
        self.pins[key] += 1
        self.pool.move_to_end(key)
        return True

    def unpin(self, key: int) -> None:
        if self.pins[key] <= 0:
            raise RuntimeError(f"unpin of checkpoint {key:#x} that holds no pin")
        self.pins[key] -= 1
        if not self.pins[key]:
            del self.pins[key]

    def slot_of(self, key: int) -> int:
        return self.pool[key]

    def check(self) -> list[str]:
        errors = []
        slots = list(self.pool.values())
        if len(set(slots)) != len(slots) or set(slots) & set(self._free_pool):
            errors.append("a checkpoint pool slot is held twice")
        if len(slots) + len(self._free_pool) != self.num_checkpoints:
            errors.append(f"checkpoint pool slots leaked: {len(slots)} held + {len(self._free_pool)} free")
        if any(k not in self.pool or n <= 0 for k, n in self.pins.items()):
            errors.append("a pinned checkpoint is not in the pool")
        return errors
