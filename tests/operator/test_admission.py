"""The admission policy (pure), the AdmissionReview decision, and the webhook over real HTTPS with
the SubjectAccessReview client against a loopback API stand-in."""

from __future__ import annotations

import base64
import copy
import http.server
import json
import shutil
import socket
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import kopf
import pytest
import yaml

from pagoda_operator.admission import (
    CREATE_PODS,
    MAX_LISTED,
    MAX_REFERENCES,
    Access,
    Policy,
    findings,
    image_allowed,
    path_within,
    refusal,
    review,
)
from pagoda_operator.cli import main, parser, start_admission_webhook
from pagoda_operator.webhook import AdmissionWebhook, decide
from tests.operator.operator_fakes import kube_for, serving
from tests.operator.test_manifests import helm, render  # noqa: F401  (the helm fixture)

ROOT = Path(__file__).resolve().parents[2]
DAEMON = "ghcr.io/pagoda-serving/pagoda"
POLICY = Policy.from_values({}, extra_images=(DAEMON,))
NS = "team-a"


def base_spec() -> dict[str, Any]:
    return {"model": {"name": "m", "pvc": {"claimName": "weights"}}, "resources": {"gpusPerReplica": 1}}


def with_(path: str, value: Any) -> dict[str, Any]:
    """base_spec() with ``value`` set at the dotted ``path``."""
    spec = base_spec()
    *parents, leaf = path.split(".")
    node = spec
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value
    return spec


# Each escalation named in the issue, and the field the refusal must name.
ESCALATIONS = {
    "image outside the allowlist": (with_("image", "docker.io/evil/miner:1"), "spec.image"),
    "hostPath /": (
        {"model": {"name": "m", "hostPath": {"path": "/"}}},
        "spec.model.hostPath.path",
    ),
    "control-plane toleration": (
        with_("placement.tolerations", [{"key": "node-role.kubernetes.io/master", "operator": "Exists"}]),
        "spec.placement.tolerations[0].key",
    ),
    "toleration of every taint": (
        with_("placement.tolerations", [{"operator": "Exists"}]),
        "spec.placement.tolerations[0]",
    ),
    "pinning to a control-plane node": (
        with_("placement.nodeSelector", {"kubernetes.io/hostname": "master-0"}),
        "spec.placement.nodeSelector['kubernetes.io/hostname']",
    ),
    "node-role selector": (
        with_("placement.nodeSelector", {"node-role.kubernetes.io/control-plane": ""}),
        "spec.placement.nodeSelector['node-role.kubernetes.io/control-plane']",
    ),
    "service account": (with_("pod.serviceAccountName", "cluster-admin-sa"), "spec.pod.serviceAccountName"),
    "AppArmor unconfined": (
        with_("pod.annotations", {"container.apparmor.security.beta.kubernetes.io/daemon": "unconfined"}),
        "spec.pod.annotations['container.apparmor.security.beta.kubernetes.io/daemon']",
    ),
    "seccomp unconfined": (
        with_("pod.annotations", {"seccomp.security.alpha.kubernetes.io/pod": "unconfined"}),
        "spec.pod.annotations['seccomp.security.alpha.kubernetes.io/pod']",
    ),
    "label joining another Service": (
        with_("pod.labels", {"app": "payments"}),
        "spec.pod.labels['app']",
    ),
    "priority class": (with_("pod.priorityClassName", "system-node-critical"), "spec.pod.priorityClassName"),
    "device-plugin resource": (
        with_("pod.resources", {"limits": {"smarter-devices/fuse": 1, "memory": "1Gi"}}),
        "spec.pod.resources.limits['smarter-devices/fuse']",
    ),
    "GPU resource name of a device plugin": (
        with_("resources.gpuResourceName", "smarter-devices/fuse"),
        "spec.resources.gpuResourceName",
    ),
    "kvOffload disk outside its prefixes": (
        with_("kvOffload", {"disk": {"path": "/data/kv", "sizeGiB": 1}}),
        "spec.kvOffload.disk.path",
    ),
}
SECRET_READS = {
    "env from a Secret": (
        with_("pod.env", [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "db", "key": "password"}}}]),
        "spec.pod.env[0].valueFrom.secretKeyRef",
        Access("get", "secrets", "db"),
    ),
    "env from a ConfigMap": (
        with_("pod.env", [{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "k"}}}]),
        "spec.pod.env[0].valueFrom.configMapKeyRef",
        Access("get", "configmaps", "cfg"),
    ),
    "API key Secret": (
        with_("server.apiKeySecretRef", {"name": "api-keys", "key": "key"}),
        "spec.server.apiKeySecretRef",
        Access("get", "secrets", "api-keys"),
    ),
}
# Refused for everyone: an emptyDir over the image's own files.
FORBIDDEN = {
    "kvOffload disk over /usr/local/bin": (
        with_("kvOffload", {"disk": {"path": "/usr/local/bin", "sizeGiB": 1}}),
        "spec.kvOffload.disk.path",
    ),
    "kvOffload disk over a parent of /var/lib": (
        with_("kvOffload", {"disk": {"path": "/var/", "sizeGiB": 1}}),
        "spec.kvOffload.disk.path",
    ),
    "hostPath climbing out": (
        {"model": {"name": "m", "hostPath": {"path": "/var/lib/pagoda/models/../../../etc"}}},
        "spec.model.hostPath.path",
    ),
    "not an image reference": (with_("image", "Evil Image"), "spec.image"),
}


