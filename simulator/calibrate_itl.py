"""One stream's inter-token time, from the arrival times of its chunks (pure functions).

A chunk's arrival is when the client read it, not when the engine made it: a client (or a
server's event loop) that was held up reads everything that queued meanwhile in one go, the
chunks then a parse apart (tens of microseconds). Such a run of coalesced chunks carries no
step time, and a stream read mostly that way says nothing about the engine (measured first to
last, a stream read in one burst has an ITL of microseconds).

``stream_itl``: chunks less than ``COALESCED_GAP_S`` after the previous one are coalesced with
it. A stream whose chunk gaps are mostly coalesced is no measurement (None). Otherwise the ITL is
the mean from the last chunk of the first run (the first token and whatever queued behind it)
to the last chunk, over the tokens between: a run later in the stream is paid for by the gap
before it, so it is counted, as are streams that send several tokens per chunk. Callers take
the median over streams and repeats (``calibrate._decode_points``).
"""

from __future__ import annotations

# A tenth of a millisecond: far above the client's time to parse a chunk it already holds, far
# below any engine's decode step plus the trip of a streamed chunk.
COALESCED_GAP_S = 1e-4


def stream_itl(later: list[float], completion_tokens: int | None, max_tokens: int) -> float | None:
    """Mean inter-token time (s) of a stream whose chunks after the first arrived ``later`` s
    after it (ascending), ``completion_tokens`` from its usage when reported; None when there
    are too few tokens, or when most chunk gaps are coalesced (no step time in them)."""
    n = completion_tokens or min(max_tokens, len(later) + 1)
    arrivals = [0.0, *later][: max(n, 1)]  # chunks past the n-th carry no token (a finish chunk)
    m = len(arrivals)
    if n < 2 or m < 2:
        return None
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    separate = [g >= COALESCED_GAP_S for g in gaps]
    if 2 * sum(separate) < len(gaps):
        return None
    anchor = separate.index(True)  # the last chunk of the first coalesced run
    tokens_per_chunk = (n - 1) / (m - 1)  # 1 unless the endpoint sends several tokens a chunk
    return (arrivals[-1] - arrivals[anchor]) / ((m - 1 - anchor) * tokens_per_chunk)
