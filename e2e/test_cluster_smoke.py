"""Smoke tests for the e2e cluster itself: if these fail, no other e2e result means anything.

They cover what operator and topology tests lean on: the API server answers, CRDs with
structural schemas and status/scale subresources behave, Deployments turn into pods that
the scheduler places by GPU capacity and the fake kubelet runs, and helm talks to the cluster.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

WIDGET_CRD = textwrap.dedent("""\
    apiVersion: apiextensions.k8s.io/v1
    kind: CustomResourceDefinition
    metadata:
      name: widgets.smoke.pagoda.dev
    spec:
      group: smoke.pagoda.dev
      scope: Namespaced
      names: {plural: widgets, singular: widget, kind: Widget, shortNames: [wdg]}
      versions:
      - name: v1alpha1
        served: true
        storage: true
        subresources:
          status: {}
          scale:
            specReplicasPath: .spec.replicas
            statusReplicasPath: .status.replicas
            labelSelectorPath: .status.selector
        additionalPrinterColumns:
        - {name: Replicas, type: integer, jsonPath: .spec.replicas}
        schema:
          openAPIV3Schema:
            type: object
            properties:
              spec:
                type: object
                required: [model]
                properties:
                  model: {type: string}
                  replicas: {type: integer, minimum: 0, default: 1}
              status:
                type: object
                properties:
                  replicas: {type: integer}
                  selector: {type: string}
    """)


def test_server_version(kube_cluster):
    version = json.loads(kube_cluster.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == "v1.20.2"
    assert kube_cluster.server.startswith("https://127.0.0.1:")
    # The API server is healthy and every component we started is there.
    assert kube_cluster.kubectl("get", "--raw", "/readyz").stdout.strip() == "ok"


def test_crd_structural_schema_status_and_scale(kube_cluster, kube_namespace):
    kube_cluster.apply(WIDGET_CRD)
    kube_cluster.kubectl("wait", "--for=condition=Established", "crd/widgets.smoke.pagoda.dev", "--timeout=30s")
    ns = kube_namespace

    # Defaulting and pruning come from the structural schema.
    kube_cluster.apply({"apiVersion": "smoke.pagoda.dev/v1alpha1", "kind": "Widget",
                        "metadata": {"name": "w1"}, "spec": {"model": "tiny", "unknownField": 1}}, namespace=ns)
    widget = kube_cluster.kubectl_json("get", "widget", "w1", "-n", ns)
    assert widget["spec"] == {"model": "tiny", "replicas": 1}

    # Validation rejects a wrong type.
    bad = kube_cluster.kubectl("apply", "-n", ns, "-f", "-", check=False, input=json.dumps(
        {"apiVersion": "smoke.pagoda.dev/v1alpha1", "kind": "Widget", "metadata": {"name": "w2"},
         "spec": {"model": "tiny", "replicas": "three"}}))
    assert bad.returncode != 0 and "spec.replicas" in bad.stderr

    # Status subresource: written only through /status, the way an operator writes it.
    widget["status"] = {"replicas": 1, "selector": "app=w1"}
    kube_cluster.kubectl("replace", "--raw", f"/apis/smoke.pagoda.dev/v1alpha1/namespaces/{ns}/widgets/w1/status",
                         "-f", "-", input=json.dumps(widget))
    assert kube_cluster.kubectl_json("get", "widget", "w1", "-n", ns)["status"]["selector"] == "app=w1"

    # Scale subresource: `kubectl scale` (and so HPA/KEDA) works on the custom resource.
    kube_cluster.kubectl("scale", "widget/w1", "-n", ns, "--replicas=3")
    scale = json.loads(kube_cluster.kubectl(
        "get", "--raw", f"/apis/smoke.pagoda.dev/v1alpha1/namespaces/{ns}/widgets/w1/scale").stdout)
    assert scale["spec"]["replicas"] == 3
    assert scale["status"] == {"replicas": 1, "selector": "app=w1"}


@pytest.fixture
def gpu_node(kube_cluster):
    handle = kube_cluster.start_fake_kubelet("smoke-gpu-node", gpus=8, labels={"pagoda.dev/smoke": "true"})
    yield handle
    handle.stop()


def test_deployment_pods_scheduled_and_running(kube_cluster, kube_namespace, gpu_node):
    node = kube_cluster.kubectl_json("get", "node", gpu_node.node)
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"

    def deployment(name: str, replicas: int, gpus: int) -> dict:
        return {
            "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
            "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": {"app": name}}, "spec": {
                         # Other tests may run fake nodes too: pin to ours.
                         "nodeSelector": {"pagoda.dev/smoke": "true"},
                         "containers": [{"name": "engine", "image": "pagoda/daemon:test",
                                         "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]}}}}

    kube_cluster.apply([deployment("fits", 2, 4), deployment("too-big", 1, 16)], namespace=kube_namespace)

    # Deployment -> ReplicaSet -> 2 pods (controller-manager), bound (scheduler), Running (fake kubelet).
    kube_cluster.wait_for(
        lambda: kube_cluster.kubectl_json("get", "deployment", "fits", "-n", kube_namespace)["status"]
        .get("readyReplicas") == 2, timeout=60, what="deployment fits readyReplicas == 2")
    pods = kube_cluster.kubectl_json("get", "pods", "-n", kube_namespace, "-l", "app=fits")["items"]
    assert len(pods) == 2
    assert {p["spec"]["nodeName"] for p in pods} == {gpu_node.node}
    assert {p["status"]["phase"] for p in pods} == {"Running"}

    # 16 GPUs fit no node: the scheduler says so instead of placing the pod.
    def unschedulable():
        pods = kube_cluster.kubectl_json("get", "pods", "-n", kube_namespace, "-l", "app=too-big")["items"]
        conditions = pods[0]["status"].get("conditions", []) if pods else []
        return any(c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable" for c in conditions)

    kube_cluster.wait_for(unschedulable, timeout=60, what="pod of too-big marked Unschedulable")

    # Scaling down deletes pods; the fake kubelet finishes their deletion.
    kube_cluster.kubectl("scale", "deployment/fits", "-n", kube_namespace, "--replicas=1")
    kube_cluster.wait_for(
        lambda: len(kube_cluster.kubectl_json("get", "pods", "-n", kube_namespace, "-l", "app=fits")["items"]) == 1,
        timeout=60, what="deployment fits scaled down to one pod")


def test_helm_version_and_install(kube_cluster, kube_namespace, tmp_path: Path):
    assert kube_cluster.helm("version", "--short").stdout.startswith("v3.")

    chart = tmp_path / "smoke"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: smoke\nversion: 0.1.0\n")
    (chart / "templates" / "configmap.yaml").write_text(textwrap.dedent("""\
        apiVersion: v1
        kind: ConfigMap
        metadata:
          name: {{ .Release.Name }}-config
        data:
          greeting: {{ .Values.greeting | quote }}
        """))
    kube_cluster.helm("install", "hello", str(chart), "-n", kube_namespace, "--set", "greeting=hi", "--wait")
    configmap = kube_cluster.kubectl_json("get", "configmap", "hello-config", "-n", kube_namespace)
    assert configmap["data"] == {"greeting": "hi"}
