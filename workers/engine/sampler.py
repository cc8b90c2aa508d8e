"""Token sampling: greedy, temperature, top-k, top-p, and per-request seeds.

Sampling uses the exponential race (``argmax(p / E)`` with ``E ~ Exp(1)``), which draws from
``p`` without a host sync. A seeded request owns its generator, so its tokens do not depend on
which other requests share its batch.
"""

from __future__ import annotations

import torch

from workers.engine.sequence import Sequence


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """``logits`` [N, vocab] float32, row i for ``seqs[i]`` -> token ids [N]."""
        params = [s.params for s in seqs]
        greedy_ids = logits.argmax(dim=-1)
        if all(p.greedy for p in params):
            return greedy_ids
        temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=logits.device)
        probs = torch.softmax(logits / temps[:, None], dim=-1)
        if any((p.top_k > 0) or p.top_p < 1.0 for p in params):
            probs = _top_k_top_p(probs, [p.top_k for p in params], [p.top_p for p in params])
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, seq in enumerate(seqs):
            if seq.params.seed is not None and not seq.params.greedy:
                if seq.generator is None:
                    seq.generator = torch.Generator(device=logits.device).manual_seed(seq.params.seed)
                noise[i].exponential_(generator=seq.generator)  # type: ignore[arg-type]
        sampled = (probs / noise).argmax(dim=-1)
        is_greedy = torch.tensor([p.greedy for p in params], device=logits.device)
        return torch.where(is_greedy, greedy_ids, sampled)


def _top_k_top_p(probs: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    vocab = probs.shape[-1]
    ks = torch.tensor([k if k > 0 else vocab for k in top_k], device=probs.device)
    ps = torch.tensor(top_p, device=probs.device, dtype=probs.dtype)
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=probs.device)
    # Keep a token while the mass before it is below top_p (so the top token always stays).
    drop = (rank[None, :] >= ks[:, None]) | ((sorted_p.cumsum(-1) - sorted_p) > ps[:, None])
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
