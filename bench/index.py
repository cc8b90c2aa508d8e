"""The prefix index against Dynamo's ``RadixTree`` (``ai-dynamo-runtime``) on one event stream.

Workload (agentic): 8 system prompts of 256 blocks (4k tokens); sessions extend their prompt by
32-192 blocks a turn; a pool of long sessions grows to 2,100-2,600 blocks (33-42k tokens), the
others to 300-900 blocks; each session lives on one worker, which stores the system prompt the
first time it needs it. 20% of the events are removals: the least recently used session of a
random worker loses up to 128 blocks from its tail. Block size 16. Engine hashes are opaque ids
(an xxh3 of the router key with an engine seed), so the index must map them to its own keys. They
are the same on every worker (vLLM with a fixed PYTHONHASHSEED): Dynamo's RadixTree requires it
(with per-worker hashes its stores fail with "Failed to find parent block"); Mesh's index keeps a
map per worker and handles both (tests/unit/core/test_index.py, tests/unit/events/test_subscriber.py).

Both indices get the same events:
- Mesh: ``PrefixIndex.apply_stored/apply_removed`` with the event's token ids; the timed apply
  includes computing the router keys (xxh3 per block) from the tokens.
- Dynamo: ``RadixTree.apply_event`` with the event already serialized to its JSON and the local
  block hashes already computed (``compute_block_hash_for_seq``): its timed apply excludes both.

Dynamo is also fed from the token ids (``dynamo from tokens``: local hashes, its JSON, apply), the
way Mesh is fed; and Mesh is also fed pre-hashed (``mesh pre-hashed``: ``apply_stored(keys=...)``
with the events' router keys computed beforehand), the way Dynamo's main column is: the index's own
work against the tree's. Every apply is timed in a fresh process pinned to one core (``--cpu``),
``--repeats`` times per variant in alternating order; medians and ranges are reported (why pinned:
see ``VARIANTS``; Dynamo unpinned on two cores is reported too). Match: ``PrefixIndex.match(keys)`` vs ``RadixTree.find_matches(local hashes)`` on requests of 512
and 2,048 blocks taken from indexed sessions; every query's overlaps must be identical (asserted).
Memory per indexed block: tracemalloc for Mesh (a fresh index replaying the stream), RSS growth
of a fresh subprocess for Dynamo. Decision: tokens (a Python list) -> keys -> ``kv_aware`` on a
live cluster view (the request path: ``explain=False``, as ``Router.route``), for 8k and 32k-token
prompts; Dynamo's column is its lookup alone (tokens ->
``compute_block_hash_for_seq`` -> ``find_matches``), no policy.

    python bench/index.py [--sizes 16 64 256 1024] [--events 5000] [--repeats 5] [--cpu N | --no-pin]
                          [--json bench/results/index.json]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import argparse
import gc
import json
import os
import pickle
import platform
import random
import statistics
import subprocess
import tempfile
import time
import tracemalloc
from array import array
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from mesh.core.index import PrefixIndex
from mesh.core.keys import block_keys as chain_keys
from mesh.core.keys import namespace_seed
from policies.base import ClusterView, RequestInfo, TargetState, Tier
from policies.kv_aware import KvAware

BS = 16
SYSTEMS = 8
SYSTEM_BLOCKS = 256
LONG_POOL = 16
REMOVAL_SHARE = 0.2
SEED = namespace_seed("bench-model")
VOCAB = 150_000


@dataclass
class Session:
    sid: int
    worker: int
    system: int
    max_blocks: int
    tokens: list[int]
    keys: list[int]
    local: list[int]
    cached: int = 0  # leading blocks currently cached on its worker
    stamp: int = 0
    long: bool = False


@dataclass
class Stream:
    workers: int
    ours: list[tuple[Any, ...]] = field(default_factory=list)  # ("S", w, hashes, parent, tokens) | ("R", w, hashes)
    dynamo: list[tuple[int, bytes]] = field(default_factory=list)
    blocks: int = 0  # blocks carried by all events
    sessions: list[Session] = field(default_factory=list)
    entries: int = 0  # (worker, block) pairs cached at the end
    unique: int = 0  # distinct blocks cached at the end


class Generator:
    def __init__(self, workers: int, seed: int) -> None:
        self.w = workers
        self.rng = random.Random(seed)
        self.np = np.random.default_rng(seed)
        self.engine_seed = self.rng.getrandbits(63)
        self.systems = []
        for _ in range(SYSTEMS):
            toks = self.np.integers(0, VOCAB, SYSTEM_BLOCKS * BS).tolist()
            self.systems.append((toks, chain_keys(toks, BS, SEED), _local(toks)))
        self.has_system: list[set[int]] = [set() for _ in range(workers)]
        self.by_worker: list[list[Session]] = [[] for _ in range(workers)]
        self.active_short: list[Session] = []
        self.active_long: list[Session] = []
        self.stream = Stream(workers)
        self.clock = 0
        self.n_sessions = 0

    def eh(self, w: int, key: int) -> int:
        return xxhash.xxh3_64_intdigest(key.to_bytes(8, "little"), self.engine_seed)

    def new_session(self, long: bool) -> Session:
        system = self.rng.randrange(SYSTEMS)
        toks, keys, local = self.systems[system]
        cap = self.rng.randint(2100, 2600) if long else self.rng.randint(300, 900)
        s = Session(self.n_sessions, self.rng.randrange(self.w), system, cap, list(toks), list(keys), list(local),
                    long=long)
        self.n_sessions += 1
        self.by_worker[s.worker].append(s)
        self.stream.sessions.append(s)
        return s

    def store_turn(self, s: Session) -> None:
        w = s.worker
        if s.cached == 0 and s.system not in self.has_system[w]:
            toks, keys, local = self.systems[s.system]
            self._emit_store(w, keys, None, toks, local)
            self.has_system[w].add(s.system)
        if s.cached == 0:
            s.cached = SYSTEM_BLOCKS
        n_new = min(self.rng.randint(32, 192), s.max_blocks - len(s.keys))
        if n_new > 0:
            new = self.np.integers(0, VOCAB, n_new * BS).tolist()
            s.keys += chain_keys(new, BS, s.keys[-1])
            s.local += _local(new)
            s.tokens += new
        if s.cached < len(s.keys):
            lo, hi = s.cached, len(s.keys)
            self._emit_store(w, s.keys[lo:hi], s.keys[lo - 1], s.tokens[lo * BS : hi * BS], s.local[lo:hi])
            s.cached = hi
        self.clock += 1
        s.stamp = self.clock

    def remove_chunk(self) -> bool:
        w = self.rng.randrange(self.w)
        victims = [s for s in self.by_worker[w] if s.cached > SYSTEM_BLOCKS]
        if not victims:
            return False
        s = min(victims, key=lambda x: x.stamp)
        chunk = min(128, s.cached - SYSTEM_BLOCKS)
        gone = s.keys[s.cached - chunk : s.cached][::-1]  # leaf first, as an engine frees them
        hashes = [self.eh(w, k) for k in gone]
        self.stream.ours.append(("R", w, hashes))
        ev = {"event_id": len(self.stream.dynamo), "data": {"removed": {"block_hashes": hashes}}}
        self.stream.dynamo.append((w, json.dumps(ev).encode()))
        self.stream.blocks += chunk
        s.cached -= chunk
        return True

    def _emit_store(self, w: int, keys: list[int], parent_key: int | None, tokens: list[int], local: list[int]) -> None:
        hashes = [self.eh(w, k) for k in keys]
        parent = None if parent_key is None else self.eh(w, parent_key)
        self.stream.ours.append(("S", w, hashes, parent, tokens, keys))
        blocks = [{"block_hash": h, "tokens_hash": lh} for h, lh in zip(hashes, local)]
        ev = {"event_id": len(self.stream.dynamo), "data": {"stored": {"parent_hash": parent, "blocks": blocks}}}
        self.stream.dynamo.append((w, json.dumps(ev).encode()))
        self.stream.blocks += len(keys)

    def step(self) -> None:
        if self.rng.random() < REMOVAL_SHARE and self.remove_chunk():
            return
        while len(self.active_long) < LONG_POOL:
            self.active_long.append(self.new_session(long=True))
        while len(self.active_short) < max(32, self.w):
            self.active_short.append(self.new_session(long=False))
        pool = self.active_long if self.rng.random() < 0.4 else self.active_short
        s = self.rng.choice(pool)
        self.store_turn(s)
        if len(s.keys) >= s.max_blocks:
            pool.remove(s)

    def finish(self) -> Stream:
        unique: set[int] = set()
        entries = 0
        for w in range(self.w):
            held: set[int] = set()
            for sys_id in self.has_system[w]:
                held.update(self.systems[sys_id][1])
            for s in self.by_worker[w]:
                if s.cached:
                    held.update(s.keys[: s.cached])
            entries += len(held)
            unique |= held
        self.stream.entries, self.stream.unique = entries, len(unique)
        return self.stream


def _local(tokens: list[int]) -> list[int]:
    from dynamo._core import compute_block_hash_for_seq

    return list(compute_block_hash_for_seq(tokens, BS))


def apply_ours(index: PrefixIndex, stream: Stream, tids: list[str]) -> float:
    stored = index.apply_stored
    removed = index.apply_removed
    gpu = Tier.GPU
    gc.collect()
    t0 = time.perf_counter()
    for ev in stream.ours:
        if ev[0] == "S":
            stored(tids[ev[1]], ev[2], ev[3], ev[4], BS, SEED, gpu)
        else:
            removed(tids[ev[1]], ev[2], gpu)
    return time.perf_counter() - t0


def apply_ours_prehashed(index: PrefixIndex, stream: Stream, tids: list[str]) -> float:
    """Mesh given each event's router keys (``apply_stored(keys=...)``): the index's own work,
    as Dynamo's pre-hashed apply is its tree's (plus its JSON parse)."""
    stored = index.apply_stored
    removed = index.apply_removed
    gpu = Tier.GPU
    gc.collect()
    t0 = time.perf_counter()
    for ev in stream.ours:
        if ev[0] == "S":
            stored(tids[ev[1]], ev[2], ev[3], ev[4], BS, SEED, gpu, keys=ev[5])
        else:
            removed(tids[ev[1]], ev[2], gpu)
    return time.perf_counter() - t0


def apply_dynamo(tree: Any, stream: Stream) -> float:
    apply = tree.apply_event
    gc.collect()
    t0 = time.perf_counter()
    for w, payload in stream.dynamo:
        apply(w, payload)
    return time.perf_counter() - t0


def apply_dynamo_from_tokens(tree: Any, stream: Stream) -> float:
    """Dynamo fed like Mesh is: from the event's token ids (local hashes + its JSON + apply)."""
    from dynamo._core import compute_block_hash_for_seq

    apply, dumps = tree.apply_event, json.dumps
    gc.collect()
    t0 = time.perf_counter()
    for i, ev in enumerate(stream.ours):
        if ev[0] == "S":
            local = compute_block_hash_for_seq(ev[4], BS)
            blocks = [{"block_hash": h, "tokens_hash": lh} for h, lh in zip(ev[2], local)]
            data = {"stored": {"parent_hash": ev[3], "blocks": blocks}}
        else:
            data = {"removed": {"block_hashes": ev[2]}}
        apply(ev[1], dumps({"event_id": i, "data": data}).encode())
    return time.perf_counter() - t0


