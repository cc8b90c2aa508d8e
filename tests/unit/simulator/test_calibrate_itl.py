"""``mesh calibrate``'s inter-token time of a stream: the chunks read coalesced with the first
after a stall (of the client, or of the server's loop) carry no step time and are not counted;
a stream read mostly that way is no measurement, and a decode point is the median over streams
and repeats."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from simulator.calibrate import Endpoint, StreamStats, _decode_points
from simulator.calibrate_itl import stream_itl

BURST = 15e-6  # a parse apart: chunks read from one buffer


def spread(n: int, itl: float, finish_chunk: bool = True) -> list[float]:
    """Arrivals after the first of ``n`` one-token chunks, ``itl`` apart (a finish chunk after)."""
    later = [i * itl for i in range(1, n)]
    return later + [later[-1] + BURST] if finish_chunk else later


def test_a_stream_read_in_one_burst_measures_nothing() -> None:
    """16 tokens read within 0.2 ms of each other (the client stalled across the batch's first
    token): first to last over 15 tokens would say 0.015 ms; it is no measurement."""
    later = [i * BURST for i in range(1, 16)]
    assert stream_itl(later, 16, 16) is None
    assert StreamStats(0.02, later, 40, 16, 0).itl(16) is None


def test_tokens_queued_behind_the_first_are_not_counted() -> None:
    """The first 4 tokens read together, then one every 2 ms: 2 ms (first to last said 1.5 ms)."""
    later = [i * BURST for i in range(1, 4)] + [3 * BURST + i * 2e-3 for i in range(1, 13)]
    assert stream_itl(later, 16, 16) == pytest.approx(2e-3)
    assert StreamStats(0.02, later, 40, 16, 0).itl(16) == pytest.approx(2e-3)


def test_a_stream_mostly_in_its_leading_burst_is_no_measurement() -> None:
    """14 tokens read together, then 2 (the stall ended near the stream's end): too few to say anything."""
    later = [i * BURST for i in range(1, 14)] + [1e-3, 10e-3]
    assert stream_itl(later, 16, 16) is None


def test_tokens_sent_in_pairs_are_paid_for_by_the_gap_before() -> None:
    """A loaded server whose loop sends what its engine made every 4 ms (two 2 ms steps): 2 ms."""
    later = [t for k in range(1, 9) for t in (k * 4e-3, k * 4e-3 + BURST)]
    assert stream_itl(later, 17, 17) == pytest.approx(2e-3, rel=1e-3)


def test_a_stream_read_as_sent_is_its_mean_gap() -> None:
    assert stream_itl(spread(16, 2e-3), 16, 16) == pytest.approx(2e-3)  # the finish chunk is no token
    assert stream_itl(spread(16, 2e-3, finish_chunk=False), None, 16) == pytest.approx(2e-3)
    # a burst mid-stream (tokens 8-10 read at 10's arrival) is paid for by the gap before it
    later = spread(16, 2e-3)
    later[7:9] = [later[9] - 2 * BURST, later[9] - BURST]
    assert stream_itl(later, 16, 16) == pytest.approx(2e-3)
    assert stream_itl([], 1, 16) is None and stream_itl([2e-3], 1, 16) is None  # one token: no gap


class _Scripted:
    """Stands in for the endpoint in ``_decode_points``: its streams' arrivals in order of the calls."""

    vocab = 100  # prompts are token ids: no sizing probe
    words_per_token = None

    def __init__(self, script: list[list[float]]) -> None:
        self.script = script

    async def stream_stats(self, prompt: Any, max_tokens: int) -> StreamStats:
        return StreamStats(0.01, self.script.pop(0), len(prompt), max_tokens, 0)


def test_a_decode_point_is_the_median_of_the_streams_read_as_sent() -> None:
    """Three rounds per point (the default): a round read in one burst is left out (and said), the rest give
    the median; a point whose every stream came coalesced is left out."""
    burst = [i * BURST for i in range(1, 16)]
    script = [burst, spread(16, 2e-3), spread(16, 2.2e-3),  # batch 1
              burst, burst, spread(16, 3e-3), spread(16, 3e-3), spread(16, 3.2e-3), spread(16, 3.2e-3),  # batch 2
              burst, burst, burst]  # one stream at a long context, three times
    lines: list[str] = []
    batch, ctx = asyncio.run(_decode_points(_Scripted(script), 512, 16, 2, True, lines.append))  # type: ignore[arg-type]
    assert [(b, round(t * 1e4, 6)) for b, t, _ in batch] == [(1, 21.0), (2, 31.0)]
    assert ctx == [] and not script
    assert sum("most read in one burst with the first" in line for line in lines) == 3


async def _serve_one_burst(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A completion stream whose 16 tokens, its usage and [DONE] go out in one write (as a server
    whose loop was held up sends what queued, or a stalled client reads it)."""
    await reader.readuntil(b"\r\n\r\n")
    event = {"choices": [{"index": 0, "text": "a", "finish_reason": None}]}
    body = b"".join(b"data: %s\n\n" % json.dumps(event).encode() for _ in range(16))
    body += b'data: {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 16}}\n\ndata: [DONE]\n\n'
    await asyncio.sleep(0.01)  # prefill
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n" + body)
    await writer.drain()
    writer.close()


def test_a_stream_that_came_in_one_write_over_a_socket_measures_nothing() -> None:
    async def main() -> StreamStats:
        server = await asyncio.start_server(_serve_one_burst, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        ep = Endpoint(f"http://127.0.0.1:{port}", "m", None, 10)
        try:
            return await ep.stream_stats("hello", 16)
        finally:
            await ep.close()
            server.close()
            await server.wait_closed()

    st = asyncio.run(main())
    assert st.completion_tokens == 16 and len(st.later) == 15  # every token arrived ...
    assert st.itl(16) is None  # ... and none of them says how long a step takes
