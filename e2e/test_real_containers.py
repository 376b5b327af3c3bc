"""The main job with real containers: the chart's operator runs an InferenceService on a real
kubelet (``local_cluster``: Debian's dockerd, the images built here, the tiny Qwen3 on a host
path), and the official ``openai`` client talks to the daemons.

There is no kube-proxy, so Service ClusterIPs route nowhere: clients find the ready pods in the
Service's Endpoints (which the endpoints controller keeps from the Service's selector and the
pods' readiness, as kube-proxy would) and talk to the pod IPs, which this machine reaches over
the node's bridge. The tests in this module build on each other, in file order, around one
InferenceService: apply, scale, roll, kill a container, delete.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "quickstart-inferenceservice.yaml"
NAME = "tiny-qwen3"
PORT = 8000
MESSAGES = [{"role": "user", "content": "What is paged attention?"}]

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")


def manifest(local_cluster, name: str = NAME, model_path: str | None = None) -> dict[str, Any]:
    """examples/quickstart-inferenceservice.yaml, with this session's model directory."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["model"]["hostPath"]["path"] = model_path or str(local_cluster.model_dir)
    return doc


def isvc(local_cluster, ns: str, name: str = NAME) -> dict[str, Any]:
    return local_cluster.kubectl_json("get", "inferenceservice", name, "-n", ns)


def cond(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def wait_ready(local_cluster, ns: str, replicas: int, timeout: float = 240, name: str = NAME) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        obj = isvc(local_cluster, ns, name)
        st = obj.get("status") or {}
        ok = (
            cond(obj, "Ready").get("status") == "True"
            and st.get("observedGeneration") == obj["metadata"]["generation"]
            and st.get("readyReplicas") == replicas
            and len(local_cluster.endpoints(name, ns)) == replicas
        )
        return obj if ok else None

    try:
        return local_cluster.wait_for(ready, timeout=timeout, interval=0.5, what=f"{ns}/{name} Ready with {replicas}")
    except TimeoutError:
        pods = local_cluster.kubectl("get", "pods", "-n", ns, "-o", "wide", check=False).stdout
        status = json.dumps(isvc(local_cluster, ns, name).get("status"), indent=1)
        raise AssertionError(f"not Ready:\n{status}\n{pods}") from None


def client(ip: str) -> openai.OpenAI:
    # No keep-alive: every request opens a connection to the pod it names, as a client behind a
    # connection-level load balancer would, and nothing outlives a pod going away.
    return openai.OpenAI(
        base_url=f"http://{ip}:{PORT}/v1",
        api_key="none",
        max_retries=0,
        timeout=30,
        http_client=httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), timeout=30),
    )


def ask(ip: str, max_tokens: int = 8) -> str:
    reply = client(ip).chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=max_tokens, temperature=0)
    assert reply.choices[0].finish_reason in ("length", "stop")
    return reply.choices[0].message.content or ""


def requests_served(ip: str) -> float:
    text = httpx.get(f"http://{ip}:{PORT}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total{")
    )


@pytest.fixture(scope="module")
def ns(local_cluster):
    name = local_cluster.create_namespace("real")
    yield name
    local_cluster.delete_namespace(name)


def test_apply_ready_and_complete(local_cluster, ns):
    local_cluster.apply(manifest(local_cluster), namespace=ns)
    obj = wait_ready(local_cluster, ns, replicas=1)
    assert cond(obj, "Degraded")["status"] == "False"
    (ip,) = local_cluster.endpoints(NAME, ns)
    pod = local_cluster.kubectl_json("get", "pods", "-n", ns, "-l", f"pagoda.dev/inferenceservice={NAME}")["items"][0]
    assert pod["status"]["podIP"] == ip and pod["spec"]["nodeName"] == local_cluster.node
    # A real container of the image the chart's operator was told to use.
    # the image we built (by ID: docker names an image by any one of its tags, and a quickstart
    # on the same docker may have tagged the same image :dev)
    built = local_cluster.docker("image", "inspect", "--format", "{{.Id}}", local_cluster.daemon_image).stdout.strip()
    assert pod["status"]["containerStatuses"][0]["imageID"].endswith(built)

    c = client(ip)
    assert [m.id for m in c.models.list().data] == [NAME]
    plain = c.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=16, temperature=0)
    assert plain.usage.completion_tokens == 16 and plain.choices[0].finish_reason == "length"
    chunks = [
        ch.choices[0].delta.content or ""
        for ch in c.chat.completions.create(
            model=NAME, messages=MESSAGES, max_tokens=16, temperature=0, stream=True
        )
        if ch.choices
    ]
    assert len(chunks) > 1 and "".join(chunks) == plain.choices[0].message.content
    # The status the operator keeps: placement from the daemon, the endpoint of the Service.
    assert obj["status"]["endpoint"] == f"http://{NAME}.{ns}.svc:{PORT}"
    assert [p["node"] for p in obj["status"]["placement"]] == [local_cluster.node]


