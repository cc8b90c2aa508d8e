"""The engine's logits at every position of one sequence, computed chunk by chunk through the
paged cache (a chunk of 1 token is a decode step, a longer one a prefill over the cached prefix),
and the comparison with a reference's logits that the loader tests share."""

from __future__ import annotations

import torch

from workers.engine.block_manager import BlockManager
from workers.engine.model_runner import ModelRunner
from workers.engine.scheduler import ScheduledBatch
from workers.engine.sequence import SamplingParams, Sequence


def chunked_logits(runner: ModelRunner, block_size: int, tokens: list[int], chunks: list[int],
                   *, recurrent_slots: int = 0) -> torch.Tensor:
    """``runner``'s logits for ``tokens``, ``chunks`` tokens at a time (they sum to its length);
    ``recurrent_slots``: state slots to enable for a hybrid model."""
    bm = BlockManager(runner.num_blocks, block_size)
    if recurrent_slots:
        bm.enable_states(recurrent_slots, 0, 0)
    seq = Sequence("r", tokens, SamplingParams(max_tokens=1), block_size, key_seed=1)
    bm.allocate(seq)
    out = []
    for n in chunks:
        batch = ScheduledBatch(decodes=[seq]) if n == 1 else ScheduledBatch(prefills=[(seq, n)])
        inputs = runner.prepare(batch)
        with torch.inference_mode():
            hidden = runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta, runner.backend)
            out.append(runner.model.compute_logits(hidden))
        seq.num_computed_tokens += n
    return torch.cat(out)


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, rel_tol: float = 1e-5) -> None:
    """Relative error of the whole logits tensor under ``rel_tol``, and the same argmax everywhere."""
    rel = (ours - ref).norm() / ref.norm()
    assert rel < rel_tol, f"relative error {rel:.2e}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
