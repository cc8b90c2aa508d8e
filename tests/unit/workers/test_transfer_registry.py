"""``workers.transfer.registry``: exactly-once release of pinned transfers whatever the order of
consumers, cancels, deadlines and readers; admission bounds never exceeded."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.transfer.registry import Admission, Release, TransferGone, TransferRegistry


class Unpins:
    def __init__(self) -> None:
        self.calls: list[tuple[int, ...]] = []

    def __call__(self, block_ids: tuple[int, ...]) -> None:
        self.calls.append(block_ids)


def test_released_only_when_every_consumer_is_done() -> None:
    unpins = Unpins()
    reg = TransferRegistry(unpins, ttl_s=10)
    reg.add("t", [1, 2], [11, 12], ["decode", "cpu_save"], now=0.0)
    assert not reg.consumer_done("t", "decode")
    assert unpins.calls == [] and reg.active == 1
    assert reg.consumer_done("t", "cpu_save")
    assert unpins.calls == [(1, 2)]
    assert reg.stats()["transfers_released_by_consumer"] == 1 and reg.active == 0


def test_deadline_releases_and_late_consumer_is_a_duplicate() -> None:
    unpins = Unpins()
    reg = TransferRegistry(unpins, ttl_s=5)
    reg.add("t", [3], [13], ["decode"], now=100.0)
    assert reg.expire(104.9) == 0
    assert reg.expire(105.0) == 1
    assert not reg.consumer_done("t", "decode")
    assert unpins.calls == [(3,)]
    s = reg.stats()
    assert s["transfers_released_by_timeout"] == 1 and s["transfer_duplicate_releases"] == 1


def test_release_waits_for_the_reader_then_a_late_pull_is_refused() -> None:
    unpins = Unpins()
    reg = TransferRegistry(unpins, ttl_s=5)
    reg.add("t", [4, 5], [14, 15], ["decode"], now=0.0)
    t = reg.begin_read("t")
    assert reg.cancel("t")
    assert unpins.calls == []  # the reader still streams the pages
    with pytest.raises(TransferGone):
        reg.begin_read("t")
    reg.end_read(t)
    assert unpins.calls == [(4, 5)]
    assert reg.stats()["transfers_released_by_cancel"] == 1 and reg.stats()["transfer_late_pulls"] == 1


def test_a_state_checkpoint_is_unpinned_once_with_its_blocks_after_the_last_reader() -> None:
    """A hybrid transfer's state pin follows its blocks': deferred while a reader streams, then
    released exactly once whatever releases the transfer again."""
    unpins, states = Unpins(), list[int]()
    reg = TransferRegistry(unpins, ttl_s=5, unpin_state=states.append)
    reg.add("t", [4, 5], [14, 15], ["decode"], now=0.0, state_key=15)
    assert reg.stats()["transfer_pinned_states"] == 1 and reg.describe(0.0)[0]["state"] is True
    t = reg.begin_read("t")
    assert reg.consumer_done("t", "decode")
    assert states == [] and unpins.calls == []
    reg.end_read(t)
    assert not reg.cancel("t") and reg.expire(100.0) == 0
    assert (unpins.calls, states) == ([(4, 5)], [15])
    assert reg.stats()["transfer_pinned_states"] == 0


def test_a_state_must_be_the_last_blocks_on_a_registry_that_unpins_states() -> None:
    with_states = TransferRegistry(Unpins(), unpin_state=lambda key: None)
    for bad in ([], [1]):  # no block, or not the last block's key
        with pytest.raises(ValueError):
            with_states.add("t", bad, [10 + b for b in bad], ["decode"], now=0.0, state_key=99)
    with pytest.raises(ValueError):
        TransferRegistry(Unpins()).add("t", [1], [11], ["decode"], now=0.0, state_key=11)


def test_no_consumer_releases_at_once() -> None:
    unpins = Unpins()
    reg = TransferRegistry(unpins)
    reg.add("t", [7], [17], [], now=0.0)
    assert unpins.calls == [(7,)] and reg.active == 0


ops = st.lists(
    st.tuples(st.sampled_from(["done_a", "done_b", "cancel", "expire", "read", "end_read", "dup"]),
              st.integers(0, 3), st.floats(0, 20)),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_every_transfer_is_unpinned_exactly_once(sequence: list[tuple[str, int, float]]) -> None:
    unpins = Unpins()
    reg = TransferRegistry(unpins, ttl_s=10)
    readers: dict[int, list[object]] = {i: [] for i in range(4)}
    for i in range(4):
        reg.add(f"t{i}", [i * 10, i * 10 + 1], [i, i + 100], ["a", "b"], now=float(i))
    clock = 0.0
    for op, i, dt in sequence:
        tid = f"t{i}"
        clock += dt
        if op == "done_a":
            reg.consumer_done(tid, "a")
        elif op == "done_b":
            reg.consumer_done(tid, "b")
        elif op in ("cancel", "dup"):
            reg.cancel(tid)
        elif op == "expire":
            reg.expire(clock)
        elif op == "read":
            try:
                readers[i].append(reg.begin_read(tid))
            except TransferGone:
                pass
        elif op == "end_read" and readers[i]:
            reg.end_read(readers[i].pop())  # type: ignore[arg-type]
        # never unpinned while somebody reads it
        for j, rs in readers.items():
            if rs:
                assert (j * 10, j * 10 + 1) not in unpins.calls
    for i, rs in readers.items():
        while rs:
            reg.end_read(rs.pop())  # type: ignore[arg-type]
    reg.expire(1e9)
    assert sorted(unpins.calls) == [(i * 10, i * 10 + 1) for i in range(4)]  # each exactly once
    s = reg.stats()
    released = sum(s[f"transfers_released_by_{r.value}"] for r in Release)
    assert released == 4 and reg.active == 0 and reg.pinned_blocks == 0


def test_admission_bounds_count_and_bytes() -> None:
    adm = Admission(max_pending=2, max_bytes=100)
    a = adm.try_admit(60)
    assert a is not None
    assert adm.try_admit(50) is None  # bytes
    b = adm.try_admit(40)
    assert b is not None
    assert adm.try_admit(0) is None  # count
    assert adm.too_large(101) and not adm.too_large(100)
    a.release()
    a.release()  # idempotent
    assert adm.pending == 1 and adm.pending_bytes == 40
    b.release()
    s = adm.stats()
    assert s["admission_peak_pending"] == 2 and s["admission_peak_bytes"] == 100 and s["admission_refused"] == 2


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 80)), max_size=80))
def test_admission_never_exceeds_its_bounds(steps: list[tuple[bool, int]]) -> None:
    adm = Admission(max_pending=3, max_bytes=150)
    held = []
    for admit, size in steps:
        if admit:
            t = adm.try_admit(size)
            if t is not None:
                held.append(t)
        elif held:
            held.pop(size % len(held)).release()
        assert adm.pending <= 3 and adm.pending_bytes <= 150
        assert adm.pending == len(held) and adm.pending_bytes == sum(t.nbytes for t in held)
    for t in held:
        t.release()
    assert adm.pending == 0 and adm.pending_bytes == 0
