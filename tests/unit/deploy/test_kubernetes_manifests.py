"""The Kubernetes manifests in deploy/kubernetes, checked without a cluster.

Every document parses and is a kind at an apiVersion current Kubernetes serves; the ConfigMap's
mesh.yaml is valid for mesh's own config loader; the probe paths are routes of the gateway (and
of the worker); ports, names and selectors agree across the Deployment, StatefulSet, Services,
RBAC and the config; the discovery config, fed the EndpointSlice Kubernetes makes of the worker
Service, yields the workers at the ports the pods listen on.
"""

from __future__ import annotations

import shutil
import subprocess
import types
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi import FastAPI

from mesh.cli import build_parser
from mesh.cluster.kubernetes import desired_workers
from mesh.config import MeshConfig, parse_config
from mesh.gateway.app import create_app
from policies.base import Role

DIR = Path(__file__).resolve().parents[3] / "deploy" / "kubernetes"
# Kinds at the apiVersions Kubernetes 1.29+ serves (GA; none deprecated).
SERVED = {("v1", "Namespace"), ("v1", "ConfigMap"), ("v1", "Service"), ("v1", "ServiceAccount"),
          ("apps/v1", "Deployment"), ("apps/v1", "StatefulSet"), ("rbac.authorization.k8s.io/v1", "Role"),
          ("rbac.authorization.k8s.io/v1", "RoleBinding")}


def manifests() -> dict[str, list[dict[str, Any]]]:
    return {p.name: [d for d in yaml.safe_load_all(p.read_text()) if d is not None]
            for p in sorted(DIR.glob("*.yaml")) if p.name != "kustomization.yaml"}


def objects() -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for docs in manifests().values() for d in docs}


def container(obj: dict[str, Any]) -> dict[str, Any]:
    (c,) = obj["spec"]["template"]["spec"]["containers"]
    return c


def port_named(c: dict[str, Any], name: str) -> int:
    return next(p["containerPort"] for p in c["ports"] if p["name"] == name)


def gateway_config(tmp_path: Path) -> tuple[MeshConfig, dict[str, Any]]:
    """The ConfigMap's mesh.yaml through mesh's loader (its admin key file pointed at a real file)."""
    raw = yaml.safe_load(objects()[("ConfigMap", "mesh-gateway-config")]["data"]["mesh.yaml"])
    key = tmp_path / "admin-key"
    key.write_text("k" * 32)
    return parse_config({**raw, "server": {**raw["server"], "admin_key_file": str(key)}}), raw


def get_routes(app: FastAPI) -> set[str]:
    return {r.path for r in app.routes if "GET" in getattr(r, "methods", set())}


