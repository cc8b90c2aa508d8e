"""policies.spec_check: every problem of a spec once, at its path; the roles a spec routes to."""

from __future__ import annotations

from policies.base import Role
from policies.spec_check import named_roles, spec_problems


def test_a_spec_that_builds_has_no_problem() -> None:
    assert spec_problems("session_sticky") == []
    assert spec_problems({"name": "pipeline", "params": {"scorers": [{"name": "prefix", "weight": 2}, "load"],
                                                         "picker": {"name": "softmax", "params": {"temperature": 0.5}}}}) == []


def test_problems_in_separate_branches_are_all_reported() -> None:
    problems = spec_problems({"name": "pipeline", "params": {
        "filters": ["healthy", "helthy"], "scorers": [{"name": "load", "weight": -1}, "kv_utilisation"], "pickr": "max_score"}})
    assert [p.split(": ", 1)[0] for p in problems] == [
        "policy.params.pickr", "policy.params.filters[1]", "policy.params.scorers[0].weight", "policy.params.scorers[1]"]
    assert "(did you mean 'picker'?)" in problems[0] and "(did you mean 'healthy'?)" in problems[1]
    assert "(did you mean 'kv_utilization'?)" in problems[3]


def test_an_error_of_the_composite_itself_is_reported_once_at_its_path() -> None:
    problems = spec_problems({"name": "pipeline", "params": {"scorers": ["load"], "profiles": {
        "prefill": {"scorers": ["prefix"]}, "decode": {"scorers": ["load"]}}}})
    assert problems == ["policy: pipeline: give either profiles or filters/scorers/picker, not both"]


def test_a_plugin_path_that_does_not_import_gets_no_name_suggestion() -> None:
    (problem,) = spec_problems({"name": "no_such_module_xyz:Policy"})
    assert problem.startswith("policy.name: policy 'no_such_module_xyz:Policy': cannot import") and "did you mean" not in problem


def test_named_roles_of_profiles_and_role_filters_inside_a_wrapper() -> None:
    spec = {"name": "session_sticky", "params": {"inner": {"name": "pipeline", "params": {
        "filters": [{"name": "role", "params": {"roles": ["decode", "mixed"]}}], "scorers": ["load"]}}}}
    assert named_roles(spec) == [("policy.params.inner.params.filters[0]", frozenset({Role.DECODE, Role.MIXED}))]
    assert named_roles("kv_aware") == []
