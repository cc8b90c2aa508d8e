"""Runs one scheduled batch: builds the flat inputs, runs the model, samples.

Batch layout (``AttentionMetadata``): the prefill chunks first (sequence i's new tokens are
``[cu_seqlens_q[i], cu_seqlens_q[i+1])``), then one token per decoding sequence. Token t of a
sequence sits at absolute position ``p = num_computed_tokens + t`` and its K/V goes to slot
``block_table[p // block_size] * block_size + p % block_size``.

On CUDA with the Triton backend, batches made only of decodes replay CUDA graphs captured at
fixed batch sizes (padding rows store nothing: slot -1, context 1, a valid block id).
``launch_decode`` enqueues such a step without a host sync and ``collect`` reads its tokens, so
the engine can enqueue step t+1 (input ids taken on the device from step t's samples) before
it books step t (async decode, ``LLMEngine``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

from workers.config import EngineConfig, ModelConfig
from workers.engine.demo_sampler import DemoSampler
from workers.engine.sampler import Sampler
from workers.engine.scheduler import ScheduledBatch
from workers.engine.sequence import Sequence
from workers.engine.state_checkpoints import StateCopy, num_state_slots
from workers.model.attention.base import AttentionBackend, get_backend
from workers.model.decoder import DTYPES, CausalLM, build_model
from workers.model.layers import AttentionMetadata
from workers.model.recurrent import RecurrentMetadata

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


@dataclass
class DecodeLaunch:
    """A graph decode step whose forward and sampling are enqueued on the device."""

    seqs: list[Sequence]  # one per row of ``tokens``
    tokens: torch.Tensor  # [n] int64 on the device: the sampled tokens (the next launch reads them)
    host: torch.Tensor  # [n] int64, pinned: receives ``tokens``
    event: torch.cuda.Event  # recorded after the copy into ``host``

    def rows(self) -> dict[int, int]:
        """seq_id -> row of ``tokens``."""
        return {s.seq_id: i for i, s in enumerate(self.seqs)}


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
        n_attn = len(model_config.attention_layers)
        self.kv_cache = torch.empty(
            n_attn, 2, self.num_blocks, self.block_size, model_config.num_kv_heads,
            model_config.head_dim, dtype=self.dtype, device=self.device,
        )
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(n_attn)]
        # Hybrid models: recurrent state per slot (``workers.engine.state_checkpoints`` owns the
        # slot numbering: running states, boundary buffers, the checkpoint pool), float32.
        m = model_config
        self.states: torch.Tensor | None = torch.zeros(
            len(m.recurrent_layers), self._num_state_slots(), m.linear_num_heads, m.linear_key_dim,
            m.linear_value_dim, dtype=torch.float32, device=self.device,
        ) if m.is_hybrid else None
        self.sampler = make_sampler(model_config, config, self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._g_sizes: list[int] = []
        self.num_graph_replays = 0
        if self._use_graphs():
            self._capture_graphs()

    # ---- sizing ---------------------------------------------------------------------------

    def _num_state_slots(self) -> int:
        cfg = self.config
        return num_state_slots(cfg.max_num_seqs, cfg.num_state_checkpoints if cfg.enable_prefix_caching else 0)

    def _num_kv_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        per_block = self.block_size * self.model_config.kv_bytes_per_token(self.dtype.itemsize)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * cfg.gpu_memory_utilization) - (total - free) - self._activation_reserve()
            budget -= self._num_state_slots() * self.model_config.state_bytes() if self.model_config.is_hybrid else 0
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
        if self._graph_size(batch) is not None:
            launch = self._launch(batch.decodes, None)
            return {s.seq_id: t for s, t in zip(launch.seqs, self.collect(launch), strict=True)}
        else:
            inputs = self.prepare(batch)
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, self.backend)
            if self.states is not None:
                self._end_snapshots(batch)
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
        if self.states is not None:
            meta.recurrent = self._recurrent_meta(batch)
        return StepInputs(
            input_ids=_t(np.concatenate(ids), dev),
            positions=_t(np.concatenate(pos), dev),
            meta=meta,
            logits_indices=_t(np.array(logits_idx, dtype=np.int64), dev),
            sample_seqs=sample_seqs,
        )

    # ---- recurrent state (hybrid models) -----------------------------------------------------

    def _recurrent_meta(self, batch: ScheduledBatch) -> RecurrentMetadata:
        """Slots of this step's sequences; the snapshots that fall inside a prefill chunk (the
        ones at a chunk's end are copied after the forward pass, ``_end_snapshots``)."""
        assert self.states is not None
        snaps = batch.snapshots
        meta = RecurrentMetadata(self.states)
        for seq, n in batch.prefills:
            if seq.state_slot is None:
                raise RuntimeError(f"sequence {seq.seq_id} runs without a recurrent state slot")
            meta.prefill_slots.append(seq.state_slot)
            meta.prefill_starts.append(seq.num_computed_tokens)
            meta.prefill_snaps.append([(o, d) for o, d in snaps.get(seq.seq_id, ()) if o < n])
        if batch.decodes:
            meta.decode_slots = _t(np.array([s.state_slot for s in batch.decodes], dtype=np.int64), self.device)
        return meta

    def _end_snapshots(self, batch: ScheduledBatch) -> None:
        """Copy each sequence's state into the snapshot slots planned at the end of its step."""
        assert self.states is not None
        src, dst = [], []
        for seq, n in batch.items():
            for off, dest in batch.snapshots.get(seq.seq_id, ()):
                if off == n:
                    src.append(seq.state_slot)
                    dst.append(dest)
        if src:
            st = self.states
            st.index_copy_(1, _t(np.array(dst), self.device), st.index_select(1, _t(np.array(src), self.device)))

    def copy_states(self, copies: list[StateCopy]) -> None:
        """Run queued slot-to-slot state copies in order (restores, end-of-turn promotions)."""
        if self.states is None:
            return
        with torch.inference_mode():
            for c in copies:
                self.states[:, c.dst].copy_(self.states[:, c.src])

    # ---- CUDA graphs for decode -------------------------------------------------------------
    #
    # Static device inputs of every graph (views of three buffers, so one step needs two
    # host-to-device copies and one row scatter):
    #   _g_in  [5, top] int64: input ids, positions, slots, the row of each sequence in the previous
    #          launch's sampled tokens (async decode), the table rows that changed this step;
    #   _g_i32 [top + top * max_blocks] int32: context lengths, then the changed table rows;
    #   _g_tables [top, max_blocks] int32: persistent; row i is rewritten only when the sequence in
    #          row i or its block table changed (``_g_rows`` mirrors what the device holds).
    # Host staging is pinned and double-buffered: launch j fills set j % 2 after waiting for launch
    # j - 2's event, so a launch may be enqueued while the previous one still runs.

    def _use_graphs(self) -> bool:
        # Hybrid models run eagerly: their state slots are not graph inputs yet. MoE models too: their
        # experts are picked on the host (``workers.model.moe``). The demo preset too:
        # a graph step samples on the device (greedy argmax), and its script is chosen on the host.
        return (self.config.cuda_graphs and self.device.type == "cuda" and self.backend.name == "triton"
                and not self.model_config.is_hybrid and not self.model_config.num_experts
                and not self.model_config.demo_script)

    def _graph_sizes(self) -> list[int]:
        top = min(self.config.max_graph_batch_size, self.config.max_num_seqs)
        sizes = [b for b in (1, 2, 4, 8) if b <= top] + list(range(16, top + 1, 16))
        return sizes if sizes[-1] == top else sizes + [top]

    def graph_size_for(self, n: int) -> int | None:
        """The captured batch size that serves ``n`` decodes (None: no graph does)."""
        if not self.graphs or n <= 0:
            return None
        return next((b for b in self._g_sizes if b >= n), None)

    def _graph_size(self, batch: ScheduledBatch) -> int | None:
        if batch.prefills or not batch.decodes:
            return None
        return self.graph_size_for(len(batch.decodes))

    @torch.inference_mode()
    def _capture_graphs(self) -> None:
        sizes = self._graph_sizes()
        top = sizes[-1]
        max_blocks = -(-self._max_model_len() // self.block_size)
        dev = self.device
        self._g_top, self._g_max_blocks = top, max_blocks
        self._g_sizes = sorted(sizes)
        self._g_in = torch.zeros(5, top, dtype=torch.int64, device=dev)
        self._g_in[2].fill_(-1)  # padding rows store nothing
        self._g_i32 = torch.ones(top + top * max_blocks, dtype=torch.int32, device=dev)
        self._g_ids, self._g_pos, self._g_slots = self._g_in[0], self._g_in[1], self._g_in[2]
        self._g_ctx = self._g_i32[:top]
        self._g_tables = torch.zeros(top, max_blocks, dtype=torch.int32, device=dev)
        self._g_rows: list[list[int] | None] = [None] * top  # the block table each device row holds
        self._g_logits: dict[int, torch.Tensor] = {}
        self._g_st64 = [torch.zeros(5, top, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self._g_st32 = [torch.ones(top + top * max_blocks, dtype=torch.int32, pin_memory=True) for _ in range(2)]
        self._g_tok = [torch.zeros(top, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self._g_st64_np = [t.numpy() for t in self._g_st64]
        self._g_st32_np = [t.numpy() for t in self._g_st32]
        self._g_done: list[torch.cuda.Event | None] = [None, None]
        self._g_flip = 0
        pool = None
        # A capture stream of this engine's device: torch's default one is made once per process,
        # on the device of the first capture, and capturing on it would switch a second engine's
        # launches to that device (Triton then loads its kernels mid-capture: not permitted).
        capture_stream = torch.cuda.Stream(device=dev)
        try:
            for b in reversed(sizes):  # largest first: smaller graphs reuse its pool
                meta = AttentionMetadata(self._g_slots[:b], 0, decode_block_tables=self._g_tables[:b],
                                         decode_context_lens=self._g_ctx[:b])
                # Logits in the model's dtype: greedy rows take their argmax directly (the
                # float32 cast, 6 bytes per logit, happens only for sampled rows).
                run = lambda: self.model.lm_head(  # noqa: E731
                    self.model(self._g_ids[:b], self._g_pos[:b], self.kv_caches, meta, self.backend))
                run()  # warm up (Triton compiles) outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=capture_stream):
                    self._g_logits[b] = run()
                pool = graph.pool()
                self.graphs[b] = graph
            torch.cuda.synchronize()
        except Exception as exc:  # a backend that syncs on the host cannot be captured
            log.warning("CUDA graph capture failed (%s); decode runs eagerly", exc, exc_info=True)
            self.graphs.clear()
            self._g_logits.clear()

    def launch_decode(self, seqs: list[Sequence], prev: DecodeLaunch | None = None) -> DecodeLaunch:
        """Enqueue one graph decode step of ``seqs`` and its sampling; no host sync.

        Without ``prev``, each sequence computes its last token (position ``len - 1``). With
        ``prev`` (async decode), each computes the token ``prev`` sampled for it, which is still
        on the device and not yet in ``token_ids`` (position ``len``); its block table must
        already hold that position. ``collect`` returns the sampled tokens."""
        with torch.cuda.device(self.device), torch.inference_mode():
            return self._launch(seqs, prev)

    @staticmethod
    def collect(launch: DecodeLaunch) -> list[int]:
        """The tokens ``launch`` sampled, one per sequence (waits for that step only)."""
        launch.event.synchronize()
        return launch.host.tolist()

    def _launch(self, seqs: list[Sequence], prev: DecodeLaunch | None) -> DecodeLaunch:
        n = len(seqs)
        b = self.graph_size_for(n)
        if b is None:
            raise ValueError(f"no decode graph serves {n} sequences")
        k = self._next_staging()
        m = self._stage(k, seqs, prev, b)
        self._upload(k, m, b, prev)
        return self._replay_and_sample(k, b, seqs)

    def _next_staging(self) -> int:
        """The host staging set (0 or 1) of this launch, once launch j - 2 has consumed it."""
        k = self._g_flip
        self._g_flip ^= 1
        done = self._g_done[k]
        if done is not None:
            done.synchronize()  # launch j - 2 has consumed this staging set (long since, normally)
        return k

    def _stage(self, k: int, seqs: list[Sequence], prev: DecodeLaunch | None, b: int) -> int:
        """Fill staging set ``k`` for ``seqs`` padded to the graph size ``b``; the number of table
        rows that changed (their indices in row 4, their tables after the context lengths)."""
        n, bs = len(seqs), self.block_size
        st, st32 = self._g_st64_np[k], self._g_st32_np[k]
        rows_held, changed = self._g_rows, []
        shift = 0 if prev is not None else 1
        ids, pos, slots = [], [], []
        for i, s in enumerate(seqs):  # runs per sequence per step: plain Python, no numpy per row
            table = s.block_table
            p = len(s.token_ids) - shift
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            if shift:
                ids.append(s.token_ids[-1])
            if rows_held[i] != table:
                rows_held[i] = list(table)
                changed.append(i)
        st[1, :n] = pos
        st[2, :n] = slots
        st[0:2, n:b] = 0
        st[2, n:b] = -1  # padding rows store nothing
        if prev is None:
            st[0, :n] = ids
        else:
            rows = prev.rows()
            st[3, :n] = [rows[s.seq_id] for s in seqs]
            st[3, n:b] = 0
        st32[:n] = st[1, :n] + 1
        st32[n:b] = 1
        if changed:
            self._stage_tables(k, seqs, changed)
        return len(changed)

    def _stage_tables(self, k: int, seqs: list[Sequence], changed: list[int]) -> None:
        """Stage the block tables of the rows in ``changed`` (and their indices) in set ``k``."""
        st, st32 = self._g_st64_np[k], self._g_st32_np[k]
        top, width, m = self._g_top, self._g_max_blocks, len(changed)
        st[4, :m] = changed
        staged = st32[top : top + m * width].reshape(m, width)
        for j, i in enumerate(changed):
            table = seqs[i].block_table
            staged[j, : len(table)] = table

    def _upload(self, k: int, m: int, b: int, prev: DecodeLaunch | None) -> None:
        """Copy staging set ``k`` to the graph's static inputs (``m`` changed table rows); with
        ``prev``, gather the input ids from its sampled tokens on the device."""
        top, width = self._g_top, self._g_max_blocks
        # Padding rows keep whatever (valid) block ids their table rows hold: context 1 reads
        # only position 0 of row i, and slot -1 writes nothing.
        self._g_in.copy_(self._g_st64[k], non_blocking=True)
        self._g_i32[: top + m * width].copy_(self._g_st32[k][: top + m * width], non_blocking=True)
        if m:
            self._g_tables.index_copy_(0, self._g_in[4, :m],
                                       self._g_i32[top : top + m * width].view(m, width))
        if prev is not None:
            torch.index_select(prev.tokens, 0, self._g_in[3, :b], out=self._g_in[0, :b])

    def _replay_and_sample(self, k: int, b: int, seqs: list[Sequence]) -> DecodeLaunch:
        """Replay graph ``b``, sample its first ``len(seqs)`` rows and enqueue their copy to the host."""
        n = len(seqs)
        self.graphs[b].replay()
        self.num_graph_replays += 1
        logits = self._g_logits[b][:n]
        if all(s.params.greedy for s in seqs):
            tokens = logits.argmax(dim=-1)  # = the sampler's greedy path on the float32 cast
        else:
            tokens = self.sampler(logits.float(), seqs)
        host = self._g_tok[k][:n]
        host.copy_(tokens, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._g_done[k] = event
        return DecodeLaunch(seqs, tokens, host, event)

    def _max_model_len(self) -> int:
        return self.config.max_model_len or self.model_config.max_position_embeddings


def make_sampler(model_config: ModelConfig, config: EngineConfig, device: torch.device) -> Sampler | DemoSampler:
    """The sampler of the logits, or the demo preset's script (which needs the EOS id)."""
    if not model_config.demo_script:
        return Sampler(device, config.seed)
    if model_config.eos_token_id is None:
        raise ValueError(f"{model_config.name}: a scripted (demo) model needs an eos_token_id")
    worker = config.worker_name or config.served_model_name or model_config.name
    return DemoSampler(worker, model_config.eos_token_id)


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
