"""The operator against a real kube-apiserver (docs/testing.md: the ``kube_cluster`` fixture).

The operator runs as a real process (``python -m pagoda_operator``); a fake kubelet stands in for
the kubelet (pods become Running/Ready with podIP 127.0.0.1), and the autoscaling test serves the
daemons' ``/metrics`` itself on 127.0.0.1.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.models.hub_server import HubServer

ROOT = Path(__file__).resolve().parents[1]
CRDS = ROOT / "crds"
NODE = "pagoda-op-gpu-1"
LEASE = 4  # seconds: short, so that a crashed operator's successor starts soon


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Operator:
    """``python -m pagoda_operator`` as a subprocess, with its log in the cluster's log dir."""

    def __init__(
        self, cluster: Any, lease_namespace: str, name: str = "operator", extra_args: tuple[str, ...] = ()
    ):
        self.cluster, self.lease_namespace, self.name = cluster, lease_namespace, name
        self.extra_args = extra_args
        self.log_path = Path(cluster.logs_dir) / f"pagoda-{name}.log"
        self.process: subprocess.Popen | None = None
        self.metrics_port = 0

    def start(self) -> Operator:
        self.metrics_port = free_port()
        env = {
            **self.cluster.env,
            "PYTHONPATH": os.pathsep.join([str(ROOT / "operator"), os.environ.get("PYTHONPATH", "")]),
            "POD_NAME": f"e2e-{self.name}",  # as the chart gives each replica its pod's name
        }
        argv = [
            sys.executable,
            "-m",
            "pagoda_operator",
            f"--kubeconfig={self.cluster.kubeconfig}",
            "--interval=1",
            f"--metrics-port={self.metrics_port}",
            "--metrics-address=127.0.0.1",
            f"--lease-namespace={self.lease_namespace}",
            f"--lease-duration={LEASE}",
            "--lease-renew=1",
            "--daemon-image=pagoda-test:e2e",
            "--log-level=INFO",
            "--scrape-timeout=1",
            *self.extra_args,
        ]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL
            )
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.alive():
            assert self.process is not None
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def metrics(self) -> str:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()


# ---- fixtures -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(kube_cluster):
    for crd in sorted(CRDS.glob("*.yaml")):
        kube_cluster.kubectl("apply", "-f", str(crd))
    for crd in sorted(CRDS.glob("*.yaml")):
        kube_cluster.kubectl(
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            "crd",
            yaml.safe_load(crd.read_text())["metadata"]["name"],
        )
    return kube_cluster


@pytest.fixture(scope="module")
def gpu_node(cluster):
    handle = cluster.start_fake_kubelet(NODE, gpus=8)
    yield handle.node
    handle.stop()


@pytest.fixture(scope="module")
def config_hub(tmp_path_factory):
    """A Hub-compatible server on loopback with one model's config.json (32 attention heads over 8
    KV heads): the endpoint the operator may read configs from (--model-config-endpoint)."""
    folder = tmp_path_factory.mktemp("dense")
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "num_attention_heads": 32, "num_key_value_heads": 8,
        "intermediate_size": 14336}))
    server = HubServer().start()
    server.add_repo("org/dense", folder)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def operator(cluster, gpu_node, config_hub):
    ns = cluster.create_namespace("pagoda-operator")
    # --lws-discovery-interval: a LeaderWorkerSet CRD installed by a test is seen within a second
    op = Operator(cluster, ns, extra_args=(f"--model-config-endpoint={config_hub.url}",
                                           "--lws-discovery-interval=1")).start()
    cluster.wait_for(lambda: "leading as" in op.log() or not op.alive(), timeout=60, what="operator leads")
    assert op.alive(), op.log()[-3000:]
    yield op
    op.stop()
    if not os.environ.get("PAGODA_E2E_KEEP"):
        cluster.delete_namespace(ns)


@pytest.fixture
def ns(cluster, operator, request):
    name = cluster.create_namespace(request.node.name)
    yield name
    cluster.delete_namespace(name)


# ---- helpers ------------------------------------------------------------------------------
def isvc(name: str, **spec: Any) -> dict[str, Any]:
    body = {"model": {"name": "tiny", "hostPath": {"path": "/data/tiny"}}, "resources": {"gpusPerReplica": 1}}
    body.update(spec)
    return {
        "apiVersion": "pagoda.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": body,
    }


def get(cluster, kind: str, name: str, ns: str | None = None) -> dict[str, Any] | None:
    args = ["get", kind, name] + (["-n", ns] if ns else [])
    proc = cluster.kubectl(*args, "-o", "json", check=False)
    return json.loads(proc.stdout) if proc.returncode == 0 else None