# ---------------------------------------------------------------- apply, measured in fresh processes
# Dynamo's RadixTree runs its tree on a background thread and every ``apply_event`` waits for it:
# with the caller and that thread on two cores each event pays a cross-core wake-up (~100 us), on
# one core a direct switch. Its apply is ~1M blocks/s in the first case and ~3.7M in the second,
# and which one a run gets depended on the scheduler (the "bimodal" runs of earlier rounds: the fast
# runs were those where other jobs kept the second core busy). So each apply is timed in a fresh
# process pinned to one core (the same core for both sides; Mesh is single-threaded): Dynamo's
# figure is then its tree's own speed, with no thread hand-off. Dynamo on two cores (unpinned) is
# measured too, as context. Repetitions alternate the sides; the table reports medians and ranges.

ALL_CPUS = os.sched_getaffinity(0)  # before main() pins this process
VARIANTS = {  # name -> (side, pinned)
    "mesh_tokens": ("mesh", True), "mesh_prehashed": ("mesh_pre", True),
    "dynamo_prehashed": ("dynamo", True), "dynamo_tokens": ("dynamo_tok", True),
    "dynamo_prehashed_2cores": ("dynamo", False),
}


def dump_stream(stream: Stream, path: str) -> None:
    """The events in a compact form for the child processes: token ids as one uint32 buffer."""
    flat = array("I")
    ours = []
    for ev in stream.ours:
        if ev[0] == "S":
            ours.append(("S", ev[1], ev[2], ev[3], len(flat), len(ev[4]), ev[5]))
            flat.extend(ev[4])
        else:
            ours.append(ev)
    with open(path, "wb") as f:
        pickle.dump({"workers": stream.workers, "blocks": stream.blocks, "entries": stream.entries, "ours": ours, "tokens": flat.tobytes(),
                     "dynamo": stream.dynamo}, f, protocol=pickle.HIGHEST_PROTOCOL)


