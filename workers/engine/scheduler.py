"""Continuous batching with chunked prefill under a per-step token budget.

One step schedules, in order:
1. running sequences with one token left to compute (decodes), then running sequences in the
   middle of a chunked prefill; a sequence that cannot get a block for its next tokens preempts
   the most recently admitted running sequence (its blocks are freed and it is re-queued at the
   front of the waiting queue; it recomputes later, from whatever of its prefix is still cached);
2. waiting sequences, first come first served, while the budget, ``max_num_seqs`` and the free
   blocks allow. A prefix hit sets ``num_computed_tokens``, so only the uncached suffix is
   scheduled.

A sequence gets at most ``prefill_chunk`` new tokens per step. Requests that never fit at all
are refused by ``LLMEngine.validate`` before they get here, so a waiting request always fits
once enough running ones finish: the queue never deadlocks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from workers.config import EngineConfig
from workers.engine.block_manager import BlockManager
from workers.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """This step's work: (sequence, new tokens) pairs, prefill chunks first, then decodes."""

    prefills: list[tuple[Sequence, int]] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)
    # hybrid models: seq_id -> (tokens into its step, state slot) snapshots this step writes
    snapshots: dict[int, list[tuple[int, int]]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.prefills) + len(self.decodes)

    def items(self) -> list[tuple[Sequence, int]]:
        return self.prefills + [(s, 1) for s in self.decodes]

    def __bool__(self) -> bool:
        return bool(self.prefills or self.decodes)


