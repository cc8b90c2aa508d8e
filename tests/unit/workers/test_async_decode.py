"""Async decode and the graph input staging, on CPU: the CUDA graph path with its capture and
replay stood in for by eager runs of the same model over the same static buffers.

What runs for real: ``ModelRunner._capture_graphs``' buffers, ``_launch`` (staging, table rows
re-sent only when they change, the device-side id gather from the previous step's tokens),
``Scheduler.schedule_ahead`` and ``LLMEngine``'s step-ahead loop. What is stood in for: CUDA
events (no-ops: the CPU runs in order) and the graph itself (an eager forward reading the static
inputs). The GPU test ``tests/gpu/test_engine_gpu.py::test_async_decode_equals_sync_decode``
checks the real graphs."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading

import pytest
import torch

from tests.support.cuda_graphs import emulate_graphs
from workers.config import EngineConfig, get_preset
from workers.engine.block_manager import MEDIUM_GPU, AllBlocksCleared, BlockManager, BlockRemoved, BlockStored
from workers.engine.llm_engine import AsyncLLMEngine, LLMEngine, RequestOutput
from workers.engine.scheduler import Scheduler
from workers.engine.sequence import SamplingParams, Sequence, SequenceStatus
from workers.model.decoder import build_model

TINY = get_preset("tiny")


def _make_engine(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch, mode: str,
                 num_kv_blocks: int) -> LLMEngine:
    """mode: "eager" (no graphs), "sync" (graph path, one step at a time), "async"."""
    cfg = EngineConfig(device="cpu", attention_backend="torch", num_kv_blocks=num_kv_blocks, max_num_seqs=16,
                       max_graph_batch_size=16, max_num_batched_tokens=128, max_model_len=512, cpu_threads=1)
    engine = LLMEngine(TINY, cfg, eos_token_id=257, model=model)
    if mode != "eager":
        emulate_graphs(engine.runner, monkeypatch)
        engine.async_decode = mode == "async"
    return engine


def _workload() -> tuple[list[list[int]], list[int], list[int]]:
    """12 prompts (5-49 tokens), their arrival steps and max_tokens."""
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(5, 50))] for _ in range(12)]
    arrivals = sorted(rng.randrange(0, 25) for _ in prompts)
    max_tokens = [rng.randrange(1, 28) for _ in prompts]
    return prompts, arrivals, max_tokens


Workload = tuple[list[list[int]], list[int], list[int]]  # prompts, arrival steps, max_tokens


def _admit(engine: LLMEngine, pending: list[int], step: int, workload: Workload, stops: dict[int, int],
           out: dict[str, list[int]]) -> None:
    """Add every pending request whose arrival step has come (greedy, its stop token if any)."""
    prompts, arrivals, max_tokens = workload
    while pending and arrivals[pending[0]] <= step:
        i = pending.pop(0)
        stop = (stops[i],) if i in stops else ()
        engine.add_request(f"r{i}", prompts[i], SamplingParams(
            temperature=0.0, max_tokens=max_tokens[i], ignore_eos=True, stop_token_ids=stop))
        out[f"r{i}"] = []


def _run(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch, mode: str, stops: dict[int, int],
         num_kv_blocks: int, workload: Workload | None = None) -> tuple[dict[str, list[int]], LLMEngine]:
    """mode: "eager" (no graphs), "sync" (graph path, one step at a time), "async"."""
    engine = _make_engine(model, monkeypatch, mode, num_kv_blocks)
    prompts, arrivals, max_tokens = workload or _workload()
    out: dict[str, list[int]] = {}
    pending, step = list(range(len(prompts))), 0
    while pending or engine.has_unfinished():
        _admit(engine, pending, step, (prompts, arrivals, max_tokens), stops, out)
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        engine.block_manager.check(engine.scheduler.all_seqs())
        step += 1
    assert engine.block_manager.num_used_blocks == 0
    return out, engine


@pytest.mark.parametrize("num_kv_blocks", [200, 14])  # roomy; short (preemptions, refused look-ahead)
def test_async_and_graph_paths_equal_eager(monkeypatch: pytest.MonkeyPatch, num_kv_blocks: int) -> None:
    model = build_model(TINY, torch.device("cpu"), seed=0)
    eager, _ = _run(model, monkeypatch, "eager", {}, num_kv_blocks)
    # Stop tokens taken from the middle of outputs: finishes that depend on the token in flight.
    stops = {i: toks[len(toks) // 2] for i, toks in enumerate(eager.values()) if len(toks) >= 6 and i % 2 == 0}
    assert stops
    eager, eager_engine = _run(model, monkeypatch, "eager", stops, num_kv_blocks)
    sync, _ = _run(model, monkeypatch, "sync", stops, num_kv_blocks)
    ahead, engine = _run(model, monkeypatch, "async", stops, num_kv_blocks)
    assert sync == eager
    assert ahead == eager
    assert engine.num_steps_ahead > 0 and engine.runner.num_graph_replays > engine.num_steps_ahead
    if num_kv_blocks == 14:
        assert eager_engine.stats()["preemptions"] > 0


# ---- abort while a step is in flight ------------------------------------------------------------


class _EventLog:
    """A stand-in KV event publisher that replays what it is sent into the set of cached block
    hashes (GPU tier) a subscriber would hold, refusing inconsistent events on the spot."""

    def __init__(self) -> None:
        self.cached: set[int] = set()
        self.num_published = self.num_dropped = 0

    def publish(self, events: list[object]) -> None:
        self.num_published += len(events)
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                self.cached.clear()
            elif getattr(ev, "medium", MEDIUM_GPU) != MEDIUM_GPU:
                continue
            elif isinstance(ev, BlockStored):
                again = self.cached.intersection(ev.block_hashes)
                assert not again, f"BlockStored of blocks already stored: {again}"
                self.cached.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                unknown = set(ev.block_hashes) - self.cached
                assert not unknown, f"BlockRemoved of blocks never stored: {unknown}"
                self.cached.difference_update(ev.block_hashes)

    def close(self) -> None: ...


def _check_engine(engine: LLMEngine) -> None:
    """Every block's ref count equals the references of the live sequences (none leaked or
    freed twice), and the prefix cache is internally consistent."""
    engine.block_manager.check(engine.scheduler.all_seqs())


def _abort_plan(ref: dict[str, list[int]], prompts: list[list[int]], stops: dict[int, int]) -> dict[str, int]:
    """request id -> abort after this many delivered tokens, from a run without aborts:
    - a request that ends on its stop token: abort while that token is being computed;
    - a request whose in-flight step writes the first slot of a block the look-ahead just took;
    - requests in the middle of their decode, and right after their first token;
    - a request that has already finished (abort must be a no-op)."""
    plan: dict[str, int] = {}
    boundaries = 0
    for i, rid in enumerate(ref):
        toks, p = ref[rid], len(prompts[i])
        cross = next((n for n in range(2, len(toks) - 1) if (p + n - 1) % 16 == 0), 0)
        if i == 0:
            plan[rid] = len(toks)  # finished: abort_request returns False
        elif i in stops and len(toks) >= 3 and toks[-1] == stops[i]:
            plan[rid] = len(toks) - 1
        elif cross and boundaries < 2:
            plan[rid], boundaries = cross, boundaries + 1
        elif i % 2 and len(toks) >= 4:
            plan[rid] = len(toks) // 2
        elif len(toks) >= 2:
            plan[rid] = 1
    return plan


def _run_aborting(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch, mode: str, stops: dict[int, int],
                  num_kv_blocks: int, plan: dict[str, int], abort_preempted: int = 0,
                  workload: Workload | None = None) -> tuple[
                      dict[str, list[int]], dict[str, int], LLMEngine, list[int]]:
    """``_run`` with aborts: each request in ``plan`` right after it was delivered that many tokens,
    and the first ``abort_preempted`` requests seen preempted after generating tokens. Returns the
    delivered tokens, the number delivered at each abort, the engine, and for each abort that hit
    a request whose next step was in flight (enqueued on the "device"), the position it computes."""
    engine = _make_engine(model, monkeypatch, mode, num_kv_blocks)
    log = engine.publisher = _EventLog()
    prompts, arrivals, max_tokens = workload or _workload()
    out: dict[str, list[int]] = {}
    aborted_at: dict[str, int] = {}
    final: dict[str, list[RequestOutput]] = {}  # outputs after the abort: only the abort itself
    in_flight: list[int] = []
    bs = engine.config.block_size

    def abort(rid: str) -> None:
        seq = engine.requests.get(rid)
        cur = engine._inflight
        if seq is not None and cur is not None and any(s is seq for s in cur.seqs):
            in_flight.append(len(seq.token_ids) - 1)
            # The enqueued step computes the last token: the table covers it, nothing beyond.
            assert len(seq.block_table) == -(-len(seq.token_ids) // bs)
        done = rid not in engine.requests
        assert engine.abort_request(rid) is not done
        if not done:
            aborted_at[rid], final[rid] = len(out[rid]), []
        _check_engine(engine)

    pending, step = list(range(len(prompts))), 0
    while pending or engine.has_unfinished():
        _admit(engine, pending, step, (prompts, arrivals, max_tokens), stops, out)
        preemptions = engine.scheduler.stats.preemptions
        outputs = engine.step()
        _check_engine(engine)
        for o in outputs:
            if o.request_id in final:
                final[o.request_id].append(o)
            else:
                out[o.request_id] += o.new_token_ids
        for rid, n in plan.items():
            if rid not in aborted_at and rid in out and len(out[rid]) == n and any(
                    o.request_id == rid for o in outputs):
                abort(rid)
        if abort_preempted and engine.scheduler.stats.preemptions > preemptions:
            victims = [s for s in engine.scheduler.waiting if s.admissions and s.num_completion_tokens]
            for s in victims[:abort_preempted]:
                assert not s.block_table  # preempted: its blocks are already back
                abort(s.request_id)
                abort_preempted -= 1
        step += 1
    for rid, outs in final.items():  # exactly one: the abort, and no token after it
        assert [(o.new_token_ids, o.finished, o.finish_reason) for o in outs] == [([], True, "abort")], rid
    bm = engine.block_manager
    assert bm.num_used_blocks == 0 and not engine.requests and engine._inflight is None
    assert not bm.events, "events left unpublished"
    assert log.cached == bm.cached_keys()  # the subscriber's view is the block manager's
    return out, aborted_at, engine, in_flight


def _check_aborted_run(ref: dict[str, list[int]], out: dict[str, list[int]], aborted_at: dict[str, int]) -> None:
    """The others' greedy outputs equal the run without aborts; an aborted request got exactly
    its tokens up to the abort, and nothing after."""
    assert aborted_at
    for rid, toks in ref.items():
        if rid in aborted_at:
            assert out[rid] == toks[: aborted_at[rid]], rid
            assert aborted_at[rid] < len(toks), rid
        else:
            assert out[rid] == toks, rid


def test_abort_with_step_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """Aborts between steps: with the request's next step enqueued, with it writing into a
    block the look-ahead just took, with its stop token in flight, after its first token, and
    after it finished; the sync graph path (no look-ahead) runs the same plan."""
    model = build_model(TINY, torch.device("cpu"), seed=0)
    first, _ = _run(model, monkeypatch, "eager", {}, 200)
    stops = {i: toks[len(toks) // 2] for i, toks in enumerate(first.values()) if len(toks) >= 6 and i % 2 == 0}
    ref, _ = _run(model, monkeypatch, "sync", stops, 200)
    plan = _abort_plan(ref, _workload()[0], stops)
    assert {"r0"} < set(plan) and len(set(plan.values())) > 2
    assert any(n == len(ref[rid]) - 1 and ref[rid][-1] == stops.get(int(rid[1:])) for rid, n in plan.items())
    for mode in ("sync", "async"):
        out, aborted_at, engine, in_flight = _run_aborting(model, monkeypatch, mode, stops, 200, plan)
        _check_aborted_run(ref, out, aborted_at)
        assert "r0" not in aborted_at  # finished before its abort: nothing to abort
        if mode == "async":
            assert engine.num_steps_ahead > 0
            assert len(in_flight) >= 3, "too few aborts hit a request whose next step was in flight"
            assert any(p % 16 == 0 for p in in_flight), "no abort while its step wrote a look-ahead block"


def test_abort_preempted_and_in_flight_under_pressure(monkeypatch: pytest.MonkeyPatch) -> None:
    """8 blocks for 4 requests that grow to 5 blocks each: decodes preempt one another, the
    look-ahead is refused, and preempted requests (and one mid-decode) are aborted."""
    rng = random.Random(5)
    workload = ([[rng.randrange(256) for _ in range(20)] for _ in range(4)], [0, 0, 0, 1], [60, 60, 60, 60])
    model = build_model(TINY, torch.device("cpu"), seed=0)
    ref, ref_engine = _run(model, monkeypatch, "sync", {}, 8, workload)
    assert ref_engine.stats()["preemptions"] > 0
    plan = {"r0": 40}  # the first admitted: never a preemption victim
    for mode in ("sync", "async"):
        out, aborted_at, engine, in_flight = _run_aborting(
            model, monkeypatch, mode, {}, 8, plan, abort_preempted=2, workload=workload)
        _check_aborted_run(ref, out, aborted_at)
        assert engine.stats()["preemptions"] > 0
        assert "r0" in aborted_at and len(aborted_at) == 3, "two requests must be aborted while preempted"
        if mode == "async":
            assert engine.num_steps_ahead > 0 and in_flight


async def test_client_disconnect_aborts_with_step_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """AsyncLLMEngine: a client that stops reading mid-stream (closes its iterator) aborts its
    request while its next step is enqueued; the others finish with the synchronous outputs,
    the engine hands nothing for it to deliver after the abort, and every block comes back."""
    model = build_model(TINY, torch.device("cpu"), seed=0)
    rng = random.Random(7)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(5, 40))] for _ in range(5)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (20, 40, 120, 25, 30)]
    ref = _make_engine(model, monkeypatch, "sync", 200).generate(prompts, params)
    victim, n_read = "c2", 5

    engine = _make_engine(model, monkeypatch, "async", 200)
    log = engine.publisher = _EventLog()
    aeng = AsyncLLMEngine(engine)
    trace: list[tuple[str, str, object]] = []  # engine thread: ("out"|"abort", request id, what)
    abort_sent = threading.Event()
    deliver, send, abort_request = aeng._deliver, aeng._send, engine.abort_request

    def traced_deliver(rid: str, item: object) -> None:
        trace.append(("out", rid, item))
        deliver(rid, item)
        got = sum(len(i.new_token_ids) for k, r, i in trace if k == "out" and r == victim)  # type: ignore[attr-defined]
        if rid == victim and got == n_read:  # hold the engine until the client has gone
            assert abort_sent.wait(60), "the client never closed its stream"

    def traced_abort(rid: str) -> bool:
        cur = engine._inflight
        ok = abort_request(rid)
        trace.append(("abort", rid, (ok, cur is not None and any(s.request_id == rid for s in cur.seqs))))
        return ok

    def traced_send(cmd: tuple[object, ...]) -> None:
        send(cmd)
        if cmd[0] == "abort" and cmd[1] == victim:
            abort_sent.set()

    aeng._deliver, aeng._send = traced_deliver, traced_send  # type: ignore[method-assign]
    engine.abort_request = traced_abort  # type: ignore[method-assign]

    async def client(i: int) -> list[int]:
        rid, toks = f"c{i}", []
        async with contextlib.aclosing(aeng.generate(rid, prompts[i], params[i])) as stream:
            async for o in stream:
                toks += o.new_token_ids
                if rid == victim and len(toks) >= n_read:
                    break  # the client went away
        return toks

    aeng.start()
    try:
        got = await asyncio.wait_for(asyncio.gather(*(client(i) for i in range(len(prompts)))), 120)
        for _ in range(6000):  # the engine thread books the abort and its last steps
            if victim not in engine.requests and not engine.has_unfinished():
                break
            await asyncio.sleep(0.01)
    finally:
        aeng.shutdown()
    assert aeng.error is None
    assert got[2] == ref[2][:n_read]
    assert [g for i, g in enumerate(got) if i != 2] == [r for i, r in enumerate(ref) if i != 2]
    aborts = [(r, what) for k, r, what in trace if k == "abort"]
    assert aborts == [(victim, (True, True))]  # aborted once, its next step in flight
    after = trace[next(j for j, (k, r, _) in enumerate(trace) if k == "abort"):]
    late = [item for k, r, item in after if k == "out" and r == victim]
    assert [(o.new_token_ids, o.finish_reason) for o in late] == [([], "abort")]  # type: ignore[attr-defined]
    bm = engine.block_manager
    assert not engine.has_unfinished() and bm.num_used_blocks == 0 and not engine.requests
    bm.check([])
    assert log.cached == bm.cached_keys()


def test_look_ahead_takes_blocks_without_content_first() -> None:
    """``schedule_ahead`` allocates before the in-flight token is known, so a row that token
    finishes (EOS, stop) wastes its look-ahead block. The free pool keeps blocks without content
    ahead of cached ones, so the waste costs a cached prefix (a BlockRemoved) only when no empty
    free block is left: the block the synchronous path takes one step later, had the row not finished."""
    bm = BlockManager(4, 4)
    sched = Scheduler(EngineConfig(device="cpu", block_size=4), bm)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    cached = Sequence("a", list(range(8)), params, 4, 1)  # 2 blocks, computed, committed, freed
    bm.allocate(cached)
    cached.num_computed_tokens = 8
    bm.commit(cached)
    seq = Sequence("b", list(range(100, 104)), params, 4, 1)  # 1 block, full: the next token needs a block
    bm.allocate(seq)
    bm.free_seq(cached)  # its blocks stay cached, at the back of the free pool
    seq.num_computed_tokens, seq.status = 3, SequenceStatus.RUNNING
    sched.running.append(seq)
    bm.drain_events()
    assert len(bm.cached) == 2 and bm.num_free_blocks == 3
    assert sched.schedule_ahead([seq], 512) == [seq]  # the last token (position 3) is in flight
    assert len(seq.block_table) == 2 and not bm.drain_events() and len(bm.cached) == 2
    bm.check([seq])
    # The in-flight token finishes it: both its blocks go back empty, ahead of the cached ones.
    sched.finish(seq, "stop")
    assert list(bm.free) == [2, 3, 1, 0] and not bm.drain_events()
    # With only cached blocks free, the look-ahead evicts one: the tail of the chain, announced.
    other = Sequence("c", list(range(200, 208)), params, 4, 1)
    bm.allocate(other)
    other.num_computed_tokens, other.status = 7, SequenceStatus.RUNNING
    sched.running.append(other)
    assert sched.schedule_ahead([other], 512) == [other]
    assert other.block_table == [2, 3, 1]
    assert bm.drain_events() == [BlockRemoved([cached.keys_upto(2)[1]])] and len(bm.cached) == 1
    bm.check([other])
