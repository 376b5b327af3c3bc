"""Prefill/decode disaggregation on the real-container cluster: an InferenceService with
`spec.disaggregation` on the tiny CPU model becomes Ready as one pod of three containers (prefill
engine, decode engine, pd-proxy on the Service's port), answers chat completions through the
openai client, and the decode engine took the prompts' KV blocks from the prefill engine's disk
tier (its `vllm:external_prefix_cache_hits_total`, which the proxy's /metrics serves) while the
prefill engine generated one token per request. With `prefill.replicas` the prefill engine runs
in a pod of its own and the decode engine fetches the blocks from it over TCP, at the pod IP the
operator listed for the proxy and the prefill engine named in its answer."""

from __future__ import annotations

import re

from test_prometheus import PREFILL_SERIES, PROMETHEUS, PROMTOOL, Prometheus, dashboard_queries
from test_real_containers import PORT, client, cond, httpx, isvc, manifest, wait_ready

NAME = "pd"
PREFILL_PORT = 8100
# 80 words: several full 16-token blocks whatever the chat template adds.
MESSAGES = [{"role": "user", "content": " ".join(f"w{i}" for i in range(80))}]


def metric(ip: str, port: int, name: str) -> float:
    text = httpx.get(f"http://{ip}:{port}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def test_prefill_decode_and_proxy_serve_as_one_ready_pod(local_cluster):
    ns = local_cluster.create_namespace("pd")
    doc = manifest(local_cluster, NAME)
    doc["spec"]["disaggregation"] = {"kvDiskGiB": 0.05}
    try:
        local_cluster.apply(doc, namespace=ns)
        obj = wait_ready(local_cluster, ns, replicas=1, timeout=420, name=NAME)
        assert cond(obj, "Degraded")["status"] == "False"
        (pod,) = local_cluster.kubectl_json("get", "pods", "-n", ns, "-l", f"pagoda.dev/inferenceservice={NAME}")[
            "items"]
        assert [c["name"] for c in pod["spec"]["containers"]] == ["prefill", "decode", "proxy"]
        assert {c["name"]: c["ready"] for c in pod["status"]["containerStatuses"]} == {
            "prefill": True, "decode": True, "proxy": True}
        roles = obj["status"]["disaggregation"]
        assert [roles[r]["readyPods"] for r in ("prefill", "decode", "proxy")] == [1, 1, 1]
        (ip,) = local_cluster.endpoints(NAME, ns)
        assert ip == pod["status"]["podIP"]

        c = client(ip)
        assert [m.id for m in c.models.list().data] == [doc["spec"]["model"]["name"]]
        for _ in range(3):
            reply = c.chat.completions.create(model=doc["spec"]["model"]["name"], messages=MESSAGES, max_tokens=8,
                                              temperature=0)
            assert reply.choices[0].finish_reason in ("length", "stop") and reply.usage.completion_tokens >= 1
        streamed = c.chat.completions.create(model=doc["spec"]["model"]["name"], messages=MESSAGES, max_tokens=8,
                                             temperature=0, stream=True)
        assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == (
            reply.choices[0].message.content)
        # the proxy's /metrics are the decode engine's: it loaded the prompt's blocks from the prefill tier
        assert metric(ip, PORT, "vllm:external_prefix_cache_hits_total") > 0
        assert metric(ip, PORT, "vllm:generation_tokens_total") >= 3
        # the prefill engine (its own port, open on the pod IP for the kubelet's probes) generated
        # one token for each of the 4 requests
        assert metric(ip, PREFILL_PORT, "vllm:generation_tokens_total") == 4
    finally:
        local_cluster.delete_namespace(ns)


def test_prefill_pods_apart_serve_through_the_decode_replicas_proxy(local_cluster, tmp_path):
    ns = local_cluster.create_namespace("pd-apart")
    doc = manifest(local_cluster, NAME)
    # the prefill autoscaler held at one pod by its bounds: it reads the prefill pod's /metrics, scales nothing
    doc["spec"]["disaggregation"] = {"kvDiskGiB": 0.05, "prefill": {"replicas": 1, "autoscaling": {"maxReplicas": 1}}}
    try:
        local_cluster.apply(doc, namespace=ns)
        # the proxy is ready once the kubelet has refreshed its list with the ready prefill pod
        obj = wait_ready(local_cluster, ns, replicas=1, timeout=600, name=NAME)
        assert cond(obj, "Degraded")["status"] == "False"
        pods = local_cluster.kubectl_json("get", "pods", "-n", ns, "-l", f"pagoda.dev/inferenceservice={NAME}")[
            "items"]
        by_role = {p["metadata"]["labels"].get("pagoda.dev/role", "replica"): p for p in pods}
        assert sorted(by_role) == ["prefill", "replica"], [p["metadata"]["name"] for p in pods]
        prefill, replica = by_role["prefill"], by_role["replica"]
        assert [c["name"] for c in prefill["spec"]["containers"]] == ["prefill"]
        assert [c["name"] for c in replica["spec"]["containers"]] == ["decode", "proxy"]
        prefill_ip, ip = prefill["status"]["podIP"], replica["status"]["podIP"]
        assert prefill_ip != ip
        # the Service has the replica only
        assert local_cluster.endpoints(NAME, ns) == [ip]
        roles = obj["status"]["disaggregation"]
        assert roles["prefill"]["replicas"] == 1 and roles["prefill"]["readyPods"] == 1
        assert [roles[r]["readyPods"] for r in ("decode", "proxy")] == [1, 1]
        instances = local_cluster.kubectl_json("get", "configmap", f"{NAME}-prefill-instances", "-n", ns)
        assert instances["data"]["prefill"] == f"http://{prefill_ip}:{PREFILL_PORT}\n"

        c = client(ip)
        for _ in range(3):
            reply = c.chat.completions.create(model=doc["spec"]["model"]["name"], messages=MESSAGES, max_tokens=8,
                                              temperature=0)
            assert reply.choices[0].finish_reason in ("length", "stop") and reply.usage.completion_tokens >= 1
        # the decode engine fetched the prompt's blocks from the prefill pod over TCP and loaded them
        assert metric(ip, PORT, "pagoda:kv_transfer_fetched_bytes_total") > 0
        assert metric(ip, PORT, "vllm:external_prefix_cache_hits_total") > 0
        assert metric(prefill_ip, PREFILL_PORT, "vllm:generation_tokens_total") == 3
        assert metric(ip, PORT, 'pagoda_pd_proxy_requests_total') >= 6  # 3 prefill + 3 decode, all ok

        # a ticker pass (every 15 s) scraped the prefill pod on its port; the Deployment is at its count
        def prefill_stepped() -> dict | None:
            st = isvc(local_cluster, ns, NAME)["status"]["disaggregation"]["prefill"]
            return st if ((st.get("autoscaling") or {}).get("signals") or {}).get("pods") == 1 else None

        stepped = local_cluster.wait_for(prefill_stepped, timeout=60, interval=1, what="a prefill autoscaler step")
        deployment = local_cluster.kubectl_json("get", "deployment", f"{NAME}-prefill", "-n", ns)
        assert deployment["spec"]["replicas"] == stepped["replicas"] == stepped["autoscaling"]["desiredReplicas"] == 1
        # the Grafana dashboard's queries over the prefill autoscaler's series return them through a
        # real Prometheus scraping the operator (e2e/test_prometheus.py checks the other queries)
        if PROMETHEUS is not None and PROMTOOL is not None:
            with Prometheus(local_cluster, tmp_path) as prom:
                prom.wait_until_scraped({"pagoda-operator"})
                queries = [q for q in dashboard_queries() if PREFILL_SERIES in q]
                assert len(queries) == 3, queries  # wanted, signal, decisions
                for q in queries:
                    result = prom.query(q)
                    assert any(r["metric"].get("namespace") == ns and r["metric"].get("name") == NAME
                               for r in result), (q, result)

        # the prefill pod replaced (a new IP): the operator lists the new one, the kubelet refreshes
        # the proxy's file, the decode engine fetches from it; the replica's pod is not rolled
        selector = f"pagoda.dev/inferenceservice={NAME},pagoda.dev/role=prefill"
        local_cluster.kubectl("delete", "pod", prefill["metadata"]["name"], "-n", ns, "--wait=false")

        def new_prefill() -> dict | None:
            items = local_cluster.kubectl_json("get", "pods", "-n", ns, "-l", selector)["items"]
            return next((p for p in items if p["metadata"]["name"] != prefill["metadata"]["name"]
                         and p["status"].get("podIP") and any(c["type"] == "Ready" and c["status"] == "True"
                                                               for c in p["status"].get("conditions") or [])), None)

        replacement = local_cluster.wait_for(new_prefill, timeout=300, interval=2, what="a new ready prefill pod")
        new_url = f"http://{replacement['status']['podIP']}:{PREFILL_PORT}\n"
        local_cluster.wait_for(lambda: local_cluster.kubectl_json(
            "get", "configmap", f"{NAME}-prefill-instances", "-n", ns)["data"]["prefill"] == new_url,
            timeout=60, interval=1, what="the list naming the new prefill pod")
        fetched = metric(ip, PORT, "pagoda:kv_transfer_fetched_bytes_total")

        attempt = iter(range(1000))

        def served_through_the_new_pod() -> bool:
            n = next(attempt)  # a prompt of its own each time: none is in the decode engine's cache yet
            other = [{"role": "user", "content": " ".join(f"v{n}x{i}" for i in range(80))}]
            c.chat.completions.create(model=doc["spec"]["model"]["name"], messages=other, max_tokens=2,
                                      temperature=0)
            return metric(ip, PORT, "pagoda:kv_transfer_fetched_bytes_total") > fetched

        local_cluster.wait_for(served_through_the_new_pod, timeout=240, interval=5,
                               what="a prompt computed by the new prefill pod and fetched from it")
        assert metric(replacement["status"]["podIP"], PREFILL_PORT, "vllm:generation_tokens_total") >= 1
        (same,) = [p for p in local_cluster.kubectl_json("get", "pods", "-n", ns, "-l",
                                                         f"pagoda.dev/inferenceservice={NAME}")["items"]
                   if "pagoda.dev/role" not in p["metadata"]["labels"]]
        assert same["metadata"]["uid"] == replica["metadata"]["uid"]
        assert [cs["restartCount"] for cs in same["status"]["containerStatuses"]] == [0, 0]
    finally:
        local_cluster.delete_namespace(ns)
