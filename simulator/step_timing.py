"""How long one simulated worker's engine steps take: the profile's cost model in closed form.

A decode step of ``batch`` sequences at ``ctx`` KV tokens costs ``base + per_seq * batch +
per_ctx * ctx (+ per_ctx2 * ctx^2)``; ``decode_span`` sums ``k`` consecutive steps (each adds one
token per sequence) without a loop. A prefill step costs its chunk tokens (linear and
quadratic), their context work and the prefix-hit tokens admitted into it, plus a decode step
and the mixed-batch extras when decodes ride along, plus the CPU-tier blocks it loads.

Pure: built once per worker from its ``Profile`` (milliseconds there, seconds here), never
mutated; the additions keep one order, so a given step always costs the same float.
"""

from __future__ import annotations

from simulator.profile import Profile


class StepTiming:
    """A worker's step costs in seconds (see the module docstring)."""

    __slots__ = ("cpu_load_s", "decode", "hit_s", "mixed_s", "mixed_seq_s", "mixed_tok_s", "prefill")

    def __init__(self, profile: Profile, block_size: int, *, shared: bool = False) -> None:
        # shared: the costs measured with the device's workers all busy (simulator.device)
        p, d = (profile.shared_prefill, profile.shared_decode) if shared else (profile.prefill, profile.decode)
        self.prefill = (p.base_ms / 1e3, p.per_token_ms / 1e3, p.per_token2_ms / 1e3, p.per_token_ctx_ms / 1e3)
        self.hit_s = p.per_hit_token_ms / 1e3  # per prefix-hit token of a request admitted in the step
        self.mixed_s = p.mixed_ms / 1e3  # a step that prefills and decodes: extra cost
        self.mixed_seq_s = p.mixed_per_seq_ms / 1e3
        self.mixed_tok_s = p.mixed_per_token_ms / 1e3
        self.decode = (d.base_ms / 1e3, d.per_seq_ms / 1e3, d.per_ctx_token_ms / 1e3, d.per_ctx_token2_ms / 1e3)
        self.cpu_load_s = profile.per_block_ms_at(profile.cpu.load_ms_per_block, block_size) / 1e3  # per trace block

    def decode_span(self, k: int, batch: int, ctx: int) -> float:
        """Time of ``k`` decode steps of ``batch`` sequences starting at ``ctx`` KV tokens."""
        if k <= 0:
            return 0.0
        base, per_seq, per_ctx, per_ctx2 = self.decode
        tri = k * (k - 1) / 2
        t = k * (base + per_seq * batch) + per_ctx * (k * ctx + batch * tri)
        if per_ctx2:
            sq = k * ctx * ctx + 2 * ctx * batch * tri + batch * batch * (k - 1) * k * (2 * k - 1) / 6
            t += per_ctx2 * sq
        return t

    def steps_done(self, k: int, elapsed: float, batch: int, ctx: int) -> int:
        """Steps of a ``k``-step decode segment completed ``elapsed`` seconds after its start."""
        lo, hi = 0, k  # invariant: span(lo) <= elapsed, answer < hi unless elapsed >= span(k)
        if self.decode_span(hi, batch, ctx) <= elapsed:
            return hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.decode_span(mid, batch, ctx) <= elapsed:
                lo = mid
            else:
                hi = mid
        return lo

    def prefill_step(self, n_tok: int, ctx_work: int, hit_tokens: int, prompt_tokens: int, cpu_blocks: int,
                     batch: int, ctx: int) -> float:
        """One step prefilling ``n_tok`` chunk tokens (``ctx_work``: tokens x their context) while
        ``batch`` sequences at ``ctx`` KV tokens decode; ``hit_tokens`` and ``prompt_tokens`` are
        those of the requests admitted into it, ``cpu_blocks`` the CPU-tier blocks it loads."""
        base, per_tok, per_tok2, per_ctx = self.prefill
        dur = base + per_tok * n_tok + per_tok2 * n_tok * n_tok + per_ctx * ctx_work + self.hit_s * hit_tokens
        if batch:
            dur += self.decode_span(1, batch, ctx)
            dur += self.mixed_s + self.mixed_seq_s * batch + self.mixed_tok_s * prompt_tokens
        dur += cpu_blocks * self.cpu_load_s
        return dur