def alice(access: Access) -> bool:
    """May write InferenceServices only."""
    return False


def bob(access: Access) -> bool:
    """May create pods (and read nothing)."""
    return access == CREATE_PODS


@pytest.mark.parametrize("case", sorted(ESCALATIONS))
def test_each_widening_is_refused_naming_its_field_unless_the_requester_may_create_pods(case):
    spec, field = ESCALATIONS[case]
    refused = review(POLICY, spec, alice)
    assert [v.field for v in refused] == [field]
    assert field in refusal(NS, "x", refused)
    assert "admission.policy." in refused[0].explain(NS)  # says which chart value widens it
    assert review(POLICY, spec, bob) == []


@pytest.mark.parametrize("case", sorted(SECRET_READS))
def test_secret_and_configmap_references_need_get_on_that_object_even_for_pod_creators(case):
    spec, field, access = SECRET_READS[case]
    for requester in (alice, bob):
        refused = review(POLICY, spec, requester)
        assert [(v.field, v.needs) for v in refused] == [(field, access)]
    assert review(POLICY, spec, lambda a: a == access) == []


@pytest.mark.parametrize("case", sorted(FORBIDDEN))
def test_system_paths_and_malformed_values_are_refused_for_everyone(case):
    spec, field = FORBIDDEN[case]
    policy = Policy.from_values({"hostPathPrefixes": ["/var/lib/pagoda/models"]})
    assert [v.field for v in review(policy, spec, lambda a: True)] == [field]


def test_every_violation_is_listed_in_one_message():
    spec = {
        **base_spec(),
        "image": "evil:1",
        "placement": {
            "tolerations": [{"key": "node-role.kubernetes.io/master", "operator": "Exists"}],
            "nodeSelector": {"kubernetes.io/hostname": "master-0"},
        },
        "pod": {
            "serviceAccountName": "admin",
            "priorityClassName": "system-node-critical",
            "annotations": {"container.apparmor.security.beta.kubernetes.io/daemon": "unconfined"},
            "env": [{"name": "P", "valueFrom": {"secretKeyRef": {"name": "db", "key": "p"}}}],
        },
    }
    refused = review(POLICY, spec, alice)
    assert len(refused) == 7
    message = refusal(NS, "x", refused)
    for v in refused:
        assert v.field in message


def test_a_long_list_is_capped_in_the_message():
    spec = with_("pod.annotations", {f"evil.io/a{i}": "x" for i in range(MAX_LISTED + 5)})
    message = refusal(NS, "x", review(POLICY, spec, alice))
    assert message.count("evil.io/a") == MAX_LISTED * 2  # field and message name each key
    assert message.endswith("and 5 more")