def load_stream(path: str, side: str) -> Stream:
    with open(path, "rb") as f:
        d = pickle.load(f)
    st = Stream(d["workers"], dynamo=d["dynamo"], blocks=d["blocks"], entries=d["entries"])
    if side == "mesh_pre":
        # given the keys, apply_stored reads the token ids' length only: the stream's token ids (14M
        # ints at 1,024 workers) are not kept resident, as Dynamo's pre-hashed side keeps none
        filler: dict[int, list[int]] = {}
        st.ours = [("S", e[1], e[2], e[3], filler.setdefault(e[5], [0] * e[5]), e[6]) if e[0] == "S" else e
                   for e in d["ours"]]
    elif side != "dynamo":
        flat = array("I")
        flat.frombytes(d["tokens"])
        st.ours = [("S", e[1], e[2], e[3], flat[e[4] : e[4] + e[5]].tolist(), e[6]) if e[0] == "S" else e
                   for e in d["ours"]]
    return st


def child_apply(side: str, path: str, cpus: set[int]) -> None:
    """One timed apply in this (fresh) process on ``cpus``; prints the seconds it took."""
    os.sched_setaffinity(0, cpus)
    stream = load_stream(path, side)
    tids = [f"w{w}" for w in range(stream.workers)]
    gc.collect()
    gc.freeze()  # the loaded stream's objects: no collection walks them, on either side
    if side in ("mesh", "mesh_pre"):
        index = PrefixIndex()
        secs = (apply_ours if side == "mesh" else apply_ours_prehashed)(index, stream, tids)
        if index.stats()["engine_hashes"] != stream.entries:
            raise SystemExit(f"the index lost (worker, block) entries: {index.stats()['engine_hashes']} != {stream.entries}")
    else:
        from dynamo._core import RadixTree

        secs = (apply_dynamo if side == "dynamo" else apply_dynamo_from_tokens)(RadixTree(), stream)
    print(json.dumps({"seconds": secs}))


