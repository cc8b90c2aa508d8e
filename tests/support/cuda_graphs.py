"""The CUDA graph path of ``ModelRunner`` on CPU, for the engine's tests of async decode and graph
input staging: the capture and replay stood in for by eager runs of the same model over the same
static buffers, CUDA events by no-ops (the CPU runs in order). What runs for real:
``ModelRunner._capture_graphs``' buffers and ``_launch``."""

from __future__ import annotations

import types

import pytest
import torch

from workers.engine.model_runner import ModelRunner
from workers.model.layers import AttentionMetadata


class _Event:  # CPU work is synchronous: recorded means done
    def record(self) -> None: ...

    def synchronize(self) -> None: ...


class _Replay:
    """A "graph" of batch size ``b``: an eager forward over the runner's static inputs."""

    def __init__(self, runner: ModelRunner, b: int) -> None:
        self.runner, self.b = runner, b

    def replay(self) -> None:
        r, b = self.runner, self.b
        meta = AttentionMetadata(r._g_slots[:b], 0, decode_block_tables=r._g_tables[:b],
                                 decode_context_lens=r._g_ctx[:b])
        with torch.inference_mode():
            r._g_logits[b].copy_(r.model.lm_head(r.model(r._g_ids[:b], r._g_pos[:b], r.kv_caches, meta, r.backend)))


def emulate_graphs(runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    """Capture ``runner``'s graphs with CUDA stood in for, each "graph" an eager forward over the
    static inputs (``_Replay``), and route its decode launches through them."""
    zeros, ones = torch.zeros, torch.ones
    with monkeypatch.context() as m:  # only while the buffers are made: no pinned memory on CPU
        m.setattr(torch, "zeros", lambda *a, pin_memory=False, **k: zeros(*a, **k))
        m.setattr(torch, "ones", lambda *a, pin_memory=False, **k: ones(*a, **k))
        m.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
        m.setattr(torch.cuda, "CUDAGraph", lambda: types.SimpleNamespace(pool=lambda: None))
        m.setattr(torch.cuda, "graph", lambda *a, **k: _NoCapture())
        m.setattr(torch.cuda, "Stream", lambda *a, **k: None)
        runner._capture_graphs()
    assert runner.graphs, "the stand-in capture failed"
    for b in runner.graphs:
        runner.graphs[b] = _Replay(runner, b)  # type: ignore[assignment]

    def launch(seqs, prev=None):  # type: ignore[no-untyped-def]
        with torch.inference_mode():
            return runner._launch(seqs, prev)

    monkeypatch.setattr(runner, "launch_decode", launch)
    monkeypatch.setattr(torch.cuda, "Event", _Event)


class _NoCapture:
    def __enter__(self) -> _NoCapture:
        return self

    def __exit__(self, *exc: object) -> bool:
        return False
