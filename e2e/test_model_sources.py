"""Models from `hf://` and `s3://` on the real-container cluster: the Hub-compatible server of the
unit tests (tests/models/hub_server.py) and moto's S3 server run on this machine at the node
bridge's address, where pods reach them; an InferenceService names the model by
`spec.model.uri` with `endpoint` and a credentials Secret; the daemon fetches the tiny model into
its cache volume, serves it, and the openai client gets an answer. A wrong token (the Hub's 401),
a wrong S3 key (InvalidAccessKeyId) and an S3 prefix with no model are `Degraded` with the
source's error in the message.

The node's model cache (the chart's modelCache, on by default), for each of hf:// and s3://: two
replicas and a second InferenceService of one model in one namespace download each file once
(counted at the Hub and at moto: tests/models/s3_server.py); the node's NodeTopology lists the
model in use, the operator labels the node with it and the pods prefer that label; once its
InferenceServices are deleted the topology agent evicts it and the label goes
(e2e/quickstart/values.yaml keeps the cache at ~100 KiB).

A daemon killed (SIGKILL) half-way through its download restarts in its pod and goes on: the files
it had fetched are not asked for again, only the one it was fetching. (Resuming inside one file,
a Range request from the bytes already there, is shown by tests/models/test_fetch.py against the
same Hub and moto.)
"""

from __future__ import annotations

import dataclasses
import ipaddress
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_real_containers import _daemon_container, client, cond, isvc, manifest, wait_ready

from pagoda_operator.placement import model_label
from tests.models.hub_server import HubServer

LOCAL_VALUES = Path(__file__).parent / "quickstart" / "values.yaml"  # the chart values the cluster runs with
REPO = "org/tiny-qwen3"
TOKEN = "hf_e2e_token"
NEEDED = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}


def bridge_address(local_cluster) -> str:
    """This machine's address on the pods' bridge: the pod network's first address."""
    return str(next(ipaddress.ip_network(local_cluster.pod_cidr, strict=False).hosts()))


@pytest.fixture(scope="module")
def hub(local_cluster):
    server = HubServer(token=TOKEN, host=bridge_address(local_cluster)).start()
    server.add_repo(REPO, local_cluster.model_dir, extra={"README.md": b"# not fetched\n"})
    yield server
    server.stop()


def hf_manifest(local_cluster, hub: HubServer, name: str, secret: str) -> dict[str, Any]:
    doc = manifest(local_cluster, name)
    doc["spec"]["model"] = {"name": name, "uri": f"hf://{REPO}", "endpoint": hub.url,
                            "credentials": {"secretName": secret}}
    # the quickstart example keeps the daemon offline (it reads a mounted directory)
    doc["spec"]["pod"]["env"] = [e for e in doc["spec"]["pod"].get("env", []) if e["name"] != "HF_HUB_OFFLINE"]
    return doc


def secret(name: str, token: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "stringData": {"HF_TOKEN": token}}


def wait_degraded(local_cluster, ns: str, name: str) -> dict[str, Any]:
    def degraded() -> dict[str, Any] | None:
        c = cond(isvc(local_cluster, ns, name), "Degraded")
        return c if c.get("status") == "True" else None

    found = local_cluster.wait_for(degraded, timeout=240, what=f"{name}: Degraded")
    assert cond(isvc(local_cluster, ns, name), "Ready")["status"] == "False"
    return found


@pytest.fixture(scope="module")
def s3(local_cluster):
    """moto's S3 server at the bridge address, a bucket holding the tiny model under a prefix."""
    import boto3

    from tests.models.s3_server import CountingS3Server
    from tests.server.conftest import free_port

    server = CountingS3Server(bridge_address(local_cluster), free_port())
    server.start()
    url = server.url
    client = boto3.client("s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id="testing",
                          aws_secret_access_key="testing")
    client.create_bucket(Bucket="models")
    for path in sorted(local_cluster.model_dir.rglob("*")):
        if path.is_file():
            client.put_object(Bucket="models", Key=f"tiny/{path.relative_to(local_cluster.model_dir)}",
                              Body=path.read_bytes())
    yield server
    server.stop()


