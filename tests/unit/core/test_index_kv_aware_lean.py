"""kv_aware's request path (``ClusterView.explain`` False: one lean pass keeping the running
minimum) must decide exactly as its general path: same pick, same RNG draws, same terms."""

from __future__ import annotations

import random

import pytest

from policies.base import ClusterView, NoCandidate, Overlap, RequestInfo, TargetState
from policies.kv_aware import KvAware


class FixedIndex:
    def __init__(self, overlaps: dict[str, Overlap]) -> None:
        self.overlaps = overlaps

    def match(self, keys: object) -> dict[str, Overlap]:
        return self.overlaps


def random_cluster(rng: random.Random) -> tuple[list[TargetState], dict[str, Overlap]]:
    targets = []
    overlaps = {}
    for i in range(rng.choice([1, 2, 5, 40, 300])):
        load = rng.random() < 0.5
        t = TargetState(
            f"t{i}", f"t{i}",
            models=frozenset(rng.choice([(), ("m",), ("other",)])),
            block_size=rng.choice([16, 16, 64, 0]),
            healthy=rng.random() > 0.1, draining=rng.random() < 0.05, circuit_open=rng.random() < 0.05,
            index_healthy=rng.random() > 0.1,
            # small integer loads make exact ties common
            in_flight=rng.randrange(3), prefill_tokens=16 * rng.randrange(3) if load else 0,
            decode_tokens=16 * rng.randrange(3) if load else 0, max_in_flight=rng.choice([0, 0, 1, 2]),
        )
        targets.append(t)
        if rng.random() < 0.5:
            overlaps[t.id] = Overlap(rng.randrange(12), rng.choice([0, 0, rng.randrange(4)]))
    return targets, overlaps


@pytest.mark.parametrize("seed", range(40))
def test_lean_request_path_decides_like_the_general_path(seed: int) -> None:
    rng = random.Random(seed)
    targets, overlaps = random_cluster(rng)
    index = FixedIndex(overlaps)
    policy = KvAware(cpu_weight=0.5)
    general_rng, lean_rng = random.Random(seed), random.Random(seed)
    for blocks in (0, 3, 10, 10, 10):
        req = RequestInfo(model="m", block_keys=list(range(blocks)), block_size=16, prompt_tokens=blocks * 16 + 3)
        try:
            want = policy.decide(req, ClusterView(targets, 0.0, index, explain=True, rng=general_rng))
        except NoCandidate:
            with pytest.raises(NoCandidate):
                policy.decide(req, ClusterView(targets, 0.0, index, explain=False, rng=lean_rng))
            continue
        got = policy.decide(req, ClusterView(targets, 0.0, index, explain=False, rng=lean_rng))
        assert got.target == want.target
        assert got.scores == {want.target: want.scores[want.target]}
        assert got.overlaps == {k: v for k, v in want.overlaps.items() if k == want.target}
        assert got.reason == want.reason
    assert general_rng.random() == lean_rng.random()  # the same number of draws


def test_lean_path_keeps_ties_random_and_skips_full_targets() -> None:
    targets = [TargetState(f"t{i}", f"t{i}") for i in range(4)] + [TargetState("full", "full", in_flight=1,
                                                                                  max_in_flight=1)]
    index = FixedIndex({"full": Overlap(10, 0)})
    policy = KvAware()
    req = RequestInfo(model="m", block_keys=list(range(10)), block_size=16, prompt_tokens=160)
    picks = {policy.decide(req, ClusterView(targets=targets, now=0.0, index=index, explain=False)).target
             for _ in range(60)}
    assert picks == {"t0", "t1", "t2", "t3"}