def test_too_many_references_are_refused_without_asking_for_each():
    env = [
        {"name": f"E{i}", "valueFrom": {"secretKeyRef": {"name": f"s{i}"}}} for i in range(MAX_REFERENCES + 1)
    ]
    asked: list[Access] = []
    refused = review(POLICY, with_("pod.env", env), lambda a: asked.append(a) or True)
    assert [v.field for v in refused] == ["spec.pod.env"] and asked == []


def test_access_is_asked_once_per_distinct_access_and_never_for_a_plain_spec():
    asked: list[Access] = []
    assert review(POLICY, base_spec(), lambda a: asked.append(a) or False) == []
    assert asked == []
    spec = with_("image", "evil:1")
    spec["pod"] = {
        "serviceAccountName": "x",
        "env": [{"name": "A", "valueFrom": {"secretKeyRef": {"name": "s"}}}] * 2,
    }
    review(POLICY, spec, lambda a: asked.append(a) or False)
    assert sorted(asked, key=str) == sorted([CREATE_PODS, Access("get", "secrets", "s")], key=str)


def test_the_examples_pass_the_default_and_quickstart_policies():
    example = yaml.safe_load((ROOT / "examples" / "inferenceservice.yaml").read_text())
    assert findings(POLICY, example["spec"]) == []
    quickstart_values = yaml.safe_load((ROOT / "e2e" / "quickstart" / "values.yaml").read_text())
    daemon = quickstart_values["daemonImage"]["repository"]
    policy = Policy.from_values(quickstart_values["admission"]["policy"], extra_images=(daemon,))
    quick = yaml.safe_load((ROOT / "examples" / "quickstart-inferenceservice.yaml").read_text())
    assert findings(policy, {**quick["spec"], "image": f"{daemon}:dev"}) == []


def test_gpu_tolerations_and_selectors_pass_by_default():
    spec = with_(
        "placement",
        {
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "nodeSelector": {
                "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                "topology.kubernetes.io/zone": "a",
            },
        },
    )
    spec["pod"] = {
        "annotations": {"prometheus.io/scrape": "true"},
        "resources": {"limits": {"hugepages-2Mi": "1Gi"}},
    }
    assert findings(POLICY, spec) == []


@pytest.mark.parametrize(
    "image, allowed",
    [
        (f"{DAEMON}:0.1.0", True),
        (f"{DAEMON}@sha256:{'a' * 64}", True),
        (DAEMON, True),
        (f"{DAEMON}-evil:0.1.0", False),
        ("ghcr.io/pagoda-serving/other:1", False),
        ("pagoda-daemon:dev", False),
    ],
)
def test_an_image_entry_names_a_repository_with_any_tag(image, allowed):
    assert image_allowed(image, (DAEMON,)) is allowed
    assert image_allowed("ghcr.io/pagoda-serving/other:1", ("ghcr.io/pagoda-serving/*",))


@pytest.mark.parametrize(
    "path, allowed",
    [
        ("/var/lib/pagoda/models", True),
        ("/var/lib/pagoda/models/tiny", True),
        ("/var/lib/pagoda/models/", True),
        ("/var/lib/pagoda/models-other", False),
        ("/var/lib/pagoda", False),
        ("/", False),
    ],
)
def test_path_prefixes_match_whole_components(path, allowed):
    assert path_within(path, ("/var/lib/pagoda/models/",)) is allowed


def test_policy_values_are_checked():
    with pytest.raises(ValueError, match="unknown admission policy keys"):
        Policy.from_values({"tolerationKey": ["x"]})
    with pytest.raises(ValueError, match="list of non-empty strings"):
        Policy.from_values({"images": "x"})
    with pytest.raises(ValueError, match="system directories"):
        Policy.from_values({"kvDiskPathPrefixes": ["/usr"]})
    widened = Policy.from_values({"tolerationKeys": ["dedicated"], "images": ["a/b"]}, extra_images=("c/d",))
    assert widened.toleration_keys == ("dedicated",) and widened.images == ("c/d", "a/b")
    spec = with_("placement.tolerations", [{"key": "dedicated", "operator": "Exists"}])
    assert review(widened, spec, alice) == []