def s3_manifest(local_cluster, url: str, name: str, uri: str, secret_name: str) -> dict[str, Any]:
    doc = manifest(local_cluster, name)
    doc["spec"]["model"] = {"name": name, "uri": uri, "endpoint": url, "region": "us-east-1",
                            "credentials": {"secretName": secret_name}}
    return doc


def s3_secret(name: str, key_id: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name},
            "stringData": {"AWS_ACCESS_KEY_ID": key_id, "AWS_SECRET_ACCESS_KEY": "testing"}}


def test_an_s3_model_is_fetched_served_and_bad_keys_or_prefixes_are_degraded(local_cluster, s3):
    from moto.core.authorization import enable_iam_authentication

    ns = local_cluster.create_namespace("s3")
    try:
        local_cluster.apply([s3_secret("s3-keys", "testing"),
                             s3_manifest(local_cluster, s3.url, "from-s3", "s3://models/tiny", "s3-keys"),
                             s3_manifest(local_cluster, s3.url, "no-model", "s3://models/none", "s3-keys")],
                            namespace=ns)
        wait_ready(local_cluster, ns, replicas=1, timeout=300, name="from-s3")
        (ip,) = local_cluster.endpoints("from-s3", ns)
        reply = client(ip).completions.create(model="from-s3", prompt="hello", max_tokens=8, temperature=0)
        assert reply.usage.completion_tokens == 8
        missing = wait_degraded(local_cluster, ns, "no-model")
        assert "s3://models/none" in missing["message"] and "no config.json" in missing["message"], missing
        # moto checks keys only with IAM on (in this process, where its server runs)
        with enable_iam_authentication():
            local_cluster.apply([s3_secret("wrong-keys", "AKIAWRONG"),
                                 s3_manifest(local_cluster, s3.url, "bad-keys", "s3://models/tiny", "wrong-keys")],
                                namespace=ns)
            bad = wait_degraded(local_cluster, ns, "bad-keys")
        assert "s3://models/tiny" in bad["message"] and "InvalidAccessKeyId" in bad["message"], bad
    finally:
        local_cluster.delete_namespace(ns)


def test_an_hf_model_is_fetched_served_and_a_bad_token_is_degraded(local_cluster, hub):
    ns = local_cluster.create_namespace("hf")
    try:
        local_cluster.apply([secret("hub-token", TOKEN), secret("wrong-token", "hf_wrong"),
                             hf_manifest(local_cluster, hub, "from-hub", "hub-token"),
                             hf_manifest(local_cluster, hub, "bad-token", "wrong-token")], namespace=ns)
        obj = wait_ready(local_cluster, ns, replicas=1, timeout=300, name="from-hub")
        assert cond(obj, "Degraded")["status"] == "False"
        (ip,) = local_cluster.endpoints("from-hub", ns)
        reply = client(ip).chat.completions.create(model="from-hub", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=8, temperature=0)
        assert reply.usage.completion_tokens == 8
        fetched = {r[1].rsplit("/", 1)[1] for r in hub.resolve_requests() if r[0] == "GET"}
        assert fetched >= NEEDED and "README.md" not in fetched, fetched
        for name in NEEDED:  # one pod, one download each (a restart of the container would reuse them)
            gets = [r for r in hub.file_requests(name) if r[2] is None]
            assert len(gets) == 1, (name, hub.file_requests(name))

        def revision_reported() -> list[str] | None:
            revisions = [e.get("modelRevision") for e in isvc(local_cluster, ns, "from-hub")["status"]["placement"]]
            return revisions if revisions and all(revisions) else None

        # the operator's periodic scrape of the daemon's pagoda:model_info
        sha = hub.repos[REPO].sha
        assert local_cluster.wait_for(revision_reported, timeout=90, what="modelRevision in status") == [sha]

        def degraded() -> dict[str, Any] | None:
            c = cond(isvc(local_cluster, ns, "bad-token"), "Degraded")
            return c if c.get("status") == "True" else None

        bad = local_cluster.wait_for(degraded, timeout=240, what="bad-token: Degraded")
        assert f"hf://{REPO}" in bad["message"] and "401" in bad["message"], bad
        assert cond(isvc(local_cluster, ns, "bad-token"), "Ready")["status"] == "False"
    finally:
        local_cluster.delete_namespace(ns)


