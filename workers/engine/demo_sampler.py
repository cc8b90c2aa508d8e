"""The ``demo`` preset's next token: the next byte of a scripted answer, not a sample of the logits.

A random-weight model over a byte vocabulary answers mojibake. The demo preset keeps tiny's model
and runs every request through the real engine (paged KV cache, prefix cache, KV events,
continuous batching, the forward pass of every step); only the choice of the next token changes:
``DemoSampler`` replaces ``Sampler`` and emits, one byte per step, an answer that says which worker
served the request and how many of its prompt tokens came from that worker's prefix cache.

The answer is a pure function of what is fixed once a sequence is admitted (the worker's name,
the prompt's length, the prompt tokens found cached at its first admission: ``Scheduler``
sets ``num_cached_tokens`` then and never again), so a sequence recomputed after a preemption
continues the same text. The byte at output position ``k`` is ``answer[k]``; after the answer
comes EOS (with ``ignore_eos`` the answer repeats, a space between). Streaming, ``max_tokens``,
stop strings, stop token ids and usage all apply as to any other token, on the normal path.
Temperature, top-p and seeds are ignored: the answer is the same for every sampling setting.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from workers.engine.sequence import Sequence

DEMO_NOTE = ("demo preset: tiny's random weights run every step, but each next token is the next byte of a "
             "scripted answer (which worker served it, how many prompt tokens came from its prefix cache)")


def demo_answer(worker: str, prompt_tokens: int, cached_tokens: int) -> str:
    """The text the demo preset answers with (ASCII, but for a non-ASCII worker name)."""
    if cached_tokens:
        cache = (f"; {cached_tokens} came from my prefix cache (the gateway sends a prompt where its prefix "
                 f"lives), so I computed only {prompt_tokens - cached_tokens}.")
    else:
        cache = (", none of them in my prefix cache yet: send it again and the gateway routes it back here "
                 "to reuse them.")
    return (f"Hello from {worker}, a Mesh worker running the demo preset. Your prompt was {prompt_tokens} "
            f"tokens{cache} (Random weights: this answer is scripted, one token per engine step.)")


class DemoSampler:
    """``Sampler``'s interface (logits [N, vocab], one sequence per row -> token ids [N]) for the
    demo preset; the logits only give the device."""

    def __init__(self, worker: str, eos_token_id: int) -> None:
        self.worker = worker
        self.eos_token_id = eos_token_id

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        ids = [self.next_token(s) for s in seqs]
        return torch.tensor(ids, dtype=torch.int64, device=logits.device)

    def next_token(self, seq: Sequence) -> int:
        script = self._script(seq.num_prompt_tokens, seq.num_cached_tokens, seq.params.ignore_eos)
        return script[seq.num_completion_tokens % len(script)]

    @lru_cache(maxsize=1024)  # noqa: B019  (one sampler per engine, for the engine's lifetime)
    def _script(self, prompt_tokens: int, cached_tokens: int, ignore_eos: bool) -> tuple[int, ...]:
        answer = tuple(demo_answer(self.worker, prompt_tokens, cached_tokens).encode())
        return answer + ((ord(" "),) if ignore_eos else (self.eos_token_id,))
