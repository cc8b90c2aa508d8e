"""Through the real CLI (``mesh config validate``): a ``pipeline`` with no scorers scores every
candidate 0, so its picker chooses at random and the policy behaves like ``random`` (a scorer list
lost to a YAML indentation slip would give no other sign). It is a loud warning
naming the profile, not an error: ``tests/unit/policies/test_policies_pipeline.py`` relies on it as a fair
random choice.
"""

from __future__ import annotations

from pathlib import Path

from tests.support.config_cli import validate_policy


def test_a_pipeline_without_scorers_is_warned_about(tmp_path: Path) -> None:
    proc = validate_policy(tmp_path, {"name": "pipeline", "params": {"filters": ["healthy"]}})
    out = proc.stdout + proc.stderr
    assert "no scorers" in out and "random" in out, out


def test_a_pd_profile_without_scorers_is_named_in_the_warning(tmp_path: Path) -> None:
    proc = validate_policy(tmp_path, {"name": "pipeline", "params": {"profiles": {
        "prefill": {"scorers": ["load"]}, "decode": {"filters": ["healthy"]}}}})
    out = proc.stdout + proc.stderr
    assert "pipeline profile 'decode': no scorers" in out and "'prefill': no scorers" not in out, out


def test_a_pipeline_with_scorers_is_not_warned_about(tmp_path: Path) -> None:
    proc = validate_policy(tmp_path, {"name": "pipeline", "params": {"scorers": ["load"]}})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no scorers" not in proc.stdout + proc.stderr