def test_daemon_runs_unprivileged_on_a_read_only_root(local_cluster, ns):
    """The daemon process (pid 1 of its container) is uid/gid 10001 with no capabilities, no
    privilege gain, the runtime's seccomp filter, and no service-account token; its root
    filesystem refuses writes while /tmp and the cache directory take them."""
    pod = local_cluster.kubectl_json("get", "pods", "-n", ns)["items"][0]["metadata"]["name"]

    def in_pod(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
        return local_cluster.kubectl("exec", "-n", ns, pod, "-c", "daemon", "--", *argv, check=check)

    status = dict(
        line.split(":", 1) for line in in_pod("cat", "/proc/1/status").stdout.splitlines() if ":" in line
    )
    assert "pagoda" in in_pod("cat", "/proc/1/cmdline").stdout
    assert status["Uid"].split() == ["10001"] * 4 and status["Gid"].split() == ["10001"] * 4, status
    assert int(status["CapEff"], 16) == 0 and int(status["CapBnd"], 16) == 0, status
    assert status["NoNewPrivs"].strip() == "1" and status["Seccomp"].strip() == "2", status

    refused = in_pod("sh", "-c", "echo x > /pagoda-write-test", check=False)
    assert refused.returncode != 0 and "Read-only file system" in refused.stderr, refused
    for writable in ("/tmp", "/var/cache/pagoda"):
        in_pod("sh", "-c", f"echo x > {writable}/write-test && rm {writable}/write-test")
    assert in_pod("ls", "/var/run/secrets/kubernetes.io/serviceaccount", check=False).returncode != 0

    inspect = json.loads(local_cluster.docker("inspect", _daemon_container(local_cluster, ns, pod)).stdout)[0]
    assert inspect["HostConfig"]["ReadonlyRootfs"] is True and inspect["HostConfig"]["Privileged"] is False

    # The chart turns NetworkPolicies on: the operator wrote one for the pods, the HTTP port only
    # (this cluster's bridge does not enforce it; the API server accepted it).
    policy = local_cluster.kubectl_json("get", "networkpolicy", NAME, "-n", ns)
    assert policy["spec"]["podSelector"]["matchLabels"]["pagoda.dev/inferenceservice"] == NAME
    assert policy["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": PORT}], "from": [{"namespaceSelector": {}}]}]


def test_pod_network_stays_on_this_machine(local_cluster, ns):
    """Pods route through the node IP only; the node changed no iptables rule and no kernel
    setting of this machine (ip_forward, the kubelet's and dockerd's favourite sysctls); logs and
    exec go through the kubelet as on any cluster."""
    assert local_cluster.host_settings() == local_cluster.host_settings_before
    pod = local_cluster.kubectl_json("get", "pods", "-n", ns)["items"][0]["metadata"]["name"]
    routes = local_cluster.kubectl("exec", "-n", ns, pod, "--", "cat", "/proc/net/route").stdout.splitlines()[1:]
    gateways = {r.split()[2] for r in routes if r.split()[1] == "00000000"}  # default route: little-endian hex
    node_ip_hex = "".join(f"{int(b):02X}" for b in reversed(local_cluster.node_ip.split(".")))
    assert gateways == {node_ip_hex}, routes
    # The API server reaches the kubelet (logs, exec) with its client certificate.
    local_cluster.kubectl("logs", "-n", ns, pod)


