"""Paged KV blocks with prefix caching (nano-vllm's cut, vLLM's vocabulary).

Ownership and lifecycle of one block:

    free, no content --allocate--> used (ref 1) --commit--> used + cached (key registered)
    used + cached --free (ref 0)--> free + cached   (content KEPT, key still registered)
    free + cached --hit--> used + cached            (revival: never passes through _take_fresh)
    free + cached --_take_fresh--> used, no content (eviction: ``_evict``, the ONLY place that
                                                     drops content; emits BlockRemoved)

With a CPU offload tier (``num_cpu_blocks`` > 0, ``workers.offload.cpu_block_pool``):

    eviction of a cached block --> its pages are saved to a CPU slot first (unless the CPU pool
        already holds its key): a ``Swap(out=True)`` queued in ``swaps``, a CPU BlockStored
        emitted before the GPU BlockRemoved (so a subscriber never loses the block in between)
    prefix match --> each block from the GPU cache, else from the CPU pool (verified tokens);
        a CPU hit takes a fresh GPU block, is registered in the GPU prefix cache at once (the
        next turn hits on the GPU) and queues a ``Swap(out=False)``; its CPU copy stays

Swaps are page copies in queue order; the engine runs them (``take_swaps``) after scheduling and
before the forward pass, so a save reads a page before anything overwrites it and a restored
page is in place before anything reads it. Between engine steps no swap is pending.

Invariants (``check()``):
- a block is in the free pool iff its ref count is 0;
- ``cached[key] == block_id`` iff ``blocks[block_id].key == key``; a cached block holds exactly
  ``block_size`` tokens whose key, chained from its parent key, equals its own key;
- a block is registered only after its K/V was computed (commit follows the forward pass), or,
  for a restore, with its copy queued ahead of every forward pass, so a hit never reads a slot
  that nobody wrote;
- with a CPU tier: the CPU pool's own invariants (``CpuBlockPool.check``), and a key held on both
  tiers stands for the same tokens after the same parent.

The free pool is ordered: the front is taken first. Blocks without content go to the front;
cached blocks go to the back, a sequence's last block first, so the tail of a chain is evicted
before its head and a surviving prefix stays contiguous.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from mesh.core.keys import block_keys
from workers.engine.sequence import Sequence
from workers.engine.state_checkpoints import ATTENTION_GROUP, ATTENTION_KIND, StateCheckpoints
from workers.offload.cpu_block_pool import CpuBlockPool

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]  # empty for a CPU store: a tier update of blocks known by hash (vLLM's shape)
    block_size: int
    medium: str = MEDIUM_GPU
    # vLLM's per-block extra hash inputs: the cache salt rides on a chain's first block, so a
    # subscriber keys a salted chain in the salt's namespace (None: nothing extra anywhere)
    extra_keys: list[tuple[str, ...] | None] | None = None
    # hybrid models: the KV cache group and its kind (vLLM's KVCacheSpecKind value); None: one group
    group_idx: int | None = None
    kind: str | None = None


def salt_extra_keys(salt: str | None, first: int, n: int) -> list[tuple[str, ...] | None] | None:
    """``extra_keys`` of ``n`` stored blocks starting at chain position ``first``."""
    if not salt or first:
        return None
    return [(salt,)] + [None] * (n - 1)


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str = MEDIUM_GPU
    group_idx: int | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class Swap(NamedTuple):
    """One queued page copy between the GPU cache and the CPU pool."""

    out: bool  # True: GPU -> CPU (save before eviction); False: CPU -> GPU (restore)
    gpu_block: int
    cpu_slot: int


class Block:
    __slots__ = ("block_id", "ref_count", "key", "parent_key", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.key: int | None = None  # set iff registered in the prefix cache
        self.parent_key: int | None = None  # the namespace seed for a chain's first block
        self.token_ids: tuple[int, ...] | None = None

    def clear(self) -> None:
        self.key = self.parent_key = self.token_ids = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_cpu_blocks: int = 0) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        if num_cpu_blocks < 0:
            raise ValueError("num_cpu_blocks must be >= 0")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.cached: dict[int, int] = {}  # key -> block id
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.events: list[KVEvent] = []  # since the last drain_events()
        self.num_revived = 0
        self.num_evicted = 0
        self.cpu = CpuBlockPool(num_cpu_blocks, block_size) if num_cpu_blocks else None
        self.swaps: list[Swap] = []  # queued page copies, in order (run by the engine)
        self.num_saved = 0  # blocks copied GPU -> CPU
        self.num_restored = 0  # blocks copied CPU -> GPU (CPU prefix hits)
        # Hybrid models: recurrent-state slots and checkpoints (``enable_states``); a hit is cut
        # back to the deepest block with a checkpoint.
        self.states: StateCheckpoints | None = None
        self.num_unresumable_tokens = 0  # attention-block hits dropped for want of a checkpoint

    def enable_states(self, max_num_seqs: int, num_checkpoints: int, interval: int,
                      prompt_end: bool = False) -> StateCheckpoints:
        """Make this a hybrid model's block manager (before any allocation). Its attention blocks
        are announced as group 0 of kind full_attention, checkpoints as the recurrent group."""
        if self.cpu is not None:
            raise ValueError("the CPU offload tier does not hold recurrent state: hybrid models run without it")
        self.states = StateCheckpoints(max_num_seqs, num_checkpoints if self.enable_prefix_caching else 0,
                                       interval, self.block_size, prompt_end)
        return self.states

    # ---- capacity -------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self.free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / len(self.blocks)

    # ---- prefix lookup --------------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> list[int]:
        """GPU blocks holding the leading part of ``seq``'s cached prefix (before any CPU hit)."""
        hits: list[int] = []
        for bid, _ in self._match(seq):
            if bid < 0:
                break
            hits.append(bid)
        return hits

    def _match(self, seq: Sequence) -> list[tuple[int, int]]:
        """``seq``'s resumable cached prefix: the attention blocks' (``_match_blocks``), cut back
        to the deepest block with a recurrent-state checkpoint on a hybrid model."""
        hits = self._match_blocks(seq)
        return hits if self.states is None else self.states.resumable(hits)

    def _match_blocks(self, seq: Sequence) -> list[tuple[int, int]]:
        """``seq``'s cached prefix, verified token by token; pure. One ``(block id, key)`` per
        block: the GPU block holding it, or -1 when only the CPU pool does (a restore).

        The block holding the last token is never matched: at least one token must be computed,
        so that the step produces logits (and never writes into a shared block).
        """
        if not self.enable_prefix_caching:
            return []
        limit = (len(seq) - 1) // self.block_size
        hits: list[tuple[int, int]] = []
        parent = seq.key_seed
        cpu = self.cpu
        for i, key in enumerate(seq.keys_upto(limit)):
            tokens = tuple(seq.block_tokens(i))
            bid = self.cached.get(key)
            if bid is not None:
                block = self.blocks[bid]
                # The key names the whole chain; compare what it stands for anyway.
                if block.parent_key != parent or block.token_ids != tokens:
                    break
            elif cpu is None or cpu.lookup(key, parent, tokens) is None:
                break
            hits.append((-1 if bid is None else bid, key))
            parent = key
        return hits

    def _blocks_needed(self, seq: Sequence, hits: list[tuple[int, int]]) -> int:
        """Free blocks that allocating ``seq`` takes: revived GPU hits, restores, the rest."""
        revived = sum(1 for b, _ in hits if b >= 0 and self.blocks[b].ref_count == 0)
        return revived + seq.num_blocks - sum(1 for b, _ in hits if b >= 0)

    # ---- allocation -----------------------------------------------------------------------

    def can_allocate(self, seq: Sequence) -> bool:
        return self._blocks_needed(seq, self._match(seq)) <= len(self.free)

    def allocate(self, seq: Sequence) -> int:
        """Give a waiting ``seq`` blocks for all its tokens, reusing its cached prefix (GPU hits
        revived, CPU hits restored into fresh blocks).

        Sets ``num_computed_tokens`` to the hit length and returns it. Call ``can_allocate`` first.
        """
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already holds blocks")
        hits = self._match(seq)
        if self.states is not None:
            self.num_unresumable_tokens += (len(self._match_blocks(seq)) - len(hits)) * self.block_size
        if self._blocks_needed(seq, hits) > len(self.free):
            raise RuntimeError("allocate without capacity (call can_allocate first)")
        for bid, _ in hits:  # revive before taking fresh blocks, so a hit is never evicted here
            if bid >= 0:
                self._ref(bid)
        table = self._restore(seq, hits, self.cpu) if self.cpu is not None else [b for b, _ in hits]
        seq.block_table = table + [self._take_fresh() for _ in range(seq.num_blocks - len(table))]
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_committed_blocks = len(hits)
        if self.states is not None:
            self.states.acquire(seq, hits[-1][1] if hits else None)
        return seq.num_computed_tokens

    def _restore(self, seq: Sequence, hits: list[tuple[int, int]], cpu: CpuBlockPool) -> list[int]:
        """Block ids of the hits, CPU hits restored into fresh GPU blocks: registered in the GPU
        prefix cache now (announced as GPU BlockStored), pages copied by the queued swaps.

        The CPU hits stay pinned until their swap is queued: a save triggered by one of these
        fresh allocations may evict from the CPU pool, but never a block still to be restored
        (a later save into the same slot is queued after the restore, so it reads first).
        """
        cpu.pinned |= {k for b, k in hits if b < 0}
        table: list[int] = []
        run: list[int] = []  # consecutive restored positions -> one BlockStored
        keys = [k for _, k in hits]
        for i, (bid, key) in enumerate(hits):
            if bid < 0:
                bid = self._take_fresh()
                cb = cpu.blocks[key]
                block = self.blocks[bid]
                block.key, block.parent_key, block.token_ids = key, cb.parent_key, cb.token_ids
                self.cached[key] = bid
                self.swaps.append(Swap(False, bid, cb.slot))
                cpu.pinned.discard(key)
                cpu.touch(key)
                self.num_restored += 1
                run.append(i)
            elif run:
                self._emit_stored(seq, keys, run[0], run)
                run = []
            table.append(bid)
        self._emit_stored(seq, keys, run[0] if run else 0, run)
        return table

    def can_append(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether ``seq`` can hold ``num_tokens`` tokens in total."""
        return self._blocks_for(num_tokens) - len(seq.block_table) <= len(self.free)

    def append_slots(self, seq: Sequence, num_tokens: int) -> None:
        need = self._blocks_for(num_tokens) - len(seq.block_table)
        if need > len(self.free):
            raise RuntimeError("append_slots without capacity (call can_append first)")
        seq.block_table += [self._take_fresh() for _ in range(need)]

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _ref(self, bid: int) -> None:
        block = self.blocks[bid]
        if block.ref_count == 0:
            del self.free[bid]  # revival: the content and the registration stay as they are
            self.num_revived += 1
        block.ref_count += 1

    def _take_fresh(self) -> int:
        """A block for new content: the front of the free pool, evicting what it cached."""
        bid, _ = self.free.popitem(last=False)
        block = self.blocks[bid]
        if block.key is not None:
            self._evict(block)
        block.clear()
        block.ref_count = 1
        return bid

    def _evict(self, block: Block) -> None:
        """Drop a free cached block's registration (saved to the CPU tier first, when there is one)."""
        key = block.key
        if key is None:
            return
        if self.cpu is not None:
            self._save(block, self.cpu)
        del self.cached[key]
        self.events.append(BlockRemoved([key], group_idx=self._group))
        self.num_evicted += 1
        block.clear()

    def evict_free(self) -> int:
        """Evict every free cached block now, tails first (each saved to the CPU tier when there
        is one); the blocks stay free. Benchmarks and tests use it to move prefixes to the CPU
        tier; run ``take_swaps`` before the next write. Returns how many were evicted."""
        victims = [bid for bid in self.free if self.blocks[bid].key is not None]
        for bid in victims:
            self._evict(self.blocks[bid])
            self.free.move_to_end(bid, last=False)  # no content left: reused first
        return len(victims)

    def _save(self, block: Block, cpu: CpuBlockPool) -> bool:
        """Queue the copy of cached ``block``'s pages into the CPU pool (nothing to copy when the
        pool holds its key already: refreshed in the LRU). False when the pool has no room."""
        key, parent, tokens = block.key, block.parent_key, block.token_ids
        if key is None or parent is None or tokens is None:
            return False
        if key in cpu:
            cpu.touch(key)
            return True
        got = cpu.store(key, parent, tokens)
        if got is None:
            return False
        slot, evicted = got
        if evicted is not None:
            self.events.append(BlockRemoved([evicted], MEDIUM_CPU))
        self.swaps.append(Swap(True, block.block_id, slot))
        self.events.append(BlockStored([key], None, [], self.block_size, MEDIUM_CPU))
        self.num_saved += 1
        return True

    def offload(self, block_ids: Iterable[int], keys: Iterable[int]) -> int:
        """Save cached blocks to the CPU pool now, whether in use or not (a prefill's transferred
        prefix: the ``cpu_save`` consumer). A block no longer holding the expected key is skipped.
        Returns the number of blocks that are in the CPU pool afterwards. Run ``take_swaps``
        before anything writes these blocks."""
        if self.cpu is None:
            return 0
        done = 0
        for bid, key in zip(block_ids, keys, strict=True):
            block = self.blocks[bid]
            if block.key == key and self._save(block, self.cpu):
                done += 1
        return done

    def take_swaps(self) -> list[Swap]:
        """The queued page copies, in order; the caller runs them all before the next forward pass."""
        swaps, self.swaps = self.swaps, []
        return swaps

    # ---- commit: computed full blocks become cached ----------------------------------------

    def commit(self, seq: Sequence) -> None:
        """Register every full block of ``seq`` whose K/V is now computed (prompt or generated).

        A block whose key is already registered elsewhere (two requests computed the same new
        prefix in one step) stays unregistered: its twin serves the hits.
        """
        if not self.enable_prefix_caching:
            return
        done = seq.num_computed_tokens // self.block_size
        start = seq.num_committed_blocks
        if done <= start:
            return
        keys = seq.keys_upto(done)
        run: list[int] = []  # consecutive newly registered blocks -> one BlockStored
        run_start = start
        for i in range(start, done):
            bid, key = seq.block_table[i], keys[i]
            block = self.blocks[bid]
            if block.key is None and key not in self.cached:
                block.key, block.token_ids = key, tuple(seq.block_tokens(i))
                block.parent_key = keys[i - 1] if i else seq.key_seed
                self.cached[key] = bid
                if not run:
                    run_start = i
                run.append(i)
                continue
            self._emit_stored(seq, keys, run_start, run)
            run = []
        self._emit_stored(seq, keys, run_start, run)
        seq.num_committed_blocks = done

    def _emit_stored(self, seq: Sequence, keys: list[int], first: int, run: list[int]) -> None:
        if not run:
            return
        bs = self.block_size
        self.events.append(
            BlockStored(
                block_hashes=[keys[i] for i in run],
                parent_block_hash=keys[first - 1] if first else None,
                token_ids=seq.token_ids[first * bs : (first + len(run)) * bs],
                block_size=bs,
                extra_keys=salt_extra_keys(seq.cache_salt, first, len(run)),
                group_idx=self._group,
                kind=None if self.states is None else ATTENTION_KIND,
            )
        )

    @property
    def _group(self) -> int | None:
        """The attention blocks' KV cache group on the wire (None: a one-group model)."""
        return None if self.states is None else ATTENTION_GROUP

    # ---- free -----------------------------------------------------------------------------

    def free_seq(self, seq: Sequence) -> None:
        """Drop ``seq``'s references (finish, abort or preemption); cached content stays. The
        blocks it frees go to the back of the pool, tail first; with ``seq.evict_first`` (the
        retention hint) to the front, behind the empty blocks and still tail first."""
        if self.states is not None:
            self.states.release(seq)
        spill = seq.evict_first
        front: list[int] = []
        for bid in reversed(seq.block_table):
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[bid] = None
                if block.key is None:
                    self.free.move_to_end(bid, last=False)  # nothing to keep: reuse first
                elif spill:
                    front.append(bid)
        if front:
            self._to_eviction_front(front)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_committed_blocks = 0

    def _to_eviction_front(self, tail_first: list[int]) -> None:
        """Put cached free blocks (a chain's, tail first) right behind the empty blocks at the
        front of the pool: evicted before any other cached block, the tail before the head."""
        empties = []
        for bid in self.free:
            if self.blocks[bid].key is not None:
                break
            empties.append(bid)
        for bid in reversed(tail_first):
            self.free.move_to_end(bid, last=False)
        for bid in reversed(empties):
            self.free.move_to_end(bid, last=False)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, on the GPU and in the CPU pool; only when no block is in use
        and no swap is queued (nor, on a hybrid model, a state checkpoint pinned by a transfer).
        Emits AllBlocksCleared (which covers both tiers)."""
        if self.num_used_blocks or self.swaps or (self.states is not None and self.states.pins):
            return False
        for block in self.blocks:
            block.clear()
        self.cached.clear()
        if self.cpu is not None:
            self.cpu.clear()
        if self.states is not None:
            self.events += self.states.events  # announced before the clear that covers them
            self.states.events.clear()
            self.states.clear()
        self.events.append(AllBlocksCleared())
        return True

    def drain_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        if self.states is not None and self.states.events:
            # Checkpoints after the step's attention blocks: a subscriber keys a checkpoint by
            # its parent block, which this step's commit may be the one to announce.
            events += self.states.events
            self.states.events.clear()
        return events

    def cached_keys(self) -> set[int]:
        return set(self.cached)

    # ---- integrity --------------------------------------------------------------------------

    def check(self, seqs: Iterable[Sequence] | None = None) -> None:
        """Raise RuntimeError naming every broken invariant (tests call this after operations)."""
        errors: list[str] = []
        for block in self.blocks:
            in_free = block.block_id in self.free
            if block.ref_count < 0:
                errors.append(f"block {block.block_id} ref {block.ref_count}")
            if (block.ref_count == 0) != in_free:
                errors.append(f"block {block.block_id} ref {block.ref_count} but in_free={in_free}")
            if block.key is not None:
                errors += self._check_cached_block(block)
        for key, bid in self.cached.items():
            if self.blocks[bid].key != key:
                errors.append(f"cached[{key}] -> block {bid} whose key is {self.blocks[bid].key}")
        if seqs is not None:
            errors += self._check_refs(list(seqs))
        if self.cpu is not None:
            errors += self.cpu.check() + self._check_tiers(self.cpu)
        if self.states is not None:
            errors += self.states.check()
        if errors:
            raise RuntimeError("block manager corrupt: " + "; ".join(errors[:10]))

    def _check_tiers(self, cpu: CpuBlockPool) -> list[str]:
        """A key cached on both tiers stands for the same tokens; queued swaps name real blocks."""
        errors = []
        for key, bid in self.cached.items():
            cb, block = cpu.blocks.get(key), self.blocks[bid]
            if cb is not None and (cb.token_ids != block.token_ids or cb.parent_key != block.parent_key):
                errors.append(f"key {key:#x} holds other tokens on the CPU than in GPU block {bid}")
        for sw in self.swaps:
            if not (0 <= sw.gpu_block < len(self.blocks) and 0 <= sw.cpu_slot < cpu.num_blocks):
                errors.append(f"swap {sw} out of range")
        return errors

    def _check_cached_block(self, block: Block) -> list[str]:
        if block.token_ids is None or len(block.token_ids) != self.block_size or block.parent_key is None:
            return [f"cached block {block.block_id} without a full block of tokens or a parent"]
        if self.cached.get(block.key) != block.block_id:  # type: ignore[arg-type]
            return [f"block {block.block_id} has key {block.key} not registered to it"]
        recomputed = block_keys(block.token_ids, self.block_size, 0, parent=block.parent_key)[0]
        if recomputed != block.key:
            return [f"block {block.block_id}: key does not match its tokens and parent"]
        return []

    def _check_refs(self, seqs: list[Sequence]) -> list[str]:
        errors: list[str] = []
        counts = [0] * len(self.blocks)
        for seq in seqs:
            for i, bid in enumerate(seq.block_table):
                counts[bid] += 1
                block = self.blocks[bid]
                if block.key is not None and i < seq.num_full_blocks:
                    if block.token_ids != tuple(seq.block_tokens(i)):
                        errors.append(f"seq {seq.seq_id} block {i} (id {bid}) holds other tokens")
            if len(seq.block_table) * self.block_size < seq.num_computed_tokens:
                errors.append(f"seq {seq.seq_id} computed past its blocks")
        for block, n in zip(self.blocks, counts):
            if block.ref_count != n:
                errors.append(f"block {block.block_id} ref {block.ref_count} != {n} holders")
        return errors