def measure_apply(stream: Stream, repeats: int, cpu: int | None, progress: Progress, task: Any) -> dict[str, list[float]]:
    """Blocks/s of every variant, ``repeats`` fresh processes each, the variants alternating."""
    fd, path = tempfile.mkstemp(suffix=".pkl")
    os.close(fd)
    out: dict[str, list[float]] = {v: [] for v in VARIANTS}
    try:
        dump_stream(stream, path)
        for rep in range(repeats):
            names = list(VARIANTS) if rep % 2 == 0 else list(reversed(VARIANTS))
            for name in names:
                progress.update(task, description=f"{stream.workers} workers: apply {name} {rep + 1}/{repeats}")
                side, pinned = VARIANTS[name]
                arg = str(cpu) if pinned and cpu is not None else ",".join(map(str, sorted(ALL_CPUS)))
                res = subprocess.run([sys.executable, __file__, "--child-apply", side, path, arg],
                                     capture_output=True, text=True, timeout=600, env={**os.environ, "RUST_LOG": "error"})
                if res.returncode != 0:
                    raise RuntimeError(f"apply {name} failed: {res.stderr[-2000:]}")
                secs = json.loads(res.stdout.strip().splitlines()[-1])["seconds"]
                out[name].append(stream.blocks / secs)
    finally:
        os.unlink(path)
    return out


def spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def keys_only(stream: Stream) -> float:
    gc.collect()
    t0 = time.perf_counter()
    for ev in stream.ours:
        if ev[0] == "S":
            chain_keys(ev[4], BS, SEED)
    return time.perf_counter() - t0


def pct(xs: list[float], q: int) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1]


def queries(stream: Stream, blocks: int, n: int, rng: random.Random) -> list[Session]:
    pool = [s for s in stream.sessions if len(s.keys) >= blocks]
    return [rng.choice(pool) for _ in range(n)] if pool else []


CHUNK = 20  # queries per side in a row: each side's caches are its own, noise hits both alike


def match_latency(index: PrefixIndex, tree: Any, picks: list[Session], blocks: int) -> dict[str, Any]:
    ours_t: list[float] = []
    dyn_t: list[float] = []
    matched, targets = [], []
    clock = time.perf_counter_ns
    for lo in range(0, len(picks), CHUNK):  # alternate the sides by chunks (interleaving per query let
        chunk = picks[lo : lo + CHUNK]      # Dynamo's thread and Mesh evict each other's caches)
        got = []
        for s in chunk:
            keys = s.keys[:blocks]
            t0 = clock()
            got.append(index.match(keys))
            ours_t.append((clock() - t0) / 1e3)
        dyns = []
        for s in chunk:
            local = s.local[:blocks]
            t0 = clock()
            dyns.append(tree.find_matches(local))
            dyn_t.append((clock() - t0) / 1e3)
        for mine_ov, dyn in zip(got, dyns):
            mine = {t: ov.blocks for t, ov in mine_ov.items()}
            theirs = {f"w{wid}": score for (wid, _rank), score in dyn.scores.items() if score}
            if mine != theirs:  # the correctness cross-check against the peer
                diff = {t: (mine.get(t), theirs.get(t)) for t in set(mine) | set(theirs) if mine.get(t) != theirs.get(t)}
                raise AssertionError(f"overlaps differ from Dynamo's on a {blocks}-block query: {dict(list(diff.items())[:5])}")
            matched.append(max(mine.values(), default=0))
            targets.append(len(mine))
    return {
        "queries": len(picks),
        "ours_p50_us": pct(ours_t, 50), "ours_p99_us": pct(ours_t, 99),
        "dynamo_p50_us": pct(dyn_t, 50), "dynamo_p99_us": pct(dyn_t, 99),
        "mean_deepest_match_blocks": statistics.fmean(matched), "mean_targets_matched": statistics.fmean(targets),
    }


def decision_latency(index: PrefixIndex, tree: Any, stream: Stream, tokens_n: int, reps: int,
                     rng: random.Random) -> dict[str, Any]:
    from dynamo._core import compute_block_hash_for_seq

    pool = [s for s in stream.sessions if len(s.tokens) >= tokens_n]
    if not pool:
        return {}
    targets = [TargetState(f"w{w}", f"w{w}", in_flight=rng.randrange(4), prefill_tokens=rng.randrange(4096),
                           decode_tokens=rng.randrange(65536)) for w in range(stream.workers)]
    policy = KvAware()
    ours, dyn, parts = [], [], []
    clock = time.perf_counter_ns
    prompts = []
    for _ in range(reps):
        s = rng.choice(pool)
        prompts.append(s.tokens[:tokens_n] + [7] * 11)  # a partial last block, as a real prompt has
    for lo in range(0, reps, CHUNK):  # the sides alternate by chunks, as in match_latency
        chunk = prompts[lo : lo + CHUNK]
        for prompt in chunk:
            tokens = list(prompt)  # fresh from a tokenizer: its ints in cache (the copy touches each)
            t0 = clock()
            keys = chain_keys(tokens, BS, SEED)
            tk = clock()
            req = RequestInfo(model="bench-model", block_keys=keys, block_size=BS, prompt_tokens=len(tokens))
            view = ClusterView(targets=targets, now=0.0, index=index, explain=False)  # the request path
            view.overlaps(req)
            tm = clock()
            d = policy.decide(req, view)
            t1 = clock()
            assert d.target is not None  # noqa: S101
            ours.append((t1 - t0) / 1e3)
            parts.append(((tk - t0) / 1e3, (tm - tk) / 1e3, (t1 - tm) / 1e3))
        for prompt in chunk:
            tokens = list(prompt)
            t1 = clock()
            tree.find_matches(list(compute_block_hash_for_seq(tokens, BS)))
            dyn.append((clock() - t1) / 1e3)
    return {"tokens": tokens_n, "ours_p50_us": pct(ours, 50), "ours_p99_us": pct(ours, 99),
            "keys_p50_us": pct([p[0] for p in parts], 50), "match_p50_us": pct([p[1] for p in parts], 50),
            "policy_p50_us": pct([p[2] for p in parts], 50),
            "dynamo_lookup_p50_us": pct(dyn, 50), "dynamo_lookup_p99_us": pct(dyn, 99)}


