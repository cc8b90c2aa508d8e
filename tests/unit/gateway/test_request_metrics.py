"""mesh.request_metrics (bounded labels, Prometheus histogram semantics), mesh.gateway.request_id,
the access log's line format and its config key."""

from __future__ import annotations

import json
import timeit
from dataclasses import dataclass, field
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from mesh.config import ConfigError, parse_config
from mesh.gateway.access_log import FIELDS, line
from mesh.gateway.request_id import MAX_LENGTH, RequestIds
from mesh.request_metrics import OTHER_MODEL, TTFT_BUCKETS, RequestSeries


@dataclass
class _Target:
    id: str


@dataclass
class _Worker:
    models: frozenset[str]
    targets: list[_Target]


@dataclass
class _Registry:
    workers: dict[str, Any] = field(default_factory=dict)
    version: int = 0


class _Families(Collector):
    def __init__(self, series: RequestSeries) -> None:
        self.series = series

    def collect(self) -> Any:
        return self.series.families()


def _samples(series: RequestSeries) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(series))
    text = generate_latest(registry).decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def _registry() -> _Registry:
    return _Registry({"w0": _Worker(frozenset({"llama"}), [_Target("w0")]),
                      "w1": _Worker(frozenset({"qwen", "qwen-lora"}), [_Target("w1@0"), _Target("w1@1")])})


def test_unknown_models_share_one_other_label_and_known_ones_their_own() -> None:
    series = RequestSeries(_registry())
    assert series.series("llama", "w0") is series.series("llama", "w0")
    made_up = {series.series(f"made-up-{i}", "w0") for i in range(100)}
    assert len(made_up) == 1  # a client's made-up names are one series, not a hundred
    series.series("qwen-lora", "w1@1").usage(10, 4, 2)
    labels = {dict(k[1])["model"] for k in _samples(series) if k[0] == "mesh_prompt_tokens_total"}
    assert labels == {"llama", OTHER_MODEL, "qwen-lora"}


def test_a_model_discovered_later_gets_its_own_series_once_the_registry_moves() -> None:
    reg = _registry()
    series = RequestSeries(reg)
    assert series.series("mistral", "w0") is series.series("anything", "w0")  # both "other"
    reg.workers["w0"].models = frozenset({"llama", "mistral"})
    reg.version += 1
    assert series.series("mistral", "w0") is not series.series("anything", "w0")


def test_a_removed_workers_series_leave_the_scrape() -> None:
    reg = _registry()
    series = RequestSeries(reg)
    series.series("llama", "w0").usage(1, 0, 1)
    old = series.series("qwen", "w1@0")
    old.usage(5, 0, 5)
    series.on_workers_removed([reg.workers.pop("w1")])
    targets = {dict(k[1])["target"] for k in _samples(series) if k[0] == "mesh_prompt_tokens_total"}
    assert targets == {"w0"}
    assert series.series("qwen", "w1@0") is not old  # a new worker of that name starts at zero


def test_histograms_follow_prometheus_le_semantics() -> None:
    series = RequestSeries(_registry())
    s = series.series("llama", "w0")
    for seconds in (0.001, 0.0011, 0.5, 1e6):  # on a bound counts in it; past the last in +Inf only
        s.ttft(seconds)
    got = _samples(series)
    labels = {("model", "llama"), ("target", "w0")}

    def bucket(le: str) -> float:
        return got[("mesh_time_to_first_token_seconds_bucket", frozenset({*labels, ("le", le)}))]

    assert bucket("0.001") == 1 and bucket("0.005") == 2 and bucket("0.5") == 3
    assert bucket(repr(TTFT_BUCKETS[-1])) == 3 and bucket("+Inf") == 4
    assert got[("mesh_time_to_first_token_seconds_count", frozenset(labels))] == 4
    assert abs(got[("mesh_time_to_first_token_seconds_sum", frozenset(labels))] - (0.5021 + 1e6)) < 1e-6


def test_an_observation_is_far_cheaper_than_a_prometheus_client_histograms() -> None:
    s = RequestSeries(_registry()).series("llama", "w0")
    per_call = min(timeit.repeat(lambda: s.itl(0.02), number=5_000, repeat=7)) / 5_000  # min: a loaded box
    assert per_call < 2e-6, per_call  # ~0.2 us; prometheus_client's observe: ~3.4 us here


def test_request_ids_keep_a_sane_client_id_and_make_the_rest() -> None:
    ids = RequestIds()
    assert ids.of([(b"x-request-id", b"abc-1_2.3:4")]) == b"abc-1_2.3:4"
    assert ids.of([(b"x-request-id", b"x" * MAX_LENGTH)]) == b"x" * MAX_LENGTH
    made = [ids.of(h) for h in ([], [(b"x-request-id", b"a b")], [(b"x-request-id", b"x" * (MAX_LENGTH + 1))],
                                [(b"x-request-id", b"caf\xc3\xa9")], [(b"x-request-id", b"")])]
    assert len(set(made)) == len(made)
    assert all(m.split(b"-")[0] == made[0].split(b"-")[0] and len(m.split(b"-")[0]) == 16 for m in made)
    assert RequestIds().of([]).split(b"-")[0] != made[0].split(b"-")[0]  # another process, another prefix


def test_an_access_log_line_is_one_json_object_with_every_field() -> None:
    entry = (1_800_000_000.25, b"rid-1", "POST", "/v1/chat/completions", 200, "llama", "w0", "w0@1", "s",
             12, 4, 7, 0.1234567, 0.5, "10.0.0.1:5555")
    got = json.loads(line(entry))  # type: ignore[arg-type]
    assert list(got) == list(FIELDS)
    assert got["time"] == "2027-01-15T08:00:00.250Z" and got["request_id"] == "rid-1"
    assert (got["prompt_tokens"], got["cached_tokens"], got["generation_tokens"]) == (12, 4, 7)
    assert got["ttft_s"] == 0.123457 and got["client"] == "10.0.0.1:5555"
    assert "\n" not in line(entry)  # type: ignore[arg-type]


def test_the_access_log_key_takes_yaml_off_and_json_only() -> None:
    assert parse_config(yaml.safe_load("server: {access_log: off}"), "t").server.access_log == "off"  # YAML: false
    assert parse_config(yaml.safe_load("server: {access_log: json}"), "t").server.access_log == "json"
    with pytest.raises(ConfigError, match="server.access_log"):
        parse_config({"server": {"access_log": "text"}}, "t")