# ---- the AdmissionReview decision --------------------------------------------------------
def admission_review(operation: str, spec: dict[str, Any], old_spec: dict[str, Any] | None = None) -> dict:
    obj = {
        "apiVersion": "pagoda.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "svc", "namespace": NS},
    }
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "u-1",
            "kind": {"group": "pagoda.dev", "version": "v1alpha1", "kind": "InferenceService"},
            "resource": {"group": "pagoda.dev", "version": "v1alpha1", "resource": "inferenceservices"},
            "namespace": NS,
            "operation": operation,
            "userInfo": {"username": "alice", "groups": ["devs", "system:authenticated"]},
            "object": {**obj, "spec": spec},
            "oldObject": {**obj, "spec": old_spec} if old_spec is not None else None,
        },
    }


def users(*allowed: tuple[str, Access]):
    def user_can(user, namespace, access):
        assert namespace == NS
        return (user.get("username"), access) in allowed

    return user_can


def test_create_with_an_escalation_is_refused_with_403_naming_the_field():
    spec, field = ESCALATIONS["hostPath /"]
    out = decide(admission_review("CREATE", spec), POLICY, users())
    assert out["response"]["uid"] == "u-1" and out["response"]["allowed"] is False
    assert out["response"]["status"]["code"] == 403 and field in out["response"]["status"]["message"]
    assert decide(admission_review("CREATE", spec), POLICY, users(("alice", CREATE_PODS)))["response"][
        "allowed"
    ]


def test_update_is_reviewed_only_when_the_spec_changes():
    spec, _ = ESCALATIONS["image outside the allowlist"]
    # metadata-only updates (kopf's bookkeeping annotations on an object a pod creator made) pass
    assert decide(admission_review("UPDATE", spec, copy.deepcopy(spec)), POLICY, users())["response"][
        "allowed"
    ]
    # an update that adds an escalation is refused
    refused = decide(admission_review("UPDATE", spec, base_spec()), POLICY, users())["response"]
    assert not refused["allowed"] and "spec.image" in refused["status"]["message"]


def test_a_failing_access_check_refuses():
    def broken(user, namespace, access):
        raise OSError("connection refused")

    spec, _ = ESCALATIONS["service account"]
    out = decide(admission_review("CREATE", spec), POLICY, broken)["response"]
    assert (
        not out["allowed"]
        and out["status"]["code"] == 500
        and "connection refused" in out["status"]["message"]
    )


@pytest.mark.parametrize("body", [None, [], "x", {"request": "x"}, {"request": {"kind": {"group": "apps"}}}])
def test_requests_for_other_objects_or_garbage_never_crash(body):
    assert decide(body, POLICY, users())["response"]["allowed"] is True


# ---- over the wire: kopf's HTTPS server, and the SubjectAccessReview client -------------
def self_signed_for_loopback(d: Path) -> tuple[Path, Path]:
    """A certificate for https://127.0.0.1 that is its own CA (the caBundle), and its key."""
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-addext", "basicConstraints=critical,CA:TRUE",
         "-keyout", str(d / "tls.key"), "-out", str(d / "tls.crt")],
        check=True, capture_output=True,
    )  # fmt: skip
    return d / "tls.crt", d / "tls.key"


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> tuple[Path, Path]:
    if not shutil.which("openssl"):
        pytest.skip("needs openssl")
    return self_signed_for_loopback(tmp_path_factory.mktemp("tls"))


class FakeAuthorizer(http.server.ThreadingHTTPServer):
    """A loopback stand-in for the API server's SubjectAccessReview endpoint: allows what
    ``grants`` lists per user, records every review."""

    def __init__(self, grants: dict[str, set[tuple[str, str, str | None]]]):
        self.grants, self.reviews = grants, []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.reviews.append((self.path, body))
                spec, attrs = body["spec"], body["spec"]["resourceAttributes"]
                key = (attrs["verb"], attrs["resource"], attrs.get("name"))
                out = json.dumps(
                    {**body, "status": {"allowed": key in outer.grants.get(spec["user"], set())}}
                )
                self.send_response(201)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(out.encode())

            def log_message(self, *args: Any) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)