def cond(obj: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return c
    return {}


def ready(cluster, name: str, ns: str, replicas: int | None = None, generation: int | None = None):
    """Predicate: the InferenceService is Ready (optionally at a replica count and generation)."""

    def check():
        obj = get(cluster, "pisvc", name, ns)
        if not obj or cond(obj, "Ready").get("status") != "True":
            return None
        st = obj["status"]
        if replicas is not None and st.get("readyReplicas") != replicas:
            return None
        if generation is not None and st.get("observedGeneration") != generation:
            return None
        return obj

    return check


def wait_ready(cluster, name, ns, replicas=None, generation=None, timeout=60, op: Operator | None = None):
    try:
        return cluster.wait_for(
            ready(cluster, name, ns, replicas, generation), timeout=timeout, what=f"pisvc {ns}/{name} Ready"
        )
    except TimeoutError:
        print(json.dumps(get(cluster, "pisvc", name, ns), indent=1))
        if op is not None:
            print(op.log()[-4000:])
        raise


def children(cluster, name: str, ns: str) -> dict[str, dict[str, Any] | None]:
    return {
        "Deployment": get(cluster, "deployment", name, ns),
        "Service": get(cluster, "service", name, ns),
        "ConfigMap": get(cluster, "configmap", f"{name}-config", ns),
    }


def versions(cluster, name: str, ns: str) -> dict[str, str | None]:
    return {
        k: (v or {}).get("metadata", {}).get("resourceVersion")
        for k, v in children(cluster, name, ns).items()
    }


def api(cluster) -> Any:
    """The operator's own small API client, on the test cluster."""
    if str(ROOT / "operator") not in sys.path:
        sys.path.insert(0, str(ROOT / "operator"))
    from pagoda_operator.kube import Kube, load_configuration

    return Kube(load_configuration(cluster.kubeconfig))


class StatusRecorder:
    """Polls an InferenceService quickly through the API and keeps every distinct status it sees."""

    def __init__(self, cluster, name: str, ns: str):
        self.kube = api(cluster)
        self.name, self.ns = name, ns
        self.seen: list[dict[str, Any]] = []
        self.stop_flag = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _record(self) -> None:
        obj = self.kube.get("InferenceService", self.ns, self.name) or {}
        st = {"generation": obj.get("metadata", {}).get("generation"), **(obj.get("status") or {})}
        if not self.seen or self.seen[-1] != st:
            self.seen.append(st)

    def _run(self) -> None:
        while not self.stop_flag.is_set():
            self._record()
            time.sleep(0.02)

    def __enter__(self) -> StatusRecorder:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop_flag.set()
        self.thread.join(5)
        # One last read after the thread: the caller's own wait may have seen a status newer
        # than the thread's last poll, and the record must end where the caller's wait did.
        self._record()


# ---- CRDs and the schema ------------------------------------------------------------------
def test_crds_apply_and_are_established(cluster):
    names = cluster.kubectl("get", "crd", "-o", "name").stdout
    assert "inferenceservices.pagoda.dev" in names and "nodetopologies.pagoda.dev" in names
    res = cluster.kubectl("api-resources", "--api-group=pagoda.dev", "-o", "wide").stdout
    assert "pisvc" in res and "InferenceService" in res
    cluster.kubectl("get", "pagoda", "-A")  # the category resolves


@pytest.mark.parametrize(
    "spec, fragments",
    [
        (
            {"model": {"name": "m", "hostPath": {"path": "/m"}}, "engine": {"blockSize": 24}},
            ["spec.engine.blockSize", "Unsupported value: 24", '"16", "32", "64", "128"'],
        ),
        ({"model": {"name": "m"}}, ["spec.model", "oneOf"]),
        (
            {"model": {"name": "m", "uri": "hf://a/b"}, "autoscaling": {"metric": "cpu", "maxReplicas": 2}},
            ["spec.autoscaling.metric", "Unsupported value"],
        ),
        (
            {"model": {"name": "m", "uri": "hf://a/b"}, "replicas": -2},
            ["spec.replicas", "should be greater than or equal to 0"],
        ),
        ({"model": {"name": "--port=1", "uri": "hf://a/b"}}, ["spec.model.name", "should match"]),
        ({"model": {"name": "m", "pvc": {"claimName": "w", "path": "../x"}}}, ["spec.model.pvc.path", "should match"]),
        ({"model": {"name": "m", "hostPath": {"path": "/a/../etc"}}}, ["spec.model.hostPath.path", "should match"]),
        (
            {"model": {"name": "m", "uri": "hf://a/b"}, "kvOffload": {"disk": {"path": "/kv/..", "sizeGiB": 1}}},
            ["spec.kvOffload.disk.path", "should match"],
        ),
        (
            {"model": {"name": "m", "uri": "hf://a/b"}, "server": {"apiKeySecretRef": {"name": "Not_A_Name"}}},
            ["spec.server.apiKeySecretRef.name", "should match"],
        ),
    ],
)
def test_schema_invalid_is_rejected_readably(cluster, ns, spec, fragments):
    doc = {
        "apiVersion": "pagoda.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "bad"},
        "spec": spec,
    }
    proc = cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(doc), check=False)
    assert proc.returncode != 0
    for fragment in fragments:
        assert fragment in proc.stderr, proc.stderr
    assert get(cluster, "pisvc", "bad", ns) is None


def test_defaults_are_applied_by_the_api_server(cluster, ns):
    cluster.apply(
        {
            "apiVersion": "pagoda.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": "dflt"},
            "spec": {"model": {"name": "m", "uri": "hf://a/b"}, "resources": {"gpusPerReplica": 0}},
        },
        ns,
    )
    spec = get(cluster, "pisvc", "dflt", ns)["spec"]
    assert spec["replicas"] == 1 and spec["port"] == 8000
    assert spec["engine"] == {
        "blockSize": 16,
        "dtype": "auto",
        "kvCacheDtype": "auto",
        "gpuMemoryUtilization": 0.9,
        "enablePrefixCaching": True,
        "enforceEager": False,
    }
    assert spec["parallelism"] == {"tensor": 1, "expert": 1, "data": 1, "dataParallelExperts": False}
    assert spec["placement"] == {"numaPolicy": "auto", "requireNVLink": False}


def test_example_applies_as_is(cluster, ns):
    cluster.kubectl("apply", "-n", ns, "-f", str(ROOT / "examples" / "inferenceservice.yaml"))
    obj = get(cluster, "pisvc", "qwen3-8b", ns)
    assert obj["spec"]["autoscaling"]["maxReplicas"] == 4