def test_scale_to_two_and_both_serve(local_cluster, ns):
    local_cluster.kubectl("scale", f"inferenceservice/{NAME}", "-n", ns, "--replicas=2")
    wait_ready(local_cluster, ns, replicas=2)
    ips = local_cluster.endpoints(NAME, ns)
    assert len(set(ips)) == 2
    for ip in ips:
        before = requests_served(ip)
        assert ask(ip)
        assert requests_served(ip) == before + 1  # this very pod served it


def test_spec_change_rolls_without_failed_requests(local_cluster, ns):
    """A client loops over the ready endpoints while the pods are replaced one by one."""
    old_pods = {p["metadata"]["name"] for p in local_cluster.kubectl_json("get", "pods", "-n", ns)["items"]}
    stop = threading.Event()
    served: Counter[str] = Counter()
    failures: list[str] = []

    def loop() -> None:
        while not stop.is_set():
            ips = local_cluster.endpoints(NAME, ns)
            if not ips:
                failures.append("no ready endpoint")
                time.sleep(0.2)
                continue
            ip = random.choice(ips)
            try:
                ask(ip, max_tokens=4)
                served[ip] += 1
            except Exception as e:
                failures.append(f"{ip}: {type(e).__name__}: {e}")

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        time.sleep(2)
        local_cluster.kubectl(
            "patch", "inferenceservice", NAME, "-n", ns, "--type=merge", "-p",
            json.dumps({"spec": {"engine": {"maxNumSeqs": 8}}}),
        )

        def rolled() -> bool:
            pods = local_cluster.kubectl_json("get", "pods", "-n", ns)["items"]
            names = {p["metadata"]["name"] for p in pods}
            return not names & old_pods and len(names) == 2

        local_cluster.wait_for(rolled, timeout=300, interval=0.5, what="old pods replaced")
        wait_ready(local_cluster, ns, replicas=2)
        time.sleep(2)
    finally:
        stop.set()
        thread.join(60)
    config = local_cluster.kubectl_json("get", "configmap", f"{NAME}-config", "-n", ns)["data"]["engine.yaml"]
    assert "max_num_seqs: 8" in config
    assert failures == [], f"{len(failures)} failed requests during the roll, e.g. {failures[:3]}"
    new_ips = set(local_cluster.endpoints(NAME, ns))
    assert sum(served.values()) >= 10 and set(served) & new_ips and set(served) - new_ips, served


def _daemon_container(local_cluster, ns: str, pod: str) -> str:
    out = local_cluster.docker(
        "ps", "-q", "--filter", f"label=io.kubernetes.pod.namespace={ns}",
        "--filter", f"label=io.kubernetes.pod.name={pod}", "--filter", "label=io.kubernetes.container.name=daemon",
    ).stdout.split()
    assert len(out) == 1, out
    return out[0]


def test_killed_daemon_container_restarts_and_status_recovers(local_cluster, ns):
    pod = local_cluster.kubectl_json("get", "pods", "-n", ns)["items"][0]["metadata"]["name"]
    local_cluster.docker("kill", _daemon_container(local_cluster, ns, pod))
    seen: list[tuple[str, str, str]] = []

    def back_to_ready() -> bool:
        obj = isvc(local_cluster, ns)
        state = (cond(obj, "Ready").get("status"), cond(obj, "Progressing").get("status"),
                 cond(obj, "Degraded").get("status"))
        if not seen or seen[-1] != state:
            seen.append(state)
        return state[0] == "True" and any(s[0] == "False" for s in seen)

    local_cluster.wait_for(back_to_ready, timeout=180, interval=0.2, what="Ready False, then True again")
    # On the way: not Ready, and either Progressing (waiting for the pod) or Degraded said so.
    assert any(r == "False" and ("True" in (p, d)) for r, p, d in seen), seen
    restarted = local_cluster.kubectl_json("get", "pod", pod, "-n", ns)
    assert restarted["status"]["containerStatuses"][0]["restartCount"] >= 1
    wait_ready(local_cluster, ns, replicas=2)
    assert ask(restarted["status"]["podIP"])


