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


class AlwaysGone:
    """An API server that lists fine and answers every watch with 410 at once."""

    def __init__(self) -> None:
        self.lists = 0

    async def list_objects(self) -> tuple[list[dict[str, Any]], str]:
        self.lists += 1
        return [], str(self.lists)

    async def watch(self, rv: str) -> Any:
        raise Gone("too old resource version")
        yield  # an async generator, as KubeApi.watch


async def test_a_410_right_after_every_list_backs_off_instead_of_spinning() -> None:
    import asyncio

    from mesh.cluster.kubernetes import KubernetesDiscovery
    from mesh.cluster.registry import WorkerRegistry

    cfg = KubernetesDiscoveryConfig(selector={"app": "w"}, backoff_max_s=0.2)
    discovery = KubernetesDiscovery(cfg, WorkerRegistry(parse_config({})))
    api = AlwaysGone()
    task = asyncio.create_task(discovery._run(api))  # type: ignore[arg-type]
    await asyncio.sleep(1.0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert 2 <= api.lists <= 8, api.lists  # ~0.2 s apart; a spinning loop lists thousands of times
    assert discovery.last_error and "410" in discovery.last_error and discovery.state == "backoff"


def test_a_relist_keeps_the_workers_still_there_as_they_are() -> None:
    from mesh.cluster.kubernetes import KubernetesDiscovery
    from mesh.cluster.registry import WorkerRegistry

    registry = WorkerRegistry(parse_config({}))
    discovery = KubernetesDiscovery(CFG, registry)
    discovery.objects = {"ns/s": eps(ep("10.0.0.1", "a"), ep("10.0.0.2", "b"))}
    discovery.reconcile()
    a = registry.workers["a"]
    discovery.objects = {"ns/s": eps(ep("10.0.0.1", "a"))}  # what a relist after a 410 found
    discovery.reconcile()
    assert set(registry.workers) == {"a"} and registry.workers["a"] is a  # not removed and added again
    discovery.objects = {"ns/s": eps(ep("10.0.0.9", "a"))}  # the pod came back at another address
    discovery.reconcile()
    assert registry.workers["a"] is not a and registry.workers["a"].url == "http://10.0.0.9:8000"


def test_kv_events_connect_gives_workers_named_by_their_pod_on_the_bound_endpoint() -> None:
    cfg = KubernetesDiscoveryConfig(selector={"app": "w"}, kv_events_connect=True, kv_events_replay_port="kv-replay")
    objs = {"ns/s": eps(ep("10.0.0.7", "vllm-0"), ports=[{"name": "http", "port": 8000}, {"name": "kv-replay", "port": 5558}])}
    wanted, refused = desired_workers(objs, cfg)
    kv = wanted["vllm-0"][0].kv_events
    assert kv is not None and kv.endpoint is None and kv.replay_endpoint == "tcp://10.0.0.7:5558" and not refused
    assert kv.bound_topics("vllm-0") == ["vllm-0", "kv@vllm-0@"]  # llm-d's topic kv@POD@MODEL names it
    wanted, refused = desired_workers({"ns/s": eps(ep("10.0.0.7", "vllm-0"))}, cfg)
    assert not wanted and refused == {"vllm-0 (10.0.0.7)": "no port 'kv-replay' (kv_events_replay_port) on its object"}
    with pytest.raises(ConfigError, match="kv_events.bind is not set"):
        parse_config({"discovery": {"kubernetes": {"selector": {"app": "w"}, "kv_events_connect": True}}})
    with pytest.raises(ConfigError, match="exclude each other"):
        parse_config({"kv_events": {"bind": "tcp://*:5557"}, "discovery": {"kubernetes": {
            "selector": {"app": "w"}, "kv_events_connect": True, "kv_events_port": 5557}}})
