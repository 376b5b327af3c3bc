"""The Helm chart against a real kube-apiserver: lint, render, and ``helm install --wait``."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "pagoda"


@pytest.fixture(scope="module")
def gpu_node(kube_cluster):
    # GPU feature discovery's label: the topology agent DaemonSet targets such nodes.
    handle = kube_cluster.start_fake_kubelet(
        "pagoda-chart-gpu-1", gpus=8, labels={"nvidia.com/gpu.present": "true"}
    )
    yield handle.node
    handle.stop()


def test_helm_lint_and_template(kube_cluster):
    lint = kube_cluster.helm("lint", "--strict", str(CHART))
    assert "0 chart(s) failed" in lint.stdout
    out = kube_cluster.helm(
        "template", "rel", str(CHART), "--include-crds", "--set", "serviceMonitor.enabled=true"
    ).stdout
    kinds = sorted({d["kind"] for d in yaml.safe_load_all(out) if d})
    assert kinds == sorted(
        {
            "ClusterRole",
            "ClusterRoleBinding",
            "ConfigMap",
            "CustomResourceDefinition",
            "DaemonSet",
            "Deployment",
            "Role",
            "RoleBinding",
            "Secret",
            "Service",
            "ServiceAccount",
            "ServiceMonitor",
            "ValidatingWebhookConfiguration",
        }
    )


def test_helm_install_wait(kube_cluster, gpu_node):
    ns = kube_cluster.create_namespace("pagoda-chart")
    try:
        out = kube_cluster.helm(
            "install",
            "pagoda",
            str(CHART),
            "--namespace",
            ns,
            "--wait",
            "--timeout",
            "180s",
            "--set",
            "image.repository=pagoda-test/operator",
            "--set",
            "image.pullPolicy=Never",
        )
        assert "STATUS: deployed" in out.stdout, out.stdout + out.stderr
        dep = kube_cluster.kubectl_json("get", "deployment", "pagoda-operator", "-n", ns)
        assert dep["status"]["readyReplicas"] == 1
        ds = kube_cluster.kubectl_json("get", "daemonset", "pagoda-topology-agent", "-n", ns)
        assert (
            ds["status"]["desiredNumberScheduled"] >= 1
            and ds["status"]["numberReady"] == ds["status"]["desiredNumberScheduled"]
        )
        agent_nodes = {
            p["spec"]["nodeName"]
            for p in kube_cluster.kubectl_json(
                "get", "pods", "-n", ns, "-l", "app.kubernetes.io/component=topology-agent"
            )["items"]
        }
        assert gpu_node in agent_nodes
        for crd in ("inferenceservices.pagoda.dev", "nodetopologies.pagoda.dev"):
            kube_cluster.kubectl("get", "crd", crd)
        # the operator's ServiceAccount may do what the operator does, and no more
        sa = f"system:serviceaccount:{ns}:pagoda-operator"
        can = lambda *a: kube_cluster.kubectl("auth", "can-i", *a, f"--as={sa}", check=False).stdout.strip()  # noqa: E731
        assert can("patch", "inferenceservices.pagoda.dev/status", "-n", "default") == "yes"
        assert can("create", "deployments.apps", "-n", "default") == "yes"
        assert can("update", "leases.coordination.k8s.io", "-n", ns) == "yes"
        assert can("update", "leases.coordination.k8s.io", "-n", "default") == "no"
        assert can("delete", "statefulsets.apps", "-n", "default") == "yes"  # a group's workers scaled away
        assert can("delete", "configmaps", "-n", "default") == "no"
        assert can("get", "secrets", "-n", "default") == "no"
        # the admission webhook asks about requesters, and cannot rewrite its own configuration
        assert can("create", "subjectaccessreviews.authorization.k8s.io") == "yes"
        assert can("patch", "validatingwebhookconfigurations.admissionregistration.k8s.io") == "no"
        kube_cluster.kubectl("get", "validatingwebhookconfiguration", "pagoda-admission")
    finally:
        kube_cluster.helm("uninstall", "pagoda", "--namespace", ns, check=False)
        kube_cluster.delete_namespace(ns)
