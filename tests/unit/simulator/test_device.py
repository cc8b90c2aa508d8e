"""Workers on one device slow each other down, as time-slicing does, by the profile's measurements."""

from __future__ import annotations

import numpy as np
import pytest

from simulator.device import Device
from simulator.engine import SimConfig, Simulator
from simulator.profile import DecodeTiming, PrefillTiming, Profile, ProfileError, from_dict, with_shared
from simulator.traces import Trace, TraceRequest

# alone a prefill step costs 100 ms; measured with both workers of the device busy, 300 ms
PROFILE = Profile(name="t", block_size=16, kv_blocks=0, prefill=PrefillTiming(base_ms=100.0),
                  decode=DecodeTiming(base_ms=10.0), shared_workers=2, shared_prefill=PrefillTiming(base_ms=300.0),
                  shared_decode=DecodeTiming(base_ms=30.0))


def one_step_requests(*arrivals: float) -> Trace:
    """Requests of one prefill step each (one output token), on distinct prefixes."""
    reqs = [TraceRequest(i, None, a, (), 40, 1, np.arange(2, dtype=np.uint64) + 10 * i + 1, f"r{i}")
            for i, a in enumerate(arrivals)]
    return Trace(reqs, 16, ["mesh"], ["test"])


def ttft_ms(trace: Trace, profile: Profile, per_device: int) -> list[float]:
    config = SimConfig(workers=2, profile=profile, workers_per_device=per_device)
    r = Simulator(trace, "round_robin", config).run()
    assert sorted(r.worker.tolist()) == [0, 1]  # one request per worker
    return [round(float(x) * 1e3, 6) for x in r.first_token - r.arrival]


def test_workers_on_separate_devices_do_not_slow_each_other() -> None:
    assert ttft_ms(one_step_requests(0.0, 0.0), PROFILE, per_device=1) == [100.0, 100.0]


def test_workers_busy_together_run_at_the_measured_shared_pace() -> None:
    assert ttft_ms(one_step_requests(0.0, 0.0), PROFILE, per_device=2) == [300.0, 300.0]


def test_the_pace_changes_in_the_middle_of_a_step_when_another_worker_starts_or_stops() -> None:
    # w0 alone does half its step by 50 ms; both busy, its other half takes 150 ms (ends at
    # 200 ms); w1 did 50 ms of its work by then and finishes alone 50 ms later
    first, second = ttft_ms(one_step_requests(0.0, 0.05), PROFILE, per_device=2)
    assert first == pytest.approx(200.0) and second == pytest.approx(200.0)


def test_without_a_shared_measurement_busy_workers_share_the_device_evenly() -> None:
    unmeasured = Profile(name="t", block_size=16, kv_blocks=0, prefill=PrefillTiming(base_ms=100.0),
                         decode=DecodeTiming(base_ms=10.0))
    assert ttft_ms(one_step_requests(0.0, 0.0), unmeasured, per_device=2) == [200.0, 200.0]


def test_slowdown_interpolates_between_alone_and_the_measured_workers() -> None:
    device = Device(measured_workers=4)
    assert device.slowdown(1, 4.3) == 1.0
    assert device.slowdown(4, 4.3) == pytest.approx(4.3)
    assert device.slowdown(3, 4.3) == pytest.approx(1 + 2 * 3.3 / 3)
    assert device.slowdown(4, 0.8) == 1.0  # sharing never speeds a step up
    assert Device(measured_workers=0).slowdown(3, 9.0) == 3.0
    with pytest.raises(ValueError):
        Device(measured_workers=1)


def test_shared_timings_are_the_mean_of_the_workers_measured_at_once() -> None:
    a = Profile(name="a", prefill=PrefillTiming(base_ms=10.0, per_token_ms=0.1), decode=DecodeTiming(base_ms=4.0))
    b = Profile(name="b", prefill=PrefillTiming(base_ms=30.0, per_token_ms=0.3), decode=DecodeTiming(base_ms=8.0))
    p = with_shared(a, [a, b])
    assert p.shared_workers == 2 and p.prefill == a.prefill
    assert p.shared_prefill.base_ms == pytest.approx(20.0) and p.shared_prefill.per_token_ms == pytest.approx(0.2)
    assert p.shared_decode.base_ms == pytest.approx(6.0)
    with pytest.raises(ProfileError, match="shared_workers"):
        from_dict({"shared_workers": 1})
    with pytest.raises(ProfileError, match="shared_decode"):
        from_dict({"shared_workers": 4, "shared_prefill": {"base_ms": 1.0}})
