"""Models from `hf://` and `s3://` on the real-container cluster: the Hub-compatible server of the
unit tests (tests/models/hub_server.py) and moto's S3 server run on this machine at the node
bridge's address, where pods reach them; an InferenceService names the model by
`spec.model.uri` with `endpoint` and a credentials Secret; the daemon fetches the tiny model into
its cache volume, serves it, and the openai client gets an answer. A wrong token (the Hub's 401),
a wrong S3 key (InvalidAccessKeyId) and an S3 prefix with no model are `Degraded` with the
source's error in the message.

The node's model cache (the chart's modelCache, on by default): two replicas and a second
InferenceService of one hf:// model in one namespace download each file once (counted at the
Hub); the node's NodeTopology lists the model in use; once its InferenceServices are deleted the
topology agent evicts it (e2e/quickstart/values.yaml keeps the cache at ~100 KiB).

Not shown here: a download killed half-way and resumed (tests/models/test_fetch.py does it against
the same Hub and moto), eviction under a realistic size (the same unit tests' model_cache cases).
"""

from __future__ import annotations

import ipaddress
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_real_containers import client, cond, isvc, manifest, wait_ready

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
    from moto.server import ThreadedMotoServer

    from tests.server.conftest import free_port

    host, port = bridge_address(local_cluster), free_port()
    server = ThreadedMotoServer(ip_address=host, port=port, verbose=False)
    server.start()
    url = f"http://{host}:{port}"
    client = boto3.client("s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id="testing",
                          aws_secret_access_key="testing")
    client.create_bucket(Bucket="models")
    for path in sorted(local_cluster.model_dir.rglob("*")):
        if path.is_file():
            client.put_object(Bucket="models", Key=f"tiny/{path.relative_to(local_cluster.model_dir)}",
                              Body=path.read_bytes())
    yield url
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
                             s3_manifest(local_cluster, s3, "from-s3", "s3://models/tiny", "s3-keys"),
                             s3_manifest(local_cluster, s3, "no-model", "s3://models/none", "s3-keys")],
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
                                 s3_manifest(local_cluster, s3, "bad-keys", "s3://models/tiny", "wrong-keys")],
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


def node_cache(local_cluster) -> dict[str, Any]:
    topology = local_cluster.kubectl_json("get", "nodetopology", local_cluster.node)
    return (topology.get("status") or {}).get("modelCache") or {}


def test_replicas_and_services_of_one_namespace_download_once_and_the_agent_evicts_after(local_cluster, hub):
    ns = local_cluster.create_namespace("cache")
    values = yaml.safe_load(LOCAL_VALUES.read_text())
    root = Path((values.get("modelCache") or {}).get("nodePath") or "/var/lib/pagoda/model-cache")
    sha = hub.repos[REPO].sha
    entry = root / ns / "hf" / REPO.replace("/", "%2F") / sha
    hub.requests.clear()
    try:
        two = hf_manifest(local_cluster, hub, "shared-a", "hub-token")
        two["spec"]["replicas"] = 2
        local_cluster.apply([secret("hub-token", TOKEN), two], namespace=ns)
        wait_ready(local_cluster, ns, replicas=2, timeout=300, name="shared-a")
        local_cluster.apply([hf_manifest(local_cluster, hub, "shared-b", "hub-token")], namespace=ns)
        wait_ready(local_cluster, ns, replicas=1, timeout=300, name="shared-b")
        for name in NEEDED:  # three pods, two InferenceServices, one download of each file
            gets = [r for r in hub.file_requests(name) if r[2] is None]
            assert len(gets) == 1, (name, hub.file_requests(name))
        for svc in ("shared-a", "shared-b"):
            for ip in local_cluster.endpoints(svc, ns):
                reply = client(ip).completions.create(model=svc, prompt="hello", max_tokens=4, temperature=0)
                assert reply.usage.completion_tokens == 4
        assert (entry / "config.json").is_file()  # on the node, in the namespace's directory

        def listed() -> dict[str, Any] | None:
            mine = [m for m in node_cache(local_cluster).get("models", []) if m["namespace"] == ns]
            return mine[0] if mine and mine[0]["inUse"] else None

        model = local_cluster.wait_for(listed, timeout=120, what="the model in NodeTopology status.modelCache")
        assert (model["source"], model["revision"], model["complete"]) == (f"hf://{REPO}", sha, True), model

        local_cluster.kubectl("delete", "inferenceservice", "shared-a", "shared-b", "-n", ns, "--wait=true")

        def evicted() -> dict[str, Any] | None:
            cache = node_cache(local_cluster)
            gone = not any(m["namespace"] == ns for m in cache.get("models", []))
            return cache if gone and not entry.exists() else None

        cache = local_cluster.wait_for(evicted, timeout=240, what="the model evicted once nothing uses it")
        assert cache["path"] == "/model-cache" and cache["maxBytes"] == int(0.0001 * 2**30)
    finally:
        local_cluster.delete_namespace(ns)
        shutil.rmtree(root / ns, ignore_errors=True)  # the namespace's (now empty) directory on the node
