"""The event loop: replays a trace on simulated workers through the gateway's own Router.

One ``Simulator`` runs one policy over one trace. It owns the cluster state that the gateway's
registry owns live (``TargetState``s), a ``mesh.core.index.PrefixIndex`` fed only by the workers' KV
events, session bindings (``mesh.core.sessions.SessionTable``), and a ``mesh.core.router.Router`` built on
the policy: every arrival is decided once (``router.decide``) and that decision committed
(``router.commit``), never decided again, as the proxy does; the first token calls
``lease.first_token()`` and completion ``lease.finish(now)``, exactly as the proxy does.

Prefill/decode pairs are served as ``mesh.gateway.disagg_relay``'s relay serves them, through the
router's pair protocol (``commit_prefill``, ``commit_decode``, ``decode_answered``): a prefill lease
on the prefill worker until its prefill ends, whose token is discarded; then a decode lease on the
decode worker, which pulls the exported blocks it lacks, computes the last block and produces the
client's first token, where the session is bound.

Time is simulated and only moves to the next event (heap ordered by time, then kind, then a
sequence number, so runs are deterministic): a request's release, a worker's segment end (see
``worker_model``), or a prefill/decode KV transfer arriving. Idle periods cost nothing.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mesh.core.index import PrefixIndex
from mesh.core.retention import RetentionPlanner
from mesh.core.router import Router
from mesh.core.sessions import SessionTable
from policies import create_policy
from policies.base import Decision, NoCandidate, RequestInfo, Role, TargetState, Tier
from simulator.block_text import BlockText
from simulator.device import Device
from simulator.profile import Profile
from simulator.session_gate import Release, SessionGate, session_groups
from simulator.sim_config import MAX_WORKERS, SimConfig, SimulationError, check_config
from simulator.traces import DONE, START, Trace
from simulator.worker_model import (
    OP_DROP_CPU,
    OP_OFFLOAD,
    OP_RELOAD,
    OP_REMOVE,
    OP_STATE_REMOVE,
    OP_STATE_STORE,
    OP_STORE,
    CapacityError,
    SimRequest,
    WorkerModel,
)

# What other modules and tests import from here (the settings live in simulator.sim_config).
__all__ = ["MAX_WORKERS", "RunResult", "SimConfig", "SimulationError", "Simulator", "apply_event", "check_capacity",
           "check_config", "simulate"]

# Event kinds, in their order at equal times: segment ends, releases, KV transfers, then the
# wake-ups of idle workers (so requests released at one instant share the first step).
_STEP, _RELEASE, _TRANSFER, _WAKE = 0, 1, 2, 3


def check_capacity(trace: Trace, profile: Profile) -> None:
    """Raise ``CapacityError`` before the run when a request cannot fit one worker's GPU KV
    even alone (its prompt and output, in simulation blocks), naming the ``--kv-blocks`` value,
    in the profile's own blocks, that fits them all. The run used to stop at the first such
    request with a count in the trace's blocks, which is not the unit ``--kv-blocks`` takes."""
    bs = trace.block_size
    capacity = profile.blocks_at(bs)
    if not capacity:
        return
    over = [(-(-(r.prompt_tokens + max(r.output_tokens, 1)) // bs), r) for r in trace.requests]
    over = [(need, r) for need, r in over if need > capacity]
    if not over:
        return
    need, worst = max(over, key=lambda x: x[0])
    fits = -(-need * bs // profile.block_size)
    raise CapacityError(
        f"{len(over):,} of {len(trace.requests):,} requests need more KV than one worker holds: the largest, "
        f"request {worst.idx} ({worst.source}: {worst.prompt_tokens:,} prompt + {worst.output_tokens:,} output "
        f"tokens), needs {need:,} KV blocks of {bs} tokens and a worker holds {capacity:,} (profile {profile.name}: "
        f"kv_blocks {profile.kv_blocks:,} of {profile.block_size} tokens); pass --kv-blocks {fits} or more"
    )


@dataclass(slots=True)
class RunResult:
    """Raw outcome of one run; ``simulator.report`` turns it into metrics."""

    policy: str
    policy_spec: Any
    workers: list[str]
    block_size: int
    arrival: np.ndarray
    first_token: np.ndarray
    finish: np.ndarray
    prompt: np.ndarray
    output: np.ndarray
    hit: np.ndarray
    cpu_hit: np.ndarray
    worker: np.ndarray  # index of the worker that prefilled it (-1 = rejected)
    preemptions: int
    rejected: int
    session_moves: int
    router_session_moves: int
    busy_s: list[float]
    steps: list[int]
    queue_t: np.ndarray
    queue_len: np.ndarray
    running: np.ndarray
    wall_s: float
    sessions_enabled: bool
    notes: list[str] = field(default_factory=list)
    pairs: int = 0  # requests served through a prefill/decode pair
    not_sent: int = 0  # requests the session gate never released (the horizon ran out)


class Simulator:
    def __init__(
        self,
        trace: Trace,
        policy_spec: Any,
        config: SimConfig,
        *,
        progress: Callable[[int], None] | None = None,
        recorder: Any | None = None,
    ) -> None:
        check_config(config)
        check_capacity(trace, config.profile)
        self.trace = trace
        self.config = config
        self.profile = config.profile
        # strict: a plugin that raises or picks no candidate is an error, not least_load's numbers under its name
        self.policy = create_policy(policy_spec, strict=True)
        self.policy_spec = policy_spec
        self.bs = trace.block_size
        self.index = PrefixIndex()
        self.text = BlockText()  # text-based policies (cache_aware) match a spelling of the block keys
        self.sessions = SessionTable(config.session_ttl_s, config.max_bound_sessions)
        self.targets: dict[str, TargetState] = {}
        self.workers: list[WorkerModel] = []
        self._add_workers()
        self.by_id = {w.id: w for w in self.workers}
        retention = RetentionPlanner(config.retention_fill, config.retention_active_s, spill_hint=config.spill_hint,
                                     idle_factor=config.retention_idle_factor)
        self.router = Router(self.policy, self.targets, index=self.index, sessions=self.sessions,
                             speculative_ttl_s=config.speculative_ttl_s, retention=retention, seed=config.seed)
        self.progress = progress
        self.recorder = recorder  # tests: sees every route call and KV event, in order
        # event loop state
        self.heap: list[tuple[float, int, int, Any, int]] = []
        self.seq = itertools.count()
        self.lag = self.profile.event_lag_ms / 1e3
        self.events: deque[tuple[float, int, str, list[int], int | None]] = deque()
        self.queued = 0
        self.preemptions = 0
        self.in_flight = 0
        self.done = 0
        self.rejected = 0
        self.pairs = 0
        self.transferred_blocks = 0
        self.pd_policy = getattr(self.policy, "pd", None) is not None  # as mesh.gateway.disagg_proxy tells
        self.session_moves = 0
        self.last_target: dict[str, str] = {}
        n = len(trace.requests)
        self.reqs: list[SimRequest | None] = [None] * n
        self.succ: list[list[tuple[int, int, float]]] = [[] for _ in range(n)]
        self.remaining = [0] * n
        self.release_at = [0.0] * n
        self.q_t: list[float] = []
        self.q_len: list[int] = []
        self.q_run: list[int] = []
        self.gate: SessionGate | None = None
        if config.concurrency or config.horizon_s is not None:
            groups = trace.groups if trace.groups is not None else session_groups(trace.requests)
            self.gate = SessionGate(trace.requests, groups, config.concurrency, config.horizon_s)

    def _add_workers(self) -> None:
        """One ``WorkerModel`` and its ``TargetState`` per worker; with prefill workers, they
        come first and the rest decode."""
        config = self.config
        per = config.workers_per_device
        devices = [Device(self.profile.shared_workers) for _ in range(-(-config.workers // per))] if per > 1 else []
        for i in range(config.workers):
            role = Role.MIXED
            if config.prefill_workers:
                role = Role.PREFILL if i < config.prefill_workers else Role.DECODE
            state = TargetState(id=f"w{i}", worker=f"w{i}", role=role, block_size=self.bs,
                                models=frozenset({config.model}))
            self.targets[state.id] = state
            if config.hybrid_checkpoints:  # as the gateway's workers[].hybrid
                self.index.mark_hybrid(state.id)
            self.workers.append(WorkerModel(i, state, self.profile, self.bs, self,
                                            devices[i // per] if devices else None))

    # ------------------------------------------------------------------ worker callbacks
    def schedule(self, worker: WorkerModel, t: float, wake: bool = False) -> None:
        heapq.heappush(self.heap, (t, _WAKE if wake else _STEP, next(self.seq), worker, worker.version))

    def emit(self, t: float, op: int, target: str, keys: list[int], parent: int | None) -> None:
        if self.lag:
            self.events.append((t + self.lag, op, target, keys, parent))
        else:
            self._apply(t, op, target, keys, parent)

    def _apply(self, t: float, op: int, target: str, keys: list[int], parent: int | None) -> None:
        """Feed one KV event to the index, as the gateway's event subscriber does."""
        if self.recorder is not None:
            self.recorder.event(t, op, target, keys, parent)
        apply_event(self.index, op, target, keys, parent)

    def _drain(self, now: float) -> None:
        events = self.events
        while events and events[0][0] <= now:
            self._apply(*events.popleft())

    def first_token(self, req: SimRequest, t: float) -> None:
        """The client's first token (for a pair: the decode worker's, as the relay streams it)."""
        if req.lease is not None:
            req.lease.first_token()
            if req.on_decode:  # the decode worker answers: the session binds to it (the relay's hand_over)
                self.router.decode_answered(req.lease, req.session, t)
            if self.recorder is not None:
                self.recorder.first_token(t, req.idx)

    def finished(self, req: SimRequest, t: float) -> None:
        if req.lease is not None:
            req.lease.finish(t)
            if self.recorder is not None:
                self.recorder.finish(t, req.idx)
        self.in_flight -= 1
        self.done += 1
        if self.progress is not None and self.done % 256 == 0:
            self.progress(self.done)
        if self.gate is not None:  # the replay client settles a turn, then fires its dependents
            self._push_releases(self.gate.ended(req.idx, t))
        for j, trig, delay in self.succ[req.idx]:
            if trig == DONE:
                self._fire(j, t + delay, t)

    def handoff(self, req: SimRequest, t: float) -> None:
        """A pair's prefill finished at ``t``: as ``mesh.gateway.disagg_relay``'s relay, the prefill answer ends
        the prefill lease, the decode worker's lease starts (the exported blocks count as its
        cached prefix), and the decode worker pulls the exported blocks it does not hold."""
        dw = self.workers[req.decode_to]
        exported = min(req.nfull, (req.n - 1) // self.bs)  # the prefill pins all but the last token's block
        missing = exported - dw.cached_prefix(req.keys, exported)
        self.transferred_blocks += missing
        if req.lease is not None:
            req.lease.finish(t)
            req.lease = self.router.commit_decode(req.info, dw.id, exported, t)
        req.info = None
        pd = self.profile.pd
        dur = (pd.transfer_base_ms + self.profile.per_block_ms_at(pd.transfer_ms_per_block, self.bs) * missing) / 1e3
        heapq.heappush(self.heap, (t + dur, _TRANSFER, next(self.seq), req, 0))

    # ------------------------------------------------------------------ releases
    def _fire(self, j: int, when: float, now: float) -> None:
        """One dependency of ``j`` fired at ``now``, asking for its release at ``when``."""
        if when > self.release_at[j]:
            self.release_at[j] = when
        self.remaining[j] -= 1
        if self.remaining[j] == 0:
            if self.gate is None:
                heapq.heappush(self.heap, (self.release_at[j], _RELEASE, next(self.seq), j, 0))
            else:
                self._push_releases(self.gate.fired(j, self.release_at[j], now))

    def _push_releases(self, releases: list[Release]) -> None:
        for j, at in releases:
            heapq.heappush(self.heap, (at, _RELEASE, next(self.seq), j, 0))

    def _arrive(self, i: int, t: float) -> None:
        tr = self.trace.requests[i]
        if self.lag:
            self._drain(t)
        keys = tr.keys.tolist()
        info = RequestInfo(model=self.config.model, block_keys=keys, block_size=self.bs,
                           prompt_tokens=tr.prompt_tokens, max_tokens=tr.output_tokens,
                           session_id=tr.session, request_id=str(i), text=self.text.text(keys))
        try:
            decision, lease, pair = self._route(info, t)
        except NoCandidate:
            self.rejected += 1
            req = SimRequest(i, tr.session, tr.prompt_tokens, tr.output_tokens, keys, t, None, -1)
            self.reqs[i] = req
            self._started(i, t)
            self.in_flight += 1
            req.finish_t = t
            self.finished(req, t)
            return
        if self.recorder is not None:
            self.recorder.route(t, info, decision)
        w = self.by_id[decision.target]  # type: ignore[index]
        req = SimRequest(i, tr.session, tr.prompt_tokens, tr.output_tokens, keys, t, lease, w.index)
        served_by = w.id
        if pair:
            req.decode_to = self.by_id[decision.decode_target].index  # type: ignore[index]
            req.info = info
            served_by = decision.decode_target  # type: ignore[assignment]
            self.pairs += 1
        self.reqs[i] = req
        self.in_flight += 1
        if tr.session is not None:  # the turn's worker: the one that answers it
            last = self.last_target.get(tr.session)
            if last is not None and last != served_by:
                self.session_moves += 1
            self.last_target[tr.session] = served_by
        self._started(i, t)
        if self.config.sample_every and i % self.config.sample_every == 0:
            self.q_t.append(t)
            self.q_len.append(self.queued)
            self.q_run.append(self.in_flight)
        w.enqueue(req, t)

    def _started(self, i: int, t: float) -> None:
        for j, trig, delay in self.succ[i]:
            if trig == START:
                self._fire(j, t + delay, t)

    def _route(self, info: RequestInfo, t: float) -> tuple[Decision, Any, bool]:
        """(decision, lease, through a pair), as the gateway routes: the policy decides once
        (``router.decide``); a pair goes to the relay (``mesh.gateway.disagg_proxy``), which commits a
        prefill lease without the session; anything else takes the proxy's path, which commits
        that same decision (never decides again), a pair reaching it served whole by its decode
        worker (``Decision.served_whole``). Raises ``NoCandidate``."""
        decision = self.router.decide(info, t, explain=False)
        if (self.pd_policy and decision.decode_target is not None
                and decision.decode_target in self.by_id and decision.decode_target != decision.target):
            return decision, self.router.commit_prefill(info, decision.target, t), True
        decision = decision.served_whole()
        return decision, self.router.commit(info, decision, t), False

    def _transfer(self, req: SimRequest, t: float) -> None:
        """The pulled blocks arrived: the decode worker admits the request, imports them and
        computes the last block, whose token is the client's first."""
        req.on_decode = True  # req.worker stays the prefill worker (hits and load are its)
        req.importing = True
        req.g = 0
        req.target = req.n
        req.computed = 0
        self.workers[req.decode_to].enqueue(req, t)

    # ------------------------------------------------------------------ run
    def run(self) -> RunResult:
        started = time.perf_counter()
        heap = self.heap
        for tr in self.trace.requests:
            if tr.deps:
                self.remaining[tr.idx] = len(tr.deps)
                for p, trig, delay in tr.deps:
                    self.succ[p].append((tr.idx, trig, delay))
            elif self.gate is None:
                heap.append((tr.arrival or 0.0, _RELEASE, next(self.seq), tr.idx, 0))
        heapq.heapify(heap)
        if self.gate is not None:
            self._push_releases(self.gate.open())
        pop = heapq.heappop
        arrive, transfer = self._arrive, self._transfer
        while heap:
            t, kind, _, obj, ver = pop(heap)
            if kind == _RELEASE:
                arrive(obj, t)
            elif kind != _TRANSFER:
                if ver == obj.version:
                    obj.complete(t)
            else:
                transfer(obj, t)
        if self.lag:
            self._drain(float("inf"))
        wall = time.perf_counter() - started
        if self.progress is not None:
            self.progress(self.done)
        gate = self.gate
        unfinished = [i for i, r in enumerate(self.reqs)
                      if (r is None or r.finish_t < 0) and (gate is None or gate.released(i))]
        if unfinished:
            raise SimulationError(f"{len(unfinished)} requests never finished (dependency cycle in the trace?)")
        return self._result(wall)

    def _result(self, wall: float) -> RunResult:
        sent = [r for r in self.reqs if r is not None]  # with a gate: the requests it released
        reqs: list[SimRequest] = sent

        def arr(attr: str, dtype: Any = np.float64) -> np.ndarray:
            return np.fromiter((getattr(r, attr) for r in reqs), dtype=dtype, count=len(reqs))

        notes = []
        if self.sessions is None:
            notes.append("mesh.core.sessions not available: routed with sessions=None")
        if self.config.prefill_workers and not self.pairs:
            why = "it has no prefill/decode profiles" if not self.pd_policy else "it chose no pair"
            notes.append(f"--prefill-workers {self.config.prefill_workers} but no request went through a "
                         f"prefill/decode pair ({why}): the run is a mixed cluster's, roles ignored")
        return RunResult(
            policy=getattr(self.policy, "name", str(self.policy_spec)),
            policy_spec=self.policy_spec,
            workers=[w.id for w in self.workers],
            block_size=self.bs,
            arrival=arr("arrival"),
            first_token=arr("first_t"),
            finish=arr("finish_t"),
            prompt=arr("n", np.int64),
            output=arr("out", np.int64),
            hit=np.maximum(arr("hit_tokens", np.int64), 0),
            cpu_hit=arr("cpu_tokens", np.int64),
            worker=arr("worker", np.int64),
            preemptions=self.preemptions,
            rejected=self.rejected,
            pairs=self.pairs,
            session_moves=self.session_moves,
            router_session_moves=self.router.session_moves,
            busy_s=[w.busy_s for w in self.workers],
            steps=[w.steps for w in self.workers],
            queue_t=np.asarray(self.q_t),
            queue_len=np.asarray(self.q_len),
            running=np.asarray(self.q_run),
            wall_s=wall,
            sessions_enabled=self.sessions is not None,
            notes=notes,
            not_sent=len(self.reqs) - len(sent),
        )


def simulate(trace: Trace, policy_spec: Any, config: SimConfig, **kw: Any) -> RunResult:
    return Simulator(trace, policy_spec, config, **kw).run()


def apply_event(index: PrefixIndex, op: int, target: str, keys: list[int], parent: int | None) -> None:
    """One simulated KV event into ``index``, as the gateway's event subscriber applies it."""
    if op == OP_STORE:
        index.store(target, keys, parent=parent)
    elif op == OP_REMOVE:
        index.remove(target, keys, Tier.GPU)
    elif op == OP_OFFLOAD:
        # every key still has its node (it was on the GPU until now): store the CPU tier
        # first, then drop the GPU tier, so the nodes never vanish in between
        index.store(target, keys, Tier.CPU)
        index.remove(target, keys, Tier.GPU)
    elif op == OP_RELOAD:
        index.store(target, keys, parent=parent)
        index.remove(target, keys, Tier.CPU)
    elif op == OP_DROP_CPU:
        index.remove(target, keys, Tier.CPU)
    elif op == OP_STATE_STORE:
        index.store_states(target, keys)
    elif op == OP_STATE_REMOVE:
        index.remove_states(target, keys)


