"""One simulated worker: its KV cache (the true state), continuous batching, step timing.

Ownership and invariants:

- ``cache`` (GPU) and ``cpu`` (offload tier) are the worker's *true* prefix cache, keyed by
  router block keys; a key there is one computed, hashable prompt block. The router's
  ``PrefixIndex`` only learns of them through the KV events the worker emits (``emit``), which
  the engine may delay by the profile's event lag.
- ``cache[key] > 0`` is how many running requests use the block (it is pinned); ``<= 0`` means
  unreferenced, ``-cache[key]`` naming the release that freed it. ``segments`` orders the free
  blocks: one list per release, oldest release first, each in eviction order. Together they are
  exactly vLLM's free-block queue: eviction takes ``segments``' front, skipping entries that a
  later hit or release made stale (``cache[key]`` no longer names that release), and never
  touches a block in use. Every running request pins a prefix of its own chain
  (``keys[:registered]``), so pin counts never increase along a chain: a prompt's cached prefix
  is a pinned run followed by a free run, and the blocks a release frees are a suffix of its
  chain. They join the queue tail first, so a prompt's tail is evicted before its head.
- Usage: ``used_blocks`` (what ``TargetState.kv_usage`` reports, as the engines' ``kv_cache_usage``)
  counts the referenced cached blocks (a shared one once) and ``private``; unreferenced cached
  blocks are free (evictable), as in vLLM's free queue.
- Capacity: ``len(cache) + private <= capacity`` where ``private`` counts blocks held outside
  the cache (prompt blocks not yet computed, partial tails, generated tokens, and the decode
  growth reserved for the current segment). ``capacity == 0`` means unbounded: nothing is
  pinned or evicted (every value stays 0).
- Scheduling follows vLLM v1: every step decodes one token for each decoding sequence, then
  spends the rest of the token budget on prefill chunks, first of running prefills, then of
  waiting requests admitted in FCFS order (a blocked head blocks the queue). A request's blocks
  are all reserved at admission; decode growth is reserved per segment; when it cannot be
  found even after eviction, the newest decoding request is preempted (vLLM's LIFO) and
  recomputed later.
- Time: when no prefill is pending the batch is stable until the first sequence finishes, so
  ``k`` decode steps are taken as one segment whose duration is summed in closed form. An
  arrival during a segment cuts it at the next step boundary (``interrupt``).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from bisect import bisect_left
from itertools import compress, count, repeat
from operator import add, not_, sub

_NOT_POSITIVE = (0).__ge__  # v <= 0: a free block
from typing import Any

from mesh.core.router import Lease
from policies.base import TargetState
from simulator.profile import Profile

# KV events, as (time, op, target, keys, parent key of keys[0] for chain stores)
Emit = Callable[[float, int, str, list[int], "int | None"], None]
OP_STORE, OP_REMOVE, OP_OFFLOAD, OP_RELOAD, OP_DROP_CPU = range(5)
# OP_STORE: a computed chain on the GPU; OP_REMOVE: evicted from the GPU (no CPU tier);
# OP_OFFLOAD: evicted from the GPU into the CPU tier; OP_RELOAD: a chain restored from the CPU
# tier to the GPU; OP_DROP_CPU: evicted from the CPU tier.


class CapacityError(RuntimeError):
    """A request that can never fit in one worker's KV capacity."""


class SimRequest:
    """One routed request's progress on its worker."""

    __slots__ = (
        "idx", "session", "n", "out", "keys", "nfull", "arrival", "lease", "worker",
        "target", "computed", "registered", "own", "g", "first_t", "finish_t", "hit_tokens",
        "cpu_tokens", "admitted", "preemptions", "decode_to", "on_decode", "importing", "seq", "info",
    )

    def __init__(self, idx: int, session: str | None, n: int, out: int, keys: list[int], arrival: float,
                 lease: Lease | None, worker: int) -> None:
        self.idx = idx
        self.session = session
        self.n = n
        self.out = out if out > 0 else 1  # every request yields at least its first token
        self.keys = keys
        self.nfull = len(keys)
        self.arrival = arrival
        self.lease = lease
        self.worker = worker
        self.target = n  # tokens to compute before the (next) token: prompt, or prompt+generated
        self.computed = 0
        self.registered = 0  # leading prompt blocks this request holds in the cache
        self.own = 0  # blocks this request holds outside the cache
        self.g = 0  # generated tokens
        self.first_t = -1.0
        self.finish_t = -1.0
        self.hit_tokens = -1  # at first admission: GPU + CPU prefix hit, tokens
        self.cpu_tokens = 0
        self.admitted = False
        self.preemptions = 0
        self.decode_to: int = -1  # PD: the decode worker, when the decision named a pair
        self.on_decode = False  # PD: handed to its decode worker (it stays there, preempted or not)
        self.importing = False  # PD: its next admission imports the transferred prompt blocks
        self.seq = 0
        self.info: Any = None  # PD: the RequestInfo, for the decode worker's lease


