"""CRDs, the example and the Helm chart, checked without a cluster (helm tests skip without helm)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CRDS = ROOT / "crds"
CHART = ROOT / "charts" / "pagoda"
EXAMPLE = ROOT / "examples" / "inferenceservice.yaml"
ISVC_CRD = CRDS / "inferenceservices.pagoda.dev.yaml"


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def isvc_schema() -> dict[str, Any]:
    (version,) = load(ISVC_CRD)["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def test_chart_crds_are_the_crds():
    """One source of truth: charts/pagoda/crds/ must be byte-identical copies of crds/."""
    ours = sorted(p.name for p in CRDS.glob("*.yaml"))
    chart = sorted(p.name for p in (CHART / "crds").glob("*.yaml"))
    assert ours == chart, "run: cp crds/*.yaml charts/pagoda/crds/"
    for name in ours:
        assert (CRDS / name).read_bytes() == (CHART / "crds" / name).read_bytes(), (
            f"{name} differs: cp crds/{name} charts/pagoda/crds/"
        )


def walk(schema: dict[str, Any], path: str = ""):
    yield path, schema
    for k, sub in (schema.get("properties") or {}).items():
        yield from walk(sub, f"{path}.{k}")
    if isinstance(schema.get("items"), dict):
        yield from walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from walk(schema["additionalProperties"], f"{path}{{}}")


@pytest.mark.parametrize("crd", sorted(CRDS.glob("*.yaml")), ids=lambda p: p.name)
def test_crds_are_structural_and_cel_free(crd):
    doc = load(crd)
    assert doc["apiVersion"] == "apiextensions.k8s.io/v1"
    assert "x-kubernetes-validations" not in crd.read_text(), "no CEL: Kubernetes 1.20 has none"
    for version in doc["spec"]["versions"]:
        for path, node in walk(version["schema"]["openAPIV3Schema"]):
            typed = (
                "type" in node
                or node.get("x-kubernetes-int-or-string")
                or node.get("x-kubernetes-preserve-unknown-fields")
            )
            assert typed, f"{crd.name}{path}: a structural schema needs a type"
            for combinator in ("oneOf", "anyOf", "allOf"):
                for branch in node.get(combinator) or []:
                    assert not {"type", "default", "description", "properties"} & set(branch) or node.get(
                        "x-kubernetes-int-or-string"
                    ), f"{path}: {combinator} may only hold value validations"
            assert node.get("default") != "", (
                f"{crd.name}{path}: Kubernetes 1.20 rejects an empty-string default as null"
            )
            if "default" in node and node.get("type") == "object":
                assert node["default"] == {}, f"{path}: object defaults stay empty so nested defaults apply"


def test_isvc_crd_contract():
    doc = load(ISVC_CRD)
    assert doc["spec"]["group"] == "pagoda.dev" and doc["spec"]["scope"] == "Namespaced"
    names = doc["spec"]["names"]
    assert (names["kind"], names["shortNames"], names["categories"]) == (
        "InferenceService",
        ["pisvc"],
        ["pagoda"],
    )
    (v,) = doc["spec"]["versions"]
    assert v["name"] == "v1alpha1" and v["subresources"]["status"] == {}
    assert v["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    columns = [c["name"] for c in v["additionalPrinterColumns"] if not c.get("priority")]
    assert columns == ["Ready", "Replicas", "Model", "EP", "Age"]
    status = v["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    for field in (
        "conditions",
        "observedGeneration",
        "replicas",
        "readyReplicas",
        "updatedReplicas",
        "selector",
        "endpoint",
        "expertParallel",
        "autoscaling",
        "placement",
    ):
        assert field in status
    assert status["autoscaling"]["properties"]["decisions"]["maxItems"] == 10


# -- a small validator: what the API server checks, plus "would this field be pruned?" --------
def validate(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    errors: list[str] = []
    if schema.get("x-kubernetes-preserve-unknown-fields") and "properties" not in schema:
        return errors
    if schema.get("x-kubernetes-int-or-string"):
        return [] if isinstance(value, (int, str)) else [f"{path}: int or string"]
    t = schema.get("type")
    kinds = {
        "object": dict,
        "array": list,
        "string": str,
        "boolean": bool,
        "integer": int,
        "number": (int, float),
    }
    if (t and not isinstance(value, kinds[t])) or (t in ("integer", "number") and isinstance(value, bool)):
        return [f"{path}: expected {t}, got {value!r}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} not in {schema['enum']}")
    if "minimum" in schema and value < schema["minimum"]:
        errors.append(f"{path}: below minimum")
    if "maximum" in schema and value > schema["maximum"]:
        errors.append(f"{path}: above maximum")
    if "maxLength" in schema and len(value) > schema["maxLength"]:
        errors.append(f"{path}: longer than {schema['maxLength']}")
    if "minLength" in schema and len(value) < schema["minLength"]:
        errors.append(f"{path}: shorter than {schema['minLength']}")
    if "pattern" in schema and not re.search(schema["pattern"], value):
        errors.append(f"{path}: does not match {schema['pattern']}")
    if t == "object":
        for req in schema.get("required") or []:
            if req not in value:
                errors.append(f"{path}.{req}: required")
        if "oneOf" in schema:
            matched = sum(all(r in value for r in b.get("required", [])) for b in schema["oneOf"])
            if matched != 1:
                errors.append(f"{path}: must match exactly one of oneOf")
        props = schema.get("properties")
        for k, v in value.items():
            if props is not None and k in props:
                errors += validate(v, props[k], f"{path}.{k}")
            elif isinstance(schema.get("additionalProperties"), dict):
                errors += validate(v, schema["additionalProperties"], f"{path}.{k}")
            elif props is not None and path != ".metadata":
                errors.append(f"{path}.{k}: unknown field (the API server would prune it)")
    if t == "array":
        for i, item in enumerate(value):
            errors += validate(item, schema.get("items") or {}, f"{path}[{i}]")
    return errors


def test_example_is_valid_and_fully_known():
    doc = load(EXAMPLE)
    assert validate(doc, isvc_schema()) == []
    from pagoda_operator.spec import parse

    s = parse(doc["metadata"]["name"], "default", doc["spec"])
    assert s.gpus == 1 and s.autoscaling is not None and s.model.source == "pvc"


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ({"model": {"name": "m"}}, "oneOf"),
        ({"model": {"name": "m", "uri": "x"}, "engine": {"blockSize": 24}}, "not in [16, 32, 64, 128]"),
        ({"model": {"name": "m", "uri": "hf://a"}, "replicas": -1}, "below minimum"),
        (
            {"model": {"name": "m", "uri": "hf://a"}, "autoscaling": {"metric": "cpu", "maxReplicas": 2}},
            "not in",
        ),
        (
            {"model": {"name": "m", "uri": "hf://a"}, "autoscaling": {"minReplicas": 1}},
            "maxReplicas: required",
        ),
        ({"model": {"name": "m", "uri": "hf://a"}, "engine": {"gpuMemoryUtilisation": 0.5}}, "unknown field"),
        ({"model": {"name": "--port=1", "uri": "hf://a"}}, ".spec.model.name: does not match"),
        ({"model": {"name": "m", "pvc": {"claimName": "w", "path": "../x"}}}, ".spec.model.pvc.path: does not match"),
        ({"model": {"name": "m", "pvc": {"claimName": "w", "path": "/x"}}}, ".spec.model.pvc.path: does not match"),
        ({"model": {"name": "m", "hostPath": {"path": "/a/../etc"}}}, ".spec.model.hostPath.path: does not match"),
        (
            {"model": {"name": "m", "uri": "hf://a"}, "kvOffload": {"disk": {"path": "/k/..", "sizeGiB": 1}}},
            ".spec.kvOffload.disk.path: does not match",
        ),
        (
            {"model": {"name": "m", "uri": "hf://a"}, "server": {"apiKeySecretRef": {"key": "k"}}},
            ".spec.server.apiKeySecretRef.name: required",
        ),
        (
            {"model": {"name": "m", "uri": "hf://a"}, "server": {"apiKeySecretRef": {"name": "UP"}}},
            ".spec.server.apiKeySecretRef.name: does not match",
        ),
        *[({"model": {"name": "m", "uri": "hf://a"}, "engine": {"numKvBlocks": v}}, f".spec.engine.numKvBlocks: {why}")
          for v, why in ((0, "below minimum"), (2**40, "above maximum"), ("8", "expected integer"))],
        *[({"model": {"name": "m", "uri": "hf://a"}, "engine": {"schedulingPolicy": v}},
           f".spec.engine.schedulingPolicy: {why}") for v, why in (("lifo", "'lifo' not in"), ("", "'' not in"),
                                                                    (1, "expected string"))],
        *[({"model": {"name": "m", "uri": "hf://a"}, "parallelism": {"data": 2, "dataParallelExperts": v}},
           ".spec.parallelism.dataParallelExperts: expected boolean") for v in ("yes", 1)],
        ({"model": {"name": "m", "uri": "ftp://x/y"}}, ".spec.model.uri: does not match"),
        ({"model": {"name": "m", "uri": "hf://a b"}}, ".spec.model.uri: does not match"),
        ({"model": {"name": "m", "uri": "/models/x"}}, ".spec.model.uri: does not match"),
        ({"model": {"name": "m", "uri": 7}}, ".spec.model.uri: expected string"),
        ({"model": {"name": "m", "uri": "hf://" + "a" * 1020}}, ".spec.model.uri: longer than 1024"),
        (
            {"model": {"name": "m", "uri": "s3://b/m", "endpoint": "https://k:s@s3.example"}},
            ".spec.model.endpoint: does not match",
        ),
        (
            {"model": {"name": "m", "uri": "s3://b/m", "endpoint": "https://s3/" + "a" * 2048}},
            ".spec.model.endpoint: longer than 2048",
        ),
        ({"model": {"name": "m", "uri": "s3://b/m", "region": "EU"}}, ".spec.model.region: does not match"),
        ({"model": {"name": "m", "uri": "s3://b/m", "cacheSize": "-1Gi"}}, ".spec.model.cacheSize: does not match"),
        ({"model": {"name": "m", "uri": "s3://b/m", "credentials": {}}}, ".spec.model.credentials.secretName: required"),
        (
            {"model": {"name": "m", "uri": "s3://b/m", "credentials": {"secretName": "s", "key": "k"}}},
            ".spec.model.credentials.key: unknown field",
        ),
    ],
)
def test_schema_rejects(spec, fragment):
    errors = validate(
        {
            "apiVersion": "pagoda.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": "x"},
            "spec": spec,
        },
        isvc_schema(),
    )
    assert any(fragment in e for e in errors), errors


@pytest.mark.parametrize(
    "model",
    [
        {"name": "m", "uri": "hf://Qwen/Qwen3-0.6B@main", "credentials": {"secretName": "hf-token"},
         "endpoint": "https://hf-mirror.internal", "cacheSize": "40Gi"},
        {"name": "m", "uri": "s3://models/qwen3", "credentials": {"secretName": "s3-creds"},
         "endpoint": "http://minio.storage.svc:9000", "region": "us-east-1", "cacheSize": "1.5Ti"},
        {"name": "m", "uri": "pvc://weights/qwen3"},
    ],
)  # fmt: skip
def test_schema_admits_each_model_source(model):
    body = {"apiVersion": "pagoda.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": "x"},
            "spec": {"model": model}}  # fmt: skip
    assert validate(body, isvc_schema()) == []


def test_schema_admits_data_parallel_experts_and_defaults_it_off():
    body = {"apiVersion": "pagoda.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": "x"},
            "spec": {"model": {"name": "m", "uri": "hf://a"}, "resources": {"gpusPerReplica": 4},
                     "parallelism": {"data": 4, "dataParallelExperts": True}}}
    assert validate(body, isvc_schema()) == []
    field = isvc_schema()["properties"]["spec"]["properties"]["parallelism"]["properties"]["dataParallelExperts"]
    assert (field["type"], field["default"]) == ("boolean", False)


def test_crd_patterns_are_the_operators_patterns():
    """The schema refuses at apply time what spec.validate refuses later: the same regexes."""
    from pagoda_operator import spec

    props = isvc_schema()["properties"]["spec"]["properties"]
    model = props["model"]["properties"]
    assert model["name"]["pattern"] == spec.MODEL_NAME
    assert model["pvc"]["properties"]["path"]["pattern"] == spec.RELATIVE_PATH
    assert model["hostPath"]["properties"]["path"]["pattern"] == spec.ABSOLUTE_PATH
    assert props["kvOffload"]["properties"]["disk"]["properties"]["path"]["pattern"] == spec.ABSOLUTE_PATH
    assert model["uri"]["pattern"] == spec.MODEL_URI
    assert model["endpoint"]["pattern"] == spec.ENDPOINT and model["endpoint"]["maxLength"] == spec.MAX_ENDPOINT
    assert model["region"]["pattern"] == spec.REGION
    assert model["cacheSize"]["pattern"] == spec.QUANTITY and model["cacheSize"]["maxLength"] == spec.MAX_QUANTITY
    assert model["credentials"]["properties"]["secretName"]["pattern"] == spec.DNS1123_SUBDOMAIN
    assert set(spec.REMOTE_OPTIONS) <= set(model)
    from pagoda_daemon import model_uri

    assert model["uri"]["maxLength"] == model_uri.MAX_URI_LENGTH
    ref = props["server"]["properties"]["apiKeySecretRef"]
    assert ref["required"] == ["name"]
    assert ref["properties"]["name"]["pattern"] == spec.DNS1123_SUBDOMAIN
    assert ref["properties"]["key"]["pattern"] == spec.SECRET_KEY
    assert ref["properties"]["key"]["default"] == spec.DEFAULT_API_KEY_KEY


# -- helm ----------------------------------------------------------------------------------
def find_helm() -> str | None:
    if os.environ.get("PAGODA_HELM"):
        return os.environ["PAGODA_HELM"]
    ensure = ROOT / "e2e" / "cluster" / "ensure-k8s.sh"
    if ensure.exists():
        out = subprocess.run([str(ensure), "--print-bin-dir"], capture_output=True, text=True, check=False)
        cand = Path(out.stdout.strip()) / "helm"
        if out.returncode == 0 and cand.is_file() and os.access(cand, os.X_OK):
            return str(cand)
    return shutil.which("helm")


@pytest.fixture(scope="module")
def helm(tmp_path_factory) -> Any:
    path = find_helm()
    if not path:
        pytest.skip("helm not found: run e2e/cluster/ensure-k8s.sh (caches it) or set PAGODA_HELM")
    home = tmp_path_factory.mktemp("helm")
    env = {
        **os.environ,
        "HELM_CACHE_HOME": str(home / "c"),
        "HELM_CONFIG_HOME": str(home / "f"),
        "HELM_DATA_HOME": str(home / "d"),
    }

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([path, *args], capture_output=True, text=True, env=env, timeout=120)

    return run


def test_helm_lint(helm):
    out = helm("lint", "--strict", str(CHART))
    assert out.returncode == 0, out.stdout + out.stderr


def render(helm, *sets: str) -> list[dict[str, Any]]:
    args = ["template", "rel", str(CHART), "--namespace", "pagoda-system", "--include-crds"]
    for s in sets:
        args += ["--set", s]
    out = helm(*args)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def test_the_chart_gives_the_operator_its_heap_environment(helm):
    """One declaration (pagoda_operator.memory.ENVIRONMENT): the operator's container sets each
    variable to it, and the scale benchmark runs the operator with it."""
    from pagoda_operator.memory import ENVIRONMENT

    dep = next(d for d in render(helm) if d["kind"] == "Deployment" and d["metadata"]["name"] == "rel-pagoda-operator")
    env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert {name: env.get(name) for name in ENVIRONMENT} == ENVIRONMENT
    scale = (Path(__file__).resolve().parents[2] / "benchmarks" / "operator_scale.py").read_text()
    assert "from pagoda_operator.memory import ENVIRONMENT" in scale


def test_an_image_tag_of_digits_alone_renders_as_written(helm):
    """`--set image.tag=860232348115` (a content hash that happens to hold no letter): helm reads
    it as a number, which the templates once rendered as `%!s(int64=...)`, an image name no
    kubelet takes (seen in the e2e harness on 2026-11-28)."""
    docs = render(helm, "image.tag=860232348115", "daemonImage.tag=1234567")
    dep = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "rel-pagoda-operator")
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "ghcr.io/pagoda-serving/pagoda-operator:860232348115"
    assert "--daemon-image=ghcr.io/pagoda-serving/pagoda:1234567" in container["args"]


def test_helm_template_defaults(helm):
    docs = render(helm)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert ("CustomResourceDefinition", "inferenceservices.pagoda.dev") in kinds
    assert ("CustomResourceDefinition", "nodetopologies.pagoda.dev") in kinds
    assert ("Deployment", "rel-pagoda-operator") in kinds and (
        "DaemonSet",
        "rel-pagoda-topology-agent",
    ) in kinds
    assert ("ConfigMap", "rel-pagoda-dashboard") in kinds
    assert not any(d["kind"] == "ServiceMonitor" for d in docs)
    dep = next(d for d in docs if d["kind"] == "Deployment")
    assert dep["spec"]["replicas"] == 1
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["command"] == ["pagoda"] and c["args"][0] == "operator"
    assert "--lease-namespace=pagoda-system" in c["args"]
    assert "--model-config-endpoint=https://huggingface.co" in c["args"]  # the public Hub, anonymously
    assert "--daemon-image=ghcr.io/pagoda-serving/pagoda:0.1.0" in c["args"]
    ds = next(d for d in docs if d["kind"] == "DaemonSet")
    agent = ds["spec"]["template"]["spec"]["containers"][0]
    assert agent["command"] == ["pagoda"] and agent["args"] == [
        "topology", "--publish", "--interval=60", "--model-cache=/model-cache", "--model-cache-max-gib=200"]
    assert {e["name"] for e in agent["env"]} >= {"NODE_NAME"}
    assert ds["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
    import json

    dash = json.loads(next(d for d in docs if d["kind"] == "ConfigMap")["data"]["pagoda.json"])
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    for metric in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:generation_tokens_total",
        "pagoda_operator_desired_replicas",
        "pagoda_operator_autoscaling_decisions_total",
        "vllm:prefix_cache_hits_total",
        "vllm:external_prefix_cache_hits_total",
        "pagoda:kv_offload_transfer_seconds_total",
    ):
        assert metric in exprs


def test_rbac_is_least_privilege(helm):
    docs = render(helm)
    role = next(
        d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "rel-pagoda-operator"
    )
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
        # Children go through garbage collection; the operator deletes only the workloads and
        # Services of a layout it no longer wants (pod_groups.py), never ConfigMaps or anything else.
        if "delete" in rule["verbs"]:
            assert set(rule["resources"]) <= {"deployments", "statefulsets", "services", "leaderworkersets"}, rule
    # Secrets: created (an elastic InferenceService's admin key, elastic.py), never read
    secrets = [r for r in role["rules"] if "secrets" in r["resources"]]
    assert secrets == [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]}]
    verbs = {res: set(rule["verbs"]) for rule in role["rules"] for res in rule["resources"]}
    # Nothing patches Events (ours and kopf's are created) or reads the status subresource.
    assert verbs["events"] == {"list", "create"} and verbs["inferenceservices/status"] == {"patch"}
    # Groups of pods as LeaderWorkerSets where the CRD is installed: written like the StatefulSets
    lws = [r for r in role["rules"] if "leaderworkersets" in r["resources"]]
    assert lws == [{"apiGroups": ["leaderworkerset.x-k8s.io"], "resources": ["leaderworkersets"],
                    "verbs": ["get", "list", "watch", "create", "update", "delete"]}]
    assert verbs["leaderworkersets"] == verbs["statefulsets"]
    lease = next(d for d in docs if d["kind"] == "Role")
    assert lease["metadata"]["namespace"] == "pagoda-system"
    assert lease["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create", "update"]}
    ]


def test_helm_template_options(helm):
    docs = render(
        helm,
        "serviceMonitor.enabled=true",
        "topologyAgent.enabled=false",
        "operator.replicas=2",
        "operator.watchNamespaces={team-a,team-b}",
        "grafanaDashboard.enabled=false",
    )
    assert sum(d["kind"] == "ServiceMonitor" for d in docs) == 2
    assert not any(d["kind"] == "DaemonSet" for d in docs)
    dep = next(d for d in docs if d["kind"] == "Deployment")
    assert dep["spec"]["replicas"] == 2
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args
    off = render(helm, "operator.modelConfigEndpoints=null")
    args = next(d for d in off if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a for a in args if a.startswith("--model-config-endpoint")] == ["--model-config-endpoint=none"]


def test_the_node_model_cache_reaches_operator_and_agent_and_goes_when_off(helm):
    """On by default: the operator renders namespaces' directories of the nodePath; the agent
    mounts the root, opens it to 1777 in an init container that is root without any capability,
    tends it (--model-cache) and may list InferenceServices, nothing more. Off: none of it."""
    from pagoda_operator.cli import parser

    docs = render(helm)
    op = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert "--node-model-cache=/var/lib/pagoda/model-cache" in op["args"]
    assert parser().parse_args(op["args"][1:]).node_model_cache == "/var/lib/pagoda/model-cache"
    pod = next(d for d in docs if d["kind"] == "DaemonSet")["spec"]["template"]["spec"]
    assert pod["volumes"] == [{"name": "model-cache",
                               "hostPath": {"path": "/var/lib/pagoda/model-cache", "type": "DirectoryOrCreate"}}]
    (init,) = pod["initContainers"]
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert init["securityContext"]["allowPrivilegeEscalation"] is False and "0o1777" in init["command"][-1]
    assert pod["containers"][0]["volumeMounts"] == [{"name": "model-cache", "mountPath": "/model-cache"}]
    role = next(d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"].endswith("topology-agent"))
    assert {"apiGroups": ["pagoda.dev"], "resources": ["inferenceservices"], "verbs": ["list"]} in role["rules"]

    off = render(helm, "modelCache.nodePath=")
    op = next(d for d in off if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert not any(a.startswith("--node-model-cache") for a in op["args"])
    pod = next(d for d in off if d["kind"] == "DaemonSet")["spec"]["template"]["spec"]
    assert "initContainers" not in pod and "volumes" not in pod
    assert not any(a.startswith("--model-cache") for a in pod["containers"][0]["args"])
    role = next(d for d in off if d["kind"] == "ClusterRole" and d["metadata"]["name"].endswith("topology-agent"))
    assert not any("inferenceservices" in r["resources"] for r in role["rules"])


def test_topology_agent_runs_in_the_host_network_namespace(helm):
    """A pod's own network namespace hides the node's NICs from /sys/class/net."""
    ds = next(d for d in render(helm) if d["kind"] == "DaemonSet")
    assert ds["spec"]["template"]["spec"]["hostNetwork"] is True
    assert ds["spec"]["template"]["spec"]["dnsPolicy"] == "ClusterFirstWithHostNet"


def test_network_policy_values_reach_the_operator_and_its_rbac(helm):
    """On by default: the operator gets --network-policy with one peer flag per httpFrom entry
    (parsed by the operator's own CLI) and may write networkpolicies; off, neither."""
    from pagoda_operator.cli import parser

    def operator_args(docs):
        dep = next(d for d in docs if d["kind"] == "Deployment")
        return dep["spec"]["template"]["spec"]["containers"][0]["args"]

    def role_resources(docs):
        role = next(d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "rel-pagoda-operator")
        return {r for rule in role["rules"] for r in rule["resources"]}

    docs = render(helm)
    args = parser().parse_args(operator_args(docs)[1:])
    assert args.network_policy is True and args.network_policy_http_from == [{"namespaceSelector": {}}]
    assert "networkpolicies" in role_resources(docs)
    assert not any(d["kind"] == "NetworkPolicy" for d in docs)  # the operator's own: opt-in

    narrowed = render(
        helm,
        "networkPolicy.httpFrom[0].namespaceSelector.matchLabels.team=a",
        "networkPolicy.httpFrom[1].namespaceSelector.matchLabels.name=monitoring",
    )
    assert parser().parse_args(operator_args(narrowed)[1:]).network_policy_http_from == [
        {"namespaceSelector": {"matchLabels": {"team": "a"}}},
        {"namespaceSelector": {"matchLabels": {"name": "monitoring"}}},
    ]

    off = render(helm, "networkPolicy.enabled=false")
    assert not any(a.startswith("--network-policy") for a in operator_args(off))
    assert "networkpolicies" not in role_resources(off)


def test_operator_network_policy_opens_only_metrics_webhook_and_extra_rules(helm):
    docs = render(
        helm,
        "networkPolicy.operator.enabled=true",
        "networkPolicy.operator.metricsFrom[0].namespaceSelector.matchLabels.name=monitoring",
        "networkPolicy.operator.extraIngress[0].ports[0].port=9999",
    )
    (pol,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert pol["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "operator"
    assert pol["spec"]["policyTypes"] == ["Ingress"]
    metrics = {
        "ports": [{"port": 8080, "protocol": "TCP"}],
        "from": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}],
    }
    # The API server calls the webhook from outside the pod network: its port is open to all.
    assert pol["spec"]["ingress"] == [metrics, {"ports": [{"port": 9443, "protocol": "TCP"}]}, {"ports": [{"port": 9999}]}]

    (pol,) = [d for d in render(helm, "networkPolicy.operator.enabled=true", "admission.enabled=false")
              if d["kind"] == "NetworkPolicy"]
    assert [r["ports"][0]["port"] for r in pol["spec"]["ingress"]] == [8080]


def test_topology_agent_runs_unprivileged(helm):
    ds = next(d for d in render(helm) if d["kind"] == "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert pod["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 10001,
        "runAsGroup": 10001,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    sc = pod["containers"][0]["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["privileged"] is False


def test_quickstart_example_is_the_cpu_variant_of_the_example():
    """examples/quickstart-inferenceservice.yaml (what `make quickstart` applies) is valid, and
    differs from examples/inferenceservice.yaml only where its header says."""
    quick = load(ROOT / "examples" / "quickstart-inferenceservice.yaml")
    assert validate(quick, isvc_schema()) == []
    from pagoda_operator.spec import parse

    s = parse(quick["metadata"]["name"], "default", quick["spec"])
    assert s.gpus == 0 and s.device == "cpu" and s.model.source == "hostPath" and s.autoscaling is None
    full = load(EXAMPLE)["spec"]
    for key in ("port",):
        assert quick["spec"][key] == full[key]
    assert quick["spec"]["pod"]["env"] == full["pod"]["env"]
    assert set(quick["spec"]) <= set(full)


def test_local_cluster_values_render(helm):
    """The values the quickstart and the real-container e2e tests install the chart with."""
    values = ROOT / "e2e" / "quickstart" / "values.yaml"
    out = helm("template", "rel", str(CHART), "--namespace", "pagoda-system", "-f", str(values))
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    dep = next(d for d in docs if d["kind"] == "Deployment")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] == "pagoda-operator:dev" and c["imagePullPolicy"] == "Never"
    assert "--daemon-image=pagoda-daemon:dev" in c["args"] and "--image-pull-policy=Never" in c["args"]
    ds = next(d for d in docs if d["kind"] == "DaemonSet")
    terms = ds["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"][0]["matchExpressions"][0]["key"] == "pagoda.dev/local-node"


def test_operator_traces_only_where_an_otlp_endpoint_is_set(helm):
    def env(*sets: str) -> dict[str, Any]:
        dep = next(d for d in render(helm, *sets) if d["kind"] == "Deployment")
        return {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}

    assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in env()
    on = env("operator.otlpEndpoint=http://collector.obs:4318", "operator.otlpProtocol=http/protobuf")
    assert on["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://collector.obs:4318"
    assert on["OTEL_EXPORTER_OTLP_PROTOCOL"] == "http/protobuf"