def memory_ours(stream: Stream, tids: list[str]) -> int:
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    index = PrefixIndex()
    apply_ours(index, stream, tids)
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    del index
    return used


_DYNAMO_RSS = r"""
import gc, pickle, sys
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
from dynamo._core import RadixTree
events = pickle.load(open(sys.argv[1], "rb"))
gc.collect(); gc.disable()
before = rss()
tree = RadixTree()
for w, payload in events:
    tree.apply_event(w, payload)
print(rss() - before)
"""


def memory_dynamo(stream: Stream) -> int | None:
    with tempfile.NamedTemporaryFile(suffix=".pkl", delete=False) as f:
        pickle.dump(stream.dynamo, f)
        path = f.name
    try:
        out = subprocess.run([sys.executable, "-c", _DYNAMO_RSS, path], capture_output=True, text=True, timeout=300,
                             env={**os.environ, "RUST_LOG": "error"})
        return int(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None
    finally:
        os.unlink(path)


def run_size(workers: int, events: int, n_queries: int, reps: int, repeats: int, cpu: int | None,
             progress: Progress, task: Any) -> dict[str, Any]:
    from dynamo._core import RadixTree

    gen = Generator(workers, seed=workers)
    for i in range(events):
        gen.step()
        if i % 500 == 0:
            progress.update(task, description=f"{workers} workers: generating {i}/{events}")
    stream = gen.finish()
    tids = [f"w{w}" for w in range(workers)]
    rates = measure_apply(stream, repeats, cpu, progress, task)
    progress.update(task, description=f"{workers} workers: building both indices for the queries")
    index = PrefixIndex()
    apply_ours(index, stream, tids)
    tree = RadixTree()
    apply_dynamo(tree, stream)
    keys_s = statistics.median(keys_only(stream) for _ in range(3))
    rng = random.Random(workers)
    progress.update(task, description=f"{workers} workers: matching (cross-checked)")
    gc.collect()
    gc.freeze()  # the stream's millions of objects: keep collections (for both sides) off them
    med = {name: statistics.median(xs) for name, xs in rates.items()}
    row: dict[str, Any] = {
        "workers": workers, "events": len(stream.ours), "removal_events": sum(e[0] == "R" for e in stream.ours),
        "event_blocks": stream.blocks, "indexed_entries": stream.entries, "indexed_unique_blocks": stream.unique,
        "apply_blocks_per_s": {name: spread(xs) for name, xs in rates.items()},
        "apply_runs_blocks_per_s": rates,
        "ours_apply_blocks_per_s": med["mesh_tokens"], "ours_prehashed_apply_blocks_per_s": med["mesh_prehashed"],
        "dynamo_apply_blocks_per_s": med["dynamo_prehashed"], "dynamo_from_tokens_blocks_per_s": med["dynamo_tokens"],
        "dynamo_2cores_apply_blocks_per_s": med["dynamo_prehashed_2cores"],
        "ratio_prehashed": med["mesh_prehashed"] / med["dynamo_prehashed"],
        "ratio_from_tokens": med["mesh_tokens"] / med["dynamo_tokens"],
        "ratio_prehashed_vs_dynamo_2cores": med["mesh_prehashed"] / med["dynamo_prehashed_2cores"],
        "ours_key_hashing_share": keys_s / (stream.blocks / med["mesh_tokens"]),
    }
    assert index.stats()["engine_hashes"] == stream.entries, "the index lost (worker, block) entries"  # noqa: S101
    for blocks in (512, 2048):
        picks = queries(stream, blocks, n_queries, rng)
        if picks:
            row[f"match_{blocks}"] = match_latency(index, tree, picks, blocks)
    progress.update(task, description=f"{workers} workers: decisions")
    for toks in (8192, 32768):
        row[f"decision_{toks}"] = decision_latency(index, tree, stream, toks, reps, rng)
    gc.unfreeze()
    progress.update(task, description=f"{workers} workers: memory")
    mem = memory_ours(stream, tids)
    dmem = memory_dynamo(stream)
    row["ours_bytes"] = mem
    row["dynamo_rss_bytes"] = dmem
    row["ours_bytes_per_entry"] = mem / stream.entries
    row["ours_bytes_per_unique_block"] = mem / stream.unique
    row["dynamo_bytes_per_entry"] = None if dmem is None else dmem / stream.entries
    row["dynamo_bytes_per_unique_block"] = None if dmem is None else dmem / stream.unique
    return row


def _rate(sp: dict[str, float]) -> str:
    return f"{sp['median'] / 1e6:.2f}M [{sp['min'] / 1e6:.2f}-{sp['max'] / 1e6:.2f}]"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}x"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 256, 1024])
    ap.add_argument("--events", type=int, default=5000)
    ap.add_argument("--queries", type=int, default=300)
    ap.add_argument("--decisions", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5,
                    help="apply runs per variant, each in a fresh process (median and range reported)")
    ap.add_argument("--cpu", type=int, default=max(os.sched_getaffinity(0)),
                    help="the one core that every timed apply (and this process) is pinned to")
    ap.add_argument("--no-pin", action="store_true", help="pin nothing (Dynamo's apply then depends on the scheduler)")
    ap.add_argument("--json", default="bench/results/index.json")
    ap.add_argument("--child-apply", nargs=3, metavar=("SIDE", "PATH", "CPU"), help=argparse.SUPPRESS)
    return ap.parse_args()