def test_delete_removes_everything(local_cluster, ns):
    mac = local_cluster.bridge_mac()
    local_cluster.kubectl("delete", "inferenceservice", NAME, "-n", ns, "--wait=true", "--timeout=60s")
    selector = f"pagoda.dev/inferenceservice={NAME}"

    def gone() -> bool:
        left = local_cluster.kubectl(
            "get", "deployment,replicaset,pod,service,configmap,networkpolicy", "-n", ns, "-l", selector, "-o", "name"
        ).stdout.split()
        containers = local_cluster.docker("ps", "-aq", "--filter", f"label=io.kubernetes.pod.namespace={ns}").stdout.split()
        return not left and not containers

    local_cluster.wait_for(gone, timeout=120, interval=1, what="children, pods and containers gone")
    assert local_cluster.endpoints(NAME, ns) == []
    # The pods' veths left the bridge and its MAC stayed: the remaining pods' ARP entries for
    # the gateway still hold, so the API server still reaches the admission webhook (the next
    # test's apply goes through it).
    assert local_cluster.bridge_mac() == mac


def test_bad_model_path_is_degraded_with_the_reason(local_cluster, tmp_path):
    """Two ways to get the path wrong: nothing there (the kubelet cannot mount it), or a
    directory without a model (the daemon exits saying so); and a layout only the model's
    config.json rules out (tensor 3 against its 4 heads), named in the spec's own fields."""
    ns = local_cluster.create_namespace("bad-model")
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    empty.chmod(0o755)
    missing = "/var/lib/pagoda/models/no-such-model"
    split = manifest(local_cluster, "split")
    split["spec"]["parallelism"] = {"tensor": 3}
    try:
        local_cluster.apply([manifest(local_cluster, "missing", missing), manifest(local_cluster, "empty", str(empty)),
                             split], namespace=ns)

        def degraded(name: str) -> dict[str, Any] | None:
            c = cond(isvc(local_cluster, ns, name), "Degraded")
            return c if c.get("status") == "True" else None

        mount = local_cluster.wait_for(lambda: degraded("missing"), timeout=120, what="missing: Degraded")
        assert mount["reason"] == "VolumeMountFailed", mount
        assert missing in mount["message"] and "not a directory" in mount["message"]

        crash = local_cluster.wait_for(lambda: degraded("empty"), timeout=180, what="empty: Degraded")
        assert crash["reason"] == "ConfigurationRefused", crash  # `pagoda serve` exits 2
        assert "has no config.json" in crash["message"], crash

        layout = local_cluster.wait_for(lambda: degraded("split"), timeout=180, what="split: Degraded")
        assert layout["reason"] == "ConfigurationRefused", layout
        assert ("attention heads (4) is not divisible by spec.parallelism.tensor × spec.parallelism.expert = 3"
                in layout["message"]), layout
        for name in ("missing", "empty", "split"):
            assert cond(isvc(local_cluster, ns, name), "Ready")["status"] == "False"
    finally:
        local_cluster.delete_namespace(ns)


def test_tensor_and_data_parallel_ranks_serve_in_one_unprivileged_pod(local_cluster):
    """parallelism.tensor 2 × data 2 on CPU: two engines behind the pod's API server, each engine
    core starting its rank 1 as a process of its own inside the same read-only, non-root container
    (rendezvous in /tmp, gloo on loopback, /dev/shm from the pod); greedy answers equal the
    one-process engine's on the same weights, and both engines serve."""
    ns = local_cluster.create_namespace("tp")
    doc = manifest(local_cluster, "tiny-tp")
    doc["spec"]["parallelism"] = {"tensor": 2, "data": 2}
    doc["spec"]["pod"]["resources"]["limits"]["memory"] = "8Gi"  # four ranks, each with its KV cache
    try:
        local_cluster.apply(doc, namespace=ns)
        wait_ready(local_cluster, ns, replicas=1, name="tiny-tp", timeout=300)
        (ip,) = local_cluster.endpoints("tiny-tp", ns)
        prompts = ["The capital of", "Paged attention keeps", "1 2 3 4"]
        got = [client(ip).completions.create(model=NAME, prompt=p, max_tokens=8, temperature=0).choices[0].text
               for p in prompts]
        from pagoda_daemon import LLM, SamplingParams

        one = LLM(str(local_cluster.model_dir), device="cpu", max_model_len=256, num_kv_blocks=64)
        want = [o.outputs[0].text for o in one.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8))]
        assert got == want
        engines = httpx.get(f"http://{ip}:{PORT}/health", timeout=10).json()["engine"]["engines"]
        assert [e["requests"] >= 1 for e in engines] == [True, True], engines  # no shared prefix: turns
        pod = local_cluster.kubectl_json("get", "pods", "-n", ns)["items"][0]["metadata"]["name"]
        assert "tp-rank-1 pagoda_daemon.models.loader: loaded Qwen3ForCausalLM" in local_cluster.kubectl(
            "logs", "-n", ns, pod).stdout
        ranks = local_cluster.kubectl("exec", "-n", ns, pod, "-c", "daemon", "--", "sh", "-c",
                                      "grep -l 'pagoda_daemon[.]executor[.]multiproc' /proc/[0-9]*/cmdline").stdout.split()
        assert len(ranks) == 2, ranks  # each engine's rank 1
    finally:
        local_cluster.delete_namespace(ns)