@pytest.fixture
def authorizer() -> Iterator[FakeAuthorizer]:
    with serving(FakeAuthorizer({"bob": {("create", "pods", None)}})) as server:
        yield server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_user_can_sends_the_requesters_identity_in_a_subject_access_review(authorizer):
    kube = kube_for(authorizer)
    user = {"username": "bob", "uid": "42", "groups": ["g"], "extra": {"scopes": ["a"]}}
    assert kube.user_can(user, "create", "pods", NS) is True
    assert kube.user_can(user, "get", "secrets", NS, "db") is False
    path, body = authorizer.reviews[-1]
    assert path == "/apis/authorization.k8s.io/v1/subjectaccessreviews"
    assert body["spec"] == {
        "user": "bob",
        "uid": "42",
        "groups": ["g"],
        "extra": {"scopes": ["a"]},
        "resourceAttributes": {"verb": "get", "resource": "secrets", "namespace": NS, "name": "db"},
    }


def test_the_webhook_answers_over_https_with_the_requesters_own_access(tls, authorizer):
    cert, key = tls
    kube = kube_for(authorizer)
    port = free_port()
    server = kopf.WebhookServer(addr="127.0.0.1", port=port, certfile=str(cert), pkeyfile=str(key))
    webhook = AdmissionWebhook(
        server, POLICY, lambda user, ns, a: kube.user_can(user, a.verb, a.resource, ns, a.name)
    )
    webhook.start()
    spec, field = ESCALATIONS["control-plane toleration"]
    try:
        answers(port, cert, spec, field)
    finally:
        webhook.stop()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"https://127.0.0.1:{port}/", verify=ssl.create_default_context(cafile=cert))


def answers(port: int, cert: Path, spec: dict[str, Any], field: str) -> None:
    with httpx.Client(verify=ssl.create_default_context(cafile=cert), timeout=10) as client:
        request = admission_review("CREATE", spec)
        out = client.post(f"https://127.0.0.1:{port}/inferenceservices", json=request).json()
        assert out["response"]["allowed"] is False and field in out["response"]["status"]["message"]
        request["request"]["userInfo"] = {"username": "bob"}
        out = client.post(f"https://127.0.0.1:{port}/inferenceservices", json=request).json()
        assert out["response"]["allowed"] is True
        assert client.post(f"https://127.0.0.1:{port}/x", content=b"{not json").status_code == 400


def test_cli_refuses_a_webhook_without_certificates_or_with_a_bad_policy(tls, capsys):
    assert main(["--admission-port=9443"]) == 2
    assert "--admission-cert-file" in capsys.readouterr().err
    cert, key = tls
    argv = ["--admission-port=9443", f"--admission-cert-file={cert}", f"--admission-key-file={key}"]
    assert main([*argv, '--admission-policy={"tolerationKey": ["x"]}']) == 2
    assert "unknown admission policy keys" in capsys.readouterr().err
    assert main([*argv, "--admission-policy=[x]"]) == 2
    assert "expected a mapping" in capsys.readouterr().err


