"""One simulated worker's scheduler: continuous batching over its KV cache, and its segments.

Ownership: ``WorkerModel`` extends ``simulator.worker_cache.WorkerCache`` (the true prefix
cache, its invariants and its KV events) with the waiting, prefilling and decoding requests and
the current segment; ``simulator.step_timing.StepTiming`` prices each segment. The engine
(``simulator.engine``) drives it: ``enqueue`` on arrival, ``complete`` at a segment's end.

- Usage: ``used_blocks`` (what ``TargetState.kv_usage`` reports, as the engines'
  ``kv_cache_usage``) counts the referenced cached blocks (a shared one once) and ``private``.
- Scheduling follows vLLM v1: every step decodes one token for each decoding sequence, then
  spends the rest of the token budget on prefill chunks, first of running prefills, then of
  waiting requests admitted in FCFS order (a blocked head blocks the queue). Blocks follow the
  bundled engine's block manager (``workers/engine/block_manager.py``): a request's prompt
  blocks are all taken at admission, and only when the free blocks (uncached, or cached and
  unreferenced) cover them: a request that does not fit evicts nothing. A running request holds
  the blocks of its computed tokens; each decode step takes the block its token needs (reserved
  per segment); when they cannot be found, the newest running request is preempted (vLLM's
  LIFO) and recomputed, its recompute ending, as the engine's, by sampling its next token.
- Time: with no prefill pending the batch is stable until the first sequence finishes, so ``k``
  decode steps are one segment; an arrival during it cuts it at the next step boundary. A
  segment is an amount of work (its cost alone on the device) done at a pace: 1, or on a
  device shared with other workers ``simulator.device``'s slowdown, which changes when they
  start or stop (``repace``): ``seg_end = seg_mark + (seg_work - seg_done) * seg_slow``.
"""

from __future__ import annotations

from collections import deque
from itertools import compress, count
from operator import not_
from typing import Any

from policies.base import TargetState
from simulator.device import Device
from simulator.profile import Profile
from simulator.sim_request import CapacityError, SimRequest
from simulator.step_timing import StepTiming
from simulator.worker_cache import (
    OP_DROP_CPU,
    OP_OFFLOAD,
    OP_RELOAD,
    OP_REMOVE,
    OP_STATE_REMOVE,
    OP_STATE_STORE,
    OP_STORE,
    Emit,
    WorkerCache,
)

# What other modules and tests import from here (the cache and its events live in worker_cache).
__all__ = ["OP_DROP_CPU", "OP_OFFLOAD", "OP_RELOAD", "OP_REMOVE", "OP_STATE_REMOVE", "OP_STATE_STORE", "OP_STORE",
           "CapacityError", "Emit", "SimRequest", "WorkerModel"]


