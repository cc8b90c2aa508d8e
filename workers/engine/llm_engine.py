"""The engine loop: ``LLMEngine`` (synchronous: add_request / abort_request / step) and
``AsyncLLMEngine`` (the step loop in a background thread, one asyncio queue per request).

Async decode (CUDA graphs): ``step`` enqueues the next decode step before it waits for and
books the one in flight, so the host's scheduling and bookkeeping overlap the device's work;
outputs still come one step per call, in the same order.

Threading: everything under ``LLMEngine`` (scheduler, block manager, model runner) belongs to one
thread. ``AsyncLLMEngine`` owns that thread; the event loop talks to it only through a command
queue (add, abort) and receives outputs through ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

from mesh.core.keys import namespace_seed
from workers.config import EngineConfig, ModelConfig
from workers.engine.block_manager import BlockManager
from workers.engine.model_runner import DecodeLaunch, ModelRunner
from workers.engine.scheduler import ScheduledBatch, Scheduler
from workers.engine.sequence import SamplingParams, Sequence, SequenceStatus
from workers.model.decoder import CausalLM
from workers.offload.kv_offload import CpuKVCache

log = logging.getLogger(__name__)


class RequestOutput(NamedTuple):  # immutable, and cheap to build for every sequence every step
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    num_output_tokens: int


class LLMEngine:
    def __init__(
        self,
        model_config: ModelConfig,
        config: EngineConfig,
        *,
        eos_token_id: int | None = None,
        model: CausalLM | None = None,
        async_decode: bool | None = None,
    ) -> None:
        self.model_config = model_config
        self.config = config
        self.runner = ModelRunner(model_config, config, model)
        self.max_model_len = min(
            config.max_model_len or model_config.max_position_embeddings, model_config.max_position_embeddings
        )
        self.eos_token_id = model_config.eos_token_id if model_config.eos_token_id is not None else eos_token_id
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
                                          num_cpu_blocks=config.cpu_offload_blocks)
        self.cpu_cache = (  # the CPU offload tier's pages (the block manager keeps their bookkeeping)
            CpuKVCache(self.runner.kv_cache, config.cpu_offload_blocks) if config.cpu_offload_blocks else None)
        if model_config.is_hybrid:
            self.block_manager.enable_states(config.max_num_seqs, config.num_state_checkpoints,
                                             config.checkpoint_interval_tokens, config.state_checkpoint_prompt_end)
        self.scheduler = Scheduler(config, self.block_manager)
        # Async decode: while a graph decode step runs on the device, the next one is scheduled
        # and enqueued, and the finished one is booked (the host's ~0.3-1 ms per step overlaps
        # the device's). Default: on with CUDA graphs, off with the CPU offload tier (whose page
        # copies assume the synchronous order).
        has_graphs = bool(self.runner.graphs)
        self.async_decode = (has_graphs and self.cpu_cache is None) if async_decode is None else (
            async_decode and has_graphs)
        self._inflight: DecodeLaunch | None = None
        self.num_steps_ahead = 0  # decode steps enqueued before the previous step's tokens were read
        self.model_name = config.served_model_name or model_config.name
        self._seeds: dict[str | None, int] = {None: namespace_seed(self.model_name)}
        self.requests: dict[str, Sequence] = {}
        self._aborted: list[Sequence] = []  # reported by the next step
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.num_evict_first = 0  # requests added with the retention hint
        # The last step scheduled nothing: requests wait for blocks held outside the scheduler.
        self.stalled = False
        self.publisher: Any = None
        if config.kv_events_endpoint:
            from workers.server.kv_events import KVEventPublisher  # needs pyzmq + msgspec

            self.publisher = KVEventPublisher(
                config.kv_events_endpoint, config.kv_events_replay_endpoint, topic=config.kv_events_topic,
                bind_host=config.kv_events_bind_host,
                buffer_steps=config.kv_events_buffer_steps, max_queue_size=config.kv_events_queue_size,
            )

    # ---- requests -------------------------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        return self.runner.num_blocks * self.config.block_size

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError with a client-facing message if the request can never be served."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad!r} is out of vocabulary (0 <= id < {vocab})")
        params.validate()
        total = n + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {total} tokens ({n} in the prompt, {params.max_tokens} in the completion)."
            )
        if total > self.capacity_tokens:
            raise ValueError(
                f"the request needs {total} tokens of KV cache ({n} prompt + {params.max_tokens} "
                f"max_tokens), over this worker's capacity of {self.capacity_tokens} tokens"
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        *,
        evict_first: bool = False,
    ) -> None:
        """Queue a request. ``evict_first``: once it ends, its cached blocks are evicted before any
        other's (the router's retention hint for a session that does not fit this worker)."""
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        self.validate(prompt_token_ids, params)
        seq = Sequence(request_id, prompt_token_ids, params, self.config.block_size, self._seed(cache_salt),
                       cache_salt, evict_first=evict_first)
        self.num_evict_first += evict_first
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def _seed(self, cache_salt: str | None) -> int:
        """The key namespace of a request: (served model, salt), as the router computes it."""
        seed = self._seeds.get(cache_salt)
        if seed is None:
            if len(self._seeds) > 4096:
                self._seeds = {None: self._seeds[None]}
            seed = self._seeds[cache_salt] = namespace_seed(self.model_name, None, cache_salt)
        return seed

    def abort_request(self, request_id: str) -> bool:
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq, "abort")
        self._aborted.append(seq)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted) or self._inflight is not None

    # ---- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step's outputs. Under async decode a call finishes the step in flight and leaves
        the next one (scheduled ahead) running on the device while the caller handles these."""
        outputs = [self._output(s, []) for s in self._aborted]
        self._aborted = []
        self.stalled = False
        if self._inflight is not None:
            outputs += self._finish_inflight()
            self._publish()
            return outputs
        batch = self.scheduler.schedule()
        states = self.block_manager.states
        if states is not None:  # where this step's forward pass snapshots the recurrent state
            for seq, n in batch.items():
                plan = states.plan(seq, seq.num_computed_tokens, n)
                if plan:
                    batch.snapshots[seq.seq_id] = plan
        self.run_swaps()  # saves read pages before this step overwrites them; restores land before it reads
        if batch:
            if self.async_decode and self.runner.graph_size_for(len(batch.decodes)) is not None and not batch.prefills:
                self._inflight = self.runner.launch_decode(batch.decodes)
                outputs += self._finish_inflight()
            else:
                outputs += self._advance(batch, self.runner.run(batch))
        elif self.scheduler.waiting and not self.scheduler.running:
            self.stalled = self.block_manager.num_used_blocks > 0
            if not self.stalled:
                # Every block free and still no fit: cannot happen after validate(); never spin on it.
                seq = self.scheduler.waiting[0]
                log.error("request %s fits in no free block set; aborting it", seq.request_id)
                self.abort_request(seq.request_id)
            # else: blocks held outside the scheduler (transfer pins) come back when unpinned;
            # the request waits for them (the async loop sleeps until a command arrives).
        self._publish()
        return outputs

    def _advance(self, batch: ScheduledBatch, sampled: dict[int, int]) -> list[RequestOutput]:
        """Book one computed step: counts, commits, sampled tokens, finishes; its outputs."""
        outputs = []
        advanced = self.scheduler.postprocess(batch, sampled, self.eos_token_id, self.max_model_len)
        self.num_generated_tokens += len(advanced)
        for seq in advanced:  # positional and inline: this runs per sequence per step
            finished = seq.status is SequenceStatus.FINISHED
            outputs.append(RequestOutput(
                seq.request_id, [seq.token_ids[-1]], finished, seq.finish_reason, seq.num_prompt_tokens,
                seq.num_cached_tokens, len(seq.token_ids) - seq.num_prompt_tokens,
            ))
            if finished:
                self.requests.pop(seq.request_id, None)
        self.num_steps += 1
        return outputs

    def _finish_inflight(self) -> list[RequestOutput]:
        """Async decode: enqueue the next decode step when it can be scheduled ahead (its input
        tokens are the in-flight step's, still on the device), then wait for the in-flight step
        and book it. The host work of both overlaps the device's. A sequence finished meanwhile
        (abort, or EOS/stop in the token just read) is skipped: its row of the next step is
        wasted work on blocks it no longer reads."""
        cur, nxt = self._inflight, None
        if cur is None:
            return []
        ahead = self.scheduler.schedule_ahead(cur.seqs, self.max_model_len)
        if ahead is not None and self.runner.graph_size_for(len(ahead)) is not None:
            nxt = self.runner.launch_decode(ahead, cur)
            self.num_steps_ahead += 1
        tokens = self.runner.collect(cur)
        running = SequenceStatus.RUNNING
        live = [(s, t) for s, t in zip(cur.seqs, tokens, strict=True) if s.status is running]
        outputs = self._advance(ScheduledBatch(decodes=[s for s, _ in live]), {s.seq_id: t for s, t in live})
        if nxt is not None and not any(s.status is running for s in nxt.seqs):
            nxt = None  # every row finished: nothing to collect (the device finishes it unobserved)
        self._inflight = nxt
        return outputs

    def run_swaps(self, sync: bool = False) -> int:
        """Run the page copies the block manager queued (CPU offload); call before anything
        writes or reads the GPU pages after an allocation. ``sync``: wait until they are done."""
        states = self.block_manager.states
        if states is not None:
            self.runner.copy_states(states.take_copies())
        swaps = self.block_manager.take_swaps()
        if swaps and self.cpu_cache is not None:
            self.cpu_cache.run(swaps)
        if sync and self.cpu_cache is not None:
            self.cpu_cache.synchronize()
        return len(swaps)

    def _publish(self) -> None:
        events = self.block_manager.drain_events()
        if events and self.publisher is not None:
            self.publisher.publish(events)

    @staticmethod
    def _output(seq: Sequence, new: list[int]) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            num_output_tokens=seq.num_completion_tokens,
        )

    def reset_prefix_cache(self) -> bool:
        ok = self.block_manager.reset_prefix_cache()
        self._publish()
        return ok

    # ---- helpers ----------------------------------------------------------------------------

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[int]]:
        """Run ``prompts`` to completion (tests, benchmarks); returns each one's output tokens."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist, strict=True):
            self.add_request(rid, prompt, p)
        out: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished():
            for o in self.step():
                out[o.request_id] += o.new_token_ids
        return [out[rid] for rid in ids]

    def stats(self) -> dict[str, float]:
        st, bm = self.scheduler.stats, self.block_manager
        pub = self.publisher
        return {
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "kv_blocks_total": bm.num_blocks,
            "kv_blocks_used": bm.num_used_blocks,
            "kv_blocks_cached": len(bm.cached),
            "kv_cache_usage": bm.usage,
            "prompt_tokens": st.prompt_tokens,
            "prompt_cached_tokens": st.prompt_hit_tokens,
            "prefix_cache_queries": st.prefix_query_tokens,
            "prefix_cache_hits": st.prefix_hit_tokens,
            "prefill_computed_tokens": st.prefill_computed_tokens,
            "decode_computed_tokens": st.decode_computed_tokens,
            "generation_tokens": self.num_generated_tokens,
            "preemptions": st.preemptions,
            "blocks_evicted": bm.num_evicted,
            "blocks_revived": bm.num_revived,
            "evict_first_requests": self.num_evict_first,
            **self._offload_stats(),
            **self._state_stats(),
            "steps": self.num_steps,
            "kv_events_published": pub.num_published if pub else 0,
            "kv_events_dropped": pub.num_dropped if pub else 0,
        }

    def _offload_stats(self) -> dict[str, float]:
        bm, cpu = self.block_manager, self.block_manager.cpu
        return {
            "cpu_kv_blocks_total": cpu.num_blocks if cpu else 0,
            "cpu_kv_blocks_cached": len(cpu) if cpu else 0,
            "cpu_prefix_cache_hits": bm.num_restored * self.config.block_size,  # tokens, every admission
            "cpu_blocks_restored": bm.num_restored,
            "cpu_blocks_saved": bm.num_saved,
            "cpu_blocks_evicted": cpu.num_evicted if cpu else 0,
        }

    def _state_stats(self) -> dict[str, float]:
        """Hybrid models' recurrent-state checkpoints (zeros for other models)."""
        bm, st = self.block_manager, self.block_manager.states
        return {
            "state_checkpoints_total": st.num_checkpoints if st else 0,
            "state_checkpoints_cached": len(st) if st else 0,
            "state_checkpoints_saved": st.num_saved if st else 0,
            "state_checkpoints_end_of_turn": st.num_promoted if st else 0,
            "state_checkpoints_restored": st.num_restored if st else 0,
            "state_checkpoints_evicted": st.num_evicted if st else 0,
            "prefix_unresumable_tokens": bm.num_unresumable_tokens,  # attention hits without a checkpoint
        }

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None


