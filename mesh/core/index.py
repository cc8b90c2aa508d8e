"""The prefix index: which target holds which block, on which tier (``PrefixIndex``).

- Keys are router block keys (``mesh.core.keys``): a key names a whole prefix. ``match(keys)``
  returns, per target, its longest *consecutive* cached prefix of ``keys`` (``Overlap.gpu_blocks``
  leading blocks on the GPU, then ``cpu_blocks`` from the CPU tier); targets with no overlap are
  absent (``tests/unit/core/test_index.py`` checks it against a brute-force oracle).
- Engine events (``apply_stored``/``apply_removed``) name blocks by engine hash, mapped per target
  to router keys; an engine may hold a hash in several copies (``mesh.core.index_copies``). A hash
  stored again for other content (or named twice in one event) is a rename: the block it named
  goes with every copy, as every copy goes with ``tier=None`` removals, ``AllBlocksCleared`` and
  ``clear_target``. Speculative entries: ``mesh.core.index_spec``.
- With ``max_keys`` > 0, least recently stored/matched leaves are evicted first (a match refreshes
  its deepest block, and a parent is a leaf only once its children are gone: a prefix that keeps
  being matched stays); a store of a hash whose node was evicted is never a copy (an under-claim,
  never an over-claim); engine hashes of evicted nodes are swept from the engine maps (``_sweep``),
  so memory is bounded by ``max_keys`` whatever the events.
- Hybrid targets (``mesh.core.index_states``): a match is cut back to the deepest block holding a
  recurrent-state checkpoint (``apply_state_stored``), since only there can the engine resume.
Parts: nodes and masks ``index_nodes``, chain writes ``index_chain``, match's search
``index_depths``, slots ``index_slots``. Ownership: a ``PrefixIndex`` owns its parts; it runs on
one thread (no lock).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Mapping, Sequence
from heapq import heappush
from typing import cast

from mesh.core.index_chain import (
    add_holder,
    drop_tail,
    join_run,
    new_chain,
    remove_chain,
    remove_hashes,
    remove_repeated,
    sweep_engine_map,
    tier_update,
)
from mesh.core.index_copies import CopyCounts
from mesh.core.index_depths import match_prefix
from mesh.core.index_nodes import EMPTY, ROOT, Nodes
from mesh.core.index_slots import Slots
from mesh.core.index_spec import Speculation
from mesh.core.index_states import Checkpoints
from mesh.core.keys import block_keys
from policies.base import Overlap, Tier

_SWEEP_MIN = 1 << 16  # engine hashes a target's map may hold before its first sweep
_BULK_MIN = 16  # blocks from which one event's C-speed bulk passes beat the per-block loop


class PrefixIndex:
    """Call ``expire(now)`` periodically: it ends speculation and scrubs removed targets' slots
    (``mesh.core.index_slots``). ``match`` results are plain dicts, valid as a snapshot. The
    per-target maps from engine hash to key are bounded by each engine's own cache: entries leave
    with the engine's removals or the target's reset; one whose node the budget evicted resolves
    its children's parent key until the map's next sweep (about ``2 x max_keys`` a target at most).
    """

    def __init__(self, max_keys: int = 0, scrub_budget: int = 4096) -> None:
        if max_keys < 0:
            raise ValueError(f"max_keys must be >= 0, got {max_keys}")
        self.max_keys = max_keys  # 0 = unbounded
        self.scrub_budget = scrub_budget  # nodes scrubbed per expire() call
        self._nodes = Nodes(max_keys)
        # targets
        self._slots = Slots()
        self._slot = self._slots.of  # live target -> slot: the hot paths' lookup (never rebound)
        # engine layer and speculation
        self._emap: dict[str, dict[int, int]] = {}  # target -> engine hash -> key
        self._copies = CopyCounts()
        # With a budget only: target -> engine hashes the engine holds on its CPU tier. A node the
        # budget evicted takes its CPU bit with it, and the engine's later GPU removal must not
        # forget the hash (children stored below the CPU copy need it as their parent).
        self._offloaded: dict[str, set[int]] = {}
        self._spec = Speculation()
        self._sweep_at: dict[str, int] = {}  # with a budget: target -> engine map size of its next sweep
        self._sweep_floor = max(2 * max_keys, _SWEEP_MIN)
        self._hints_ca: dict[int, int] = {}  # match's search hints (verified before use)
        self._hints_cg: dict[int, int] = {}
        self._states = Checkpoints()  # hybrid targets' recurrent-state checkpoints
        self.lookaheads: dict[str, int] = {}  # target -> tokens past each block its hashes cover (mesh.core.lookahead)

    @property
    def evicted(self) -> int:
        """Keys evicted by the budget (a counter for metrics)."""
        return self._nodes.evicted

    # ------------------------------------------------------------------ slots
    def _slot_of(self, target: str) -> int:
        return self._slots.assign(target, self._nodes)

    def targets(self) -> list[str]:
        return list(self._slot)

    # -------------------------------------------------------------- key layer
    def store(self, target: str, keys: Sequence[int], tier: Tier = Tier.GPU, *, parent: int | None = None) -> None:
        """Record that ``target`` holds the chain ``keys`` on ``tier``.

        ``keys`` is consecutive (``keys[i]`` extends ``keys[i-1]``); ``parent`` is the key of the
        block before ``keys[0]``, None when ``keys[0]`` is a prompt's first block.
        """
        if not len(keys):
            return
        self._store_chain(self._slot_of(target), keys, tier, self._nodes.parent_nid(parent))
        self._nodes.trim()

    def remove(self, target: str, keys: Sequence[int], tier: Tier | None = None) -> None:
        """Forget ``keys`` for ``target`` on ``tier`` (None: every tier, speculative included)."""
        slot = self._slot.get(target)
        if slot is None:
            return
        specs = self._spec.of(slot)
        if tier is Tier.CPU:
            for key in reversed(keys):  # leaf first: no cascade below an already-removed node
                self._nodes.remove_key(slot, key, tier, specs)
            return
        if len(keys) >= _BULK_MIN and self._drop_tail(1 << slot, keys[::-1]):
            return
        remove_chain(self._nodes, slot, reversed(keys), tier, specs)

    def clear_target(self, target: str) -> None:
        """Drop every entry of ``target`` at once (O(1); nodes are scrubbed incrementally). A
        hybrid target stays hybrid, without checkpoints."""
        self._states.clear(target)
        self._emap.pop(target, None)
        self._copies.drop_target(target)
        self._offloaded.pop(target, None)
        self._sweep_at.pop(target, None)
        slot = self._slots.release(target)
        if slot is not None:
            self._spec.forget(slot)
            self._nodes.retire(1 << slot)

    def store_speculative(self, target: str, keys: Sequence[int], expires_at: float) -> None:
        """Count ``keys`` (a chain from a prompt's first block) as held on the GPU by ``target``
        until ``expires_at`` (see ``expire``) or until the engine's event confirms a key."""
        n = len(keys)
        if not n:
            return
        slot = self._slot_of(target)
        bit = 1 << slot
        nodes = self._nodes
        get = nodes.id.get
        cg = nodes.cg
        if cg[get(keys[-1], EMPTY)] & bit:  # the whole chain consecutive on the GPU (a repeated prompt)
            return
        # blocks already consecutive on the GPU need nothing: skip them with one binary search
        depth = bisect_right(range(n), 0, key=lambda i: 0 if cg[get(keys[i], EMPTY)] & bit else 1)
        if depth >= n:
            return
        tail = keys[depth:]
        parent = nodes.id[keys[depth - 1]] if depth else ROOT
        self._store_chain(slot, tail, Tier.GPU, parent, spec_deadline=expires_at)
        self._spec.schedule(expires_at, slot, self._slots.gen[slot], tail)
        nodes.trim()

    def expire_speculative(self, now: float) -> int:
        """End speculative entries whose deadline is <= ``now`` (``Router.view``, before every
        decision, live and simulated); returns the number ended. Costs only what expires."""
        return self._spec.expire(now, self._slots.gen, self._nodes)

    def expire(self, now: float) -> int:
        """``expire_speculative``, then scrub a slice of retired slots (a caller without its own
        paced scrubbing). Returns the number of speculative entries ended."""
        ended = self.expire_speculative(now)
        if self._nodes.dying or self._nodes.scrub is not None:
            self._scrub_step(self.scrub_budget)
        return ended

    def scrub(self, budget: int) -> bool:
        """Scrub up to ``budget`` nids of retired slots now; whether scrubbing work remains (the
        gateway's keeper scrubs in short paced steps after a reset instead of one long one)."""
        if self._nodes.dying or self._nodes.scrub is not None:
            self._scrub_step(budget)
        return bool(self._nodes.dying or self._nodes.scrub is not None)

    def compact(self) -> None:
        """Finish scrubbing every retired slot now (tests; otherwise ``expire`` does it)."""
        while self._nodes.dying or self._nodes.scrub is not None:
            self._scrub_step(1 << 62)

    def _scrub_step(self, budget: int) -> None:
        done = self._nodes.scrub_step(budget)
        if done:  # a full pass is done: these slots hold no stale bit anywhere, reuse them
            self._slots.reuse(done)

    # ----------------------------------------------------------- engine layer
    def apply_stored(
        self,
        target: str,
        engine_hashes: Sequence[int],
        parent_engine_hash: int | None,
        token_ids: Sequence[int] | None,
        block_size: int,
        seed: int,
        tier: Tier = Tier.GPU,
        *,
        keys: Sequence[int] | None = None,
        keyed_from: int | None = None,
    ) -> int:
        """Apply an engine's BlockStored; returns the number of blocks applied.

        Router keys are chained from the parent's router key (the seed at a prompt's start), so
        they never depend on the engine's hash function. A store whose parent engine hash is
        unknown cannot be keyed and is skipped (returns 0). A store without tokens is a tier
        update of blocks already known by engine hash. A store below a parent, on a tier, of a
        hash the target holds on that tier for the same key is one more copy of it; from the root
        it is a report of held blocks, no copy (``mesh.core.index_copies``).
        Raises ValueError when ``token_ids`` do not cover exactly ``len(engine_hashes)`` blocks
        or hold a bad token id.

        ``keys``: the blocks' router keys when the caller already has them (they must equal
        ``block_keys(token_ids, block_size, <the parent's key or seed>)``; not rechecked), so
        hashing can run elsewhere (benchmarks measure the index alone with it). With
        ``keyed_from`` they are only a proposal, chained from that key by a keyer that cannot see
        the index (``mesh.events.prepare``): used when it is this store's parent key, else the
        store is keyed here (keys are a function of the tokens and the parent key alone).
        """
        n = len(engine_hashes)
        if n == 0:
            return 0
        emap = self._emap.get(target)
        if not token_ids:
            return self._tier_update(target, emap, engine_hashes, tier)
        if len(token_ids) != n * block_size:
            raise ValueError(f"BlockStored carries {len(token_ids)} tokens for {n} blocks of {block_size}")
        parent_key = self._parent_key(emap, parent_engine_hash, seed)
        if parent_key is None:
            return 0
        if keys is None or (keyed_from is not None and keyed_from != parent_key):
            keys = block_keys(token_ids, block_size, parent_key)
        elif len(keys) != n:
            raise ValueError(f"BlockStored has {n} blocks but {len(keys)} keys were given")
        slot = self._slot_of(target)
        if emap is None:
            emap = self._emap[target] = {}
        elif not emap.keys().isdisjoint(engine_hashes):
            self._forget_renamed(target, emap, engine_hashes, keys)
            held = self._nodes.g if tier is Tier.GPU else self._nodes.c
            self._copies.count_store(target, 1 << slot, emap, engine_hashes, keys, tier, self._nodes.id, held,
                                     report=parent_engine_hash is None)
        if tier is Tier.CPU and self.max_keys:
            self._offloaded.setdefault(target, set()).update(engine_hashes)
        # the parent's nid only now: a renamed hash may have removed the parent's node
        parent = ROOT if parent_engine_hash is None else self._nodes.parent_nid(parent_key)
        self._store_mapped(slot, emap, engine_hashes, keys, tier, parent)
        self._nodes.trim()
        if self.max_keys and len(emap) > self._sweep_at.get(target, self._sweep_floor):
            self._sweep(target, emap)
        return n

    def parent_key(self, target: str, parent_engine_hash: int | None, seed: int) -> int | None:
        return self._parent_key(self._emap.get(target), parent_engine_hash, seed)  # the caller keys the store

    @staticmethod
    def _parent_key(emap: dict[int, int] | None, parent_engine_hash: int | None, seed: int) -> int | None:
        """The router key a store's chain extends: the seed at a prompt's start, else the parent's
        key (None: the parent is unknown, so the store cannot be keyed)."""
        if parent_engine_hash is None:
            return seed
        return emap.get(parent_engine_hash) if emap else None

    def _sweep(self, target: str, emap: dict[int, int]) -> None:
        sweep_engine_map(self._nodes.id, self._copies, target, emap, self._offloaded.get(target, ()))
        self._sweep_at[target] = max(self._sweep_floor, 2 * len(emap))

    def _store_mapped(
        self, slot: int, emap: dict[int, int], engine_hashes: Sequence[int], keys: Sequence[int], tier: Tier,
        parent: int,
    ) -> None:
        """Write the chain ``keys`` below node ``parent`` and map its engine hashes to its keys
        (to the index's own key objects where the blocks were indexed: the map shares them)."""
        nodes = self._nodes
        ids = nodes.id
        size = len(emap)
        joined = keys[0] in ids  # e.g. a shared system prompt
        if not joined and not nodes.orphans:  # the usual agentic turn: a new chain
            nodes.clock += 1
            gpu = tier is Tier.GPU
            new_chain(nodes, 1 << slot, keys, nodes.g if gpu else nodes.c, gpu, parent, nodes.clock, _BULK_MIN)
            if nodes.budget:
                heappush(nodes.lru, (nodes.clock, ids[keys[-1]]))
        else:
            run = self._store_chain(slot, keys, tier, parent)
            if joined:
                key_a = nodes.key
                n = len(keys)
                if run is not None and run[1] == n:  # joined in bulk: the chain's nids are contiguous
                    keys = key_a[run[0] : run[0] + n]
                else:
                    keys = list(map(key_a.__getitem__, map(ids.__getitem__, keys)))
        emap.update(zip(engine_hashes, keys))
        if len(emap) - size != len(keys):  # some hash was known, or named two blocks of this event
            remove_repeated(self._nodes, slot, self._spec.of(slot), engine_hashes, keys)

    def _forget_renamed(
        self, target: str, emap: dict[int, int], engine_hashes: Sequence[int], keys: Sequence[int]
    ) -> None:
        """An engine hash names one block of its engine: stored again for other content (an engine
        restarted with another hash seed and no reset, a colliding or careless publisher), the
        block it named is gone from that engine. Its old key is removed for ``target`` on every
        tier and every copy, as BlockRemoved events would (else the target kept claiming it for
        good). A hash stored again for the same key is another copy (``CopyCounts.count_store``)."""
        renamed = [h for h, key in zip(engine_hashes, keys) if emap.get(h, key) != key]
        if renamed:
            self.apply_removed(target, renamed, None)

    def _tier_update(self, target: str, emap: dict[int, int] | None, hashes: Sequence[int], tier: Tier) -> int:
        slot = self._slot.get(target)
        if not emap or slot is None:
            return 0
        if tier is Tier.CPU and self.max_keys:
            self._offloaded.setdefault(target, set()).update(h for h in hashes if h in emap)
        return tier_update(self._nodes, self._copies, target, 1 << slot, emap, hashes, tier)

    def apply_removed(
        self,
        target: str,
        engine_hashes: Sequence[int],
        tier: Tier | None = Tier.GPU,
        remaining: Sequence[int] | None = None,
    ) -> int:
        """Apply an engine's BlockRemoved from ``tier`` (None: every tier and every copy).
        ``remaining``: the copies of each hash the engine still holds after this removal (vLLM's
        ``remaining_copy_counts``, one per hash; None when the engine does not say): 0 removes
        the block, n > 0 keeps it. Without it a removal takes one copy away. Returns the number
        of blocks that resolved to a known key (kept or removed)."""
        emap = self._emap.get(target)
        slot = self._slot.get(target)
        if not emap or slot is None:
            return 0
        kept = 0
        if target in self._copies or (remaining is not None and any(remaining)):
            engine_hashes, kept = self._copies.take(target, emap, engine_hashes, tier, remaining)
            if not engine_hashes:
                return kept
        elif remaining is not None and len(remaining) != len(engine_hashes):
            raise ValueError(f"BlockRemoved has {len(engine_hashes)} hashes but {len(remaining)} copy counts")
        if tier is not Tier.CPU and len(engine_hashes) >= _BULK_MIN:
            keys = list(map(emap.get, engine_hashes))
            if None not in keys and self._drop_tail(1 << slot, cast("list[int]", keys)):  # all known: checked
                deque(map(emap.__delitem__, engine_hashes), 0)
                if target in self._copies:
                    self._copies.prune(target, emap, engine_hashes)
                return kept + len(keys)
        offloaded = self._offloaded.get(target)
        done = remove_hashes(self._nodes, slot, emap, engine_hashes, tier, self._spec.of(slot), offloaded)
        if self.max_keys and tier is not Tier.GPU and offloaded is not None:
            offloaded.difference_update(engine_hashes)
        if target in self._copies:  # a hash forgotten takes its counts along
            self._copies.prune(target, emap, engine_hashes)
        return kept + done

    # ------------------------------------------------------- hybrid targets
    def mark_hybrid(self, target: str, hybrid: bool = True) -> None:
        """``target`` serves a hybrid model: its matches need a checkpoint (``resumable``)."""
        if hybrid:
            self._states.hybrid.add(target)
        else:
            self._states.forget(target)

    def is_hybrid(self, target: str) -> bool:
        return target in self._states.hybrid

    def apply_state_stored(
        self,
        target: str,
        engine_hashes: Sequence[int],
        parent_engine_hash: int | None,
        token_ids: Sequence[int] | None,
        block_size: int,
        seed: int,
    ) -> int:
        """Apply a BlockStored of a recurrent KV cache group: checkpoints of the state after the
        blocks ``engine_hashes`` name. Marks ``target`` hybrid. Keys are chained from the parent's
        router key, as attention stores are; ``token_ids`` cover whole blocks ending at the last
        hash, possibly more blocks than hashes (vLLM skips a Mamba group's null blocks, whose
        state was not kept): the hashes name the last blocks of the span. Returns the checkpoints
        applied (0: the parent is unknown, or no tokens to key them by); ValueError when the
        tokens are not whole blocks covering the hashes."""
        self._states.hybrid.add(target)
        parent_key = self._parent_key(self._emap.get(target), parent_engine_hash, seed)
        if parent_key is None or not engine_hashes or not token_ids or block_size <= 0:
            return 0
        return self._states.store_span(target, engine_hashes, token_ids, block_size, parent_key)

    def store_states(self, target: str, keys: Sequence[int]) -> None:
        """Record checkpoints of ``target`` after the blocks ``keys`` (router keys; the simulator's
        key-level twin of ``apply_state_stored``). Marks ``target`` hybrid."""
        self._states.store(target, keys, keys)

    def remove_states(self, target: str, keys: Sequence[int]) -> None:
        self._states.remove(target, keys)

    def apply_state_removed(self, target: str, engine_hashes: Sequence[int]) -> int:
        """Apply a BlockRemoved of a recurrent KV cache group (checkpoints evicted)."""
        return self._states.remove(target, engine_hashes)

    def state_keys_of(self, target: str) -> set[int]:
        """Router keys where ``target`` holds a checkpoint (tests, debugging)."""
        return self._states.keys_of(target)

    def apply_cleared(self, target: str) -> None:
        """Apply an engine's AllBlocksCleared."""
        self.clear_target(target)

    # ------------------------------------------------------------------ reads
    def match(self, keys: Sequence[int]) -> Mapping[str, Overlap]:
        """Per target, its longest consecutive cached prefix of ``keys``; for a hybrid target the
        deepest part of it that ends at a recurrent-state checkpoint (its resumable prefix)."""
        out = match_prefix(self._nodes, self._slots.names.of, keys, self._hints_ca, self._hints_cg)
        if self._states.hybrid and out:
            return self._states.cut(keys, dict(out))
        return out

    def holds(self, target: str, key: int) -> Tier | None:
        slot = self._slot.get(target)
        nodes = self._nodes
        n = nodes.id.get(key)
        if slot is None or n is None:
            return None
        bit = 1 << slot
        if (nodes.g[n] | nodes.s[n]) & bit:
            return Tier.GPU
        return Tier.CPU if nodes.c[n] & bit else None

    def keys_of(self, target: str) -> set[int]:
        slot = self._slot.get(target)
        if slot is None:
            return set()
        bit = 1 << slot
        g, c, s = self._nodes.g, self._nodes.c, self._nodes.s
        return {k for k, n in self._nodes.id.items() if (g[n] | c[n] | s[n]) & bit}

    def engine_map(self, target: str) -> dict[int, int]:
        """A copy of ``target``'s engine hash -> router key map (tests, debugging)."""
        return dict(self._emap.get(target, {}))

    def engine_copies(self, target: str, tier: Tier = Tier.GPU) -> dict[int, int]:
        """``target``'s engine hashes held in 2+ copies on ``tier`` -> their copies (tests, debugging)."""
        return self._copies.copies(target, tier)

    def stats(self) -> dict[str, int]:
        return {
            "keys": len(self._nodes.id),
            "targets": len(self._slot),
            "engine_hashes": sum(map(len, self._emap.values())),
            "engine_copies": self._copies.total(),  # beyond the first
            "speculative": self._spec.count(),
            "dying_slots": self._nodes.dying.bit_count(),
            "evicted": self._nodes.evicted,
            "state_checkpoints": self._states.count(),
        }

    def __len__(self) -> int:
        return len(self._nodes.id)

    # -------------------------------------------------------------- the store path
    def _store_chain(
        self, slot: int, keys: Sequence[int], tier: Tier, parent: int, spec_deadline: float | None = None
    ) -> tuple[int, int] | None:
        """The hot path of every store: one pass down the chain below node ``parent``, parent
        before child, on ``tier`` (speculatively until ``spec_deadline`` when one is given).
        Returns ``(first nid, length)`` of the leading run joined in bulk (``_join_run``), if any."""
        nodes = self._nodes
        bit = 1 << slot
        spec = spec_deadline is not None
        gpuish = spec or tier is Tier.GPU
        field = nodes.s if spec else nodes.g if gpuish else nodes.c
        specs = self._spec.open(slot) if spec else self._spec.of(slot)
        nodes.clock += 1
        stamp = nodes.clock
        p, todo, joined = parent, keys, None
        if not spec and len(keys) >= _BULK_MIN and keys[0] in nodes.id:
            joined = self._join_run(bit, keys, field, gpuish, p, stamp)
            if joined is not None:
                lo, run = joined
                p = lo + run - 1
                todo = keys[run:] if run < len(keys) else ()
        add_holder(nodes, bit, todo, field, gpuish, p, stamp, spec, specs, _BULK_MIN)
        if spec_deadline is not None and specs is not None:
            specs.update(dict.fromkeys(keys, spec_deadline))
        if nodes.budget:
            last = nodes.id.get(keys[-1])
            if last is not None and nodes.kid[last] == 0:
                heappush(nodes.lru, (stamp, last))
        return joined

    # The bulk paths' seams (tests/unit/core/test_index_bulk.py overrides them to compare against the
    # per-block paths and to count how often they run).
    def _join_run(
        self, bit: int, keys: Sequence[int], field: list[int], gpuish: bool, p: int, stamp: int
    ) -> tuple[int, int] | None:
        return join_run(self._nodes, bit, keys, field, gpuish, p, stamp, _BULK_MIN)

    def _drop_tail(self, bit: int, keys: Sequence[int]) -> bool:
        return drop_tail(self._nodes, bit, keys)