def _blocks(tokens: int, bs: int) -> int:
    return -(-tokens // bs)


class WorkerModel(WorkerCache):
    """A worker's scheduler over its KV cache (``WorkerCache``), driven by the engine's event loop."""

    def __init__(
        self,
        index: int,
        state: TargetState,
        profile: Profile,
        block_size: int,
        sim: Any,
        device: Device | None = None,
    ) -> None:
        config = getattr(sim, "config", None)
        super().__init__(state.id, block_size, profile.blocks_at(block_size), profile.cpu_blocks_at(block_size),
                         sim.emit, getattr(config, "hybrid_checkpoints", 0), getattr(config, "hybrid_interval_blocks", 0))
        self.index = index
        self.state = state
        self.profile = profile
        self.waiting: deque[SimRequest] = deque()
        self.prefilling: list[SimRequest] = []
        self.decoding: list[SimRequest] = []
        self.ctx_tokens = 0  # KV tokens of decoding sequences (n + g each)
        # engine callbacks: emit(t, op, target, keys), schedule(worker, t), first_token(req, t),
        # finished(req, t), handoff(req, t); counters: queued, preemptions
        self.sim = sim
        self.schedule = sim.schedule
        self.blocked_at = -1  # releases count when the queue head last failed to fit
        # current segment
        self.busy = False
        self.seg_start = 0.0
        self.seg_end = 0.0
        self.seg_k = 0
        self.seg_reserved = 0
        self.seg_chunks: list[tuple[SimRequest, int]] = []
        self.seg_mixed = False
        self.seg_work = 0.0  # the segment's cost alone on its device (s)
        self.seg_done = 0.0  # of which done by seg_mark
        self.seg_mark = 0.0  # when the current pace began
        self.seg_slow = 1.0  # wall seconds per second of work at the current pace
        self.seg_sigma = 1.0  # the segment's cost with the device's workers all busy, over seg_work
        self.device = device
        self.version = 0
        self.busy_s = 0.0
        self.steps = 0
        self.seq = 0
        self.timing = StepTiming(profile, block_size)
        self.shared_timing = StepTiming(profile, block_size, shared=True) if profile.shared_workers else None
        self._step_hits = 0  # hit tokens of the requests admitted while planning this step
        self._step_prompt = 0  # prompt tokens of the requests admitted while planning this step
        state.kv_capacity_blocks = self.capacity
        state.block_size = block_size

    # ------------------------------------------------------------------ arrivals
    def enqueue(self, req: SimRequest, t: float) -> None:
        self.waiting.append(req)
        self.sim.queued += 1
        if not self.busy:
            # wake after every release of this instant: simultaneous arrivals share a step
            self.busy = True
            self.seg_start = self.seg_end = t
            self.seg_k = 0
            self.seg_mixed = False
            self.seg_chunks = []
            self.version += 1
            self.sim.schedule(self, t, wake=True)
        elif len(self.waiting) == 1 and not self.seg_mixed and self.seg_k > 1:
            self.interrupt(t)  # (behind a blocked head it could not start any sooner)

    def interrupt(self, t: float) -> None:
        """Cut the running decode segment at the first step boundary at or after ``t``."""
        elapsed = self.seg_done + (t - self.seg_mark) / self.seg_slow  # work done by t
        batch, ctx = len(self.decoding), self.ctx_tokens
        j = self.timing.steps_done(self.seg_k, elapsed, batch, ctx)
        k = j if self.timing.decode_span(j, batch, ctx) >= elapsed else j + 1
        k = max(k, 0)
        if k >= self.seg_k:
            return
        self.seg_k = k
        self.seg_work = self.timing.decode_span(k, batch, ctx)
        self.seg_end = self.seg_mark + (self.seg_work - self.seg_done) * self.seg_slow
        self.version += 1
        self.schedule(self, self.seg_end)

    def repace(self, t: float, busy: int) -> None:
        """The device's busy count changed at ``t``: the running segment goes on at the new pace."""
        if not self.busy or self.seg_end <= t or self.device is None:
            return
        self.seg_done += (t - self.seg_mark) / self.seg_slow
        self.seg_mark = t
        self.seg_slow = self.device.slowdown(busy, self.seg_sigma)
        self.seg_end = max(t, t + (self.seg_work - self.seg_done) * self.seg_slow)
        self.version += 1
        self.schedule(self, self.seg_end)

    # ------------------------------------------------------------------ admission
    def _admit(self, req: SimRequest, t: float) -> tuple[bool, int]:
        """Allocate a waiting request's blocks; (admitted, CPU blocks to load).

        A PD import (``req.importing``) pins its GPU prefix like any request (the decode worker
        pins the longest prefix it caches; no CPU tier) and takes the rest of ``keys[:limit]``
        from the transfer: ``_admit_waiting`` registers them right after."""
        bs = self.bs
        keys = req.keys
        limit = min(req.nfull, (req.target - 1) // bs)  # the last token is always computed
        hp, h = self._hits(keys, limit)
        if self.states is not None and not req.importing:  # hybrid: resumable only at a checkpoint
            h = self._resumable(keys, h)
            hp = min(hp, h)
        c = 0
        cpu = self.cpu
        if cpu is not None and h < limit and not req.importing and self.states is None:
            c = next(compress(count(), map(not_, map(cpu.__contains__, keys[h:limit]))), limit - h)
        # room for the prompt (or everything to recompute); the generated tokens' blocks come
        # with the decode steps that compute them (as the engine's allocate and append_slots)
        need = _blocks(req.target, bs) - h
        if self.capacity:
            if need > self.capacity:
                raise CapacityError(
                    f"request {req.idx} needs {need} KV blocks of {bs} tokens but worker {self.id} "
                    f"holds {self.capacity}: raise --kv-blocks (blocks of {self.profile.block_size} tokens)"
                )
            # as the engine's can_allocate: the free blocks (uncached, or cached and not among
            # its hits) must cover it; a request that does not fit evicts and revives nothing
            if need > self._free() + self.n_free - (h - hp):
                return False, 0
            self._pin(keys, hp, h)  # its hits are in use from now: eviction cannot take them
            loaded = keys[h : h + c]
            if c:  # out of the tier before the eviction below offloads into it
                deque(map(cpu.__delitem__, loaded), 0)  # type: ignore[union-attr]
            room = self._free()
            if need > room:
                self.evict(need - room, t)
            if c:
                self.cache.update(dict.fromkeys(loaded, 1))
                self.emit(t, OP_RELOAD, self.id, loaded, keys[h - 1] if h else None)
        req.registered = h + c
        req.own = need - c
        self.private += req.own
        req.computed = (h + c) * bs
        if req.hit_tokens < 0:
            req.hit_tokens = (h + c) * bs
            req.cpu_tokens = c * bs
        req.admitted = True
        self.seq += 1
        req.seq = self.seq
        return True, c

    # ------------------------------------------------------------------ planning
    def _growth(self, k: int) -> int:
        bs = self.bs
        # a decoding request holds the blocks of its computed tokens (n + g - 1: its last sampled
        # token is not computed yet); each step computes one more
        return sum(_blocks(r.n + r.g - 1 + k, bs) - _blocks(r.n + r.g - 1, bs) for r in self.decoding)

    def _reserve(self, k: int, t: float) -> int:
        """Reserve decode growth for up to ``k`` steps; the steps reserved (0: not even one).

        As the engine, which takes a block when the step that needs it runs: the steps use the
        uncached free blocks, and only the first step may evict (a segment whose later steps
        would need to stops before them; the next segment evicts for its own first step).
        Replaces the current reservation."""
        self.private -= self.seg_reserved
        self.seg_reserved = 0
        if not self.capacity or not self.decoding:
            return k
        room = self._free()
        if self._growth(k) > room:
            k = self._steps_within(k, room)
            if not k:
                if self._growth(1) > room + self.n_free:
                    return 0
                k = 1
        need = self._growth(k)
        if need > room:
            self.evict(need - room, t)
        self.seg_reserved = need
        self.private += need
        return k

    def _steps_within(self, k: int, room: int) -> int:
        """The most steps (at most ``k``) whose decode growth fits ``room`` blocks."""
        lo, hi = 0, k  # invariant: growth(lo) <= room < growth(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self._growth(mid) <= room:
                lo = mid
            else:
                hi = mid
        return lo

    def _preempt(self, t: float) -> None:
        """Recompute the newest running request later (vLLM's LIFO preemption)."""
        running = self.prefilling + self.decoding
        victim = max(running, key=lambda r: r.seq)
        if len(running) == 1:
            raise CapacityError(
                f"request {victim.idx} ({victim.n} prompt + {victim.out} output tokens) outgrows the KV "
                f"capacity of worker {self.id} ({self.capacity} blocks of {self.bs}) while running alone"
            )
        if victim in self.decoding:
            self.decoding.remove(victim)
            self.ctx_tokens -= victim.n + victim.g
            victim.target = victim.n + victim.g
        else:
            self.prefilling.remove(victim)
        self._release(victim, t)
        victim.registered = 0
        victim.computed = 0
        victim.importing = False  # recomputed here (its imported blocks may still be cached hits)
        victim.preemptions += 1
        self.waiting.appendleft(victim)
        self.sim.queued += 1
        self.sim.preemptions += 1

    def _admit_waiting(self, budget: int, t: float, chunks: list[tuple[SimRequest, int]]) -> tuple[int, int, int]:
        """Admit waiting requests FCFS into the step; (budget left, context work, CPU blocks)."""
        ctx_work = cpu_blocks = 0
        max_seqs = self.profile.max_num_seqs
        waiting = self.waiting
        while waiting and budget > 0 and len(self.prefilling) + len(self.decoding) < max_seqs:
            if self.blocked_at == self.releases:
                break  # the head did not fit and nothing was freed since
            req = waiting[0]
            ok, c = self._admit(req, t)
            if not ok:
                self.blocked_at = self.releases
                break
            waiting.popleft()
            self.sim.queued -= 1
            cpu_blocks += c
            if req.importing:  # PD: the transferred blocks join the cache (stored events); the
                req.importing = False  # last (partial) block is computed here, as the real decode worker does
                req.computed = min(req.nfull, (req.target - 1) // self.bs) * self.bs
                self._register(req, t)
            self.prefilling.append(req)
            self._step_hits += req.computed  # = its prefix hits (GPU + CPU), just admitted
            self._step_prompt += req.n
            take = min(req.target - req.computed, budget)
            chunks.append((req, take))
            ctx_work += take * req.computed
            budget -= take
        return budget, ctx_work, cpu_blocks

    def plan(self, t: float) -> None:
        """Choose and schedule the next segment starting at ``t`` (or go idle).

        As vLLM: running decodes get their next token's blocks first (preempting the newest
        running request while they cannot), then running prefills take the budget, then
        waiting requests are admitted, unless this step preempted."""
        preempted = False
        while self.decoding and not self._reserve(1, t):
            self._preempt(t)
            preempted = True
        budget = self.profile.max_batched_tokens - len(self.decoding)
        self._step_hits = self._step_prompt = 0
        chunks: list[tuple[SimRequest, int]] = []
        ctx_work = cpu_blocks = 0
        for r in self.prefilling:
            if budget <= 0:
                break
            take = min(r.target - r.computed, budget)
            chunks.append((r, take))
            ctx_work += take * r.computed
            budget -= take
        if not preempted or not (chunks or self.decoding):
            budget, work, cpu_blocks = self._admit_waiting(budget, t, chunks)
            ctx_work += work
        if not chunks and not self.decoding:
            self._go_idle(t)
            return
        if chunks:
            dur = self._mixed_segment(chunks, ctx_work, cpu_blocks)
        else:
            dur = self._decode_segment(t)
        self._start_segment(t, dur)
        self._update_usage()
        self.schedule(self, self.seg_end)

    def _start_segment(self, t: float, work: float) -> None:
        """The planned segment (``work`` s alone) starts at ``t``, at the device's pace."""
        self.busy = True
        self.seg_start = self.seg_mark = t
        self.seg_work = work
        self.seg_done = 0.0
        self.seg_slow = 1.0
        if self.device is not None:
            self.seg_slow = self.device.slowdown(self.device.start(self, t), self.seg_sigma)
        self.seg_end = t + work * self.seg_slow
        self.version += 1

    def _go_idle(self, t: float) -> None:
        """Nothing to run: drop the decode reservation and stop (a waiting head that cannot be
        admitted with nothing running never fits: ``CapacityError``)."""
        if self.waiting:
            head = self.waiting[0]
            raise CapacityError(
                f"worker {self.id} cannot admit request {head.idx} with nothing running: "
                "KV capacity too small for it"
            )
        self.private -= self.seg_reserved
        self.seg_reserved = 0
        self.busy = False
        if self.device is not None:
            self.device.stop(self, t)
        self._update_usage()

    def _mixed_segment(self, chunks: list[tuple[SimRequest, int]], ctx_work: int, cpu_blocks: int) -> float:
        """One step that prefills ``chunks`` (and decodes every decoding sequence); its duration."""
        n_tok = sum(take for _, take in chunks)
        args = (n_tok, ctx_work, self._step_hits, self._step_prompt, cpu_blocks, len(self.decoding), self.ctx_tokens)
        dur = self.timing.prefill_step(*args)
        if self.shared_timing is not None and dur > 0:
            self.seg_sigma = self.shared_timing.prefill_step(*args) / dur
        self.seg_chunks = chunks
        self.seg_mixed = True
        self.seg_k = 1
        return dur

    def _decode_segment(self, t: float) -> float:
        """Decode steps until the first sequence finishes (as many as fit); their duration."""
        k = min(r.out - r.g for r in self.decoding)
        if k > 1:
            k = max(1, self._reserve(k, t))  # one step always fits: it was reserved above
        dur = self.timing.decode_span(k, len(self.decoding), self.ctx_tokens)
        if self.shared_timing is not None and dur > 0:
            self.seg_sigma = self.shared_timing.decode_span(k, len(self.decoding), self.ctx_tokens) / dur
        self.seg_chunks = []
        self.seg_mixed = False
        self.seg_k = k
        return dur

    @property
    def _cpu_load_s(self) -> float:
        """Seconds to load one (trace) block from the CPU tier (``StepTiming.cpu_load_s``)."""
        return self.timing.cpu_load_s

    def _update_usage(self) -> None:
        # the engines' kv_cache_usage: "fraction of KV blocks held by requests"
        if self.capacity:
            self.state.kv_usage = self.used_blocks / self.capacity

    # ------------------------------------------------------------------ segment completion
    def complete(self, t: float) -> None:
        """The current segment ended at ``t``: apply it, then plan the next one."""
        k = self.seg_k
        self.busy_s += t - self.seg_start
        self.steps += k
        decoding = self.decoding
        bs = self.bs
        if k and decoding:
            grown = 0
            for r in decoding:
                before = _blocks(r.n + r.g - 1, bs)
                r.g += k
                grown += _blocks(r.n + r.g - 1, bs) - before
                r.own += _blocks(r.n + r.g - 1, bs) - before
            self.ctx_tokens += k * len(decoding)
            # the reservation becomes the requests' own blocks (grown <= reserved)
            self.private += grown - self.seg_reserved if self.capacity else grown
        elif self.capacity:
            self.private -= self.seg_reserved
        self.seg_reserved = 0
        if self.seg_mixed:
            done = []
            for r, take in self.seg_chunks:
                r.computed += take
                self._register(r, t)
                if r.computed >= r.target:
                    done.append(r)
            for r in done:
                self.prefilling.remove(r)
                if r.decode_to >= 0 and not r.on_decode:
                    # PD prefill done: its one sampled token is discarded (as by the relay and
                    # vLLM); the client's first token comes from the decode worker
                    self._release(r, t)
                    self.sim.handoff(r, t)
                    continue
                r.g += 1  # the prefill (or a recompute) ends by sampling the next token
                if r.g == 1:
                    r.first_t = t
                    self.sim.first_token(r, t)
                self._join_decode(r, t)
            self.seg_chunks = []
        for r in [r for r in decoding if r.g >= r.out]:
            decoding.remove(r)
            self.ctx_tokens -= r.n + r.g
            self._release(r, t)
            r.finish_t = t
            self.sim.finished(r, t)
        self.plan(t)

    def _join_decode(self, r: SimRequest, t: float) -> None:
        if r.g >= r.out:
            self._release(r, t)
            r.finish_t = t
            self.sim.finished(r, t)
            return
        self.decoding.append(r)
        self.ctx_tokens += r.n + r.g

    # ------------------------------------------------------------------ checks
    def check(self) -> None:
        """Integrity check (tests call it after operations); raises AssertionError."""
        running = self.prefilling + self.decoding
        own = sum(r.own for r in running)
        if self.private != own + self.seg_reserved:
            raise AssertionError(f"{self.id}: private {self.private} != own {own} + reserved {self.seg_reserved}")
        self.check_blocks(running)
        if self.ctx_tokens != sum(r.n + r.g for r in self.decoding):
            raise AssertionError(f"{self.id}: ctx_tokens out of sync")
        if self.cpu is not None and len(self.cpu) > self.cpu_capacity:
            raise AssertionError(f"{self.id}: CPU tier over capacity")