# ---- the chart ------------------------------------------------------------------------------
def test_chart_wires_the_webhook_to_every_replica_with_a_matching_certificate(helm, tmp_path):  # noqa: F811
    docs = render(helm)
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    config = by_kind[("ValidatingWebhookConfiguration", "rel-pagoda-admission")]
    (hook,) = config["webhooks"]
    assert hook["failurePolicy"] == "Fail" and hook["sideEffects"] == "None" and hook["timeoutSeconds"] <= 10
    assert hook["rules"] == [
        {
            "apiGroups": ["pagoda.dev"],
            "apiVersions": ["*"],
            "resources": ["inferenceservices"],
            "operations": ["CREATE", "UPDATE"],
            "scope": "Namespaced",
        }
    ]
    ref = hook["clientConfig"]["service"]
    assert ref["namespace"] == "pagoda-system"
    service = by_kind[("Service", ref["name"])]
    deployment = by_kind[("Deployment", "rel-pagoda-operator")]
    pod = deployment["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    container = pod["spec"]["containers"][0]
    assert {"name": "webhook", "containerPort": 9443, "protocol": "TCP"} in container["ports"]
    args = dict(a.split("=", 1) for a in container["args"] if a.startswith("--admission-"))
    assert args["--admission-port"] == "9443" and "--admission-client-ca" not in args
    policy = Policy.from_values(json.loads(args["--admission-policy"]))
    assert policy == Policy(), "the chart's defaults are the operator's defaults"
    # the certificate the pods mount is signed by the caBundle, for the Service's DNS name
    secret = by_kind[("Secret", "rel-pagoda-webhook-tls")]
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "webhook-tls"]
    assert volume["secret"]["secretName"] == "rel-pagoda-webhook-tls"
    assert secret["data"]["ca.crt"] == hook["clientConfig"]["caBundle"]
    for key in ("ca.crt", "tls.crt"):
        (tmp_path / key).write_bytes(base64.b64decode(secret["data"][key]))
    dns = f"{ref['name']}.pagoda-system.svc"
    check = subprocess.run(
        [
            "openssl",
            "verify",
            "-CAfile",
            str(tmp_path / "ca.crt"),
            "-verify_hostname",
            dns,
            str(tmp_path / "tls.crt"),
        ],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    # RBAC: SubjectAccessReviews, and no write access to webhook configurations
    role = by_kind[("ClusterRole", "rel-pagoda-admission")]
    assert role["rules"] == [
        {"apiGroups": ["authorization.k8s.io"], "resources": ["subjectaccessreviews"], "verbs": ["create"]}
    ]
    assert not any(
        "admissionregistration.k8s.io" in r["apiGroups"]
        for d in docs
        if d["kind"] == "ClusterRole"
        for r in d["rules"]
    )


def test_chart_client_ca_reaches_the_operator(helm, tls):  # noqa: F811
    cert, _ = tls
    pem = cert.read_text()
    out = helm(
        "template",
        "rel",
        str(ROOT / "charts" / "pagoda"),
        "-n",
        "pagoda-system",
        "--set-string",
        f"admission.clientCA={pem}",
    )
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    secret = next(d for d in docs if d["kind"] == "Secret")
    assert base64.b64decode(secret["data"]["client-ca.crt"]).decode() == pem
    container = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][
        0
    ]
    assert "--admission-client-ca=/etc/pagoda/webhook-tls/client-ca.crt" in container["args"]


def test_chart_without_admission_renders_no_webhook(helm):  # noqa: F811
    docs = render(helm, "admission.enabled=false")
    assert "ValidatingWebhookConfiguration" not in {d["kind"] for d in docs}
    secrets = [d["metadata"]["name"] for d in docs if d["kind"] == "Secret"]
    assert secrets == ["rel-pagoda-operator-admin"]  # elastic EP's (operator-secret.yaml), no webhook TLS
    container = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][
        0
    ]
    assert not any(a.startswith("--admission-") for a in container["args"])


def test_with_a_client_ca_only_clients_with_a_certificate_it_signed_are_answered(tls, authorizer):
    """--admission-client-ca: the API server's webhook client certificate, nobody else's."""
    cert, key = tls
    port = free_port()
    args = parser().parse_args(
        [
            f"--admission-port={port}",
            "--admission-address=127.0.0.1",
            f"--admission-cert-file={cert}",
            f"--admission-key-file={key}",
            f"--admission-client-ca={cert}",
        ]
    )
    webhook = start_admission_webhook(args, POLICY, kube_for(authorizer))
    url = f"https://127.0.0.1:{port}/inferenceservices"
    request = admission_review("CREATE", ESCALATIONS["service account"][0])
    try:
        with pytest.raises(httpx.HTTPError):
            httpx.post(url, json=request, verify=ssl.create_default_context(cafile=cert), timeout=10)
        context = ssl.create_default_context(cafile=cert)
        context.load_cert_chain(cert, key)
        out = httpx.post(url, json=request, verify=context, timeout=10).json()
        assert out["response"]["allowed"] is False
    finally:
        webhook.stop()