class EngineDeadError(RuntimeError):
    """The engine loop died; no request can be served (HTTP 503)."""


class RequestRejected(ValueError):
    """The engine refused a request when it arrived (HTTP 400)."""


class AsyncLLMEngine:
    """Runs ``LLMEngine.step`` in a background thread; ``generate`` streams one request."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        self._wake = threading.Event()
        self._stop = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self.engine.close()

    @property
    def alive(self) -> bool:
        return self.error is None and self._thread.is_alive()

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, cache_salt: str | None = None,
        *, evict_first: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request until it finishes. Closing the iterator early (a client that
        went away) aborts the request and frees its blocks. Validate before calling."""
        if self.error is not None:
            raise EngineDeadError(f"engine loop died: {self.error!r}")
        q: asyncio.Queue[Any] = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        self._send(("add", request_id, prompt_token_ids, params, cache_salt, evict_first))
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._send(("abort", request_id))

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    async def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (refused while blocks are in use); runs on the engine thread."""
        if not self.alive:
            raise EngineDeadError(f"engine loop died: {self.error!r}")
        done: concurrent.futures.Future[bool] = concurrent.futures.Future()
        self._send(("reset", done))
        return await asyncio.wrap_future(done)

    def _send(self, cmd: tuple[Any, ...]) -> None:
        self._inbox.put(cmd)
        self._wake.set()

    # ---- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop:
                self._drain_inbox()
                if not self.engine.has_unfinished():
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                for out in self.engine.step():
                    self._deliver(out.request_id, out)
                if self.engine.stalled:  # nothing can run until a command (an unpin) arrives
                    self._wake.wait(0.05)
                    self._wake.clear()
        except BaseException as exc:  # the loop must not die silently
            log.exception("engine loop failed")
            self.error = exc
            self.fail_all(f"engine loop died: {exc!r}")

    def fail_all(self, reason: str) -> None:
        """End every request's stream with ``EngineDeadError(reason)`` (the loop died, or a
        shutdown's drain timed out); their consumers' exits abort them in the engine."""
        for rid in list(self._streams):
            self._deliver(rid, EngineDeadError(reason))

    def _drain_inbox(self) -> None:
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, rid, ids, params, salt, evict_first = cmd
                try:
                    self.engine.add_request(rid, ids, params, salt, evict_first=evict_first)
                except ValueError as exc:
                    self._deliver(rid, RequestRejected(str(exc)))
            elif cmd[0] == "abort":
                self.engine.abort_request(cmd[1])
            elif cmd[0] == "reset":
                cmd[1].set_result(self.engine.reset_prefix_cache())

    def _deliver(self, request_id: str, item: Any) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return  # the client is gone
        loop, q = stream
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # the loop closed
            pass
