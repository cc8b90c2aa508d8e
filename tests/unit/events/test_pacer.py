"""The pacer of KV event work on the loop (``mesh.events.pacer``): slices, rests, the shared share."""

from __future__ import annotations

import asyncio
import time

import pytest

from mesh.events.pacer import Pacer


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def test_event_work_takes_at_most_its_share_of_the_loop_and_others_run_between_slices() -> None:
    pacer = Pacer(slice_s=0.002, share=0.5)
    gaps: list[float] = []  # how long a request's callback waited for the loop
    stop = False

    async def probe() -> None:
        while not stop:
            t = time.perf_counter()
            await asyncio.sleep(0)
            gaps.append(time.perf_counter() - t)

    task = asyncio.get_running_loop().create_task(probe())
    start = time.perf_counter()
    worked = 0.0
    while time.perf_counter() - start < 0.5:  # a flood: always work to do
        await pacer.turn()
        busy(0.0001)
        worked += 0.0001
    elapsed = time.perf_counter() - start
    stop = True
    await task
    assert worked / elapsed <= 0.6  # the share (0.5), with a generous margin for a loaded machine
    assert pacer.slices >= 20 and pacer.rested_s > 0
    assert len(gaps) >= 20  # the probe ran between slices throughout


async def test_work_within_a_slice_never_yields() -> None:
    pacer = Pacer(slice_s=10.0, share=0.5)
    ran = []
    other = asyncio.get_running_loop().call_soon(ran.append, 1)
    for _ in range(100):
        await pacer.turn()
    assert not ran and pacer.slices == 0
    other.cancel()


async def test_a_stream_starting_during_another_streams_rest_waits_for_it() -> None:
    pacer = Pacer(slice_s=0.01, share=0.1)  # a rest 9x the slice
    await pacer.turn()
    busy(0.012)
    rest = asyncio.get_running_loop().create_task(pacer.turn())  # ends the slice: rests ~0.1 s
    await asyncio.sleep(0)
    t = time.perf_counter()
    await pacer.turn()  # another stream: waits the rest out
    assert time.perf_counter() - t >= 0.05
    await rest


def test_a_pacer_needs_a_positive_slice_and_share() -> None:
    for slice_s, share in ((0, 0.5), (0.001, 0), (0.001, 1.5)):
        with pytest.raises(ValueError):
            Pacer(slice_s, share)


async def test_a_pause_without_event_work_is_never_charged_as_work() -> None:
    """A turn long after the last (another task used the pacer, then nothing ran for a while)
    starts a fresh slice: no rest is owed for the time nobody worked."""
    pacer = Pacer(slice_s=0.0005, share=0.5)
    await pacer.turn()  # e.g. the keeper's scrub step, then nothing: no idle() call
    await asyncio.sleep(0.2)
    t = time.perf_counter()
    for _ in range(10):
        await pacer.turn()
    assert time.perf_counter() - t < 0.05 and pacer.rested_s < 0.01


async def test_units_stretched_past_the_gap_by_a_starved_cpu_still_let_the_loop_run() -> None:
    """Every unit lasts longer than the pacer's gap (as when the OS or another thread holds the
    CPU mid-unit): each turn looks like one after a pause, and must still give the loop a turn."""
    pacer = Pacer(slice_s=0.0005, share=0.5)
    ran: list[int] = []
    loop = asyncio.get_running_loop()
    for i in range(5):
        loop.call_soon(ran.append, i)
        await pacer.turn()
        busy(0.004)  # past the 2 ms gap
    assert len(ran) >= 4  # a callback queued before each turn ran by the next
