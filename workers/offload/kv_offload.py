"""The CPU offload tier's pages and the copies between them and the paged GPU cache.

``CpuKVCache`` holds one host page per CPU slot, ``[num_cpu_blocks, num_layers * 2, block_size
* num_kv_heads * head_dim]`` in the model dtype (a block's K and V of every layer contiguous, so
a run of slots is one copy). On CUDA the pool is pinned and every copy is ``non_blocking`` on the
current stream: stream order puts a save before the forward pass that overwrites its GPU block,
and a restore before the forward pass that reads it, without a host sync. On a CPU device the
"CPU tier" is a second tensor and the copies are plain.

Ownership: the engine thread only. The block manager decides what moves (``Swap`` ops, in
order); ``run`` executes them in that order, batching consecutive ops of one direction
(ops of one direction never read what another op of the batch writes; of two writes to one
destination the later wins, as in sequential order).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import groupby

import torch

from workers.engine.block_manager import Swap


class CpuKVCache:
    def __init__(self, kv_cache: torch.Tensor, num_blocks: int, chunk_bytes: int = 128 << 20) -> None:
        if num_blocks < 1:
            raise ValueError("the CPU KV cache needs at least one block")
        layers, two, gpu_blocks, bs, heads, dim = kv_cache.shape
        self.device = kv_cache.device
        # [layers * 2, gpu blocks, page]: the GPU cache seen per block (a view, no copy).
        self.gpu = kv_cache.view(layers * two, gpu_blocks, bs * heads * dim)
        self.pin = self.device.type == "cuda"
        self.pages = torch.zeros(num_blocks, layers * two, bs * heads * dim, dtype=kv_cache.dtype,
                                 pin_memory=self.pin)
        self.block_bytes = self.pages[0].numel() * self.pages.element_size()
        self.rows_per_chunk = max(1, chunk_bytes // self.block_bytes)  # bounds the GPU staging buffer

    @property
    def num_blocks(self) -> int:
        return int(self.pages.shape[0])

    def run(self, swaps: Sequence[Swap]) -> None:
        """Execute ``swaps`` in order (queued on the stream; ``synchronize`` waits for them)."""
        for out, group in groupby(swaps, key=lambda s: s.out):
            if out:
                self.swap_out({s.cpu_slot: s.gpu_block for s in group})
            else:
                self.swap_in({s.gpu_block: s.cpu_slot for s in group})

    def swap_out(self, slot_to_gpu: dict[int, int]) -> None:
        """GPU blocks -> CPU slots: gather on the GPU, then one copy per run of consecutive slots
        (on a CPU device: one direct copy per block, 3-5x faster than staging there)."""
        if not self.pin:
            for slot, gid in slot_to_gpu.items():
                self.pages[slot].copy_(self.gpu[:, gid])
            return
        for chunk in _chunks(sorted(slot_to_gpu.items()), self.rows_per_chunk):
            idx = self._index([g for _, g in chunk])
            staged = self.gpu.index_select(1, idx).transpose(0, 1).contiguous()  # [k, layers*2, page]
            for first, count, row in _runs([s for s, _ in chunk]):
                self.pages[first : first + count].copy_(staged[row : row + count], non_blocking=True)

    def swap_in(self, gpu_to_slot: dict[int, int]) -> None:
        """CPU slots -> GPU blocks: one copy per run of consecutive slots into a GPU staging
        buffer, then one scatter into the paged cache (on a CPU device: one copy per block)."""
        if not self.pin:
            for gid, slot in gpu_to_slot.items():
                self.gpu[:, gid].copy_(self.pages[slot])
            return
        pairs = sorted((s, g) for g, s in gpu_to_slot.items())
        for chunk in _chunks(pairs, self.rows_per_chunk):
            idx = self._index([g for _, g in chunk])
            staged = torch.empty((len(chunk), *self.pages.shape[1:]), dtype=self.pages.dtype, device=self.device)
            for first, count, row in _runs([s for s, _ in chunk]):
                staged[row : row + count].copy_(self.pages[first : first + count], non_blocking=True)
            self.gpu.index_copy_(1, idx, staged.transpose(0, 1))

    def _index(self, block_ids: list[int]) -> torch.Tensor:
        """Block ids on the device without a host sync (pinned staging, async copy; the caching
        host allocator keeps the staging alive until the copy is done)."""
        host = torch.tensor(block_ids, dtype=torch.long, pin_memory=self.pin)
        return host.to(self.device, non_blocking=True) if self.pin else host

    def synchronize(self) -> None:
        """Wait until every queued copy is done (the pages are then readable from the host)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()


def _chunks(items: list[tuple[int, int]], size: int) -> Iterator[list[tuple[int, int]]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _runs(slots: list[int]) -> Iterator[tuple[int, int, int]]:
    """``(first slot, count, first row)`` per run of consecutive values in sorted ``slots``."""
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            yield slots[start], i - start, start
            start = i
