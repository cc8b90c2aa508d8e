"""mesh.cluster.kubernetes's mapping of EndpointSlices and Pods to workers, and kube_api's watch
lines (the loop against an API server: tests/e2e/gateway/test_kubernetes_discovery.py)."""

from __future__ import annotations

from typing import Any

import pytest

from mesh.cluster.kube_api import Gone, KubeApiError, _event
from mesh.cluster.kubernetes import desired_workers
from mesh.config import ConfigError, KubernetesDiscoveryConfig, parse_config

CFG = KubernetesDiscoveryConfig(selector={"app": "w"})


def eps(*endpoints: dict[str, Any], ports: list[dict[str, Any]] | None = None, labels: dict[str, str] | None = None,
        name: str = "s") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "labels": labels or {}},
            "ports": [{"name": "http", "port": 8000}] if ports is None else ports, "endpoints": list(endpoints)}


def ep(address: str, pod: str | None = None, **conditions: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"addresses": [address], "conditions": conditions}
    if pod:
        out["targetRef"] = {"kind": "Pod", "name": pod}
    return out


def test_ipv6_endpoint_url_and_kv_events_are_bracketed() -> None:
    cfg = KubernetesDiscoveryConfig(selector={"app": "w"}, kv_events_port="kv-events")
    objs = {"ns/s": eps(ep("fd00::5", "w-0"), ports=[{"name": "http", "port": 8000}, {"name": "kv-events", "port": 5557}])}
    wanted, refused = desired_workers(objs, cfg)
    worker, draining = wanted["w-0"]
    assert (worker.url, worker.kv_events.endpoint if worker.kv_events else None) == ("http://[fd00::5]:8000", "tcp://[fd00::5]:5557")
    assert not draining and not refused


def test_ready_unset_counts_as_ready_and_unready_is_absent() -> None:
    wanted, _ = desired_workers({"ns/s": eps(ep("10.0.0.1", "a"), ep("10.0.0.2", "b", ready=False))}, CFG)
    assert list(wanted) == ["a"]


def test_a_lone_unnamed_port_answers_the_port_name_and_a_missing_one_is_refused() -> None:
    wanted, _ = desired_workers({"ns/s": eps(ep("10.0.0.1", "a"), ports=[{"name": "", "port": 9000}])}, CFG)
    assert wanted["a"][0].url == "http://10.0.0.1:9000"
    wanted, refused = desired_workers({"ns/s": eps(ep("10.0.0.1", "a"), ports=[{"name": "grpc", "port": 9000}])}, CFG)
    assert not wanted and refused == {"a (10.0.0.1)": "no port 'http' on its object"}


def test_a_pod_in_two_slices_is_one_worker_the_ready_one() -> None:
    objs = {"ns/s4": eps(ep("10.0.0.1", "a", ready=False, serving=True, terminating=True), name="s4"),
            "ns/s6": eps(ep("fd00::1", "a"), name="s6")}
    wanted, _ = desired_workers(objs, CFG)
    assert wanted["a"][0].url == "http://[fd00::1]:8000" and wanted["a"][1] is False


def test_role_models_block_size_from_labels_and_a_bad_role_is_refused() -> None:
    labels = {"mesh.dev/role": "prefill", "mesh.dev/models": "m1, m2", "mesh.dev/block-size": "64"}
    wanted, _ = desired_workers({"ns/s": eps(ep("10.0.0.1", "a"), labels=labels)}, CFG)
    w = wanted["a"][0]
    assert (w.role.value, w.models, w.block_size) == ("prefill", ["m1", "m2"], 64)
    wanted, refused = desired_workers({"ns/s": eps(ep("10.0.0.1", "a"), labels={"mesh.dev/role": "boss"})}, CFG)
    assert not wanted and "role" in refused["a (10.0.0.1)"]


def test_terminating_ready_pod_drains_and_a_finished_one_is_absent() -> None:
    cfg = KubernetesDiscoveryConfig(selector={"app": "w"}, resource="pods", port=8000)

    def pod(**extra: Any) -> dict[str, Any]:
        meta = {"name": "p", "namespace": "ns", **extra.pop("meta", {})}
        return {"metadata": meta, "status": {"podIP": "10.0.0.9", "phase": "Running",
                                             "conditions": [{"type": "Ready", "status": "True"}], **extra}}

    assert desired_workers({"ns/p": pod()}, cfg)[0]["p"][1] is False
    assert desired_workers({"ns/p": pod(meta={"deletionTimestamp": "2026-01-01T00:00:00Z"})}, cfg)[0]["p"][1] is True
    assert desired_workers({"ns/p": pod(phase="Succeeded")}, cfg)[0] == {}


def test_watch_lines() -> None:
    assert _event('{"type":"ADDED","object":{"metadata":{"resourceVersion":"7"}}}').resource_version == "7"
    with pytest.raises(Gone):
        _event('{"type":"ERROR","object":{"kind":"Status","code":410,"message":"too old"}}')
    with pytest.raises(KubeApiError, match="500"):
        _event('{"type":"ERROR","object":{"kind":"Status","code":500}}')
    with pytest.raises(KubeApiError, match="not a JSON line"):
        _event("garbage")


def test_selector_and_ports_are_validated_with_their_paths() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"discovery": {"kubernetes": {"selector": {"app": "a b"}, "port": "Not_A_Name", "namespace": "X"}}})
    text = "\n".join(info.value.errors)
    for path in ("discovery.kubernetes.selector", "discovery.kubernetes.port", "discovery.kubernetes.namespace"):
        assert path in text
    assert KubernetesDiscoveryConfig(selector={"b": "2", "app.kubernetes.io/name": "w"}).label_selector() == \
        "app.kubernetes.io/name=w,b=2"
