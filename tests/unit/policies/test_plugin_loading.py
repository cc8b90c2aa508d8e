"""Plugins from outside the package: module:Class in YAML, entry points, and every way to get it wrong."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

from mesh.core.router import Router
from mesh.core.sessions import SessionTable
from policies import create_policy
from policies.base import RequestInfo, TargetState
from policies.registry import PluginError, create

PLUGINS = Path(__file__).parents[2] / "plugins"


@pytest.fixture(autouse=True)
def plugin_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(PLUGINS))


def targets(*ids: str) -> dict[str, TargetState]:
    return {i: TargetState(id=i, worker=i) for i in ids}


def req(sid: str | None = None) -> RequestInfo:
    return RequestInfo(model="m", block_keys=[1, 2], block_size=16, prompt_tokens=40, session_id=sid)


def policy_from_yaml(text: str, seed: int = 0):  # type: ignore[no-untyped-def]
    config = yaml.safe_load(textwrap.dedent(text))
    return create("policy", config["policy"], seed=seed)


def test_scorer_filter_and_picker_plugins_from_yaml_are_used() -> None:
    policy = policy_from_yaml(
        """
        workers:
          - {name: a1, url: http://127.0.0.1:9001}
          - {name: b1, url: http://127.0.0.1:9002}
          - {name: b2, url: http://127.0.0.1:9003}
          - {name: b3, url: http://127.0.0.1:9004}
        policy:
          name: pipeline
          params:
            filters: [healthy, {name: "mesh_test_plugins:DropIds", params: {ids: [b3]}}]
            scorers:
              - {name: "mesh_test_plugins:PreferPrefix", weight: 2, params: {prefix: b}}
              - {name: load, weight: 1}
            picker: "mesh_test_plugins:LastOfBest"
        """
    )
    router = Router(policy, targets("a1", "b1", "b2", "b3"))
    d = router.decide(req(), 0.0)
    assert d.target == "b2"  # b3 dropped; b1 and b2 tie on 3.0, the plugin picker takes the last
    assert d.scores["b2"] == {"prefer_prefix": 1.0, "load": 1.0, "total": 3.0}
    assert d.scores["a1"]["total"] == 1.0 and "b3" not in d.scores


def test_a_whole_policy_plugin_from_yaml_with_its_hooks() -> None:
    policy = policy_from_yaml(
        """
        policy: {name: "mesh_test_plugins:Alphabetical", params: {reverse: true}}
        sessions: {header: x-session-id, idle_ttl_s: 30, max_sessions: 100}
        """
    )
    router = Router(policy, targets("a", "c", "b"), sessions=SessionTable(30, 100))
    d, lease = router.route(req("s"), 0.0)
    assert d.target == "c" and policy.routed == ["c"]
    lease.finish(1.0)


def test_a_plugin_policy_wrapped_by_session_sticky() -> None:
    policy = policy_from_yaml(
        """
        policy:
          name: session_sticky
          params: {inner: "mesh_test_plugins:Alphabetical"}
        """
    )
    tmap = targets("b", "a")
    router = Router(policy, tmap, sessions=SessionTable(30, 100))
    assert router.route(req("s"), 0.0)[0].target == "a"
    tmap["a"].in_flight = 0
    router.targets["c"] = TargetState(id="c", worker="c")
    assert router.route(req("s"), 1.0)[0].reason == "bound"


def test_entry_point_plugins_load_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dist = tmp_path / "mesh_test_ep-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mesh-test-ep\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[mesh.policies]\n"
        "ep_prefer = mesh_test_plugins:PreferPrefix\n"
        "ep_broken = broken_plugin:Anything\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    scorer = create("scorer", {"name": "ep_prefer", "params": {"prefix": "x"}})
    assert type(scorer).__name__ == "PreferPrefix"
    with pytest.raises(PluginError, match="ep_broken.*entry point failed to load"):
        create("scorer", "ep_broken")


@pytest.mark.parametrize(
    ("kind", "spec", "message"),
    [
        ("policy", "no_such_policy", r"unknown policy 'no_such_policy' \(built-in: .*round_robin"),
        ("scorer", "prefix_overlap_typo", "unknown scorer 'prefix_overlap_typo'"),
        ("policy", "no_such_module_xyz:Thing", "cannot import 'no_such_module_xyz'"),
        ("policy", "broken_plugin:Thing", "cannot import 'broken_plugin'.*mesh_missing_dependency_for_tests"),
        ("policy", "mesh_test_plugins:Missing", "has no class 'Missing'"),
        ("policy", "mesh_test_plugins:NOT_A_CLASS", "has no class 'NOT_A_CLASS'"),
        ("policy", "mesh_test_plugins:NotAPolicy", "no decide"),
        ("scorer", "mesh_test_plugins:NotAScorer", "has no score"),
        ("filter", "mesh_test_plugins:LastOfBest", "has no filter"),
        ("picker", "mesh_test_plugins:NotAScorer", "has no pick"),
        ("scorer", {"name": "mesh_test_plugins:PreferPrefix", "params": {"nope": 1}}, "bad parameters"),
        ("scorer", {"name": "mesh_test_plugins:PreferPrefix"}, "bad parameters"),  # missing prefix
        ("scorer", {"params": {}}, "must be a name or a map"),
        ("scorer", {"name": "load", "params": [1]}, "params must be a mapping"),
    ],
)
def test_bad_plugin_specs_raise_clear_errors(kind: str, spec: object, message: str) -> None:
    with pytest.raises(PluginError, match=message):
        if kind == "policy":
            create("policy", spec)  # type: ignore[arg-type]
        else:
            create("policy", {"name": "pipeline", "params": _place(kind, spec)})


def _place(kind: str, spec: object) -> dict[str, object]:
    return {"filters": [spec]} if kind == "filter" else {"scorers": [spec]} if kind == "scorer" else {"picker": spec}


@pytest.mark.parametrize("weight", [-0.5, ".inf", ".nan", "'heavy'"])
def test_yaml_weights_out_of_range_are_refused(weight: str) -> None:
    with pytest.raises(PluginError, match="weight"):
        policy_from_yaml(
            f"""
            policy:
              name: pipeline
              params:
                scorers:
                  - {{name: "mesh_test_plugins:PreferPrefix", weight: {weight}, params: {{prefix: a}}}}
            """
        )


EXAMPLES = Path(__file__).parents[3] / "examples"
EXAMPLE_FILES = sorted(EXAMPLES.glob("*.yaml")) + sorted((EXAMPLES / "plugins").glob("*.yaml"))


def test_every_example_is_here() -> None:
    names = {p.name for p in EXAMPLE_FILES}
    assert {"round_robin.yaml", "cache_aware.yaml", "kv_aware.yaml", "session_sticky.yaml", "pipeline.yaml",
            "pipeline_pd.yaml", "my_scorer.yaml", "gpu_per_worker.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.name)
def test_examples_are_gateway_configs_whose_policy_builds(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mesh.config import parse_config
    from policies.registry import names

    monkeypatch.syspath_prepend(str(EXAMPLES / "plugins"))
    data = yaml.safe_load(path.read_text())
    config = parse_config(data, str(path), check_policy=False)  # the gateway's own validation
    assert config.workers and data["policy"]
    name = data["policy"] if isinstance(data["policy"], str) else data["policy"]["name"]
    if name in ("kv_aware", "cache_aware") and name not in names("policy"):
        # A policy this build does not register: the example is refused, naming exactly it.
        with pytest.raises(PluginError, match=f"unknown policy '{name}'"):
            create("policy", data["policy"])
        return
    policy = create("policy", data["policy"], seed=0)
    tmap = {w.name: TargetState(id=w.name, worker=w.name, role=w.role) for w in config.workers}
    d = Router(policy, tmap, sessions=SessionTable(60, 100)).decide(req("s1"), 0.0)
    assert d.target in tmap


def test_example_rendezvous_scorer_is_stable_and_spreads_sessions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES / "plugins"))
    policy = create("policy", yaml.safe_load((EXAMPLES / "plugins" / "my_scorer.yaml").read_text())["policy"])
    tmap = targets("w0", "w1", "w2")
    router = Router(policy, tmap)
    chosen = {f"s{i}": router.decide(req(f"s{i}"), 0.0).target for i in range(300)}
    assert all(router.decide(req(s), 5.0).target == t for s, t in chosen.items())  # stable per session
    spread = {t: sum(1 for v in chosen.values() if v == t) for t in tmap}
    assert min(spread.values()) > 60, spread
    d = router.decide(req("s1"), 0.0)
    assert all(0.0 <= row["rendezvous"] <= 1.0 for row in d.scores.values())


@pytest.mark.parametrize("spec", [
    {"name": "round_robin", "parms": {"seed": 1}},
    {"name": "session_sticky", "params": {"inner": {"name": "kv_aware", "param": {"seed": 1}}}},
    {"name": "pipeline", "params": {"picker": {"name": "max_score", "prams": {}}}},
])
def test_a_typo_in_a_plugin_specs_own_keys_is_refused(spec: dict[str, object]) -> None:
    """A misspelt key is a PluginError naming it, never dropped silently with the parameters
    under it."""
    with pytest.raises(PluginError, match="unknown keys"):
        create_policy(spec)
