"""L2 prefetch of the next sub-layer's weights (and a layer's K/V pages) on a side stream, for
CUDA-graph decode of small models (hypothesis of workers/NOTES.md run 5).

Why: every kernel of a 896-wide decode layer is latency-bound on HBM round trips (GEMMs 4-8 us
where their bytes take 0.4-4 us). While linear j runs on the main stream, a branch forked from
the main stream at j's start pulls linear j + ``distance``'s weights into the ~50 MB L2 with a
few-CTA kernel of fire-and-forget prefetches, so that GEMM reads from L2 when its turn comes.

Plumbing (no change to the model's code): forward pre-hooks on the model, each decoder layer and
each of its four linears. Each hook, while the prefetcher is ``armed`` (the runner arms it
around warm-up and capture only), records an event on the current stream, makes the side stream
wait for it, and enqueues the prefetch there; a forward hook on the model makes the current
stream wait for the side stream before the forward returns (a capture must join its forks).
Prefetches change no value: outputs are bit-identical with the prefetcher on or off.

Owner: the model runner (one per engine). ``plan`` is pure (CPU-tested); the kernels need Triton.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the plan is still computable, nothing is launched
    triton = None
    tl = None

MODES = ("line_el", "line", "bulk")  # per-128B-line prefetch (evict_last / normal), bulk prefetch
LINE = 128
BULK_CHUNK = 4096  # bytes per cp.async.bulk.prefetch instruction


@dataclass(frozen=True)
class PrefetchConfig:
    mode: str = "line_el"
    distance: int = 2  # linear j's pre-hook prefetches linear j + distance (global order)
    ctas: int = 16
    kv: str = "off"  # off | qkv (at layer i's qkv pre-hook) | down (at layer i-1's down pre-hook)
    kv_budget_bytes: int = 16 << 20  # most K/V bytes prefetched per layer (first blocks first)
    max_tensor_bytes: int = 24 << 20  # weights larger than this are never prefetched
    min_tensor_bytes: int = 64 << 10  # nor smaller ones (a launch costs more than it saves)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"prefetch mode {self.mode!r} not in {MODES}")
        if self.distance < 1 or self.ctas < 1:
            raise ValueError("prefetch distance and ctas must be >= 1")
        if self.kv not in ("off", "qkv", "down"):
            raise ValueError(f"prefetch kv {self.kv!r} not in off|qkv|down")


# ---- the plan (pure) ------------------------------------------------------------------------------

LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def plan(num_layers: int, distance: int, kv: str) -> dict[tuple[int, str], list[tuple[int, str]]]:
    """Hook point -> what to prefetch there. A point is ``(layer, linear name)`` (the linear's
    pre-hook) or ``(-1, "model")`` (the forward's start); an item is ``(layer, linear name)`` or
    ``(layer, "kv")``. Linear j (global order qkv, o, gate_up, down of layer 0, then layer 1, ...)
    is prefetched at linear j - distance's pre-hook (the first ``distance`` at the model's)."""
    order = [(i, name) for i in range(num_layers) for name in LINEARS]
    out: dict[tuple[int, str], list[tuple[int, str]]] = {}
    for j, item in enumerate(order):
        point = order[j - distance] if j >= distance else (-1, "model")
        out.setdefault(point, []).append(item)
    if kv != "off":
        for i in range(num_layers):
            point = (i, "qkv_proj") if kv == "qkv" or i == 0 else (i - 1, "down_proj")
            out.setdefault(point, []).append((i, "kv"))
    return out


def worth_it(layer_weight_bytes: int, l2_bytes: int = 50 << 20) -> bool:
    """Prefetch only models whose layer (the window of a distance-2 plan at most) fits in 3/4 of
    the L2 (qwen2-0.5b: 29.8 MB of 50; llama3-8b: 436 MB, never)."""
    return layer_weight_bytes <= 3 * l2_bytes // 4


# ---- kernels ----------------------------------------------------------------------------------------


def _jit(fn):  # type: ignore[no-untyped-def]
    return triton.jit(fn) if triton is not None else fn


@_jit
def _issue(addr, nbytes, MODE: tl.constexpr):
    """One prefetch per lane of ``addr`` (uint8 pointers); ``nbytes`` = bytes of a bulk one."""
    if MODE == 0:
        r = tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;",
                                      "=r,l", [addr], dtype=tl.int32, is_pure=False, pack=1)
    elif MODE == 1:
        r = tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;",
                                      "=r,l", [addr], dtype=tl.int32, is_pure=False, pack=1)
    else:
        r = tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
                                      "=r,l,r", [addr, nbytes], dtype=tl.int32, is_pure=False, pack=1)
    return r


@_jit
def _prefetch_range_kernel(ptr, nbytes, sink_ptr, UNIT: tl.constexpr, LANES: tl.constexpr, MODE: tl.constexpr):
    """Prefetch bytes [0, nbytes) of ``ptr`` into L2: unit u (UNIT bytes) by lane u % LANES of
    program (u // LANES) % num_programs. Tail lanes re-issue the last unit (harmless)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_units = tl.cdiv(nbytes, UNIT)
    lanes = tl.arange(0, LANES)
    acc = tl.zeros([LANES], dtype=tl.int32)
    for start in range(pid * LANES, n_units, nprog * LANES):
        u = tl.minimum(start + lanes, n_units - 1).to(tl.int64)
        off = u * UNIT
        size = tl.minimum(nbytes - off, UNIT).to(tl.int32)
        acc += _issue(ptr + off, size, MODE)
    tl.store(sink_ptr + pid, tl.sum(acc, 0))  # keeps the asm live; always 0


@_jit
def _prefetch_kv_kernel(k_ptr, v_ptr, tables_ptr, ctx_ptr, sink_ptr, n_rows, stride_table, max_blocks,
                        BLOCK_TOKENS: tl.constexpr, BLOCK_BYTES: tl.constexpr, UNIT: tl.constexpr,
                        CHUNK: tl.constexpr, MODE: tl.constexpr):
    """Prefetch the first min(blocks(ctx), max_blocks) K and V pages of each row's block table.
    Program p takes rows p, p + P, ...; CHUNK table entries x (BLOCK_BYTES / UNIT) units a pass."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    UNITS: tl.constexpr = BLOCK_BYTES // UNIT
    j = tl.arange(0, CHUNK)[:, None]
    w = tl.arange(0, UNITS)[None, :]
    acc = tl.zeros([CHUNK, UNITS], dtype=tl.int32)
    for row in range(pid, n_rows, nprog):
        ctx = tl.load(ctx_ptr + row)
        nblk = tl.minimum(tl.cdiv(ctx, BLOCK_TOKENS), max_blocks)
        for b0 in range(0, nblk, CHUNK):
            jj = tl.minimum(b0 + j, nblk - 1)  # tail lanes re-read the last valid entry
            blk = tl.load(tables_ptr + row.to(tl.int64) * stride_table + jj).to(tl.int64)
            off = blk * BLOCK_BYTES + w * UNIT
            size = tl.full([CHUNK, UNITS], UNIT, tl.int32)
            acc += _issue(k_ptr + off, size, MODE)
            acc += _issue(v_ptr + off, size, MODE)
    tl.store(sink_ptr + pid, tl.sum(tl.sum(acc, 1), 0))


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


# ---- the prefetcher -----------------------------------------------------------------------------------


class L2Prefetcher:
    """Installs the hooks of ``plan`` on ``model`` (a ``workers.model.CausalLM``) for the per-layer
    K/V ``kv_caches``; acts only while ``armed`` and on CUDA tensors."""

    def __init__(self, model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 cfg: PrefetchConfig) -> None:
        if triton is None:
            raise RuntimeError("L2Prefetcher needs Triton")
        self.cfg = cfg
        self.armed = False
        self.num_launches = 0  # prefetch kernels enqueued while armed (tests, benches)
        self.kv_caches = kv_caches
        layers = model.model.layers
        device = next(model.parameters()).device
        self.side = torch.cuda.Stream(device=device)
        self.sink = torch.zeros(max(cfg.ctas, 1024), dtype=torch.int32, device=device)
        self._meta: Any = None
        self._mode = MODES.index(cfg.mode)
        self._unit = BULK_CHUNK if cfg.mode == "bulk" else LINE
        self._weights: dict[tuple[int, str], torch.Tensor] = {}
        for i, layer in enumerate(layers):
            for name in LINEARS:
                lin = _linear(layer, name)
                n = lin.weight.numel() * lin.weight.element_size()
                if cfg.min_tensor_bytes <= n <= cfg.max_tensor_bytes:
                    self._weights[(i, name)] = _as_bytes(lin.weight)
        self._plan = plan(len(layers), cfg.distance, cfg.kv)
        self._handles = [model.register_forward_pre_hook(self._at((-1, "model"))),
                         model.register_forward_hook(self._join)]
        for i, layer in enumerate(layers):
            self._handles.append(layer.register_forward_pre_hook(self._grab_meta))
            for name in LINEARS:
                if (i, name) in self._plan:
                    self._handles.append(_linear(layer, name).register_forward_pre_hook(self._at((i, name))))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _grab_meta(self, _module: nn.Module, args: tuple[Any, ...]) -> None:
        if self.armed:
            self._meta = args[4]  # DecoderLayer.forward(positions, x, residual, kv_cache, meta, backend)

    def _at(self, point: tuple[int, str]):  # type: ignore[no-untyped-def]
        items = self._plan.get(point, [])

        def hook(_module: nn.Module, args: tuple[Any, ...]) -> None:
            if not self.armed or not items:
                return
            if point == (-1, "model"):
                self._meta = args[3] if len(args) > 3 else None  # CausalLM.forward(ids, pos, kv, meta, backend)
            main = torch.cuda.current_stream()
            self.side.wait_stream(main)
            with torch.cuda.stream(self.side):
                for item in items:
                    self._launch(item)

        return hook

    def _join(self, _module: nn.Module, _args: tuple[Any, ...], _out: Any) -> None:
        if self.armed:
            torch.cuda.current_stream().wait_stream(self.side)

    def _launch(self, item: tuple[int, str]) -> None:
        layer, what = item
        if what == "kv":
            self._launch_kv(layer)
            return
        t = self._weights.get(item)
        if t is None:
            return
        lanes = 128
        grid = (min(self.cfg.ctas, triton.cdiv(triton.cdiv(t.numel(), self._unit), lanes)),)
        _prefetch_range_kernel[grid](t, t.numel(), self.sink, UNIT=self._unit, LANES=lanes,
                                     MODE=self._mode, num_warps=4)
        self.num_launches += 1

    def _launch_kv(self, layer: int) -> None:
        meta = self._meta
        if meta is None or getattr(meta, "decode_block_tables", None) is None or meta.num_prefill_tokens:
            return
        k, v = self.kv_caches[layer]
        tables, ctx = meta.decode_block_tables, meta.decode_context_lens
        rows = tables.shape[0]
        block_bytes = k[0].numel() * k.element_size()
        unit = min(self._unit, block_bytes)
        units = block_bytes // unit
        if rows == 0 or block_bytes % unit or unit % 16 or units & (units - 1):
            return  # a page that is not a power-of-two count of whole units: not prefetched
        per_row = max(1, self.cfg.kv_budget_bytes // (2 * block_bytes * rows))
        grid = (min(self.cfg.ctas, rows),)
        _prefetch_kv_kernel[grid](
            _as_bytes(k), _as_bytes(v), tables, ctx, self.sink, rows, tables.stride(0), per_row,
            BLOCK_TOKENS=k.shape[1], BLOCK_BYTES=block_bytes, UNIT=unit, CHUNK=8, MODE=self._mode,
            num_warps=4,
        )
        self.num_launches += 1


def _linear(layer: nn.Module, name: str) -> nn.Linear:
    return getattr(layer.self_attn if name in ("qkv_proj", "o_proj") else layer.mlp, name)


def layer_weight_bytes(model: nn.Module) -> int:
    layer = model.model.layers[0]
    return sum(p.numel() * p.element_size() for p in layer.parameters())