def test_experts_spread_over_two_engines_with_eplb_serve_in_one_unprivileged_pod(local_cluster):
    """parallelism.data 2 with dataParallelExperts and eplb on CPU: two engines in one pod, each
    holding half of a MoE model's experts (plus a redundant slot) and its own requests, every MoE
    layer run by both each step (gloo on loopback), the experts rebalanced between the engines while
    they serve; greedy answers equal the one-process engine's on the same weights, both engines
    serve, and the rebalances show in the metrics."""
    ns = local_cluster.create_namespace("spread")
    name = "tiny-spread"
    model = local_cluster.moe_model_dir()
    served = "tiny-qwen3-moe"
    doc = manifest(local_cluster, name, model_path=str(model))
    doc["spec"]["model"]["name"] = served
    doc["spec"]["parallelism"] = {"data": 2, "dataParallelExperts": True,
                                  "eplb": {"redundantExperts": 2, "stepInterval": 3}}
    doc["spec"]["engine"].update(numKvBlocks=160, maxModelLen=256)
    try:
        local_cluster.apply(doc, namespace=ns)
        wait_ready(local_cluster, ns, replicas=1, name=name, timeout=300)
        (ip,) = local_cluster.endpoints(name, ns)
        prompts = ["The capital of", "Paged attention keeps", "1 2 3 4", "Experts spread over"]
        got = [client(ip).completions.create(model=served, prompt=p, max_tokens=12, temperature=0).choices[0].text
               for p in prompts]
        from pagoda_daemon import LLM, SamplingParams

        one = LLM(str(model), device="cpu", max_model_len=256, num_kv_blocks=64)
        want = [o.outputs[0].text for o in one.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))]
        assert got == want
        health = httpx.get(f"http://{ip}:{PORT}/health", timeout=10).json()["engine"]
        assert [e["requests"] >= 1 for e in health["engines"]] == [True, True], health  # no shared prefix: turns
        metrics = httpx.get(f"http://{ip}:{PORT}/metrics", timeout=10).text
        assert f'pagoda:expert_parallel_size{{model_name="{served}"}} 2.0' in metrics
        rebalances = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                      if line.startswith("pagoda:eplb_rebalances_total{")]
        assert rebalances and rebalances[0] >= 1, metrics  # 48 tokens out in steps of 3: several windows
        pod = local_cluster.kubectl_json("get", "pods", "-n", ns)["items"][0]["metadata"]["name"]
        logs = local_cluster.kubectl("logs", "-n", ns, pod).stdout
        assert "rank 1 of 2) loaded" in logs and "EPLB: rebalance" in logs  # half the experts each
    finally:
        local_cluster.delete_namespace(ns)