def apply_table(rows: list[dict[str, Any]], repeats: int, cpu: int | None) -> Table:
    t = Table(title=f"Event apply, blocks/s (median \\[min-max] of {repeats} fresh processes"
                    f"{'' if cpu is None else f', pinned to core {cpu}'}) and memory: Mesh PrefixIndex vs Dynamo RadixTree")
    for col in ("workers", "event blocks", "mesh pre-hashed", "dynamo pre-hashed", "ratio",
                "mesh from tokens", "dynamo from tokens", "ratio", "dynamo 2 cores", "mesh pre / that",
                "hashing share", "B/entry mesh", "B/entry dynamo"):
        t.add_column(col, justify="right")
    for r in rows:
        a = r["apply_blocks_per_s"]
        t.add_row(
            str(r["workers"]), f"{r['event_blocks']:,}",
            _rate(a["mesh_prehashed"]), _rate(a["dynamo_prehashed"]), f"{r['ratio_prehashed']:.2f}x",
            _rate(a["mesh_tokens"]), _rate(a["dynamo_tokens"]), f"{r['ratio_from_tokens']:.2f}x",
            _rate(a["dynamo_prehashed_2cores"]), f"{r['ratio_prehashed_vs_dynamo_2cores']:.2f}x",
            f"{r['ours_key_hashing_share']:.0%}",
            f"{r['ours_bytes_per_entry']:.0f}",
            "-" if r["dynamo_bytes_per_entry"] is None else f"{r['dynamo_bytes_per_entry']:.0f}",
        )
    return t


