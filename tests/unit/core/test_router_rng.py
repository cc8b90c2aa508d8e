"""The router's RNG: every random choice of a decision draws from it (``ClusterView.rng``), a seed
reproduces a run's choices, and a preview draws from a copy so the live decision is the one shown."""

from __future__ import annotations

from mesh.core.router import Router
from policies import create_policy
from policies.base import RequestInfo, TargetState


def _router(spec: object, seed: int | None) -> Router:
    targets = {t: TargetState(id=t, worker=t) for t in "abcdefgh"}
    return Router(create_policy(spec), targets, seed=seed)


def _request() -> RequestInfo:
    return RequestInfo(model="m", block_keys=[], block_size=16, prompt_tokens=16)


def _picks(router: Router, n: int) -> list[str]:
    return [str(router.route(_request(), float(i))[0].target) for i in range(n)]


def test_a_seed_reproduces_every_random_choice_and_another_seed_differs() -> None:
    assert _picks(_router("random", 7), 50) == _picks(_router("random", 7), 50)
    assert _picks(_router("random", 7), 50) != _picks(_router("random", 8), 50)


def test_a_preview_shows_the_next_live_decision_and_leaves_it_unchanged() -> None:
    for spec in ("random", "power_of_two", "kv_aware", "round_robin",
                 {"name": "pipeline", "params": {"picker": "weighted_random", "scorers": ["load"]}}):
        router, twin = _router(spec, 3), _router(spec, 3)
        for i in range(20):
            shown = [router.preview(_request(), float(i)).target for _ in range(3)]
            live = router.route(_request(), float(i))[0].target
            assert shown == [live] * 3, spec
            assert twin.route(_request(), float(i))[0].target == live, spec  # as if no preview ran