@dataclass
class SchedulerStats:
    prompt_tokens: int = 0  # prompt tokens of admitted requests (first admission)
    prefix_query_tokens: int = 0  # tokens looked up in the prefix cache (every admission)
    prefix_hit_tokens: int = 0  # of which found cached
    prompt_hit_tokens: int = 0  # prefix hits at first admission (the sum of usage.cached_tokens)
    prefill_computed_tokens: int = 0  # prompt positions run through the model
    decode_computed_tokens: int = 0  # other positions (decodes, and recomputed output)
    preemptions: int = 0


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self.stats = SchedulerStats()

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- scheduling ---------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        budget, preempted = self._schedule_running(batch, budget)
        if not preempted:
            self._schedule_waiting(batch, budget)
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> tuple[int, bool]:
        preemptions_before = self.stats.preemptions
        scheduled: set[int] = set()
        chunk, bs = self.config.prefill_chunk, self.block_manager.block_size
        # Decodes first (one token each), then unfinished prefills; each in admission order.
        # (This loop runs for every sequence every step: it stays free of needless calls.)
        decodes = [s for s in self.running if len(s.token_ids) - s.num_computed_tokens == 1]
        order = decodes if len(decodes) == len(self.running) else decodes + [
            s for s in self.running if len(s.token_ids) - s.num_computed_tokens > 1]
        for seq in order:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(len(seq.token_ids) - seq.num_computed_tokens, chunk, budget)
            end = seq.num_computed_tokens + n
            if end > len(seq.block_table) * bs and not self._reserve(seq, end, scheduled):
                continue
            if n == 1 and end == len(seq.token_ids):  # a decode: the last token (see _add_to_batch)
                batch.decodes.append(seq)
            else:
                batch.prefills.append((seq, n))
            scheduled.add(seq.seq_id)
            budget -= n
        return budget, self.stats.preemptions > preemptions_before

    def schedule_ahead(self, seqs: list[Sequence], max_model_len: int) -> list[Sequence] | None:
        """Async decode: the decodes of the step after the one in flight, which computes the last
        token of each of ``seqs`` (its sampled token is not known yet). Each sequence that will
        surely run again (not finished, not at its length limit, which the token cannot change)
        gets the slot of the position after its last; a sequence that the in-flight token
        finishes (EOS, stop token) is computed in vain and dropped when that token arrives.

        None when the step must be scheduled normally instead: requests wait (admission is the
        normal path's), the budget is smaller than the batch, or the free blocks do not cover
        the new slots (the normal path preempts)."""
        if self.waiting:
            return None
        ahead = []
        for s in seqs:
            n = len(s.token_ids) + 1  # after the in-flight token
            if s.status is not SequenceStatus.RUNNING or n - s.num_prompt_tokens >= s.params.max_tokens or n >= max_model_len:
                continue
            ahead.append(s)
        if not ahead or len(ahead) > self.config.max_num_batched_tokens:
            return None
        bm, bs = self.block_manager, self.block_manager.block_size
        need = sum(1 for s in ahead if len(s.token_ids) + 1 > len(s.block_table) * bs)
        if need > bm.num_free_blocks:
            return None
        for s in ahead:
            n = len(s.token_ids) + 1
            if n > len(s.block_table) * bs:
                bm.append_slots(s, n)
        return ahead

    def _reserve(self, seq: Sequence, num_tokens: int, scheduled: set[int]) -> bool:
        """Blocks for ``num_tokens`` of ``seq``, preempting the newest unscheduled sequences
        (possibly ``seq`` itself, then False) until they fit."""
        bm = self.block_manager
        while not bm.can_append(seq, num_tokens):
            victim = next(s for s in reversed(self.running) if s.seq_id not in scheduled)
            self.preempt(victim)
            if victim is seq:
                return False
        bm.append_slots(seq, num_tokens)
        return True

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not bm.can_allocate(seq):
                break
            self.waiting.popleft()
            hit = bm.allocate(seq)
            self._count_admission(seq, hit)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(len(seq) - seq.num_computed_tokens, self.config.prefill_chunk, budget)
            self._add_to_batch(batch, seq, n)
            budget -= n

    def _count_admission(self, seq: Sequence, hit: int) -> None:
        st = self.stats
        seq.admissions += 1
        st.prefix_query_tokens += len(seq)
        st.prefix_hit_tokens += hit
        if seq.admissions == 1:
            seq.num_cached_tokens = hit
            st.prompt_tokens += seq.num_prompt_tokens
            st.prompt_hit_tokens += hit

    @staticmethod
    def _add_to_batch(batch: ScheduledBatch, seq: Sequence, n: int) -> None:
        # A decode computes the sequence's last token (the graph path assumes that position);
        # a one-token chunk of a longer prefill (budget or chunk size 1) stays a prefill.
        if n == 1 and len(seq.token_ids) - seq.num_computed_tokens == 1:
            batch.decodes.append(seq)
        else:
            batch.prefills.append((seq, n))

    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks (cached ones stay cached) and queue it first for recompute."""
        self.running.remove(seq)
        self.block_manager.free_seq(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.stats.preemptions += 1

    # ---- after the forward pass ------------------------------------------------------------

    def postprocess(self, batch: ScheduledBatch, sampled: dict[int, int], eos_token_id: int | None,
                    max_model_len: int) -> list[Sequence]:
        """Advance computed counts, commit full blocks, append sampled tokens.

        ``sampled`` maps seq_id -> token for the sequences whose last token was computed this
        step. Returns the sequences that got a token (finished ones are freed and removed).
        """
        bm, stats, bs = self.block_manager, self.stats, self.block_manager.block_size
        advanced: list[Sequence] = []
        for seq, n in batch.items():
            start = seq.num_computed_tokens
            prompt = max(0, min(start + n, seq.num_prompt_tokens) - start)
            stats.prefill_computed_tokens += prompt
            stats.decode_computed_tokens += n - prompt
            seq.num_computed_tokens = start + n
            if (start + n) // bs > seq.num_committed_blocks:  # a block was completed
                bm.commit(seq)
            token = sampled.get(seq.seq_id)
            if token is None:
                continue
            seq.token_ids.append(token)
            advanced.append(seq)
            reason = self._finish_reason(seq, token, eos_token_id, max_model_len)
            if reason is not None:
                self.finish(seq, reason)
        return advanced

    @staticmethod
    def _finish_reason(seq: Sequence, token: int, eos: int | None, max_model_len: int) -> str | None:
        p = seq.params
        if not p.ignore_eos and eos is not None and token == eos:
            return "stop"
        if token in p.stop_token_ids:
            return "stop"
        n = len(seq.token_ids)
        if n - seq.num_prompt_tokens >= p.max_tokens or n >= max_model_len:
            return "length"
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finish (or abort) ``seq`` wherever it is; its blocks are freed."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free_seq(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def all_seqs(self) -> list[Sequence]:
        return list(self.running) + list(self.waiting)
