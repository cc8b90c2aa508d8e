"""Paged KV blocks with prefix caching (nano-vllm's cut, vLLM's vocabulary).

Ownership and lifecycle of one block:

    free, no content --allocate--> used (ref 1) --commit--> used + cached (key registered)
    used + cached --free (ref 0)--> free + cached   (content KEPT, key still registered)
    free + cached --hit--> used + cached            (revival: never passes through _take_fresh)
    free + cached --_take_fresh--> used, no content (eviction: the ONLY place, emits BlockRemoved)

Invariants (``check()``):
- a block is in the free pool iff its ref count is 0;
- ``cached[key] == block_id`` iff ``blocks[block_id].key == key``; a cached block holds exactly
  ``block_size`` tokens whose key, chained from its parent key, equals its own key;
- a block is registered only after its K/V was computed (commit follows the forward pass), so a
  hit never reads a slot that nobody wrote.

The free pool is ordered: the front is taken first. Blocks without content go to the front;
cached blocks go to the back, a sequence's last block first, so the tail of a chain is evicted
before its head and a surviving prefix stays contiguous.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from mesh.keys import block_keys
from workers.sequence import Sequence


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[int]


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


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
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.cached: dict[int, int] = {}  # key -> block id
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.events: list[KVEvent] = []  # since the last drain_events()
        self.num_revived = 0
        self.num_evicted = 0

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
        """Cached blocks holding a prefix of ``seq``, verified token by token; pure.

        The block holding the last token is never matched: at least one token must be computed,
        so that the step produces logits (and never writes into a shared block).
        """
        if not self.enable_prefix_caching:
            return []
        limit = (len(seq) - 1) // self.block_size
        hits: list[int] = []
        parent = seq.key_seed
        for i, key in enumerate(seq.keys_upto(limit)):
            bid = self.cached.get(key)
            if bid is None:
                break
            block = self.blocks[bid]
            # The key names the whole chain; compare what it stands for anyway.
            if block.parent_key != parent or block.token_ids != tuple(seq.block_tokens(i)):
                break
            hits.append(bid)
            parent = key
        return hits

    # ---- allocation -----------------------------------------------------------------------

    def can_allocate(self, seq: Sequence) -> bool:
        hits = self.match_prefix(seq)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return revived + seq.num_blocks - len(hits) <= len(self.free)

    def allocate(self, seq: Sequence) -> int:
        """Give a waiting ``seq`` blocks for all its tokens, reusing its cached prefix.

        Sets ``num_computed_tokens`` to the hit length and returns it. Call ``can_allocate`` first.
        """
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already holds blocks")
        hits = self.match_prefix(seq)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        if revived + seq.num_blocks - len(hits) > len(self.free):
            raise RuntimeError("allocate without capacity (call can_allocate first)")
        for bid in hits:  # revive before taking fresh blocks, so a hit is never evicted here
            self._ref(bid)
        seq.block_table = hits + [self._take_fresh() for _ in range(seq.num_blocks - len(hits))]
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_committed_blocks = len(hits)
        return seq.num_computed_tokens

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
            del self.cached[block.key]
            self.events.append(BlockRemoved([block.key]))
            self.num_evicted += 1
        block.clear()
        block.ref_count = 1
        return bid

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
            )
        )

    # ---- free -----------------------------------------------------------------------------

    def free_seq(self, seq: Sequence) -> None:
        """Drop ``seq``'s references (finish, abort or preemption); cached content stays."""
        for bid in reversed(seq.block_table):
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[bid] = None
                if block.key is None:
                    self.free.move_to_end(bid, last=False)  # nothing to keep: reuse first
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_committed_blocks = 0

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; only when no block is in use. Emits AllBlocksCleared."""
        if self.num_used_blocks:
            return False
        for block in self.blocks:
            block.clear()
        self.cached.clear()
        self.events.append(AllBlocksCleared())
        return True

    def drain_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
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
        if errors:
            raise RuntimeError("block manager corrupt: " + "; ".join(errors[:10]))

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
