"""Engine-thread block operations of a KV transfer: pin, unpin, gather, import (from host pages
or straight from a peer's cache), CPU save, leak check; on a hybrid model the same for the
recurrent state (a checkpoint of ``workers.engine.state_checkpoints``). **Engine thread only**:
the block manager, the paged cache and the state slots belong to that thread
(``workers.transfer.kv_transfer.TransferEngine.call`` runs these).

Ownership: a block pinned here holds one reference in the block manager, counted in
``BlockOps.pins``; every pin has exactly one owner (a prefill ``Transfer`` in
``workers.transfer.registry``, or a decode request's ``Hold``) that unpins it exactly once.
``BlockOps.leak_check`` proves it: every block's reference count must equal the references of
running sequences plus its pins.

A hybrid model's transfer also pins the checkpoint at the end of its last block (the state a
decode worker resumes from): ``pin_export`` cuts a prefill's prefix back to the deepest block
holding one, ``import_state`` files a received state as a checkpoint. The checkpoint's pin has
the same owner as the blocks' and is dropped with them (``unpin_state``).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from workers.engine.block_manager import BlockManager, BlockStored, salt_extra_keys
from workers.engine.llm_engine import LLMEngine
from workers.transfer.kv_layout import TransferError, layout_of


@dataclass(frozen=True)
class PinnedPrefix:
    """Blocks pinned for a transfer: the first ``len(block_ids)`` blocks of a prompt."""

    block_ids: tuple[int, ...]
    keys: tuple[int, ...]
    token_ids: tuple[tuple[int, ...], ...]
    state_key: int | None = None  # hybrid models: the pinned checkpoint (the last block's key)


class BlockOps:
    """Transfer operations on one engine's block manager and paged cache. **Engine thread
    only**: the block manager and the cache tensor belong to that thread."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.bm: BlockManager = engine.block_manager
        self.layout = layout_of(engine)
        self.pins: Counter[int] = Counter()  # block id -> references held by transfer pins
        self.num_imported = 0
        self.num_import_reused = 0  # blocks already cached when their import arrived
        self.num_states_imported = 0  # hybrid models: transferred states filed as checkpoints
        self.num_states_reused = 0  # states already checkpointed here when their import arrived

    # -- pins --

    def pin_prefix(self, keys: Sequence[int], token_blocks: Sequence[Sequence[int]], seed: int) -> PinnedPrefix:
        """Pin the longest cached prefix of ``keys`` (verified: parent chain and tokens)."""
        bm, out = self.bm, []
        parent = seed
        for key, tokens in zip(keys, token_blocks, strict=True):
            bid = bm.cached.get(key)
            if bid is None:
                break
            block = bm.blocks[bid]
            if block.parent_key != parent or block.token_ids != tuple(tokens):
                break
            out.append(bid)
            parent = key
        for bid in out:
            self._pin(bid)
        n = len(out)
        return PinnedPrefix(tuple(out), tuple(keys[:n]), tuple(tuple(t) for t in token_blocks[:n]))

    def _pin(self, bid: int) -> None:
        bm = self.bm
        block = bm.blocks[bid]
        if block.ref_count == 0:
            del bm.free[bid]  # revival: content and registration stay
        block.ref_count += 1
        self.pins[bid] += 1

    def unpin(self, block_ids: Sequence[int]) -> None:
        """Drop one pin per block, tail first (as ``free_seq``: a chain's head is evicted last)."""
        bm = self.bm
        for bid in reversed(block_ids):
            if self.pins[bid] <= 0:
                raise RuntimeError(f"unpin of block {bid} that holds no pin")
            self.pins[bid] -= 1
            if not self.pins[bid]:
                del self.pins[bid]
            block = bm.blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                bm.free[bid] = None
                if block.key is None:
                    bm.free.move_to_end(bid, last=False)

    # -- data --

    def gather(self, block_ids: Sequence[int]) -> np.ndarray:
        """Pages of ``block_ids`` as uint8 ``[n, block_bytes]`` on the host."""
        kv = self.engine.runner.kv_cache  # [layers, 2, blocks, block_size, heads, dim]
        idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=kv.device)
        pages = kv.index_select(2, idx).permute(2, 0, 1, 3, 4, 5).contiguous()
        host = pages.cpu() if pages.device.type != "cpu" else pages
        return host.view(torch.uint8).reshape(len(block_ids), -1).numpy()

    def _scatter(self, block_ids: Sequence[int], data: np.ndarray | torch.Tensor, rows: Sequence[int]) -> None:
        """Write ``rows`` of ``data`` into ``block_ids``. ``data``: uint8 ``[n, block_bytes]`` on
        the host (a pull), or a tensor ``[layers, 2, n, block_size, heads, dim]`` on any device
        (a peer copy)."""
        kv = self.engine.runner.kv_cache
        idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=kv.device)
        if isinstance(data, torch.Tensor):
            src = data.index_select(2, torch.as_tensor(list(rows), dtype=torch.long, device=data.device))
            kv.index_copy_(2, idx, src.to(kv.device))
            return
        L, _, _, bs, h, d = kv.shape
        host = np.ascontiguousarray(data[list(rows)])
        pages = torch.from_numpy(host).view(kv.dtype).reshape(len(block_ids), L, 2, bs, h, d)
        kv.index_copy_(2, idx, pages.permute(1, 2, 0, 3, 4, 5).to(kv.device))

    def import_from_peer(
        self, keys: Sequence[int], token_blocks: Sequence[Sequence[int]], seed: int,
        parent: int | None, peer_kv: torch.Tensor, peer_block_ids: Sequence[int], salt: str | None = None,
        deadline: float = math.inf,
    ) -> list[int]:
        """``import_blocks`` with the pages copied straight from a peer worker's KV cache on this
        host (``workers.transfer.kv_ipc``), synchronized before returning: the caller's read lease on the
        peer's blocks may end as soon as this returns. Refused (retryable) once the lease's
        ``deadline`` (monotonic) has passed: the peer may reuse its blocks after it."""
        if time.monotonic() > deadline:
            raise TransferError(504, "kv_lease_expired", "the read lease on the peer's blocks expired", True)
        idx = torch.as_tensor(list(peer_block_ids), dtype=torch.long, device=peer_kv.device)
        pages = peer_kv.index_select(2, idx)
        out = self.import_blocks(keys, token_blocks, seed, parent, pages, salt)
        for device in {peer_kv.device, self.engine.runner.kv_cache.device}:
            if device.type == "cuda":  # CPU tensors (tests) copy synchronously
                torch.cuda.synchronize(device)
        return out

    def import_blocks(
        self, keys: Sequence[int], token_blocks: Sequence[Sequence[int]], seed: int,
        parent: int | None, data: np.ndarray | torch.Tensor, salt: str | None = None,
    ) -> list[int]:
        """Write verified consecutive blocks of a chain into fresh blocks, register them in the
        prefix cache and pin them; returns their ids. ``parent`` is the key of the block before
        the first one (None when the first one starts the chain).

        A key already cached is pinned instead of written (another request brought it first).
        All checks come before any change: on ``TransferError`` (507 no space, 409 a key cached
        with other content) nothing was pinned, registered or written.
        """
        bm = self.bm
        plan: list[int | None] = []  # cached block id, or None: import into a fresh block
        prev = parent if parent is not None else seed
        need = 0
        for key, tokens in zip(keys, token_blocks, strict=True):
            bid = bm.cached.get(key)
            if bid is not None:
                block = bm.blocks[bid]
                if block.parent_key != prev or block.token_ids != tuple(tokens):
                    raise TransferError(409, "kv_key_conflict", f"block key {key:#x} is cached with other content")
                need += block.ref_count == 0  # reviving takes it out of the free pool
            else:
                need += 1
            plan.append(bid)
            prev = key
        if need > len(bm.free):
            raise TransferError(507, "kv_no_space", f"{need} free blocks needed, {len(bm.free)} free", True)
        for bid in plan:  # revive first, so that no fresh allocation below can evict them
            if bid is not None:
                self._pin(bid)
                self.num_import_reused += 1
        out: list[int] = []
        fresh_rows: list[int] = []
        run: list[int] = []  # positions of consecutive newly registered blocks -> one event
        prev = parent if parent is not None else seed
        for j, (key, tokens, bid) in enumerate(zip(keys, token_blocks, plan, strict=True)):
            if bid is None:
                bid = self._take_fresh()  # ref_count 1: that reference is the pin
                block = bm.blocks[bid]
                block.key, block.token_ids, block.parent_key = key, tuple(tokens), prev
                bm.cached[key] = bid
                self.pins[bid] += 1
                fresh_rows.append(j)
                run.append(j)
            else:
                self._emit(keys, token_blocks, parent, run, salt)
                run = []
            out.append(bid)
            prev = key
        self._emit(keys, token_blocks, parent, run, salt)
        self.engine.run_swaps()  # CPU offload: evicted pages are saved before the scatter overwrites them
        if fresh_rows:  # same engine-thread call: no step can read them before they are written
            self._scatter([out[j] for j in fresh_rows], data, fresh_rows)
        self.num_imported += len(fresh_rows)
        self._publish()
        return out

    def _take_fresh(self) -> int:
        """The front free block (evicting what it cached, as the block manager does)."""
        return self.bm._take_fresh()  # noqa: SLF001 (the block manager's one eviction path)

    def _emit(self, keys: Sequence[int], token_blocks: Sequence[Sequence[int]], parent: int | None,
              run: list[int], salt: str | None) -> None:
        if not run:
            return
        first = run[0]
        before = keys[first - 1] if first else parent
        tokens = [t for j in run for t in token_blocks[j]]
        extra = salt_extra_keys(salt, 0 if before is None else 1, len(run))
        self.bm.events.append(BlockStored([keys[j] for j in run], before, tokens, self.layout.block_size,
                                          extra_keys=extra))

    def _publish(self) -> None:
        """Announce the import now (the engine may be idle: no step would drain it soon)."""
        events = self.bm.drain_events()
        publisher = self.engine.publisher
        if events and publisher is not None:
            publisher.publish(events)

    def save_to_cpu(self, block_ids: Sequence[int], keys: Sequence[int]) -> int:
        """The ``cpu_save`` consumer of a prefill's transfer: copy its pinned blocks into the CPU
        offload tier and wait for the copies (then the transfer may free the GPU blocks). A block
        that no longer holds its key is skipped. Returns how many blocks are in the CPU tier."""
        done = self.bm.offload(block_ids, keys)
        self.engine.run_swaps(sync=True)
        self._publish()
        return done

    # -- recurrent state (hybrid models) --

    def pin_export(self, keys: Sequence[int], token_blocks: Sequence[Sequence[int]], seed: int) -> PinnedPrefix:
        """``pin_prefix`` for a prefill's transfer. On a hybrid model it is cut back to the deepest
        pinned block holding a state checkpoint, and that checkpoint is pinned too (none: nothing
        is pinned, the decode side computes the whole prompt)."""
        pinned = self.pin_prefix(keys, token_blocks, seed)
        states = self.bm.states
        if states is None:
            return pinned
        n = len(pinned.block_ids)
        while n and pinned.keys[n - 1] not in states:
            n -= 1
        self.unpin(pinned.block_ids[n:])
        if not n:
            return PinnedPrefix((), (), ())
        states.pin(pinned.keys[n - 1])
        return PinnedPrefix(pinned.block_ids[:n], pinned.keys[:n], pinned.token_ids[:n], pinned.keys[n - 1])

    def pin_state(self, key: int) -> bool:
        """Pin the checkpoint under ``key`` if this worker holds one."""
        return self.bm.states is not None and self.bm.states.pin(key)

    def unpin_state(self, key: int) -> None:
        if self.bm.states is None:
            raise RuntimeError("unpin of a recurrent state on a model without one")
        self.bm.states.unpin(key)

    def gather_state(self, key: int) -> np.ndarray:
        """The pinned checkpoint under ``key`` as uint8 ``[state_bytes]`` on the host."""
        states, slots = self.bm.states, self.engine.runner.states
        if states is None or slots is None or not states.pins[key]:
            raise RuntimeError(f"gather of checkpoint {key:#x} that holds no pin")
        self.engine.run_swaps()  # a queued copy into it (an end-of-turn promotion) lands first
        state = slots[:, states.slot_of(key)].contiguous()
        host = state.cpu() if state.device.type != "cpu" else state
        return host.view(torch.uint8).reshape(-1).numpy()

    def import_state(self, key: int, parent: int | None, tokens: Sequence[int], index: int, salt: str | None,
                     data: np.ndarray) -> int:
        """File a transferred state (uint8 ``[state_bytes]``: the state after block ``index`` of
        the chain, whose key is ``key``) as a checkpoint and pin it; returns ``key``. The block
        must be in this worker's prefix cache (the caller holds it pinned). A checkpoint already
        filed under ``key`` is pinned instead. On ``TransferError`` nothing was filed or pinned."""
        states, slots = self.bm.states, self.engine.runner.states
        if states is None or slots is None or data.nbytes != self.layout.state_bytes:
            raise TransferError(409, "kv_layout_mismatch", f"a {data.nbytes}-byte recurrent state for a worker "
                                f"whose state is {self.layout.state_bytes} bytes")
        if key not in self.bm.cached:
            raise TransferError(409, "kv_state_orphan", f"state {key:#x} arrived without its block")
        if states.pin(key):
            self.num_states_reused += 1
            return key
        self.engine.run_swaps()  # queued copies read their slots before this write may reuse one
        slot = states.file(key, parent, list(tokens), salt_extra_keys(salt, index, 1))
        if slot is None:
            raise TransferError(507, "kv_no_space", "every recurrent-state checkpoint is pinned", True)
        state = torch.from_numpy(np.ascontiguousarray(data)).view(torch.float32).reshape(slots[:, slot].shape)
        slots[:, slot].copy_(state.to(slots.device))
        states.pin(key)
        self.num_states_imported += 1
        self._publish()
        return key

    # -- accounting --

    def leak_check(self) -> dict[str, int]:
        """References not explained by a running sequence or a pin (must be 0), and pins."""
        held = Counter(self.pins)
        for seq in self.engine.scheduler.running:
            held.update(seq.block_table)
        leaked = sum(abs(b.ref_count - held.get(b.block_id, 0)) for b in self.bm.blocks)
        states = self.bm.states
        return {"leaked_blocks": leaked, "pinned_blocks": sum(self.pins.values()),
                "pinned_states": sum(states.pins.values()) if states is not None else 0}