# ---- lifecycle ----------------------------------------------------------------------------
def test_valid_service_gets_children_and_becomes_ready(cluster, ns, operator):
    cluster.apply(isvc("llm", replicas=2), ns)
    obj = wait_ready(cluster, "llm", ns, replicas=2, op=operator)
    st = obj["status"]
    assert st["observedGeneration"] == obj["metadata"]["generation"] == 1
    assert st["replicas"] == st["updatedReplicas"] == 2
    assert st["endpoint"] == f"http://llm.{ns}.svc:8000"
    assert (
        st["selector"]
        == "app.kubernetes.io/instance=llm,app.kubernetes.io/name=pagoda,pagoda.dev/inferenceservice=llm"
    )
    assert {p["node"] for p in st["placement"]} == {NODE} and len(st["placement"]) == 2
    kids = children(cluster, "llm", ns)
    uid = obj["metadata"]["uid"]
    for kind, child in kids.items():
        assert child is not None, kind
        (ref,) = child["metadata"]["ownerReferences"]
        assert ref["uid"] == uid and ref["controller"] is True
    c = kids["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert c["args"][:2] == ["serve", "/models"] and c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "engine.yaml" in kids["ConfigMap"]["data"]
    # the printer columns
    row = cluster.kubectl("get", "pisvc", "llm", "-n", ns).stdout.splitlines()
    assert row[0].split()[:5] == ["NAME", "READY", "REPLICAS", "MODEL", "EP"] and row[1].split()[1:5] == [
        "True",
        "2",
        "tiny",
        "1",
    ]
    # steady state: nothing is rewritten while nothing changes (timer ticks every second)
    before = versions(cluster, "llm", ns)
    rv = obj["metadata"]["resourceVersion"]
    time.sleep(4)
    assert versions(cluster, "llm", ns) == before
    assert get(cluster, "pisvc", "llm", ns)["metadata"]["resourceVersion"] == rv


LWS_CRD = ROOT / "e2e" / "cluster" / "crds" / "leaderworkerset.x-k8s.io_leaderworkersets.yaml"


def _contains(live: Any, sent: Any, where: str = "") -> list[str]:
    """Where ``live`` lacks what ``sent`` holds (the API server may add defaults, never drop)."""
    if isinstance(sent, dict):
        if not isinstance(live, dict):
            return [f"{where}: {live!r}"]
        return [m for k, v in sent.items() for m in (_contains(live[k], v, f"{where}.{k}") if k in live
                                                      else [f"{where}.{k}: pruned"])]
    if isinstance(sent, list):
        if not isinstance(live, list) or len(live) != len(sent):
            return [f"{where}: {live!r}"]
        return [m for i, (a, b) in enumerate(zip(live, sent)) for m in _contains(a, b, f"{where}[{i}]")]
    return [] if live == sent or str(live) == str(sent) else [f"{where}: {live!r} != {sent!r}"]


def _drop_empty_defaults(schema: Any) -> int:
    """Remove every ``default: ""`` below ``schema``, and make required the key of a list map
    that thereby lost its default (1.20 wants one or the other); how many defaults there were."""
    dropped = 0
    if isinstance(schema, dict):
        if schema.get("default") == "":
            del schema["default"]
            dropped += 1
        dropped += sum(_drop_empty_defaults(v) for v in schema.values())
        items = schema.get("items") or {}
        for key in schema.get("x-kubernetes-list-map-keys") or []:
            if "default" not in items["properties"][key] and key not in items.get("required", []):
                items.setdefault("required", []).append(key)
    elif isinstance(schema, list):
        dropped += sum(_drop_empty_defaults(v) for v in schema)
    return dropped


def test_groups_render_as_one_leader_worker_set_where_its_crd_is_installed(cluster, ns, operator):
    """With the LeaderWorkerSet CRD installed (vendored from kubernetes-sigs/lws,
    e2e/cluster/crds/), an InferenceService with podsPerReplica 2 gets one LeaderWorkerSet that this
    real API server accepts, every field the operator sets surviving its structural schema (no
    pruning), and no StatefulSets; podsPerReplica back to 1 deletes it for the Deployment.

    The LeaderWorkerSet controller (a Go binary) cannot run here: it cannot be pulled (no network)
    nor built (Go 1.19, no module downloads), so no pods appear, and the InferenceService is not
    Ready. The StatefulSet layout, without the CRD, is covered by test_real_containers.py.

    This API server (Kubernetes 1.20) refuses the CRD's 66 empty-string defaults, all inside the
    embedded pod schema ('default: ""' read as null: "must be of type string"), so the CRD is
    installed without them (and with imagePullSecrets' name, a list-map key left without a
    default, required); the operator renders none of the fields they concern."""
    if str(ROOT / "operator") not in sys.path:
        sys.path.insert(0, str(ROOT / "operator"))
    from pagoda_operator import builders, leader_worker_set, spec

    crd = yaml.safe_load(LWS_CRD.read_text())
    assert _drop_empty_defaults(crd) == 66
    # create, not apply: 1.3 MB, beyond what the last-applied annotation may hold
    cluster.kubectl("create", "-f", "-", input=json.dumps(crd))
    try:
        cluster.wait_for(lambda: cond(get(cluster, "crd", leader_worker_set.CRD_NAME), "Established").get(
            "status") == "True", timeout=30, what="the LeaderWorkerSet CRD established")
        time.sleep(1.2)  # past the operator's discovery interval: its first pass already sees the CRD
        body = isvc("grp", resources={"gpusPerReplica": 2, "podsPerReplica": 2}, parallelism={"tensor": 2})
        cluster.apply(body, ns)
        live = cluster.wait_for(lambda: get(cluster, "leaderworkerset", "grp-group", ns), timeout=20,
                                what="the LeaderWorkerSet")
        owner = get(cluster, "pisvc", "grp", ns)
        sent = leader_worker_set.children(spec.parse("grp", ns, owner["spec"]), owner, 1,
                                          builders.Settings(daemon_image="pagoda-test:e2e")).workload
        # what the test rendered is what the operator sent, and all of it came back
        assert live["metadata"]["annotations"][builders.HASH_ANNOTATION] == \
            sent["metadata"]["annotations"][builders.HASH_ANNOTATION]
        assert _contains(live["spec"], sent["spec"], "spec") == []
        template = live["spec"]["leaderWorkerTemplate"]
        assert (template["size"], template["restartPolicy"], live["spec"]["startupPolicy"]) == (
            2, "RecreateGroupOnPodRestart", "LeaderCreated")
        assert "$(LWS_LEADER_ADDRESS)" in template["workerTemplate"]["spec"]["containers"][0]["args"]
        assert cluster.kubectl_json("get", "statefulsets", "-n", ns)["items"] == []
        assert get(cluster, "service", "grp-group", ns)["spec"]["clusterIP"] == "None"
        assert cond(get(cluster, "pisvc", "grp", ns), "Ready").get("status") != "True"
        assert "leaderworkerset.x-k8s.io/v1 is served" in operator.log()
        # the operator's own watch of LeaderWorkerSets (optional_watch.py) saw it and asked for a pass
        cluster.wait_for(lambda: any(
            line.startswith("pagoda_operator_reconciles_total{") and 'trigger="leaderworkerset"' in line
            and float(line.rsplit(" ", 1)[1]) > 0 for line in operator.metrics().splitlines()),
            timeout=20, what="a pass after the LeaderWorkerSet's watch event")

        cluster.kubectl("patch", "pisvc", "grp", "-n", ns, "--type=merge", "-p", json.dumps(
            {"spec": {"resources": {"gpusPerReplica": 1, "podsPerReplica": 1}, "parallelism": {"tensor": 1}}}))
        cluster.wait_for(lambda: get(cluster, "deployment", "grp", ns) is not None
                         and get(cluster, "leaderworkerset", "grp-group", ns) is None, timeout=20,
                         what="the Deployment instead of the LeaderWorkerSet")
        assert operator.alive()
    finally:
        cluster.kubectl("delete", "pisvc", "grp", "-n", ns, "--ignore-not-found", check=False)
        cluster.kubectl("delete", "crd", "leaderworkersets.leaderworkerset.x-k8s.io", "--ignore-not-found",
                        "--timeout=60s", check=False)
    # The CRD deleted under the watch: the operator keeps serving (kopf's watch of LeaderWorkerSets
    # stopped the whole operator on the 404 that follows, in a CI run on 2026-11-30).
    cluster.wait_for(lambda: "leaderworkerset.x-k8s.io/v1 is not served" in operator.log(), timeout=20,
                     what="the operator finding LeaderWorkerSets no longer served")
    time.sleep(2)  # a watch reconnect after the deletion has been answered
    assert operator.alive(), operator.log()[-3000:]


def test_kubectl_scale(cluster, ns, operator):
    cluster.apply(isvc("scaled"), ns)
    wait_ready(cluster, "scaled", ns, replicas=1, op=operator)
    template = get(cluster, "deployment", "scaled", ns)["spec"]["template"]
    cluster.kubectl("scale", "-n", ns, "pisvc/scaled", "--replicas=3")
    obj = wait_ready(cluster, "scaled", ns, replicas=3, generation=2, op=operator)
    assert obj["status"]["replicas"] == 3
    dep = get(cluster, "deployment", "scaled", ns)
    assert dep["spec"]["replicas"] == 3 and dep["spec"]["template"] == template  # scaling does not roll
    cluster.kubectl("scale", "-n", ns, "pisvc/scaled", "--replicas=1")
    wait_ready(cluster, "scaled", ns, replicas=1, generation=3, op=operator)
    cluster.wait_for(
        lambda: (
            len(
                cluster.kubectl_json("get", "pods", "-n", ns, "-l", "pagoda.dev/inferenceservice=scaled")[
                    "items"
                ]
            )
            == 1
        ),
        timeout=30,
        what="scaled down to one pod",
    )


def test_spec_change_rolls_progressing_then_ready(cluster, ns, operator):
    cluster.apply(isvc("roll", replicas=2), ns)
    wait_ready(cluster, "roll", ns, replicas=2, op=operator)
    old_rs = {rs["metadata"]["name"] for rs in cluster.kubectl_json("get", "rs", "-n", ns)["items"]}
    with StatusRecorder(cluster, "roll", ns) as rec:
        cluster.kubectl(
            "patch", "pisvc", "roll", "-n", ns, "--type=merge", "-p", '{"spec":{"engine":{"blockSize":32}}}'
        )
        obj = wait_ready(cluster, "roll", ns, replicas=2, generation=2, op=operator)
    gen2 = [s for s in rec.seen if s.get("observedGeneration") == 2]
    progressing = [s for s in gen2 if cond({"status": s}, "Progressing").get("status") == "True"]
    assert progressing, f"never saw Progressing=True at generation 2: {rec.seen}"
    first_ready = next(i for i, s in enumerate(gen2) if cond({"status": s}, "Ready").get("status") == "True")
    assert gen2.index(progressing[0]) < first_ready  # Progressing came before Ready
    assert cond({"status": progressing[0]}, "Ready").get("status") == "False"
    assert cond(obj, "Progressing")["status"] == "False" and cond(obj, "Progressing")["reason"] == "Complete"
    assert "block_size: 32" in get(cluster, "configmap", "roll-config", ns)["data"]["engine.yaml"]
    new_rs = {rs["metadata"]["name"] for rs in cluster.kubectl_json("get", "rs", "-n", ns)["items"]}
    assert len(new_rs - old_rs) == 1  # rolled exactly once


def test_invalid_combination_is_degraded_and_children_untouched(cluster, ns, operator):
    cluster.apply(isvc("combo", resources={"gpusPerReplica": 4}, parallelism={"tensor": 4}), ns)
    wait_ready(cluster, "combo", ns, replicas=1, op=operator)
    before = versions(cluster, "combo", ns)
    cluster.kubectl(
        "patch", "pisvc", "combo", "-n", ns, "--type=merge", "-p",
        '{"spec":{"parallelism":{"data":3},"engine":{"kvCacheDtype":"fp8"}}}'
    )

    def degraded():
        c = cond(get(cluster, "pisvc", "combo", ns), "Degraded")
        return c if c.get("reason") == "InvalidSpec" else None

    c = cluster.wait_for(degraded, timeout=30, what="Degraded/InvalidSpec")
    assert c["status"] == "True" and "= 12 must equal resources.gpusPerReplica (4)" in c["message"]
    # and the daemon's capability list, read by the operator: no crash-looping pod for it
    assert "spec.engine.kvCacheDtype: an fp8 KV cache" in c["message"], c
    time.sleep(2)
    assert versions(cluster, "combo", ns) == before
    events = cluster.kubectl(
        "get", "events", "-n", ns, "--field-selector", "involvedObject.name=combo"
    ).stdout
    assert "InvalidSpec" in events


def test_a_layout_the_models_config_rules_out_is_refused_before_any_pod(cluster, ns, operator, config_hub):
    """TP = 3 for a model of 32 attention heads: Degraded/InvalidSpec naming the field, from the
    model's config.json read by the operator, and no Deployment (no pod to crash-loop)."""
    model = {"name": "m", "uri": "hf://org/dense", "endpoint": config_hub.url}
    cluster.apply(isvc("heads", model=model, resources={"gpusPerReplica": 3}, parallelism={"tensor": 3}), ns)

    def degraded():
        c = cond(get(cluster, "pisvc", "heads", ns), "Degraded")
        return c if c.get("reason") == "InvalidSpec" else None

    c = cluster.wait_for(degraded, timeout=30, what="Degraded/InvalidSpec")
    assert "attention heads (32)" in c["message"] and "spec.parallelism.tensor" in c["message"], c
    assert get(cluster, "deployment", "heads", ns) is None
    cluster.kubectl("patch", "pisvc", "heads", "-n", ns, "--type=merge",
                    "-p", '{"spec":{"parallelism":{"tensor":4},"resources":{"gpusPerReplica":4}}}')
    cluster.wait_for(lambda: get(cluster, "deployment", "heads", ns), timeout=30, what="the Deployment")
    gets = [p for m, p, _ in config_hub.requests if m == "GET" and p.endswith("/config.json")]
    assert gets == ["/org/dense/resolve/main/config.json"]  # read once for both generations


def test_a_quota_that_forbids_services_is_degraded_and_clears_when_lifted(cluster, ns, operator):
    """A ResourceQuota allowing no Services: the API server refuses the child Service with 403. The
    InferenceService is Degraded/QuotaExceeded naming the quota within a pass, with one Warning
    Event; lifting the quota lets it converge (the write is retried after its backoff)."""
    quota = {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "no-services"},
             "spec": {"hard": {"services": "0"}}}
    cluster.apply(quota, ns)
    cluster.wait_for(lambda: (get(cluster, "resourcequota", "no-services", ns) or {}).get("status", {}).get("hard"),
                     timeout=30, what="the quota controller fills the quota's status")
    cluster.apply(isvc("quota"), ns)

    def degraded():
        c = cond(get(cluster, "pisvc", "quota", ns), "Degraded")
        return c if c.get("status") == "True" else None

    c = cluster.wait_for(degraded, timeout=30, what="Degraded")
    assert c["reason"] == "QuotaExceeded" and "no-services" in c["message"] and "Service quota" in c["message"], c
    assert get(cluster, "deployment", "quota", ns) is None  # nothing after the refused child
    time.sleep(3)  # passes run every second: the Event is posted once, not every pass
    events = cluster.kubectl_json("get", "events", "-n", ns, "--field-selector", "involvedObject.name=quota")["items"]
    assert [e["reason"] for e in events if e["reason"] == "QuotaExceeded"] == ["QuotaExceeded"], events

    cluster.kubectl("delete", "resourcequota", "no-services", "-n", ns)
    wait_ready(cluster, "quota", ns, replicas=1, timeout=90, op=operator)
    assert cond(get(cluster, "pisvc", "quota", ns), "Degraded")["status"] == "False"


