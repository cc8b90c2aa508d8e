"""The requests of the tests that run the simulated worker against the bundled engine's scheduler
and block manager: their block size and key seed, the request shape, and closed-loop sessions."""

from __future__ import annotations

import random

BS = 4
SEED = 7

# (arrival s or None, (predecessor, think s) or None, prompt tokens); one output token each
Req = tuple[float | None, tuple[int, float] | None, list[int]]


def sessions(rng: random.Random) -> list[Req]:
    """Four independent sessions of eight turns, each turn extending the last, closed loop."""
    reqs: list[Req] = []
    for _ in range(4):
        ctx = [rng.randrange(1000) for _ in range(rng.randrange(8, 30))]
        for turn in range(8):
            ctx = ctx + [rng.randrange(1000) for _ in range(rng.randrange(1, 12))]
            if turn == 0:
                reqs.append((rng.randrange(0, 6) + rng.random(), None, list(ctx)))
            else:
                reqs.append((None, (len(reqs) - 1, rng.randrange(0, 4) + rng.random()), list(ctx)))
    return reqs
