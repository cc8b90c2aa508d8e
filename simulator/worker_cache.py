"""One simulated worker's KV cache: the true prefix cache on the GPU and the CPU offload tier,
keyed by router block keys, with vLLM's free-block queue.

Ownership: ``WorkerCache`` owns ``cache``, ``cpu``, the free queue (``segments``) and the block
counters; ``simulator.worker_model.WorkerModel`` extends it with scheduling and calls these
operations from admission, planning and completion (one object per worker, so the engine and the
tests read one set of fields). The router's ``PrefixIndex`` learns of the cache only through the
KV events it emits (``emit``), which the engine may delay by the profile's event lag.

Invariants: ``cache[key] > 0`` counts the running requests that pin the block; ``<= 0`` means
free, ``-cache[key]`` naming the release that freed it. ``segments`` orders the free blocks (one
list per release, oldest first, each in eviction order; entries a later hit or release made
stale are skipped), and eviction never touches a pinned block; a release with the gateway's
retention hint (``Lease.spill``) joins the queue's head instead of its tail, as the bundled
engine's ``free_seq`` puts such a request's blocks first in line. Capacity: ``len(cache) + private
<= capacity`` (``capacity == 0``: unbounded, nothing pinned or evicted), ``len(cpu) <=
cpu_capacity``; ``check_blocks`` verifies the pin counts and the queue.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import OrderedDict, deque
from collections.abc import Callable
from itertools import compress, count, repeat
from operator import add, not_, sub
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from simulator.sim_request import SimRequest

_NOT_POSITIVE = (0).__ge__  # v <= 0: a free block

# KV events, as (time, op, target, keys, parent key of keys[0] for chain stores)
Emit = Callable[[float, int, str, list[int], "int | None"], None]
OP_STORE, OP_REMOVE, OP_OFFLOAD, OP_RELOAD, OP_DROP_CPU, OP_STATE_STORE, OP_STATE_REMOVE = range(7)
# OP_STORE: a computed chain on the GPU; OP_REMOVE: evicted from the GPU (no CPU tier);
# OP_OFFLOAD: evicted from the GPU into the CPU tier; OP_RELOAD: a chain restored from the CPU
# tier to the GPU; OP_DROP_CPU: evicted from the CPU tier; OP_STATE_STORE / OP_STATE_REMOVE: a
# hybrid model's recurrent-state checkpoint after ``keys[0]`` stored / evicted.


class WorkerCache:
    """A worker's GPU prefix cache and CPU tier (see the module docstring for the invariants).

    Every running request pins a prefix of its own chain (``keys[:registered]``), so pin counts
    never increase along a chain: a prompt's cached prefix is a pinned run followed by a free
    run, and the blocks a release frees are a suffix of its chain. They join the queue tail
    first, so a prompt's tail is evicted before its head. ``private`` counts blocks held outside
    the cache (prompt blocks not yet computed, partial tails, generated tokens, and the decode
    growth reserved for the current segment).
    """

    def __init__(self, target_id: str, block_size: int, capacity: int, cpu_capacity: int, emit: Emit,
                 state_capacity: int = 0, state_interval: int = 0) -> None:
        self.id = target_id
        # A hybrid model (``state_capacity`` > 0), as the bundled engine's StateCheckpoints: an LRU
        # of recurrent-state checkpoints by block key, taken every ``state_interval`` prompt blocks
        # (0: none) and at each request's end (its last cached prompt block: the simulator keys
        # prompts only); a hit is cut back to the deepest checkpoint, and no CPU tier is used.
        self.states: OrderedDict[int, None] | None = OrderedDict() if state_capacity else None
        self.state_capacity = state_capacity
        self.state_interval = state_interval
        self.bs = block_size
        self.capacity = capacity
        self.cpu: OrderedDict[int, None] | None = OrderedDict() if cpu_capacity else None
        self.cpu_capacity = cpu_capacity
        self.cache: dict[int, int] = {}  # key -> users (> 0), or -(release stamp) when free
        self.n_free = 0  # cached blocks no running request uses
        self.segments: deque[tuple[int, list[int]]] = deque()  # (stamp, keys) oldest first
        self.seg_pos = 0  # next entry to look at in segments[0]
        self.stamp = 0
        self.private = 0
        # bumps whenever blocks are unpinned or freed, or new blocks cached (a waiting request's
        # hits may have grown): what can make a request that did not fit fit now
        self.releases = 0
        self.emit: Emit = emit

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

    def _checkpoint(self, key: int, t: float) -> None:
        """A recurrent-state checkpoint after block ``key`` (refreshed when held already)."""
        states = self.states
        if states is None:
            return
        if key in states:
            states.move_to_end(key)
            return
        if len(states) >= self.state_capacity:
            self.emit(t, OP_STATE_REMOVE, self.id, [states.popitem(False)[0]], None)
        states[key] = None
        self.emit(t, OP_STATE_STORE, self.id, [key], None)

    def _resumable(self, keys: list[int], h: int) -> int:
        """The deepest ``j <= h`` whose block ``keys[j - 1]`` holds a checkpoint (touched)."""
        states = self.states
        if states is None:
            return h
        for j in range(h, 0, -1):
            if keys[j - 1] in states:
                states.move_to_end(keys[j - 1])
                return j
        return 0

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

    def _unpin(self, keys: list[int], n: int, first: bool = False) -> None:
        """Drop one reference from ``keys[:n]``; blocks left unreferenced join the queue tail
        (with ``first``: its head)."""
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
            self._push_free(tail, first)

    def _push_free(self, keys: list[int], first: bool = False) -> None:
        """Queue unreferenced blocks, ``keys[0]`` to be evicted first: at the tail, or with
        ``first`` at the head (evicted before every other free block)."""
        self.stamp += 1
        tag = -self.stamp
        self.cache.update(zip(keys, repeat(tag)))
        if first:
            if self.seg_pos:  # the head segment's consumed entries go, so seg_pos can restart
                old_tag, seg = self.segments[0]
                self.segments[0] = (old_tag, seg[self.seg_pos :])
                self.seg_pos = 0
            self.segments.appendleft((tag, keys))
        else:
            self.segments.append((tag, keys))
        self.n_free += len(keys)

    def _release(self, req: SimRequest, t: float = 0.0) -> None:
        """Give back a request's blocks: private ones freed, cached ones unreferenced."""
        self.private -= req.own
        req.own = 0
        self.releases += 1
        if self.states is not None and req.registered:  # the end-of-turn checkpoint
            self._checkpoint(req.keys[req.registered - 1], t)
        if self.capacity:
            lease = req.lease
            self._unpin(req.keys, req.registered, lease is not None and lease.spill)

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
        self.releases += 1
        self.emit(t, OP_STORE, self.id, new, req.keys[reg - 1] if reg else None)
        if self.states is not None and self.state_interval:  # after the blocks they follow
            step = self.state_interval
            for b in range(-(-(reg + 1) // step) * step, upto + 1, step):
                self._checkpoint(req.keys[b - 1], t)

    @property
    def used_blocks(self) -> int:
        """Blocks held by requests: cached blocks some running request references (a shared one
        once) plus private ones. Unreferenced cached blocks are in the free pool, as in vLLM and
        the bundled engine (``workers/engine/block_manager.py``): evictable, so free."""
        return len(self.cache) - self.n_free + self.private

    def check_blocks(self, running: list[SimRequest]) -> None:
        """Capacity, pin counts and the free queue against the running requests; raises AssertionError."""
        used = len(self.cache) + self.private
        if self.capacity and used > self.capacity:
            raise AssertionError(f"{self.id}: {used} blocks used > capacity {self.capacity}")
        if not self.capacity:
            return
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
