"""The admission webhook against a real kube-apiserver (docs/operator.md, "Admission").

The operator runs as a real process serving its webhook on https://127.0.0.1:<port>; a
ValidatingWebhookConfiguration with a url clientConfig points the API server there, for this
module's namespace only. Two users, by impersonation: alice may only write InferenceServices in
the namespace; bob may also create pods (and read one Secret). Each escalation alice tries is
refused at admission with a message naming the field; the same spec from bob is accepted.
"""

from __future__ import annotations

import base64
import subprocess
from pathlib import Path
from typing import Any

import pytest
import test_operator
import yaml
from test_operator import Operator, free_port, isvc

from tests.operator.test_admission import self_signed_for_loopback

ROOT = Path(__file__).resolve().parents[1]
# test_operator's fixtures: the CRDs installed, a fake GPU node
cluster = test_operator.cluster
gpu_node = test_operator.gpu_node
LABEL = "pagoda.dev/e2e-admission"
CONTROL_PLANE_NODE = "pagoda-admission-master"

# case -> (spec overrides, the field the refusal names, whether bob may apply it)
ESCALATIONS: dict[str, tuple[dict[str, Any], str, bool]] = {
    "image": ({"image": "docker.io/evil/miner:1"}, "spec.image", True),
    "hostpath-root": (
        {"model": {"name": "tiny", "hostPath": {"path": "/"}}},
        "spec.model.hostPath.path",
        True,
    ),
    "master-toleration": (
        {"placement": {"tolerations": [{"key": "node-role.kubernetes.io/master", "operator": "Exists"}]}},
        "spec.placement.tolerations[0].key",
        True,
    ),
    "control-plane-node": (
        {"placement": {"nodeSelector": {"kubernetes.io/hostname": CONTROL_PLANE_NODE}}},
        "spec.placement.nodeSelector['kubernetes.io/hostname']",
        True,
    ),
    "service-account": ({"pod": {"serviceAccountName": "deployer"}}, "spec.pod.serviceAccountName", True),
    "env-secret": (
        {"pod": {"env": [{"name": "DB", "valueFrom": {"secretKeyRef": {"name": "db", "key": "password"}}}]}},
        "spec.pod.env[0].valueFrom.secretKeyRef",
        True,
    ),
    "apparmor-unconfined": (
        {"pod": {"annotations": {"container.apparmor.security.beta.kubernetes.io/daemon": "unconfined"}}},
        "spec.pod.annotations['container.apparmor.security.beta.kubernetes.io/daemon']",
        True,
    ),
    # an emptyDir over the image's own binaries: refused for everyone
    "kv-disk-over-binaries": (
        {"kvOffload": {"disk": {"path": "/usr/local/bin", "sizeGiB": 1}}},
        "spec.kvOffload.disk.path",
        False,
    ),
}


@pytest.fixture(scope="module")
def ns(cluster, gpu_node, tmp_path_factory):
    """A namespace under the webhook, alice's and bob's RBAC there, and the operator serving."""
    name = cluster.create_namespace("admission")
    cluster.kubectl("label", "namespace", name, f"{LABEL}={name}")
    cert, key = self_signed_for_loopback(tmp_path_factory.mktemp("webhook-tls"))
    port = free_port()
    op = Operator(
        cluster,
        name,
        name="admission-operator",
        extra_args=(
            f"--admission-port={port}",
            "--admission-address=127.0.0.1",
            f"--admission-cert-file={cert}",
            f"--admission-key-file={key}",
            # isvc()'s model is a hostPath under /data; "/" stays outside
            '--admission-policy={"hostPathPrefixes": ["/data"]}',
        ),
    ).start()
    webhook = f"{name}-admission"
    rbac: list[dict[str, Any]] = [
        role(
            "isvc-author", [{"apiGroups": ["pagoda.dev"], "resources": ["inferenceservices"], "verbs": ["*"]}]
        ),
        role(
            "pod-creator",
            [
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["create"]},
                {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"], "resourceNames": ["db"]},
            ],
        ),
        binding("alice", "isvc-author"),
        binding("bob", "isvc-author"),
        binding("bob", "pod-creator"),
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "db"},
            "stringData": {"password": "s3cret"},
        },
    ]
    try:
        cluster.apply(rbac, namespace=name)
        cluster.wait_for(
            lambda: "admission webhook on" in op.log() or not op.alive(), timeout=60, what="webhook"
        )
        assert op.alive(), op.log()[-3000:]
        cluster.apply(
            {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "ValidatingWebhookConfiguration",
                "metadata": {"name": webhook},
                "webhooks": [
                    {
                        "name": "inferenceservices.admission.pagoda.dev",
                        "admissionReviewVersions": ["v1"],
                        "sideEffects": "None",
                        "failurePolicy": "Fail",
                        "timeoutSeconds": 5,
                        "namespaceSelector": {"matchLabels": {LABEL: name}},
                        "rules": [
                            {
                                "apiGroups": ["pagoda.dev"],
                                "apiVersions": ["*"],
                                "resources": ["inferenceservices"],
                                "operations": ["CREATE", "UPDATE"],
                            }
                        ],
                        "clientConfig": {
                            "url": f"https://127.0.0.1:{port}/inferenceservices",
                            "caBundle": base64.b64encode(cert.read_bytes()).decode(),
                        },
                    }
                ],
            }
        )
        # the API server picks webhook configurations up asynchronously: wait until alice is refused
        cluster.wait_for(
            lambda: (
                apply_as(cluster, "alice", name, isvc("probe", image="evil:1"), "--dry-run=server").returncode
                != 0
            ),
            timeout=30,
            what="the webhook is called",
        )
        yield name
    finally:
        cluster.kubectl(
            "delete", "validatingwebhookconfiguration", webhook, "--ignore-not-found", check=False
        )
        op.stop()
        cluster.delete_namespace(name)


