"""Async decode and the graph input staging, on CPU: the CUDA graph path with its capture and
replay stood in for by eager runs of the same model over the same static buffers.

What runs for real: ``ModelRunner._capture_graphs``' buffers, ``_launch`` (staging, table rows
re-sent only when they change, the device-side id gather from the previous step's tokens),
``Scheduler.schedule_ahead`` and ``LLMEngine``'s step-ahead loop. What is stood in for: CUDA
events (no-ops: the CPU runs in order) and the graph itself (an eager forward reading the static
inputs). The GPU test ``tests/gpu/test_engine_gpu.py::test_async_decode_equals_sync_decode``
checks the real graphs."""

from __future__ import annotations

import random
import types

import pytest
import torch

from workers.config import EngineConfig, get_preset
from workers.engine import LLMEngine
from workers.layers import AttentionMetadata
from workers.model import build_model
from workers.model_runner import ModelRunner
from workers.sequence import SamplingParams

TINY = get_preset("tiny")


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


def _emulate_graphs(runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    zeros, ones = torch.zeros, torch.ones
    with monkeypatch.context() as m:  # only while the buffers are made: no pinned memory on CPU
        m.setattr(torch, "zeros", lambda *a, pin_memory=False, **k: zeros(*a, **k))
        m.setattr(torch, "ones", lambda *a, pin_memory=False, **k: ones(*a, **k))
        m.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
        m.setattr(torch.cuda, "CUDAGraph", lambda: types.SimpleNamespace(pool=lambda: None))
        m.setattr(torch.cuda, "graph", lambda *a, **k: _NoCapture())
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


def _run(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch, mode: str, stops: dict[int, int],
         num_kv_blocks: int) -> tuple[dict[str, list[int]], LLMEngine]:
    """mode: "eager" (no graphs), "sync" (graph path, one step at a time), "async"."""
    cfg = EngineConfig(device="cpu", attention_backend="torch", num_kv_blocks=num_kv_blocks, max_num_seqs=16,
                       max_graph_batch_size=16, max_num_batched_tokens=128, max_model_len=512, cpu_threads=1)
    engine = LLMEngine(TINY, cfg, eos_token_id=257, model=model)
    if mode != "eager":
        _emulate_graphs(engine.runner, monkeypatch)
        engine.async_decode = mode == "async"
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(5, 50))] for _ in range(12)]
    arrivals = sorted(rng.randrange(0, 25) for _ in prompts)
    max_tokens = [rng.randrange(1, 28) for _ in prompts]
    out: dict[str, list[int]] = {}
    pending, step = list(range(len(prompts))), 0
    while pending or engine.has_unfinished():
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            stop = (stops[i],) if i in stops else ()
            engine.add_request(f"r{i}", prompts[i], SamplingParams(
                temperature=0.0, max_tokens=max_tokens[i], ignore_eos=True, stop_token_ids=stop))
            out[f"r{i}"] = []
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
