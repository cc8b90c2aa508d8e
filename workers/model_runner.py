"""Runs one scheduled batch: builds the flat inputs, runs the model, samples.

Batch layout (``AttentionMetadata``): the prefill chunks first (sequence i's new tokens are
``[cu_seqlens_q[i], cu_seqlens_q[i+1])``), then one token per decoding sequence. Token t of a
sequence sits at absolute position ``p = num_computed_tokens + t`` and its K/V goes to slot
``block_table[p // block_size] * block_size + p % block_size``.

On CUDA with the Triton backend, batches made only of decodes replay CUDA graphs captured at
fixed batch sizes (padding rows store nothing: slot -1, context 1, block 0).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

from workers.attention.base import AttentionBackend, get_backend
from workers.config import EngineConfig, ModelConfig
from workers.layers import AttentionMetadata
from workers.model import DTYPES, CausalLM, build_model
from workers.sampler import Sampler
from workers.scheduler import ScheduledBatch
from workers.sequence import Sequence

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda, but torch sees no CUDA device")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the hidden states to sample from
    sample_seqs: list[Sequence]  # one per logits row


class ModelRunner:
    def __init__(self, model_config: ModelConfig, config: EngineConfig, model: CausalLM | None = None) -> None:
        self.model_config = model_config
        self.config = config
        self.device = resolve_device(config.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:
            # Oversubscribed OpenMP threads spin against each other: 15x slower on 2 busy cores.
            torch.set_num_threads(config.cpu_threads or max(1, (os.cpu_count() or 2) // 2))
        self.dtype = DTYPES[model_config.dtype]
        self.backend: AttentionBackend = get_backend(self.device, config.attention_backend)
        self.model = model if model is not None else build_model(model_config, self.device, config.seed)
        self.block_size = config.block_size
        self.num_blocks = self._num_kv_blocks()
        # One allocation: [layers, k|v, blocks, block_size, kv_heads, head_dim]; per-layer views
        # are contiguous, as the backends require.
        self.kv_cache = torch.empty(
            model_config.num_layers, 2, self.num_blocks, self.block_size, model_config.num_kv_heads,
            model_config.head_dim, dtype=self.dtype, device=self.device,
        )
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(model_config.num_layers)]
        self.sampler = Sampler(self.device, config.seed)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.num_graph_replays = 0
        if self._use_graphs():
            self._capture_graphs()

    # ---- sizing ---------------------------------------------------------------------------

    def _num_kv_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        per_block = self.block_size * self.model_config.kv_bytes_per_token(self.dtype.itemsize)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * cfg.gpu_memory_utilization) - (total - free) - self._activation_reserve()
        else:
            budget = cfg.cpu_kv_cache_bytes
        blocks = budget // per_block
        if blocks < 1:
            raise ValueError(f"no memory left for the KV cache (budget {budget} bytes)")
        return int(blocks)

    def _activation_reserve(self) -> int:
        """A generous bound on one step's activations (prefill of the whole token budget),
        the logits of a full decode batch, and the graph pool."""
        m, t = self.model_config, self.config.max_num_batched_tokens
        per_token = (4 * m.hidden_size + 2 * (m.q_size + 2 * m.kv_size) + 3 * m.intermediate_size) * 4
        logits = 3 * max(self.config.max_num_seqs, 1) * m.vocab_size * 4
        return 2 * (t * per_token + logits) + (1 << 30)

    # ---- one step -------------------------------------------------------------------------

    def run(self, batch: ScheduledBatch) -> dict[int, int]:
        """Forward ``batch``; sampled token per seq_id for sequences whose last token was computed.

        Triton launches on the *current* CUDA device, which is process-global: with several
        engines in one process (tests, benches) each step makes its own device current.
        """
        if self.device.type != "cuda":
            return self._run(batch)
        with torch.cuda.device(self.device):
            return self._run(batch)

    @torch.inference_mode()
    def _run(self, batch: ScheduledBatch) -> dict[int, int]:
        graph_bs = self._graph_size(batch)
        if graph_bs is not None:
            logits, seqs = self._replay(batch, graph_bs)
        else:
            inputs = self.prepare(batch)
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, self.backend)
            seqs = inputs.sample_seqs
            logits = self.model.compute_logits(hidden[inputs.logits_indices]) if seqs else None
        if not seqs:
            return {}
        tokens = self.sampler(logits, seqs).tolist()
        return {s.seq_id: t for s, t in zip(seqs, tokens, strict=True)}

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        bs = self.block_size
        ids: list[np.ndarray] = []
        pos: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        logits_idx: list[int] = []
        sample_seqs: list[Sequence] = []
        offset = 0
        for seq, n in batch.items():
            c = seq.num_computed_tokens
            p = np.arange(c, c + n, dtype=np.int64)
            table = np.asarray(seq.block_table, dtype=np.int64)
            ids.append(np.asarray(seq.token_ids[c : c + n], dtype=np.int64))
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            offset += n
            if c + n == len(seq):  # the last token is computed: sample the next one
                logits_idx.append(offset - 1)
                sample_seqs.append(seq)
        dev = self.device
        meta = AttentionMetadata(slot_mapping=_t(np.concatenate(slots), dev),
                                 num_prefill_tokens=sum(n for _, n in batch.prefills))
        if batch.prefills:
            pseqs = [s for s, _ in batch.prefills]
            qlens = [n for _, n in batch.prefills]
            meta.prefill_block_tables = _t(_tables(pseqs), dev, torch.int32)
            meta.cu_seqlens_q = _t(np.concatenate([[0], np.cumsum(qlens)]), dev, torch.int32)
            meta.prefill_context_lens = _t(np.array([s.num_computed_tokens + n for s, n in batch.prefills]), dev, torch.int32)
        if batch.decodes:
            meta.decode_block_tables = _t(_tables(batch.decodes), dev, torch.int32)
            meta.decode_context_lens = _t(np.array([s.num_computed_tokens + 1 for s in batch.decodes]), dev, torch.int32)
        return StepInputs(
            input_ids=_t(np.concatenate(ids), dev),
            positions=_t(np.concatenate(pos), dev),
            meta=meta,
            logits_indices=_t(np.array(logits_idx, dtype=np.int64), dev),
            sample_seqs=sample_seqs,
        )

    # ---- CUDA graphs for decode -------------------------------------------------------------

    def _use_graphs(self) -> bool:
        return self.config.cuda_graphs and self.device.type == "cuda" and self.backend.name == "triton"

    def _graph_sizes(self) -> list[int]:
        top = min(self.config.max_graph_batch_size, self.config.max_num_seqs)
        sizes = [b for b in (1, 2, 4, 8) if b <= top] + list(range(16, top + 1, 16))
        return sizes if sizes[-1] == top else sizes + [top]

    def _graph_size(self, batch: ScheduledBatch) -> int | None:
        if not self.graphs or batch.prefills or not batch.decodes:
            return None
        n = len(batch.decodes)
        return next((b for b in sorted(self.graphs) if b >= n), None)

    @torch.inference_mode()
    def _capture_graphs(self) -> None:
        sizes = self._graph_sizes()
        top = sizes[-1]
        max_blocks = -(-self._max_model_len() // self.block_size)
        dev = self.device
        self._g_ids = torch.zeros(top, dtype=torch.int64, device=dev)
        self._g_pos = torch.zeros(top, dtype=torch.int64, device=dev)
        self._g_slots = torch.full((top,), -1, dtype=torch.int64, device=dev)
        self._g_tables = torch.zeros(top, max_blocks, dtype=torch.int32, device=dev)
        self._g_ctx = torch.ones(top, dtype=torch.int32, device=dev)
        self._g_logits: dict[int, torch.Tensor] = {}
        # Pinned host staging for the static inputs (ids, positions, slots; context lens; tables).
        self._g_stage_t = torch.zeros(3, top, dtype=torch.int64, pin_memory=True)
        self._g_stage_ctx_t = torch.ones(top, dtype=torch.int32, pin_memory=True)
        self._g_stage_ctx = self._g_stage_ctx_t.numpy()
        self._g_stage_tables_t = torch.zeros(top, max_blocks, dtype=torch.int32, pin_memory=True)
        self._g_stage = self._g_stage_t.numpy()
        self._g_stage_tables = self._g_stage_tables_t.numpy()
        pool = None
        try:
            for b in reversed(sizes):  # largest first: smaller graphs reuse its pool
                meta = AttentionMetadata(self._g_slots[:b], 0, decode_block_tables=self._g_tables[:b],
                                         decode_context_lens=self._g_ctx[:b])
                run = lambda: self.model.compute_logits(  # noqa: E731
                    self.model(self._g_ids[:b], self._g_pos[:b], self.kv_caches, meta, self.backend))
                run()  # warm up (Triton compiles) outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._g_logits[b] = run()
                pool = graph.pool()
                self.graphs[b] = graph
            torch.cuda.synchronize()
        except Exception as exc:  # a backend that syncs on the host cannot be captured
            log.warning("CUDA graph capture failed (%s); decode runs eagerly", exc)
            self.graphs.clear()
            self._g_logits.clear()

    def _replay(self, batch: ScheduledBatch, b: int) -> tuple[torch.Tensor, list[Sequence]]:
        seqs = batch.decodes
        n, bs = len(seqs), self.block_size
        pos = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=n)
        w = max(len(s.block_table) for s in seqs)
        tables = self._g_stage_tables
        for i, s in enumerate(seqs):  # rows past a table's end are never read (context bound)
            tables[i, : len(s.block_table)] = s.block_table
        # Fill the pinned staging rows, then one async copy per static input. The previous step's
        # copies are complete: its sampled tokens were read back (a sync) before this step began.
        st = self._g_stage
        st[0, :n] = np.fromiter((s.token_ids[-1] for s in seqs), dtype=np.int64, count=n)
        st[1, :n] = pos
        st[2, :n] = tables[np.arange(n), pos // bs].astype(np.int64) * bs + pos % bs
        ctx = self._g_stage_ctx
        ctx[:n] = pos + 1
        ctx[n:b] = 1
        st[0:2, n:b] = 0
        st[2, n:b] = -1  # padding rows store nothing
        tables[n:b, :w] = 0
        stage = self._g_stage_t
        self._g_ids[:b].copy_(stage[0, :b], non_blocking=True)
        self._g_pos[:b].copy_(stage[1, :b], non_blocking=True)
        self._g_slots[:b].copy_(stage[2, :b], non_blocking=True)
        self._g_ctx[:b].copy_(self._g_stage_ctx_t[:b], non_blocking=True)
        self._g_tables[:b, :w].copy_(self._g_stage_tables_t[:b, :w], non_blocking=True)
        self.graphs[b].replay()
        self.num_graph_replays += 1
        return self._g_logits[b][:n], seqs

    def _max_model_len(self) -> int:
        return self.config.max_model_len or self.model_config.max_position_embeddings


def _tables(seqs: list[Sequence]) -> np.ndarray:
    """Block tables padded with -1 to the longest."""
    width = max(len(s.block_table) for s in seqs)
    out = np.full((len(seqs), width), -1, dtype=np.int32)
    for i, s in enumerate(seqs):
        out[i, : len(s.block_table)] = s.block_table
    return out


def _t(a: np.ndarray, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a)).to(dtype)
    return t.to(device, non_blocking=True) if device.type != "cpu" else t