def test_unschedulable_pods_are_degraded(cluster, ns, operator):
    cluster.apply(isvc("huge", resources={"gpusPerReplica": 16}, parallelism={"tensor": 16}), ns)

    def degraded():
        c = cond(get(cluster, "pisvc", "huge", ns), "Degraded")
        return c if c.get("status") == "True" else None

    c = cluster.wait_for(degraded, timeout=60, what="Degraded")
    if c["reason"] == "InvalidSpec":  # a NodeTopology in this cluster says no node has 16 GPUs
        assert "larger than any node offers" in c["message"]
    else:
        assert c["reason"] == "Unschedulable" and "nvidia.com/gpu" in c["message"], c


def test_crash_looping_pods_are_degraded(cluster, ns, operator):
    cluster.apply(isvc("crashy"), ns)
    wait_ready(cluster, "crashy", ns, replicas=1, op=operator)
    (pod,) = cluster.kubectl_json("get", "pods", "-n", ns, "-l", "pagoda.dev/inferenceservice=crashy")[
        "items"
    ]
    t = "2024-01-01T00:00:00Z"

    def set_status(crashing: bool) -> None:
        ok = "False" if crashing else "True"
        state = (
            {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting failed container"}}
            if crashing
            else {"running": {"startedAt": t}}
        )
        status = {
            "conditions": [
                {
                    "type": c,
                    "status": ok if c in ("Ready", "ContainersReady") else "True",
                    "lastTransitionTime": t,
                }
                for c in ("Initialized", "ContainersReady", "Ready", "PodScheduled")
            ],
            "containerStatuses": [
                {
                    "name": "daemon",
                    "image": "pagoda-test:e2e",
                    "imageID": "",
                    "ready": not crashing,
                    "restartCount": 4,
                    "started": not crashing,
                    "state": state,
                    "lastState": {
                        "terminated": {"exitCode": 1, "reason": "Error", "startedAt": t, "finishedAt": t}
                    },
                }
            ],
        }
        # kubectl 1.20 has no --subresource: patch the pod's status through the API directly
        api(cluster).merge_patch("Pod", ns, pod["metadata"]["name"], {"status": status}, sub="status")

    set_status(crashing=True)

    def degraded():
        obj = get(cluster, "pisvc", "crashy", ns)
        return obj if cond(obj, "Degraded").get("reason") == "CrashLoopBackOff" else None

    obj = cluster.wait_for(degraded, timeout=30, what="Degraded/CrashLoopBackOff")
    msg = cond(obj, "Degraded")["message"]
    assert pod["metadata"]["name"] in msg and "restarted 4 times" in msg and "last exit Error code 1" in msg
    cluster.wait_for(
        lambda: cond(get(cluster, "pisvc", "crashy", ns), "Ready").get("status") == "False",
        timeout=30,
        what="Ready=False while crash-looping",
    )
    set_status(crashing=False)
    cluster.wait_for(
        lambda: cond(get(cluster, "pisvc", "crashy", ns), "Degraded").get("status") == "False",
        timeout=30,
        what="Degraded clears",
    )
    wait_ready(cluster, "crashy", ns, replicas=1, op=operator)


def test_require_nvlink_places_through_node_topology(cluster, ns, operator, gpu_node):
    def topo(node: str, groups: list[list[int]]) -> dict[str, Any]:
        links = [
            {
                "a": a,
                "b": b,
                "type": "NVLINK" if any(a in g and b in g for g in groups) else "SYS",
                "count": 0,
            }
            for a in range(8)
            for b in range(a + 1, 8)
        ]
        return {
            "apiVersion": "pagoda.dev/v1alpha1",
            "kind": "NodeTopology",
            "metadata": {"name": node},
            "spec": {
                "cpu": {"sockets": 2, "logicalCpus": 32, "physicalCores": 16},
                "numaNodes": [{"id": 0, "cpus": "0-15"}, {"id": 1, "cpus": "16-31"}],
                "gpus": [
                    {
                        "index": i,
                        "vendor": "nvidia",
                        "model": "H100",
                        "pciBusId": f"0000:{i:02x}:00.0",
                        "numaNode": i // 4,
                    }
                    for i in range(8)
                ],
                "links": links,
                "nics": [],
                "software": {"gpuBackend": "nvml"},
                "summary": {"gpuCount": 8, "numaNodeCount": 2, "fabricAllToAll": len(groups) == 1},
            },
        }

    try:
        cluster.apply(topo(gpu_node, [[0, 1, 2, 3], [4, 5, 6, 7]]))
        cluster.wait_for(
            lambda: get(cluster, "node", gpu_node)["metadata"]["labels"].get("pagoda.dev/nvlink-gpus") == "4",
            timeout=30,
            what="node label from NodeTopology",
        )
        cluster.apply(
            isvc(
                "nv",
                resources={"gpusPerReplica": 8},
                parallelism={"tensor": 8},
                placement={"requireNVLink": True},
            ),
            ns,
        )
        c = cluster.wait_for(
            lambda: (
                cond(get(cluster, "pisvc", "nv", ns), "Degraded").get("reason") == "NoEligibleNodes"
                and cond(get(cluster, "pisvc", "nv", ns), "Degraded")
            ),
            timeout=30,
            what="NoEligibleNodes",
        )
        assert "8 GPUs connected all-to-all" in c["message"]
        assert get(cluster, "deployment", "nv", ns) is None
        cluster.apply(topo(gpu_node, [list(range(8))]))  # NVSwitch: now eligible
        obj = wait_ready(cluster, "nv", ns, replicas=1, op=operator)
        assert obj["status"]["placement"][0]["node"] == gpu_node
        aff = get(cluster, "deployment", "nv", ns)["spec"]["template"]["spec"]["affinity"]
        expr = aff["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0][
            "matchExpressions"
        ][0]
        assert expr == {"key": "pagoda.dev/nvlink-gpus", "operator": "Gt", "values": ["7"]}
        cluster.kubectl("delete", "nodetopology", gpu_node)
        cluster.wait_for(
            lambda: "pagoda.dev/nvlink-gpus" not in get(cluster, "node", gpu_node)["metadata"]["labels"],
            timeout=30,
            what="node label removed with its NodeTopology",
        )
    finally:
        cluster.kubectl("delete", "nodetopology", gpu_node, "--ignore-not-found", check=False)


def test_delete_removes_every_child(cluster, ns, operator):
    cluster.apply(isvc("gone", replicas=2), ns)
    wait_ready(cluster, "gone", ns, replicas=2, op=operator)
    cluster.kubectl("delete", "pisvc", "gone", "-n", ns, "--wait=true", "--timeout=60s")

    def all_gone():
        kids = children(cluster, "gone", ns)
        pods = cluster.kubectl_json("get", "pods", "-n", ns, "-l", "pagoda.dev/inferenceservice=gone")[
            "items"
        ]
        rs = cluster.kubectl_json("get", "rs", "-n", ns, "-l", "pagoda.dev/inferenceservice=gone")["items"]
        return all(v is None for v in kids.values()) and not pods and not rs

    cluster.wait_for(all_gone, timeout=60, what="garbage collection of every child")


def test_delete_does_not_need_the_operator(cluster, ns, operator):
    cluster.apply(isvc("orphan"), ns)
    obj = wait_ready(cluster, "orphan", ns, replicas=1, op=operator)
    assert not obj["metadata"].get("finalizers")
    operator.stop(signal.SIGTERM)
    try:
        cluster.kubectl("delete", "pisvc", "orphan", "-n", ns, "--wait=true", "--timeout=30s")
        cluster.wait_for(
            lambda: all(v is None for v in children(cluster, "orphan", ns).values()),
            timeout=60,
            what="children garbage-collected with the operator down",
        )
    finally:
        operator.start()
        cluster.wait_for(
            lambda: "leading as" in operator.log().split("waiting for the leader lease")[-1],
            timeout=6 * LEASE,
            what="operator leads again",
        )


def test_an_api_server_outage_leaves_the_leader_up_and_a_restart_retakes_its_own_lease(cluster, ns, operator):
    """The API server killed and down for 30 s (connections refused), with a lease of 4 s: the operator
    keeps leading (its grace is 60 s) and converges on what changed once the server is back.
    Then killed and started again as the same pod: it finds the lease its own and leads at
    once, instead of waiting for its own lease to expire."""
    cluster.apply(isvc("pre-outage"), ns)
    wait_ready(cluster, "pre-outage", ns, replicas=1, op=operator)
    pid_file = Path(cluster.state_dir) / "kube-apiserver.pid"
    pid = int(pid_file.read_text())
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]
    os.kill(pid, signal.SIGKILL)  # a crash (its graceful stop takes longer than the outage)
    def stopped() -> bool:  # gone, or a zombie its parent has not reaped
        try:
            return "\nState:\tZ" in Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            return True

    cluster.wait_for(stopped, timeout=30, what="the API server stopped")
    try:
        time.sleep(30)
        assert operator.alive(), operator.log()[-3000:]
    finally:
        with open(Path(cluster.logs_dir) / "kube-apiserver.log", "ab") as log:
            server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True)
        pid_file.write_text(str(server.pid))  # the cluster's teardown stops this one
    cluster.wait_for(lambda: cluster.kubectl("get", "--raw", "/readyz", check=False).returncode == 0,
                     timeout=90, what="the API server answers again")
    cluster.apply(isvc("post-outage"), ns)
    wait_ready(cluster, "post-outage", ns, replicas=1, op=operator)
    assert operator.alive() and "lost the leader lease" not in operator.log(), operator.log()[-3000:]
    assert "API server unreachable" in operator.log()  # it did see the outage

    operator.stop(signal.SIGKILL)  # the lease stays recorded as held by e2e-operator
    mark = len(operator.log())
    operator.start()
    waiting = cluster.wait_for(lambda: "waiting for the leader lease" in operator.log()[mark:] and time.monotonic(),
                               timeout=60, interval=0.05, what="the restarted operator asks for the lease")
    leading = cluster.wait_for(lambda: "leading as e2e-operator" in operator.log()[mark:] and time.monotonic(),
                               timeout=60, interval=0.05, what="the restarted operator leads")
    assert leading - waiting < LEASE / 2, (leading - waiting, operator.log()[mark:])
    assert "took the leader lease" not in operator.log()[mark:]  # renewed its own, took nothing