def test_a_replica_spanning_two_pods_serves_and_restarts_as_a_unit(local_cluster):
    """resources.podsPerReplica 2 with parallelism.tensor 2 on CPU: one group of a leader pod (the
    API and rank 0) and a worker pod (rank 1) from two StatefulSets; the ranks meet at the leader's
    pod IP over the node's bridge (gloo), and greedy answers equal the one-process engine's. The
    worker's container killed: Degraded names it, the leader leaves the broken world too, both
    restart, and the group serves again."""
    ns = local_cluster.create_namespace("group")
    name = "tiny-group"
    doc = manifest(local_cluster, name)
    doc["spec"]["parallelism"] = {"tensor": 2}
    doc["spec"]["resources"]["podsPerReplica"] = 2
    prompts = ["The capital of", "Paged attention keeps", "1 2 3 4"]

    def answers(ip: str) -> list[str]:
        return [client(ip).completions.create(model=NAME, prompt=p, max_tokens=8, temperature=0).choices[0].text
                for p in prompts]

    try:
        local_cluster.apply(doc, namespace=ns)
        wait_ready(local_cluster, ns, replicas=1, name=name, timeout=300)
        pods = {p["metadata"]["name"]: p for p in local_cluster.kubectl_json("get", "pods", "-n", ns)["items"]}
        assert set(pods) == {f"{name}-0", f"{name}-0-0"}
        (ip,) = local_cluster.endpoints(name, ns)
        assert ip == pods[f"{name}-0"]["status"]["podIP"]  # the Service reaches the leader only
        from pagoda_daemon import LLM, SamplingParams

        one = LLM(str(local_cluster.model_dir), device="cpu", max_model_len=256, num_kv_blocks=64)
        want = [o.outputs[0].text for o in one.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8))]
        assert answers(ip) == want
        assert "2 ranks over 2 node(s)" in local_cluster.kubectl("logs", "-n", ns, f"{name}-0").stdout
        worker_log = local_cluster.kubectl("logs", "-n", ns, f"{name}-0-0").stdout
        assert "node 1 of 2: ranks 1..1" in worker_log
        assert "tp-rank-1 pagoda_daemon.models.loader: loaded Qwen3ForCausalLM" in worker_log

        local_cluster.docker("kill", _daemon_container(local_cluster, ns, f"{name}-0-0"))

        def degraded() -> dict[str, Any] | None:
            c = cond(isvc(local_cluster, ns, name), "Degraded")
            return c if c.get("status") == "True" and c.get("reason") == "GroupMemberFailed" else None

        c = local_cluster.wait_for(degraded, timeout=120, interval=0.5, what="Degraded: GroupMemberFailed")
        assert f"pod {name}-0-0 exited" in c["message"], c
        wait_ready(local_cluster, ns, replicas=1, name=name, timeout=300)
        pods = {p["metadata"]["name"]: p for p in local_cluster.kubectl_json("get", "pods", "-n", ns)["items"]}
        for pod in pods.values():  # both restarted: the group re-formed as one unit
            assert pod["status"]["containerStatuses"][0]["restartCount"] >= 1, pod["metadata"]["name"]
        (ip,) = local_cluster.endpoints(name, ns)
        assert answers(ip) == want
        assert cond(isvc(local_cluster, ns, name), "Degraded")["status"] == "False"
    finally:
        local_cluster.delete_namespace(ns)


def test_node_topology_from_the_agent_matches_the_host(local_cluster):
    """The chart's topology agent (a DaemonSet on the real node) writes NodeTopology/<node>; its
    spec is what `pagoda topology --json` reports on this machine, less the process fields."""
    obj = local_cluster.wait_for(
        lambda: local_cluster.kubectl_json("get", "nodetopology", local_cluster.node), timeout=120,
        what=f"NodeTopology {local_cluster.node}",
    )
    host = json.loads(
        subprocess.run([sys.executable, "-m", "pagoda_daemon", "topology", "--json"], capture_output=True,
                       text=True, check=True).stdout
    )
    for key in ("hostname", "allowedCpus", "visibility", "warnings"):
        host.pop(key, None)
    spec = dict(obj["spec"])
    summary = spec.pop("summary")
    for gpu in spec.get("gpus", []):
        gpu.pop("fabricPeers", None)
    assert spec == host
    assert summary["gpuCount"] == len(host["gpus"]) and summary["numaNodeCount"] == len(host["numaNodes"])
    assert obj["status"]["lastHeartbeatTime"] and obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == (
        "pagoda-topology-agent"
    )