def latency_table(rows: list[dict[str, Any]]) -> Table:
    t = Table(title="Match latency (us, p50/p99; overlaps cross-checked on every query) and full decision")
    for col in ("workers", "targets hit", "512: mesh", "dynamo", "speed-up", "2048: mesh", "dynamo", "speed-up",
                "decide 8k: mesh", "dyn lookup", "decide 32k: mesh", "dyn lookup"):
        t.add_column(col, justify="right")
    for r in rows:
        m5, m2 = r.get("match_512", {}), r.get("match_2048", {})
        d8, d32 = r.get("decision_8192", {}), r.get("decision_32768", {})
        t.add_row(
            str(r["workers"]), f"{(m2 or m5).get('mean_targets_matched', 0):.0f}",
            f"{m5.get('ours_p50_us', 0):.0f}/{m5.get('ours_p99_us', 0):.0f}",
            f"{m5.get('dynamo_p50_us', 0):.0f}/{m5.get('dynamo_p99_us', 0):.0f}",
            ratio(m5.get("dynamo_p50_us"), m5.get("ours_p50_us")),
            f"{m2.get('ours_p50_us', 0):.0f}/{m2.get('ours_p99_us', 0):.0f}",
            f"{m2.get('dynamo_p50_us', 0):.0f}/{m2.get('dynamo_p99_us', 0):.0f}",
            ratio(m2.get("dynamo_p50_us"), m2.get("ours_p50_us")),
            f"{d8.get('ours_p50_us', 0):.0f}/{d8.get('ours_p99_us', 0):.0f}",
            f"{d8.get('dynamo_lookup_p50_us', 0):.0f}",
            f"{d32.get('ours_p50_us', 0):.0f}/{d32.get('ours_p99_us', 0):.0f}",
            f"{d32.get('dynamo_lookup_p50_us', 0):.0f}",
        )
    return t


def run_meta(args: argparse.Namespace, cpu: int | None, started: float, load_at_start: list[float]) -> dict[str, Any]:
    return {
        "python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
        "block_size": BS, "system_prompts": SYSTEMS, "system_blocks": SYSTEM_BLOCKS, "removal_share": REMOVAL_SHARE,
        "events_per_size": args.events, "wall_s": round(time.time() - started, 1),
        "load_average_at_start": load_at_start, "load_average_at_end": list(os.getloadavg()),
        "pinned_cpu": cpu, "apply_repeats": args.repeats,
        "note": "apply: each variant timed in --repeats fresh processes (alternating order), pinned to one core "
                "unless pinned_cpu is null (dynamo_prehashed_2cores is never pinned); the *_blocks_per_s fields "
                "are medians; latencies: Mesh and Dynamo alternate by chunks of 20 queries in the (pinned) main "
                "process",
        "dynamo": _dynamo_version(),
    }


def main() -> None:
    args = parse_args()
    os.environ.setdefault("RUST_LOG", "error")
    if args.child_apply:
        side, path, cpu_arg = args.child_apply
        child_apply(side, path, {int(c) for c in cpu_arg.split(",")})
        return
    cpu = None if args.no_pin else args.cpu
    if cpu is not None:  # match and decision latencies too: Dynamo's find_matches also crosses to its thread
        os.sched_setaffinity(0, {cpu})
    console = Console(width=200)
    rows = []
    started = time.time()
    load_at_start = list(os.getloadavg())
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("index", total=len(args.sizes))
        for w in args.sizes:
            rows.append(run_size(w, args.events, args.queries, args.decisions, args.repeats, cpu, progress, task))
            progress.advance(task)
    console.print(apply_table(rows, args.repeats, cpu))
    console.print(latency_table(rows))
    console.print("decide = tokens (a Python list) -> keys -> kv_aware over every worker; its parts (keys, match, "
                  "policy) are in the JSON. dyn lookup = tokens -> compute_block_hash_for_seq -> find_matches.")
    meta = run_meta(args, cpu, started, load_at_start)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    console.print(f"wrote {path} ({meta['wall_s']} s)")


def _dynamo_version() -> str:
    from importlib.metadata import version

    return f"ai-dynamo-runtime {version('ai-dynamo-runtime')}"


if __name__ == "__main__":
    main()