def test_operator_restart_neither_duplicates_nor_loses(cluster, ns, operator):
    cluster.apply(isvc("steady", replicas=2), ns)
    wait_ready(cluster, "steady", ns, replicas=2, op=operator)
    steady_before = versions(cluster, "steady", ns)

    operator.stop(signal.SIGKILL)  # a crash: the lease stays held until it expires
    # while the operator is down: a new service, a scale and a spec change
    cluster.apply(isvc("while-down", replicas=1), ns)
    cluster.kubectl("scale", "-n", ns, "pisvc/steady", "--replicas=3")
    time.sleep(1)
    assert get(cluster, "deployment", "while-down", ns) is None
    operator.start()

    wait_ready(cluster, "while-down", ns, replicas=1, op=operator)
    wait_ready(cluster, "steady", ns, replicas=3, generation=2, op=operator)
    after = versions(cluster, "steady", ns)
    assert after["Service"] == steady_before["Service"] and after["ConfigMap"] == steady_before["ConfigMap"]
    deps = cluster.kubectl_json("get", "deployments", "-n", ns)["items"]
    assert sorted(d["metadata"]["name"] for d in deps) == ["steady", "while-down"]
    for name, n in (("steady", 3), ("while-down", 1)):
        rs = cluster.kubectl_json("get", "rs", "-n", ns, "-l", f"pagoda.dev/inferenceservice={name}")["items"]
        assert len(rs) == 1, [r["metadata"]["name"] for r in rs]  # no roll: the template did not change
        pods = cluster.kubectl_json("get", "pods", "-n", ns, "-l", f"pagoda.dev/inferenceservice={name}")[
            "items"
        ]
        assert len([p for p in pods if not p["metadata"].get("deletionTimestamp")]) == n

    # a graceful restart mid-rollout: the change lands exactly once
    cluster.kubectl(
        "patch", "pisvc", "steady", "-n", ns, "--type=merge", "-p", '{"spec":{"engine":{"maxNumSeqs":8}}}'
    )
    operator.stop(signal.SIGTERM)
    operator.start()
    wait_ready(cluster, "steady", ns, replicas=3, generation=3, op=operator)
    rs = cluster.kubectl_json("get", "rs", "-n", ns, "-l", "pagoda.dev/inferenceservice=steady")["items"]
    assert len(rs) == 2
    assert "max_num_seqs: 8" in get(cluster, "configmap", "steady-config", ns)["data"]["engine.yaml"]