@dataclasses.dataclass
class Source:
    """One model source as the tests drive it: its URI, an InferenceService of it, the Secret its
    pods read, and the GETs of each file at its server."""

    uri: str
    server: Any  # HubServer or CountingS3Server: .requests, .delay_s
    manifest: Callable[[str], dict[str, Any]]  # InferenceService name -> manifest
    secret: dict[str, Any]
    gets: Callable[[str], list[Any]]  # file name -> whole-file GETs of it
    files_asked: Callable[[], list[str]]  # names of the files GET whole, in order


@pytest.fixture(params=["hf", "s3"])
def source(request, local_cluster) -> Source:
    if request.param == "hf":
        hub: HubServer = request.getfixturevalue("hub")
        return Source(
            uri=f"hf://{REPO}", server=hub,
            manifest=lambda name: hf_manifest(local_cluster, hub, name, "creds"),
            secret=secret("creds", TOKEN),
            gets=lambda name: [r for r in hub.file_requests(name) if r[2] is None],
            files_asked=lambda: [r[1].rsplit("/", 1)[1] for r in hub.resolve_requests() if r[0] == "GET" and r[2] is None],
        )
    s3 = request.getfixturevalue("s3")
    return Source(
        uri="s3://models/tiny", server=s3,
        manifest=lambda name: s3_manifest(local_cluster, s3.url, name, "s3://models/tiny", "creds"),
        secret=s3_secret("creds", "testing"),
        gets=lambda name: [r for r in s3.object_gets("models", f"tiny/{name}") if r[2] is None],
        files_asked=lambda: [r[1].rsplit("/", 1)[1] for r in s3.requests
                             if r[0] == "GET" and r[1].startswith("/models/tiny/") and r[2] is None],
    )


def node_cache(local_cluster) -> dict[str, Any]:
    topology = local_cluster.kubectl_json("get", "nodetopology", local_cluster.node)
    return (topology.get("status") or {}).get("modelCache") or {}


def cache_root() -> Path:
    values = yaml.safe_load(LOCAL_VALUES.read_text())
    return Path((values.get("modelCache") or {}).get("nodePath") or "/var/lib/pagoda/model-cache")