def test_every_document_is_a_served_kind_in_the_namespace_and_kustomized() -> None:
    docs = manifests()
    assert set(docs) == {"namespace.yaml", "rbac.yaml", "gateway.yaml", "worker.yaml"}
    for name, items in docs.items():
        for d in items:
            assert (d["apiVersion"], d["kind"]) in SERVED, f"{name}: {d['apiVersion']} {d['kind']}"
            assert d["metadata"]["name"]
            if d["kind"] != "Namespace":
                assert d["metadata"]["namespace"] == "mesh", f"{name}: {d['kind']} outside the namespace"
    kustomization = yaml.safe_load((DIR / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(docs)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kustomize_builds_the_set() -> None:
    out = subprocess.run(["kubectl", "kustomize", str(DIR)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert len([d for d in yaml.safe_load_all(out.stdout) if d]) == sum(len(v) for v in manifests().values())


def test_configmap_is_a_valid_mesh_config_with_discovery_and_the_admin_key_from_the_secret(tmp_path: Path) -> None:
    config, raw = gateway_config(tmp_path)
    assert config.discovery.kubernetes is not None and config.server.admin_key == "k" * 32
    deploy = objects()[("Deployment", "mesh-gateway")]
    pod = deploy["spec"]["template"]["spec"]
    mount = next(m for m in container(deploy)["volumeMounts"] if m["name"] == "admin-key")
    volume = next(v for v in pod["volumes"] if v["name"] == "admin-key")
    (item,) = volume["secret"]["items"]
    assert f"{mount['mountPath']}/{item['path']}" == raw["server"]["admin_key_file"]
    config_mount = next(m for m in container(deploy)["volumeMounts"] if m["name"] == "config")
    assert container(deploy)["args"] == ["serve", "--config", f"{config_mount['mountPath']}/mesh.yaml"]
    assert build_parser().parse_args(container(deploy)["args"]).command == "serve"


def test_gateway_probes_are_gateway_routes_on_the_configured_port(tmp_path: Path) -> None:
    config, _ = gateway_config(tmp_path)
    deploy = objects()[("Deployment", "mesh-gateway")]
    c = container(deploy)
    routes = get_routes(create_app(MeshConfig()))
    assert c["livenessProbe"]["httpGet"]["path"] == "/health" and c["readinessProbe"]["httpGet"]["path"] == "/ready"
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"]["path"] in routes
        assert port_named(c, c[probe]["httpGet"]["port"]) == config.server.port
    assert port_named(c, "http") == config.server.port and config.server.host == "0.0.0.0"
    service = objects()[("Service", "mesh-gateway")]
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert deploy["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert int(deploy["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"]) == config.server.port


@pytest.mark.parametrize("kind,name", [("Deployment", "mesh-gateway"), ("StatefulSet", "mesh-worker")])
def test_pods_run_as_non_root_with_resource_requests(kind: str, name: str) -> None:
    obj = objects()[(kind, name)]
    pod, c = obj["spec"]["template"]["spec"], container(obj)
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert {"cpu", "memory"} <= set(c["resources"]["requests"])


def test_rbac_lets_the_gateway_get_list_watch_endpointslices_and_pods() -> None:
    objs = objects()
    sa = objs[("ServiceAccount", "mesh-gateway")]
    assert objs[("Deployment", "mesh-gateway")]["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]
    binding = next(o for (k, _), o in objs.items() if k == "RoleBinding")
    role = objs[("Role", binding["roleRef"]["name"])]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "mesh-gateway", "namespace": "mesh"}]
    grants = {(g, r): set(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    assert grants[("discovery.k8s.io", "endpointslices")] >= {"get", "list", "watch"}
    assert grants[("", "pods")] >= {"get", "list", "watch"}
    assert not any(v - {"get", "list", "watch"} for v in grants.values())  # read only


def test_worker_statefulset_binds_its_kv_events_and_asks_for_a_gpu() -> None:
    objs = objects()
    sts, service = objs[("StatefulSet", "mesh-worker")], objs[("Service", "mesh-worker")]
    assert service["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == "mesh-worker"
    c = container(sts)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    args = build_parser().parse_args(["worker", *c["args"]])
    assert args.host == "0.0.0.0" and args.port == port_named(c, "http")
    assert args.kv_events_endpoint == f"tcp://*:{port_named(c, 'kv-events')}"  # bound on the pod's interfaces
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    Role(labels["mesh.dev/role"])
    assert {p["targetPort"] for p in service["spec"]["ports"]} == {p["name"] for p in c["ports"]}


def test_worker_probes_are_worker_routes() -> None:
    server = pytest.importorskip("workers.server.app")  # the worker package needs torch
    app = FastAPI()
    server.Routes(types.SimpleNamespace(engine=None, tokenizer=None)).install(app)
    c = container(objects()[("StatefulSet", "mesh-worker")])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] in get_routes(app)


def test_discovery_config_finds_the_worker_pods_in_the_services_endpointslice(tmp_path: Path) -> None:
    """The EndpointSlice the controller makes of the worker Service (its labels, the service-name
    label, the Service's port names and numbers) through the ConfigMap's discovery config."""
    config, _ = gateway_config(tmp_path)
    kube = config.discovery.kubernetes
    assert kube is not None
    service = objects()[("Service", "mesh-worker")]
    c = container(objects()[("StatefulSet", "mesh-worker")])
    endpoint_slice = {  # a slice's ports are the Service's names with the pods' numbers (targetPort resolved)
        "metadata": {"name": "mesh-worker-abcde", "namespace": "mesh",
                     "labels": {**service["metadata"]["labels"], "kubernetes.io/service-name": "mesh-worker"}},
        "ports": [{"name": p["name"], "port": port_named(c, p["targetPort"])} for p in service["spec"]["ports"]],
        "endpoints": [{"addresses": [f"10.1.0.{i}"], "conditions": {"ready": True},
                       "targetRef": {"kind": "Pod", "name": f"mesh-worker-{i}"}} for i in range(2)],
    }
    labels = endpoint_slice["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in kube.selector.items())  # the selector matches it
    wanted, refused = desired_workers({"mesh/mesh-worker-abcde": endpoint_slice}, kube)
    assert not refused
    for i in range(2):
        worker, draining = wanted[f"mesh-worker-{i}"]
        assert worker.url == f"http://10.1.0.{i}:{port_named(c, 'http')}" and not draining
        assert worker.kv_events is not None and worker.kv_events.endpoint == f"tcp://10.1.0.{i}:{port_named(c, 'kv-events')}"