def test_two_operators_never_act_at_once(cluster, ns, operator):
    standby = Operator(cluster, operator.lease_namespace, name="standby").start()
    try:
        cluster.wait_for(
            lambda: "waiting for the leader lease" in standby.log(), timeout=30, what="standby waits"
        )
        cluster.apply(isvc("pair"), ns)
        wait_ready(cluster, "pair", ns, replicas=1, op=operator)
        assert "leading as" not in standby.log()
        assert "pagoda_operator_leader 0.0" in standby.metrics()
        assert "pagoda_operator_leader 1.0" in operator.metrics()
        writes = [
            line
            for line in standby.metrics().splitlines()
            if line.startswith("pagoda_operator_writes_total{")
        ]
        assert writes == [], writes
        lease = cluster.kubectl_json("get", "lease", "pagoda-operator", "-n", operator.lease_namespace)
        assert lease["spec"]["holderIdentity"] in operator.log()

        operator.stop(signal.SIGTERM)  # releases the lease: the standby takes over at once
        cluster.wait_for(lambda: "leading as" in standby.log(), timeout=3 * LEASE, what="standby takes over")
        cluster.kubectl("scale", "-n", ns, "pisvc/pair", "--replicas=2")
        wait_ready(cluster, "pair", ns, replicas=2, generation=2, op=standby)
    finally:
        standby.stop()
        operator.start()
        cluster.wait_for(
            lambda: "leading as" in operator.log().split("waiting for the leader lease")[-1],
            timeout=6 * LEASE,
            what="operator leads again",
        )