def test_replicas_and_services_of_one_namespace_download_once_and_the_agent_evicts_after(local_cluster, source):
    ns = local_cluster.create_namespace("cache")
    source.server.requests.clear()
    try:
        two = source.manifest("shared-a")
        two["spec"]["replicas"] = 2
        local_cluster.apply([source.secret, two], namespace=ns)
        wait_ready(local_cluster, ns, replicas=2, timeout=300, name="shared-a")
        local_cluster.apply([source.manifest("shared-b")], namespace=ns)
        wait_ready(local_cluster, ns, replicas=1, timeout=300, name="shared-b")
        for name in NEEDED:  # three pods, two InferenceServices, one download of each file
            assert len(source.gets(name)) == 1, (name, source.server.requests)
        for svc in ("shared-a", "shared-b"):
            for ip in local_cluster.endpoints(svc, ns):
                reply = client(ip).completions.create(model=svc, prompt="hello", max_tokens=4, temperature=0)
                assert reply.usage.completion_tokens == 4

        def listed() -> dict[str, Any] | None:
            # The status is the agent's view at its last heartbeat (every 10 s here), which may have
            # been taken while the download was under way: wait for one taken after it finished.
            mine = [m for m in node_cache(local_cluster).get("models", []) if m["namespace"] == ns]
            return mine[0] if mine and mine[0]["inUse"] and mine[0]["complete"] else None

        model = local_cluster.wait_for(listed, timeout=120,
                                       what="the model, complete and in use, in NodeTopology status.modelCache")
        assert model["source"] == source.uri, model
        scheme, location = source.uri.split("://")
        entry = cache_root() / ns / scheme / location.replace("/", "%2F") / model["revision"]
        assert (entry / "config.json").is_file()  # on the node, in the namespace's directory
        # the operator labels the node with it; the pods prefer nodes with that label
        label = model_label(ns, source.uri)

        def labelled() -> bool:
            node = local_cluster.kubectl_json("get", "node", local_cluster.node)
            return node["metadata"]["labels"].get(label) == "true"

        local_cluster.wait_for(labelled, timeout=60, what=f"node label {label}")
        template = local_cluster.kubectl_json("get", "deployment", "shared-b", "-n", ns)["spec"]["template"]
        (pref,) = template["spec"]["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
        assert pref["preference"]["matchExpressions"] == [{"key": label, "operator": "Exists"}]

        local_cluster.kubectl("delete", "inferenceservice", "shared-a", "shared-b", "-n", ns, "--wait=true")

        def evicted() -> dict[str, Any] | None:
            cache = node_cache(local_cluster)
            gone = not any(m["namespace"] == ns for m in cache.get("models", []))
            return cache if gone and not entry.exists() else None

        cache = local_cluster.wait_for(evicted, timeout=240, what="the model evicted once nothing uses it")
        assert cache["path"] == "/model-cache" and cache["maxBytes"] == int(0.0001 * 2**30)
        local_cluster.wait_for(lambda: not labelled(), timeout=60, what=f"node label {label} removed")
    finally:
        local_cluster.delete_namespace(ns)
        shutil.rmtree(cache_root() / ns, ignore_errors=True)  # the namespace's (now empty) directory on the node


def test_a_download_killed_half_way_goes_on_without_fetching_the_done_files_again(local_cluster, source):
    ns = local_cluster.create_namespace("resume")
    source.server.requests.clear()
    source.server.delay_s = 3.0  # before each file's body: the kill lands while the third file is on its way
    try:
        local_cluster.apply([source.secret, source.manifest("resumed")], namespace=ns)

        def third_asked() -> list[str] | None:
            asked = source.files_asked()
            return asked if len(asked) >= 3 else None

        asked = local_cluster.wait_for(third_asked, timeout=240, what="the third file asked for")
        pod = local_cluster.kubectl_json("get", "pods", "-n", ns)["items"][0]["metadata"]["name"]
        local_cluster.docker("kill", _daemon_container(local_cluster, ns, pod))
        source.server.delay_s = 0
        wait_ready(local_cluster, ns, replicas=1, timeout=300, name="resumed")
        restarted = local_cluster.kubectl_json("get", "pod", pod, "-n", ns)["status"]["containerStatuses"][0]
        assert restarted["restartCount"] >= 1  # the same pod, its container restarted
        for name in asked[:2]:  # fetched and checked before the third was asked for: not again
            assert len(source.gets(name)) == 1, (name, source.server.requests)
        for name in NEEDED:
            assert source.gets(name), name  # everything arrived in the end
        (ip,) = local_cluster.endpoints("resumed", ns)
        reply = client(ip).completions.create(model="resumed", prompt="hello", max_tokens=4, temperature=0)
        assert reply.usage.completion_tokens == 4
    finally:
        source.server.delay_s = 0
        local_cluster.delete_namespace(ns)
        shutil.rmtree(cache_root() / ns, ignore_errors=True)