def role(name: str, rules: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": name},
        "rules": rules,
    }


def binding(user: str, role_name: str) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": f"{user}-{role_name}"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role_name},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
    }


def apply_as(
    cluster, user: str, namespace: str, obj: dict[str, Any], *flags: str
) -> subprocess.CompletedProcess:
    return cluster.kubectl(
        f"--as={user}", "apply", *flags, "-n", namespace, "-f", "-", input=yaml.safe_dump(obj), check=False
    )


def exists(cluster, namespace: str, name: str) -> bool:
    return cluster.kubectl("get", "pisvc", name, "-n", namespace, check=False).returncode == 0


@pytest.mark.parametrize("case", sorted(ESCALATIONS))
def test_an_escalation_is_refused_for_alice_naming_the_field_and_accepted_from_bob(cluster, ns, case):
    overrides, field, bob_may = ESCALATIONS[case]
    obj = isvc(case, **overrides)
    refused = apply_as(cluster, "alice", ns, obj)
    assert refused.returncode != 0
    assert "denied the request" in refused.stderr and field in refused.stderr, refused.stderr
    assert not exists(cluster, ns, case)
    by_bob = apply_as(cluster, "bob", ns, obj)
    if bob_may:
        assert by_bob.returncode == 0, by_bob.stderr
        assert exists(cluster, ns, case)
    else:
        assert by_bob.returncode != 0 and field in by_bob.stderr


def test_the_example_applies_as_is_for_alice(cluster, ns):
    example = yaml.safe_load((ROOT / "examples" / "inferenceservice.yaml").read_text())
    out = apply_as(cluster, "alice", ns, example)
    assert out.returncode == 0, out.stderr
    assert exists(cluster, ns, example["metadata"]["name"])


def test_an_update_that_adds_an_escalation_is_refused(cluster, ns):
    assert apply_as(cluster, "alice", ns, isvc("plain")).returncode == 0
    patch = '{"spec": {"placement": {"tolerations": [{"key": "node-role.kubernetes.io/master", "operator": "Exists"}]}}}'
    out = cluster.kubectl(
        "--as=alice", "patch", "pisvc", "plain", "-n", ns, "--type=merge", "-p", patch, check=False
    )
    assert out.returncode != 0 and "spec.placement.tolerations[0].key" in out.stderr, out.stderr
    live = cluster.kubectl_json("get", "pisvc", "plain", "-n", ns)
    assert "tolerations" not in (live["spec"].get("placement") or {})
    # a change that widens nothing goes through
    out = cluster.kubectl(
        "--as=alice",
        "patch",
        "pisvc",
        "plain",
        "-n",
        ns,
        "--type=merge",
        "-p",
        '{"spec": {"replicas": 2}}',
        check=False,
    )
    assert out.returncode == 0, out.stderr


def test_the_charts_webhook_answers_through_its_service_on_the_real_node(local_cluster):
    """The chart as the quickstart installs it: the API server calls the webhook Service at its
    endpoint (the operator pod's IP, --enable-aggregator-routing) with the chart's certificate."""
    ns = local_cluster.create_namespace("admission-real")
    try:
        local_cluster.apply(
            [
                role(
                    "isvc-author",
                    [{"apiGroups": ["pagoda.dev"], "resources": ["inferenceservices"], "verbs": ["*"]}],
                ),
                binding("alice", "isvc-author"),
            ],
            namespace=ns,
        )
        quick = yaml.safe_load((ROOT / "examples" / "quickstart-inferenceservice.yaml").read_text())
        out = apply_as(local_cluster, "alice", ns, quick, "--dry-run=server")
        assert out.returncode == 0, out.stderr
        quick["spec"]["model"]["hostPath"]["path"] = "/"
        out = apply_as(local_cluster, "alice", ns, quick, "--dry-run=server")
        assert out.returncode != 0 and "spec.model.hostPath.path" in out.stderr, out.stderr
    finally:
        local_cluster.delete_namespace(ns)