# ---- autoscaling --------------------------------------------------------------------------
class MetricsServer:
    """What every daemon pod's /metrics answers (all fake pods share podIP 127.0.0.1)."""

    def __init__(self, model: str):
        self.model, self.waiting = model, 0.0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                body = (
                    "# TYPE vllm:num_requests_waiting gauge\n"
                    f'vllm:num_requests_waiting{{model_name="{outer.model}"}} {outer.waiting}\n'
                    "# TYPE vllm:num_requests_running gauge\n"
                    f'vllm:num_requests_running{{model_name="{outer.model}"}} 1\n'
                    "# TYPE vllm:kv_cache_usage_perc gauge\n"
                    f'vllm:kv_cache_usage_perc{{model_name="{outer.model}"}} 0.25\n'
                ).encode()
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


def test_autoscaling_from_real_metrics_endpoints(cluster, ns, operator):
    metrics = MetricsServer("tiny")
    down_window = 6
    try:
        cluster.apply(
            isvc(
                "auto",
                port=metrics.port,
                autoscaling={
                    "minReplicas": 1,
                    "maxReplicas": 3,
                    "metric": "requestsWaiting",
                    "target": 2,
                    "scaleUpStabilizationSeconds": 0,
                    "scaleDownStabilizationSeconds": down_window,
                },
            ),
            ns,
        )
        wait_ready(cluster, "auto", ns, replicas=1, op=operator)

        def auto():
            return (get(cluster, "pisvc", "auto", ns).get("status") or {}).get("autoscaling") or {}

        cluster.wait_for(lambda: auto().get("signals", {}).get("pods") == 1, timeout=20, what="first scrape")
        assert auto()["signals"]["requestsWaiting"] == 0 and auto()["desiredReplicas"] == 1

        metrics.waiting = 5.0  # 2.5x the target per pod: ceil(1 * 2.5) = 3
        wait_ready(cluster, "auto", ns, replicas=3, op=operator, timeout=30)
        a = auto()
        assert a["decisions"][-1]["from"] == 1 and a["decisions"][-1]["to"] == 3
        assert a["decisions"][-1]["reason"] == "ScaleUp" and a["decisions"][-1]["value"] == 5.0
        assert get(cluster, "deployment", "auto", ns)["spec"]["replicas"] == 3
        assert get(cluster, "pisvc", "auto", ns)["spec"]["replicas"] == 1  # the spec is not written

        metrics.waiting = 0.0
        low_since = time.time()
        wait_ready(cluster, "auto", ns, replicas=1, op=operator, timeout=30)
        waited = time.time() - low_since
        assert waited >= down_window - 1.5, (
            f"scaled down after {waited:.1f}s, inside the {down_window}s window"
        )
        a = auto()
        assert [(d["from"], d["to"]) for d in a["decisions"]] == [(1, 3), (3, 1)]
        assert a["lastScaleTime"] == a["decisions"][-1]["time"]
        assert "autoscale " + ns + "/auto: 3 -> 1 replicas" in operator.log()
    finally:
        metrics.close()
