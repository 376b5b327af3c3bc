"""A model from `hf://` on the real-container cluster: the Hub-compatible server of the unit tests
(tests/models/hub_server.py) runs on this machine at the node bridge's address, where pods
reach it; an InferenceService names it by `spec.model.uri` with `endpoint` and a credentials
Secret; the daemon fetches the tiny Qwen3 into its cache volume, serves it, and the openai
client gets an answer. A wrong token is `Degraded` with the Hub's 401 in the message.

What this does not show (not built): a cache shared by the pods of a node — each pod downloads
into its own emptyDir. An S3 source on the cluster is not run here; moto's S3 server is used by
tests/models/test_fetch.py against the same fetch code.
"""

from __future__ import annotations

import ipaddress
from typing import Any

import pytest
from test_real_containers import client, cond, isvc, manifest, wait_ready

from tests.models.hub_server import HubServer

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
