"""spec.model.uri (hf://, s3://, pvc://) and the options of remote sources: parsed with the
daemon's own parser, refused at apply time by the webhook, rendered into the pod."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from pagoda_operator import builders
from pagoda_operator.admission import Access, Policy, review
from pagoda_operator.builders import CACHE_DIR, Settings, children
from pagoda_operator.spec import InvalidSpec, model_source_errors, parse
from pagoda_operator.status import Problem, compute, pod_problems
from pagoda_operator.status import Workload as StatusWorkload
from pagoda_operator.webhook import decide
from tests.operator.operator_fakes import every_capability, isvc
from tests.operator.test_admission import NS, admission_review


def refuses(_: str) -> bool:
    return False


def model(uri: Any, **extra: Any) -> dict[str, Any]:
    return {"name": "m", "uri": uri, **extra}


def build(m: dict[str, Any], **spec: Any):
    body = isvc("llama", model=m, **spec)
    s = parse("llama", "default", body["spec"], supports=every_capability)
    return s, children(s, body, 1, Settings(daemon_image="img:1"))


def pod_spec(kids) -> dict[str, Any]:
    return kids.workload["spec"]["template"]["spec"]


def daemon(kids) -> dict[str, Any]:
    return pod_spec(kids)["containers"][0]


def env_of(kids) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in daemon(kids)["env"]}


# ---- parsing -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "uri, source, scheme",
    [
        ("hf://Qwen/Qwen3-0.6B", "uri", "hf"),
        ("hf://Qwen/Qwen3-0.6B@main", "uri", "hf"),
        ("s3://my-bucket/models/qwen3", "uri", "s3"),
        ("s3://my-bucket", "uri", "s3"),
        ("pvc://weights/qwen3", "pvc", "pvc"),
        ("pvc://weights", "pvc", "pvc"),
    ],
)
def test_each_scheme_is_accepted_when_the_daemon_fetches(uri, source, scheme):
    s = parse("svc", "ns", {"model": model(uri)}, supports=every_capability)
    assert (s.model.source, s.model.scheme, s.model.uri) == (source, scheme, uri)


MALFORMED = [
    ("ftp://host/x", "spec.model.uri: 'ftp://host/x': scheme 'ftp' is not one of"),
    ("s3://Bad_Bucket/x", "is not an S3 bucket name"),
    ("s3://ab/x", "is not an S3 bucket name"),
    ("s3://bucket/a/../b", "may not contain '.', '..' or empty segments"),
    ("pvc://weights/../other", "may not contain '.', '..' or empty segments"),
    ("pvc://Weights/x", "is not a PersistentVolumeClaim name"),
    ("hf://org/na me", "whitespace or control characters"),
    ("hf://org/name\n", "whitespace or control characters"),
    ("hf://org/../name", "is not a Hugging Face repository id"),
    ("hf://org/name@..", "is not a revision"),
    ("hf://" + "a" * 2000, "1 to 1024 characters; got 2005"),
    (42, "a model reference is a string, not int"),
    (["hf://org/name"], "a model reference is a string, not list"),
    ({"hf": "org/name"}, "a model reference is a string, not dict"),
    ("/models/qwen", "is a local path: use spec.model.hostPath"),
    ("relative/path", "is neither an absolute path nor a URI"),
]


@pytest.mark.parametrize("uri, message", MALFORMED)
def test_a_malformed_uri_is_refused_naming_the_field(uri, message):
    with pytest.raises(InvalidSpec) as e:
        parse("svc", "ns", {"model": model(uri)}, supports=every_capability)
    assert str(e.value).startswith("spec.model.uri: ") and message in str(e.value)


def test_an_hf_or_s3_uri_is_refused_while_the_daemon_cannot_fetch():
    for uri in ("hf://Qwen/Qwen3-0.6B", "s3://bucket/m"):
        with pytest.raises(InvalidSpec, match=r"^spec\.model\.uri: fetching the model from a URI"):
            parse("svc", "ns", {"model": model(uri)}, supports=refuses)
    # pvc:// is a volume mount: the daemon fetches nothing
    assert parse("svc", "ns", {"model": model("pvc://weights/m")}, supports=refuses).model.source == "pvc"


REMOTE_OK = [
    model("hf://org/name", credentials={"secretName": "hf-token"}, endpoint="https://hf-mirror.internal"),
    model("s3://bucket/m", credentials={"secretName": "s3.creds"}, endpoint="http://minio.store.svc:9000",
          region="us-east-1", cacheSize="200Gi"),
    model("s3://bucket/m", endpoint="https://s3.example/path?x=1", cacheSize="1.5T"),
]


@pytest.mark.parametrize("m", REMOTE_OK)
def test_remote_options_in_bounds_are_accepted(m):
    assert model_source_errors(m) == []
    parse("svc", "ns", {"model": m}, supports=every_capability)


BAD_OPTIONS = [
    (model("hf://o/n", credentials={"secretName": "Bad_Name"}), "spec.model.credentials.secretName 'Bad_Name'"),
    (model("hf://o/n", credentials={"secretName": "a" * 254}), "spec.model.credentials.secretName"),
    (model("hf://o/n", credentials={}), "spec.model.credentials.secretName None"),
    (model("hf://o/n", credentials="hf-token"), "spec.model.credentials.secretName None"),
    (model("s3://bucket/m", endpoint="https://key:secret@s3.example"), "carries user information"),
    (model("s3://bucket/m", endpoint="https://@s3.example"), "carries user information"),
    (model("s3://bucket/m", endpoint="ftp://s3.example"), "not an http:// or https:// URL with a host"),
    (model("s3://bucket/m", endpoint="https://"), "not an http:// or https:// URL with a host"),
    (model("s3://bucket/m", endpoint="s3.example"), "not an http:// or https:// URL with a host"),
    (model("s3://bucket/m", endpoint="https://s3.example:99999"), "is not a URL"),
    (model("s3://bucket/m", endpoint="https://s3.example/a b"), "whitespace or control characters"),
    (model("s3://bucket/m", endpoint="https://s3.example/" + "a" * 2048), "1 to 2048 characters"),
    (model("s3://bucket/m", endpoint=8080), "an endpoint is a string, not int"),
    (model("s3://bucket/m", region="US-EAST-1"), "spec.model.region 'US-EAST-1' is not a region"),
    (model("s3://bucket/m", region="a" * 33), "is not a region"),
    (model("hf://o/n", region="us-east-1"), "spec.model.region: only for an s3:// uri"),
    (model("s3://bucket/m", cacheSize="-1Gi"), "spec.model.cacheSize '-1Gi' is not a positive quantity"),
    (model("s3://bucket/m", cacheSize="0"), "is not a positive quantity"),
    (model("s3://bucket/m", cacheSize="100GB"), "is not a positive quantity"),
    (model("s3://bucket/m", cacheSize=100), "is not a positive quantity"),
    (model("pvc://weights/m", credentials={"secretName": "s"}), "spec.model.credentials: only for a model fetched"),
    (model("pvc://weights/m", cacheSize="1Gi"), "spec.model.cacheSize: only for a model fetched"),
    ({"name": "m", "pvc": {"claimName": "w"}, "endpoint": "https://x"}, "spec.model.endpoint: only for"),
    ({"name": "m", "hostPath": {"path": "/m"}, "region": "eu-west-1"}, "spec.model.region: only for"),
]


@pytest.mark.parametrize("m, message", BAD_OPTIONS)
def test_remote_options_out_of_bounds_or_on_the_wrong_source_are_refused(m, message):
    with pytest.raises(InvalidSpec) as e:
        parse("svc", "ns", {"model": m}, supports=every_capability)
    assert message in str(e.value)


# ---- rendering -----------------------------------------------------------------------------
def test_a_pvc_uri_renders_exactly_like_spec_model_pvc():
    _, by_uri = build(model("pvc://weights/qwen/3"))
    _, by_pvc = build({"name": "m", "pvc": {"claimName": "weights", "path": "qwen/3", "readOnly": True}})
    assert daemon(by_uri)["args"][1] == "/models/qwen/3"
    volumes = {v["name"]: v for v in pod_spec(by_uri)["volumes"]}
    assert volumes["model"] == {
        "name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True},
    }  # fmt: skip
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in daemon(by_uri)["volumeMounts"]
    assert "PAGODA_CACHE_DIR" not in env_of(by_uri)
    assert by_uri.workload == by_pvc.workload and by_uri.config_map == by_pvc.config_map
    _, root = build(model("pvc://weights"))
    assert daemon(root)["args"][1] == "/models"


def test_hf_renders_the_token_reference_and_the_mirror():
    _, kids = build(model("hf://org/name@v1", credentials={"secretName": "hf"}, endpoint="https://mirror.internal"))
    env = env_of(kids)
    assert daemon(kids)["args"][1] == "hf://org/name@v1"
    assert env["PAGODA_CACHE_DIR"] == {"name": "PAGODA_CACHE_DIR", "value": CACHE_DIR}
    assert env["HF_TOKEN"] == {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "hf", "key": "HF_TOKEN", "optional": True}},
    }
    assert env["HF_ENDPOINT"] == {"name": "HF_ENDPOINT", "value": "https://mirror.internal"}
    assert not {"AWS_ACCESS_KEY_ID", "AWS_ENDPOINT_URL", "AWS_REGION"} & set(env)
    assert "model" not in {v["name"] for v in pod_spec(kids)["volumes"]}


def test_s3_renders_the_key_references_endpoint_and_region():
    _, kids = build(model("s3://bucket/m", credentials={"secretName": "s3"}, endpoint="http://minio:9000",
                          region="eu-west-1"))  # fmt: skip
    env = env_of(kids)
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        assert env[key] == {
            "name": key, "valueFrom": {"secretKeyRef": {"name": "s3", "key": key, "optional": True}},
        }  # fmt: skip
    assert env["AWS_ENDPOINT_URL"] == {"name": "AWS_ENDPOINT_URL", "value": "http://minio:9000"}
    assert env["AWS_REGION"] == {"name": "AWS_REGION", "value": "eu-west-1"}
    assert not {"HF_TOKEN", "HF_ENDPOINT"} & set(env)


def test_without_options_no_credentials_or_endpoint_are_rendered():
    _, kids = build(model("s3://bucket/m"))
    names = set(env_of(kids))
    assert "PAGODA_CACHE_DIR" in names
    assert not {"AWS_ACCESS_KEY_ID", "AWS_ENDPOINT_URL", "AWS_REGION", "HF_TOKEN", "HF_ENDPOINT"} & names


def test_the_users_env_still_overrides_the_source_env():
    _, kids = build(model("hf://o/n", endpoint="https://a.example"),
                    pod={"env": [{"name": "HF_ENDPOINT", "value": "https://b.example"}]})  # fmt: skip
    assert [e for e in daemon(kids)["env"] if e["name"] == "HF_ENDPOINT"] == [
        {"name": "HF_ENDPOINT", "value": "https://b.example"}
    ]


def test_cache_size_limits_the_cache_emptydir():
    _, sized = build(model("hf://o/n", cacheSize="150Gi"))
    volumes = {v["name"]: v for v in pod_spec(sized)["volumes"]}
    assert volumes["cache"] == {"name": "cache", "emptyDir": {"sizeLimit": "150Gi"}}
    assert {"name": "cache", "mountPath": CACHE_DIR} in daemon(sized)["volumeMounts"]
    _, unsized = build(model("hf://o/n"))
    assert {v["name"]: v for v in pod_spec(unsized)["volumes"]}["cache"] == {"name": "cache", "emptyDir": {}}


def test_the_node_model_cache_mounts_only_the_namespaces_directory():
    settings = Settings(daemon_image="img:1", node_model_cache="/var/lib/pagoda/model-cache")
    for uri in ("hf://o/n", "s3://bucket/m"):
        body = isvc("llama", model=model(uri, cacheSize="10Gi"))
        s = parse("llama", "team-a", body["spec"], supports=every_capability)
        kids = children(s, body, 2, settings)
        volumes = {v["name"]: v for v in pod_spec(kids)["volumes"]}
        assert volumes["model-cache"] == {
            "name": "model-cache", "hostPath": {"path": "/var/lib/pagoda/model-cache", "type": "DirectoryOrCreate"}}
        assert {"name": "model-cache", "mountPath": builders.MODEL_CACHE_DIR, "subPath": "team-a"} in \
            daemon(kids)["volumeMounts"]
        assert env_of(kids)["PAGODA_CACHE_DIR"] == {"name": "PAGODA_CACHE_DIR", "value": builders.MODEL_CACHE_DIR}
        assert volumes["cache"] == {"name": "cache", "emptyDir": {"sizeLimit": "10Gi"}}  # the rest of the caches
    # sources the daemon does not fetch get no node cache
    for m in (model("pvc://weights/m"), {"name": "m", "hostPath": {"path": "/models/x"}}):
        body = isvc("llama", model=m)
        kids = children(parse("llama", "team-a", body["spec"], supports=every_capability), body, 1, settings)
        assert "model-cache" not in {v["name"] for v in pod_spec(kids)["volumes"]}
        assert "PAGODA_CACHE_DIR" not in env_of(kids)


def test_without_a_node_model_cache_each_pod_fetches_into_its_cache_volume():
    _, kids = build(model("hf://o/n"))
    assert "model-cache" not in {v["name"] for v in pod_spec(kids)["volumes"]}
    assert env_of(kids)["PAGODA_CACHE_DIR"]["value"] == CACHE_DIR


@pytest.mark.parametrize("path", ["/var/lib/pagoda/model-cache", "/var/lib/pagoda/model-cache/team-b",
                                  "/var/lib/pagoda/model-cache/../model-cache/x", "/var/lib/pagoda", "/var/lib"])
def test_no_host_path_reaches_the_node_model_cache_whatever_the_prefixes(path):
    policy = Policy.from_values({"hostPathPrefixes": ["/var/lib"]},
                                reserved_host_paths=("/var/lib/pagoda/model-cache",))
    out = decide(review_request({"model": {"name": "m", "hostPath": {"path": path}}}), policy, everyone_can)
    assert out["response"]["allowed"] is False
    assert "reaches the node model cache '/var/lib/pagoda/model-cache'" in out["response"]["status"]["message"]
    ok = decide(review_request({"model": {"name": "m", "hostPath": {"path": "/var/lib/pagoda/models"}}}),
                policy, everyone_can)
    assert ok["response"]["allowed"] is True


@pytest.mark.parametrize("value", ["relative/dir", "/", "/etc", "/var/lib/../../etc/x", "/proc/x", "/var/lib", "/var",
                                   "/var/lib/kubelet/pods", "/var/lib/containerd"])
def test_the_operator_refuses_a_node_model_cache_that_is_not_a_safe_host_directory(value, capsys):
    from pagoda_operator.cli import parser

    with pytest.raises(SystemExit):
        parser().parse_args(["--node-model-cache", value])
    assert "--node-model-cache" in capsys.readouterr().err
    assert parser().parse_args(["--node-model-cache", "/var/lib/pagoda/model-cache/"]).node_model_cache == \
        "/var/lib/pagoda/model-cache"


def test_a_failed_download_is_the_containers_termination_message():
    _, kids = build(model("hf://o/n"))
    assert daemon(kids)["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_workers_of_a_group_fetch_with_the_same_env():
    body = isvc("big", model=model("s3://bucket/m", credentials={"secretName": "s3"}),
                resources={"gpusPerReplica": 4, "podsPerReplica": 2}, parallelism={"tensor": 4})  # fmt: skip
    s = parse("big", "default", body["spec"], supports=every_capability)
    from pagoda_operator import pod_groups

    kids = pod_groups.children(s, body, 1, Settings(daemon_image="img:1"), {0: "10.0.0.1"})
    for sts in (kids.workload, *kids.workers):
        env = {e["name"]: e for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"]["name"] == "s3"


# ---- status --------------------------------------------------------------------------------
def crashing_pod(message: str) -> dict[str, Any]:
    return {
        "metadata": {"name": "llama-abc"},
        "status": {
            "phase": "Running",
            "containerStatuses": [
                {
                    "name": "daemon",
                    "restartCount": 3,
                    "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting"}},
                    "lastState": {"terminated": {"reason": "Error", "exitCode": 1, "message": message}},
                }
            ],
        },
    }


FETCH_FAILURE = "hf://org/name: 401 Unauthorized: set HF_TOKEN in the Secret of spec.model.credentials"


def test_a_failed_fetch_is_the_degraded_message():
    log_tail = f"INFO fetching hf://org/name into {CACHE_DIR}\n{FETCH_FAILURE}\n"
    (problem,) = pod_problems([crashing_pod(log_tail)])
    assert problem == Problem(
        "CrashLoopBackOff",
        "pod llama-abc container daemon: CrashLoopBackOff (restarted 3 times), last exit Error code 1: "
        + FETCH_FAILURE,
    )
    st = compute(
        generation=1, desired=1, now="2024-01-01T00:00:00Z", previous=None, pods=[crashing_pod(log_tail)],
        workload=StatusWorkload(exists=True, current=True, replicas=1, ready=0, updated=1, problems=()),
    )  # fmt: skip
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "CrashLoopBackOff")
    assert degraded["message"].endswith(": " + FETCH_FAILURE)


# ---- admission -----------------------------------------------------------------------------
def review_request(spec: dict[str, Any], operation: str = "CREATE") -> dict[str, Any]:
    return admission_review(operation, spec, spec if operation == "UPDATE" else None)


def everyone_can(user: Any, namespace: str, access: Access) -> bool:
    return True


@pytest.mark.parametrize("uri, message", MALFORMED)
def test_the_webhook_refuses_a_malformed_uri_at_apply_time(uri, message):
    out = decide(review_request({"model": model(uri)}), Policy(), everyone_can)["response"]
    assert out["allowed"] is False and out["status"]["code"] == 422 and out["status"]["reason"] == "Invalid"
    assert f"InferenceService {NS}/svc is invalid: spec.model.uri: " in out["status"]["message"]
    assert message in out["status"]["message"]


@pytest.mark.parametrize("m, message", BAD_OPTIONS)
def test_the_webhook_refuses_bad_remote_options(m, message):
    out = decide(review_request({"model": m}), Policy(), everyone_can)["response"]
    assert out["allowed"] is False and message in out["status"]["message"]


@pytest.mark.parametrize("m", [*REMOTE_OK, model("pvc://weights/m"), model("hf://Qwen/Qwen3-0.6B@main")])
def test_the_webhook_admits_good_sources(m):
    assert decide(review_request({"model": m}), Policy(), everyone_can)["response"]["allowed"] is True


def test_the_webhook_refuses_a_malformed_uri_on_update():
    good = review_request({"model": model("hf://o/n")}, "UPDATE")
    bad = copy.deepcopy(good)
    bad["request"]["object"]["spec"]["model"]["uri"] = "hf://o/../n"
    bad["request"]["oldObject"] = good["request"]["object"]
    out = decide(bad, Policy(), everyone_can)["response"]
    assert out["allowed"] is False and "spec.model.uri" in out["status"]["message"]


def test_the_credentials_secret_needs_get_on_it_whoever_asks():
    spec = {"model": model("s3://bucket/m", credentials={"secretName": "s3-creds"})}
    asked: list[Access] = []

    def pod_creator_without_the_secret(access: Access) -> bool:
        asked.append(access)
        return access == Access("create", "pods")

    (violation,) = review(Policy(), spec, pod_creator_without_the_secret)
    assert violation.field == "spec.model.credentials.secretName"
    assert violation.needs == Access("get", "secrets", "s3-creds")
    assert review(Policy(), spec, lambda access: access == Access("get", "secrets", "s3-creds")) == []
    out = decide(review_request(spec), Policy(), lambda u, ns, a: a == Access("create", "pods"))["response"]
    assert out["allowed"] is False and out["status"]["code"] == 403
    assert "spec.model.credentials.secretName" in out["status"]["message"]


def test_builders_module_names_each_sources_standard_variables():
    assert builders.CREDENTIAL_KEYS == {
        "hf": ("HF_TOKEN",),
        "s3": ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"),
    }


def test_the_deploy_guides_model_sources_are_valid():
    """docs/deploy.md "Model sources": each InferenceService passes the schema and the operator,
    and each Secret has the keys the pod reads for its source."""
    import re
    from pathlib import Path

    import yaml

    from tests.operator.test_manifests import isvc_schema, validate

    text = (Path(__file__).resolve().parents[2] / "docs" / "deploy.md").read_text()
    section = text.split("### Model sources", 1)[1].split("\n## ", 1)[0]
    docs = [d for block in re.findall(r"```yaml\n(.*?)```", section, re.S) for d in yaml.safe_load_all(block) if d]
    secrets = {d["metadata"]["name"]: d for d in docs if d.get("kind") == "Secret"}
    services = [d for d in docs if d.get("kind") == "InferenceService"]
    schemes = set()
    for d in services:
        assert validate(d, isvc_schema()) == []
        s = parse(d["metadata"]["name"], d["metadata"]["namespace"], d["spec"], supports=every_capability)
        schemes.add(s.model.scheme)
        if s.model.credentials_secret:
            keys = set(secrets[s.model.credentials_secret]["stringData"])
            assert keys <= set(builders.CREDENTIAL_KEYS[s.model.scheme]) and keys
    assert schemes == {"hf", "s3"}
    fragments = [d["spec"]["model"] for d in docs if "kind" not in d]
    assert [parse("x", "ns", {"model": m}, supports=every_capability).model.source for m in fragments] == [
        "pvc", "hostPath",
    ]  # fmt: skip
