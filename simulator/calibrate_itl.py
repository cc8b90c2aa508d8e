"""One stream's inter-token time, from the arrival times of its chunks (pure functions).

A chunk's arrival is when the client read it, not when the engine made it: a client (or a
server's event loop) that was held up reads (or sends) everything that queued meanwhile in one
go, the chunks then a parse apart (tens of microseconds). Later in a stream such a run is paid
for by the gap before it, and a mean over the stream stays right; a run that starts the stream
is not: its first chunk arrived late, the tokens behind it in no time (a stream read in one
burst measured first to last has an ITL of microseconds).

``stream_itl``: chunks less than ``COALESCED_GAP_S`` after the previous one are coalesced with
it. The ITL is the mean from the last chunk of the leading run (the first token and whatever
queued behind it) to the last chunk, over the tokens between; a stream with fewer than half its
tokens past the leading run is no measurement (None). Callers take the median over streams and
repeats (``calibrate._decode_points``).
"""

from __future__ import annotations

# Half a millisecond: well above the client's time to parse a chunk it already holds (a hiccup
# while it drains a backlog included), well below any engine's decode step plus the trip of a
# streamed chunk.
COALESCED_GAP_S = 5e-4


def stream_itl(later: list[float], completion_tokens: int | None, max_tokens: int) -> float | None:
    """Mean inter-token time (s) of a stream whose chunks after the first arrived ``later`` s
    after it (ascending), ``completion_tokens`` from its usage when reported; None when there
    are too few tokens, or too few of them past the leading coalesced run."""
    n = completion_tokens or min(max_tokens, len(later) + 1)
    arrivals = [0.0, *later][: max(n, 1)]  # chunks past the n-th carry no token (a finish chunk)
    m = len(arrivals)
    if n < 2 or m < 2:
        return None
    anchor = 0  # the last chunk of the leading run
    while anchor + 1 < m and arrivals[anchor + 1] - arrivals[anchor] < COALESCED_GAP_S:
        anchor += 1
    tokens_per_chunk = (n - 1) / (m - 1)  # 1 unless the endpoint sends several tokens a chunk
    tokens = (m - 1 - anchor) * tokens_per_chunk
    if 2 * tokens < n - 1:
        return None
    return (arrivals[-1] - arrivals[anchor]) / tokens
