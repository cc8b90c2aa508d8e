"""The admission queue's line on its own (real asyncio, a routing function over a slot count):
FIFO order, a wake-up handed on by a request that cannot use it, and one kept when a woken
request is cancelled."""

from __future__ import annotations

import asyncio

import pytest

from mesh.config import AdmissionConfig
from mesh.errors import MeshError
from mesh.gateway.admission_queue import AdmissionQueue, OverCapacity
from mesh.metrics import Metrics


class Slots:
    """Free capacity per model; ``take(model)`` is the proxy's route: a lease or OverCapacity."""

    def __init__(self, **free: int) -> None:
        self.free = dict(free)
        self.order: list[str] = []

    def take(self, model: str, who: str) -> str:
        if self.free.get(model, 0) <= 0:
            raise OverCapacity()
        self.free[model] -= 1
        self.order.append(who)
        return who


def queue(max_waiting: int = 8, max_wait_s: float = 5.0) -> AdmissionQueue:
    return AdmissionQueue(lambda: AdmissionConfig(max_waiting=max_waiting, max_wait_s=max_wait_s), Metrics())


async def _settle() -> None:
    """Let woken tasks run: a few loop turns, far less than the queue's recheck (so what a test sees
    was done by the wake-ups, not by a waiter's periodic recheck)."""
    for _ in range(50):
        await asyncio.sleep(0)


async def test_held_requests_are_served_in_arrival_order() -> None:
    q, slots = queue(), Slots(m=0)
    tasks = [asyncio.create_task(q.admit(lambda i=i: slots.take("m", f"r{i}"))) for i in range(3)]
    await _settle()
    assert q.waiting == 3
    for _ in range(3):
        slots.free["m"] += 1
        q.released()
        await _settle()
    assert [await t for t in tasks] == ["r0", "r1", "r2"] and slots.order == ["r0", "r1", "r2"]
    assert q.waiting == 0


async def test_a_wake_up_the_head_cannot_use_goes_to_the_next() -> None:
    q, slots = queue(), Slots(a=0, b=0)
    head = asyncio.create_task(q.admit(lambda: slots.take("a", "a-request")))
    second = asyncio.create_task(q.admit(lambda: slots.take("b", "b-request")))
    await _settle()
    slots.free["b"] = 1  # capacity for model b frees: the head (model a) is woken first
    q.released()
    await _settle()
    assert second.done() and second.result() == "b-request"
    assert not head.done() and q.waiting == 1  # the head kept its place
    head.cancel()


async def test_a_cancelled_request_passes_on_the_wake_up_it_was_given() -> None:
    q, slots = queue(), Slots(m=0)
    first = asyncio.create_task(q.admit(lambda: slots.take("m", "first")))
    second = asyncio.create_task(q.admit(lambda: slots.take("m", "second")))
    await _settle()
    slots.free["m"] = 1
    q.released()  # wakes first ...
    first.cancel()  # ... which leaves before it decides
    await _settle()
    assert second.done() and second.result() == "second"


async def test_a_newcomer_queues_behind_waiting_requests() -> None:
    q, slots = queue(), Slots(m=0)
    waiting = asyncio.create_task(q.admit(lambda: slots.take("m", "waiting")))
    await _settle()
    slots.free["m"] = 1  # freed, not yet announced: a newcomer must not jump the line
    newcomer = asyncio.create_task(q.admit(lambda: slots.take("m", "newcomer")))
    await _settle()
    assert not newcomer.done()
    q.released()
    await _settle()
    assert waiting.result() == "waiting" and not newcomer.done()
    newcomer.cancel()


async def test_bounds_answer_429_when_the_line_is_full_and_503_after_the_wait() -> None:
    q, slots = queue(max_waiting=1, max_wait_s=0.05), Slots(m=0)
    held = asyncio.create_task(q.admit(lambda: slots.take("m", "held")))
    await _settle()
    with pytest.raises(MeshError) as full:
        await q.admit(lambda: slots.take("m", "refused"))
    assert full.value.status == 429 and full.value.code == "over_capacity"
    with pytest.raises(MeshError) as late:
        await held
    assert late.value.status == 503 and late.value.code == "queue_timeout"
    assert q.waiting == 0


async def test_with_holding_off_over_capacity_is_raised_at_once() -> None:
    q, slots = queue(max_waiting=0), Slots(m=0)
    with pytest.raises(OverCapacity):
        await q.admit(lambda: slots.take("m", "x"))
    assert q.held_total == 0