def _blocks(tokens: int, bs: int) -> int:
    return -(-tokens // bs)


class WorkerModel:
    """A worker's scheduler and KV cache, driven by the engine's event loop."""

    def __init__(
        self,
        index: int,
        state: TargetState,
        profile: Profile,
        block_size: int,
        sim: Any,
    ) -> None:
        self.index = index
        self.state = state
        self.id = state.id
        self.profile = profile
        self.bs = block_size
        self.capacity = profile.blocks_at(block_size)
        cpu_blocks = profile.cpu_blocks_at(block_size)
        self.cpu: OrderedDict[int, None] | None = OrderedDict() if cpu_blocks else None
        self.cpu_capacity = cpu_blocks
        self.cache: dict[int, int] = {}  # key -> users (> 0), or -(release stamp) when free
        self.n_free = 0  # cached blocks no running request uses
        self.segments: deque[tuple[int, list[int]]] = deque()  # (stamp, keys) oldest first
        self.seg_pos = 0  # next entry to look at in segments[0]
        self.stamp = 0
        self.private = 0
        self.waiting: deque[SimRequest] = deque()
        self.prefilling: list[SimRequest] = []
        self.decoding: list[SimRequest] = []
        self.ctx_tokens = 0  # KV tokens of decoding sequences (n + g each)
        # engine callbacks: emit(t, op, target, keys), schedule(worker, t), first_token(req, t),
        # finished(req, t), handoff(req, t); counters: queued, preemptions
        self.sim = sim
        self.emit: Emit = sim.emit
        self.schedule = sim.schedule
        self.releases = 0  # bumps whenever blocks are unpinned or freed
        self.blocked_at = -1  # releases count when the queue head last failed to fit
        # current segment
        self.busy = False
        self.seg_start = 0.0
        self.seg_end = 0.0
        self.seg_k = 0
        self.seg_reserved = 0
        self.seg_chunks: list[tuple[SimRequest, int]] = []
        self.seg_mixed = False
        self.version = 0
        self.busy_s = 0.0
        self.steps = 0
        self.seq = 0
        p, d = profile.prefill, profile.decode
        self._p = (p.base_ms / 1e3, p.per_token_ms / 1e3, p.per_token2_ms / 1e3, p.per_token_ctx_ms / 1e3)
        self._hit_s = p.per_hit_token_ms / 1e3  # per prefix-hit token of a request admitted in the step
        self._step_hits = 0  # hit tokens of the requests admitted while planning this step
        self._mixed_s = p.mixed_ms / 1e3  # a step that prefills and decodes: extra cost
        self._mixed_seq_s = p.mixed_per_seq_ms / 1e3
        self._mixed_tok_s = p.mixed_per_token_ms / 1e3
        self._step_prompt = 0  # prompt tokens of the requests admitted while planning this step
        self._d = (d.base_ms / 1e3, d.per_seq_ms / 1e3, d.per_ctx_token_ms / 1e3, d.per_ctx_token2_ms / 1e3)
        self._cpu_load_s = profile.per_block_ms_at(profile.cpu.load_ms_per_block, block_size) / 1e3  # per trace block
        state.kv_capacity_blocks = self.capacity
        state.block_size = block_size

    # ------------------------------------------------------------------ timing (seconds)
    def decode_span(self, k: int, batch: int, ctx: int) -> float:
        """Time of ``k`` decode steps of ``batch`` sequences starting at ``ctx`` KV tokens."""
        if k <= 0:
            return 0.0
        base, per_seq, per_ctx, per_ctx2 = self._d
        tri = k * (k - 1) / 2
        t = k * (base + per_seq * batch) + per_ctx * (k * ctx + batch * tri)
        if per_ctx2:
            sq = k * ctx * ctx + 2 * ctx * batch * tri + batch * batch * (k - 1) * k * (2 * k - 1) / 6
            t += per_ctx2 * sq
        return t

    def _steps_done(self, elapsed: float) -> int:
        """Decode steps of the current segment completed ``elapsed`` seconds after its start."""
        lo, hi = 0, self.seg_k  # invariant: span(lo) <= elapsed, answer < hi unless elapsed >= span(k)
        batch, ctx = len(self.decoding), self.ctx_tokens
        if self.decode_span(hi, batch, ctx) <= elapsed:
            return hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.decode_span(mid, batch, ctx) <= elapsed:
                lo = mid
            else:
                hi = mid
        return lo

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
        elapsed = t - self.seg_start
        j = self._steps_done(elapsed)
        batch, ctx = len(self.decoding), self.ctx_tokens
        k = j if self.decode_span(j, batch, ctx) >= elapsed else j + 1
        k = max(k, 0)
        if k >= self.seg_k:
            return
        self.seg_k = k
        self.seg_end = self.seg_start + self.decode_span(k, batch, ctx)
        self.version += 1
        self.schedule(self, self.seg_end)

    # ------------------------------------------------------------------ KV cache
    @property
    def cached_blocks(self) -> int:
        return len(self.cache)

    def cached_prefix(self, keys: list[int], limit: int) -> int:
        """Leading blocks of ``keys[:limit]`` in the GPU cache (referenced or not)."""
        return self._hits(keys, limit)[1]

    def evict(self, m: int, t: float) -> int:
        """Evict up to ``m`` unreferenced blocks, least recently released first."""
        m = min(m, self.n_free)
        if m <= 0:
            return 0
        cache = self.cache
        get = cache.get
        segments = self.segments
        out: list[int] = []
        while len(out) < m:
            tag, seg = segments[0]
            pos = self.seg_pos
            chunk = seg[pos : pos + m - len(out)]
            out.extend([k for k in chunk if get(k) == tag])
            pos += len(chunk)
            if pos >= len(seg):
                segments.popleft()
                pos = 0
            self.seg_pos = pos
        deque(map(cache.__delitem__, out), 0)
        self.n_free -= m
        out.reverse()  # heads first: the index removes leaf first (it walks the list backwards)
        if self.cpu is None:
            self.emit(t, OP_REMOVE, self.id, out, None)
        else:
            self._offload(out, t)
        return m

    def _offload(self, keys: list[int], t: float) -> None:
        cpu = self.cpu
        if cpu is None:
            return
        cpu.update(dict.fromkeys(reversed(keys)))  # in eviction order: oldest first
        self.emit(t, OP_OFFLOAD, self.id, keys, None)
        self._trim_cpu(t)

    def _trim_cpu(self, t: float) -> None:
        """Drop the oldest CPU blocks past the tier's capacity (invariant: len(cpu) <= capacity)."""
        cpu = self.cpu
        if cpu is None:
            return
        over = len(cpu) - self.cpu_capacity
        if over > 0:
            gone = [cpu.popitem(False)[0] for _ in range(over)]
            gone.reverse()
            self.emit(t, OP_DROP_CPU, self.id, gone, None)

    def _free(self) -> int:
        return self.capacity - len(self.cache) - self.private

    def _hits(self, keys: list[int], limit: int) -> tuple[int, int]:
        """(pinned run, whole cached prefix) of ``keys[:limit]``, counted at C speed."""
        if limit <= 0:
            return 0, 0
        cache = self.cache
        h = next(compress(count(), map(not_, map(cache.__contains__, keys[:limit]))), limit)
        if not h or not self.capacity:
            return 0, h
        hp = next(compress(count(), map(_NOT_POSITIVE, map(cache.__getitem__, keys[:h]))), h)
        return hp, h

    def _pin(self, keys: list[int], hp: int, h: int) -> None:
        """Reference the cached blocks ``keys[:h]`` (``keys[:hp]`` already referenced)."""
        cache = self.cache
        if hp:
            ks = keys[:hp]
            cache.update(zip(ks, map(add, map(cache.__getitem__, ks), repeat(1))))
        if h > hp:
            cache.update(dict.fromkeys(keys[hp:h], 1))  # their queue entries go stale
            self.n_free -= h - hp

    def _unpin(self, keys: list[int], n: int) -> None:
        """Drop one reference from ``keys[:n]``; blocks left unreferenced join the queue tail."""
        if n <= 0:
            return
        cache = self.cache
        ks = keys[:n]
        # counts never increase along a chain: the blocks this release frees are a suffix
        s = bisect_left(range(n), True, key=lambda i: cache[ks[i]] == 1)
        if s:
            head = ks[:s]
            cache.update(zip(head, map(sub, map(cache.__getitem__, head), repeat(1))))
        if s < n:
            tail = ks[s:]
            tail.reverse()  # the chain's end is evicted first
            self._push_free(tail)

    def _push_free(self, keys: list[int]) -> None:
        """Queue unreferenced blocks at the tail, ``keys[0]`` to be evicted first."""
        self.stamp += 1
        tag = -self.stamp
        self.cache.update(zip(keys, repeat(tag)))
        self.segments.append((tag, keys))
        self.n_free += len(keys)

    def _release(self, req: SimRequest) -> None:
        """Give back a request's blocks: private ones freed, cached ones unreferenced."""
        self.private -= req.own
        req.own = 0
        self.releases += 1
        if self.capacity:
            self._unpin(req.keys, req.registered)

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
        c = 0
        cpu = self.cpu
        if cpu is not None and h < limit and not req.importing:
            c = next(compress(count(), map(not_, map(cpu.__contains__, keys[h:limit]))), limit - h)
        # room for the prompt (or everything to recompute) and the next generated token
        need = _blocks(req.target + 1, bs) - h
        if self.capacity:
            if need > self.capacity:
                raise CapacityError(
                    f"request {req.idx} needs {need} KV blocks of {bs} tokens but worker {self.id} "
                    f"holds {self.capacity}: raise --kv-blocks (blocks of {self.profile.block_size} tokens)"
                )
            self._pin(keys, hp, h)  # its hits are in use from now: eviction cannot take them
            loaded = keys[h : h + c]
            if c:
                deque(map(cpu.__delitem__, loaded), 0)  # type: ignore[union-attr]
            room = self._free()
            if need > room:
                room += self.evict(need - room, t)
            if need > room:
                self._unpin(keys, h)
                if c:  # the borrowed blocks go back; the eviction above may have filled the tier
                    cpu.update(dict.fromkeys(loaded))  # type: ignore[union-attr]
                    self._trim_cpu(t)
                return False, 0
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

    def _register(self, req: SimRequest, t: float) -> None:
        """Cache the prompt blocks a chunk just completed (and tell the index).

        A block another request computed meanwhile is shared instead (its copy is released)."""
        upto = min(req.computed // self.bs, req.nfull)
        reg = req.registered
        if upto <= reg:
            return
        new = req.keys[reg:upto]
        cache = self.cache
        if not self.capacity:
            cache.update(dict.fromkeys(new, 0))
        elif new[0] not in cache:
            # the cache is prefix-closed (a chain is evicted leaf first and pinned root first),
            # so if the first new block is absent, so are the rest
            cache.update(dict.fromkeys(new, 1))
        else:  # computed meanwhile by another request: share its block
            for key in new:
                v = cache.get(key)
                if v is not None and v > 0:
                    cache[key] = v + 1
                else:
                    if v is not None:
                        self.n_free -= 1
                    cache[key] = 1
        req.own -= len(new)
        self.private -= len(new)
        req.registered = upto
        self.emit(t, OP_STORE, self.id, new, req.keys[reg - 1] if reg else None)

    # ------------------------------------------------------------------ planning
    def _growth(self, k: int) -> int:
        bs = self.bs
        return sum(_blocks(r.n + r.g + k, bs) - _blocks(r.n + r.g, bs) for r in self.decoding)

    def _reserve(self, k: int, t: float) -> int:
        """Reserve decode growth for as many of ``k`` steps as fit (evicting as needed).

        Replaces the current reservation; returns the steps reserved (0: not even one)."""
        self.private -= self.seg_reserved
        self.seg_reserved = 0
        if not self.capacity or not self.decoding:
            return k
        need = self._growth(k)
        room = self._free()
        if need > room:
            room += self.evict(need - room, t)
        if need > room:
            lo, hi = 0, k  # growth(lo) <= room < growth(hi)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if self._growth(mid) <= room:
                    lo = mid
                else:
                    hi = mid
            k = lo
            need = self._growth(k)
        self.seg_reserved = need
        self.private += need
        return k

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
        self._release(victim)
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
            if self.waiting:
                head = self.waiting[0]
                raise CapacityError(
                    f"worker {self.id} cannot admit request {head.idx} with nothing running: "
                    "KV capacity too small for it"
                )
            self.private -= self.seg_reserved
            self.seg_reserved = 0
            self.busy = False
            self._update_usage()
            return
        if chunks:
            n_tok = sum(take for _, take in chunks)
            base, per_tok, per_tok2, per_ctx = self._p
            dur = base + per_tok * n_tok + per_tok2 * n_tok * n_tok + per_ctx * ctx_work + self._hit_s * self._step_hits
            if self.decoding:
                dur += self.decode_span(1, len(self.decoding), self.ctx_tokens)
                dur += self._mixed_s + self._mixed_seq_s * len(self.decoding) + self._mixed_tok_s * self._step_prompt
            dur += cpu_blocks * self._cpu_load_s
            self.seg_chunks = chunks
            self.seg_mixed = True
            self.seg_k = 1
        else:
            k = min(r.out - r.g for r in self.decoding)
            if k > 1:
                k = max(1, self._reserve(k, t))  # one step always fits: it was reserved above
            dur = self.decode_span(k, len(self.decoding), self.ctx_tokens)
            self.seg_chunks = []
            self.seg_mixed = False
            self.seg_k = k
        self.busy = True
        self.seg_start = t
        self.seg_end = t + dur
        self.version += 1
        self._update_usage()
        self.schedule(self, self.seg_end)

    @property
    def used_blocks(self) -> int:
        """Blocks held by requests: cached blocks some running request references (a shared one
        once) plus private ones. Unreferenced cached blocks are in the free pool, as in vLLM and
        the bundled engine (``workers/engine/block_manager.py``): evictable, so free."""
        return len(self.cache) - self.n_free + self.private

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
                before = _blocks(r.n + r.g, bs)
                r.g += k
                grown += _blocks(r.n + r.g, bs) - before
                r.own += _blocks(r.n + r.g, bs) - before
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
                    self._release(r)
                    self.sim.handoff(r, t)
                    continue
                if r.g == 0:  # its blocks for this token were reserved at admission
                    r.g = 1
                    r.first_t = t
                    self.sim.first_token(r, t)
                self._join_decode(r, t)
            self.seg_chunks = []
        finished = [r for r in decoding if r.g >= r.out]
        if finished:
            for r in finished:
                decoding.remove(r)
                self.ctx_tokens -= r.n + r.g
                self._release(r)
                r.finish_t = t
                self.sim.finished(r, t)
        self.plan(t)

    def _join_decode(self, r: SimRequest, t: float) -> None:
        if r.g >= r.out:
            self._release(r)
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
        used = len(self.cache) + self.private
        if self.capacity and used > self.capacity:
            raise AssertionError(f"{self.id}: {used} blocks used > capacity {self.capacity}")
        if self.capacity:
            refs: dict[int, int] = {}
            for r in running:
                for k in r.keys[: r.registered]:
                    refs[k] = refs.get(k, 0) + 1
            if refs != {k: v for k, v in self.cache.items() if v > 0}:
                raise AssertionError(f"{self.id}: pin counts differ from the running requests' references")
            free = {k for k, v in self.cache.items() if v <= 0}
            if len(free) != self.n_free:
                raise AssertionError(f"{self.id}: n_free {self.n_free} != {len(free)} free blocks")
            queued = {k for tag, seg in self.segments for k in seg if self.cache.get(k) == tag}
            if queued != free:
                raise AssertionError(f"{self.id}: free blocks and the eviction queue disagree")
        if self.ctx_tokens != sum(r.n + r.g for r in self.decoding):
            raise AssertionError(f"{self.id}: ctx_tokens out of sync")
        if self.cpu is not None and len(self.cpu) > self.cpu_capacity:
            raise AssertionError(f"{self.id}: CPU tier over capacity")
