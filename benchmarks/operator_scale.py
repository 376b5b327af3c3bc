"""The operator at scale, on the project's test cluster: a real etcd, kube-apiserver, scheduler and
controller-manager on loopback, and fake kubelets (e2e/cluster/fake_kubelet.py) whose pods turn
Running and Ready at once. Creates N InferenceServices over K namespaces as fast as 8 client
threads can, then reports:

- create-to-Ready per object (the Ready condition turning True, seen by a watch): p50, p99, and
  the last one after the last create;
- the operator's requests to the API server (``pagoda_operator_api_requests_total``; kopf's own
  watches and patches are not in it) per created object, and while idle afterwards per object
  per second; the API server's requests by verb and resource over the same windows (every
  client: the fake kubelets and controllers too);
- the operator's resident memory before the creates, once all are Ready, and after the idle
  window.

    python -m benchmarks.operator_scale --objects 200 --namespaces 20 [--operator-root DIR]

``--operator-root`` runs another tree's operator (a worktree of an older commit) on the same
cluster recipe, for a before/after pair. Needs the test binaries (e2e/cluster/ensure-k8s.sh).
Prints one line prefixed RESULT.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "operator"))
sys.path.insert(0, str(ROOT))


def isvc(name: str) -> dict:
    return {"apiVersion": "pagoda.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name},
            "spec": {"model": {"name": "tiny", "hostPath": {"path": "/data/tiny"}}, "resources": {"gpusPerReplica": 1}}}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc/PID/stat), 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def component_pids(state: Path, operator_pid: int) -> dict[str, list[int]]:
    """The processes the run's CPU goes to: the control plane (start-cluster.sh's pid files),
    the fake kubelets and the operator."""
    pids: dict[str, list[int]] = {"operator": [operator_pid]}
    for f in sorted(state.glob("*.pid")):
        name = "fake-kubelets" if f.stem.startswith("fake-kubelet-") else f.stem
        if name != "watchdog":
            pids.setdefault(name, []).append(int(f.read_text().split()[0]))
    return pids


def cpu_by_component(pids: dict[str, list[int]]) -> dict[str, float]:
    return {name: sum(map(cpu_seconds, ps)) for name, ps in pids.items()}


def scrape(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def operator_requests(port: int) -> float | None:
    """None for an operator without the counter (one older than it)."""
    text = scrape(f"http://127.0.0.1:{port}/metrics")
    found = re.findall(r"^pagoda_operator_api_requests_total\{[^}]*\} (\S+)$", text, re.M)
    return sum(float(m) for m in found) if found else None


def reconciles(port: int) -> tuple[dict[str, float], dict[str, float]]:
    """The operator's reconcile passes so far from one scrape: by trigger (every result) and by
    result (changed, unchanged, gone, error; every trigger)."""
    text = scrape(f"http://127.0.0.1:{port}/metrics")
    by_trigger: Counter = Counter()
    by_result: Counter = Counter()
    for result, trigger, value in re.findall(
            r'^pagoda_operator_reconciles_total\{result="([^"]*)",trigger="([^"]*)"\} (\S+)$', text, re.M):
        by_trigger[trigger] += float(value)
        by_result[result] += float(value)
    return dict(by_trigger), dict(by_result)


def cache_bytes(port: int) -> dict[str, float]:
    text = scrape(f"http://127.0.0.1:{port}/metrics")
    return {k: float(v) for k, v in re.findall(r'^pagoda_operator_watch_cache_bytes\{kind="([^"]*)"\} (\S+)$', text, re.M)}


def answers(port: int) -> bool:
    try:
        scrape(f"http://127.0.0.1:{port}/metrics")
        return True
    except OSError:
        return False


def apiserver_requests(kube) -> Counter:
    text = kube.request("GET", "/metrics", content_type="text/plain")
    out: Counter = Counter()
    for labels, value in re.findall(r"^apiserver_request_total\{([^}]*)\} (\S+)$", text, re.M):
        fields = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        out[f"{fields.get('verb')} {fields.get('resource')}"] += float(value)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--objects", type=int, default=200)
    ap.add_argument("--namespaces", type=int, default=20)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--idle-s", type=float, default=60.0, help="how long to count requests once all are Ready")
    ap.add_argument("--timeout", type=float, default=900.0, help="give up waiting for Ready after this long")
    ap.add_argument("--operator-root", default=str(ROOT), help="the tree whose operator runs")
    ap.add_argument("--operator-env", action="append", default=[], help="KEY=VALUE for the operator's process")
    ap.add_argument("--controller-qps", type=int, default=0,
                    help="the controller-manager's and scheduler's client rate (0: their defaults)")
    ap.add_argument("--label", default="")
    a = ap.parse_args()

    from e2e.conftest import ENSURE, KubeCluster, _start_cluster
    from pagoda_operator.kube import Kube, load_configuration

    bin_dir = Path(subprocess.run([str(ENSURE), "--print-bin-dir"], capture_output=True, text=True,
                                  check=True).stdout.strip())
    state = Path(tempfile.mkdtemp(prefix="pagoda-scale-"))
    # a Service per object: the e2e recipe's /24 holds 253 (a run of 1,000 stopped there)
    cluster_env = {"PAGODA_K8S_SERVICE_CIDR": "10.0.0.0/16"}
    if a.controller_qps:
        cluster_env["PAGODA_K8S_CONTROLLER_QPS"] = str(a.controller_qps)
    _start_cluster(state, bin_dir, cluster_env)
    cluster = KubeCluster(state, bin_dir)
    operator = None
    try:
        for crd in sorted((ROOT / "crds").glob("*.yaml")):
            cluster.kubectl("apply", "-f", str(crd))
        cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd", "--all")
        # room for every object's pod: a run of 1,000 on 4 nodes stopped at 440, the nodes'
        # default 110 pods each
        per_node = -(-a.objects // a.nodes) + 1
        for i in range(a.nodes):
            cluster.start_fake_kubelet(f"node-{i}", gpus=max(8, per_node), cpu="100000", memory="100Ti",
                                       max_pods=max(110, per_node))
        namespaces = [f"scale-{i}" for i in range(a.namespaces)]
        for ns in [*namespaces, "pagoda-system"]:
            cluster.kubectl("create", "namespace", ns)
        port = 0
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        root = Path(a.operator_root).resolve()
        from pagoda_operator.memory import ENVIRONMENT  # what the chart gives the operator's container

        env = {**cluster.env, **ENVIRONMENT, "PYTHONPATH": str(root / "operator"), "POD_NAME": "scale-operator",
               **dict(kv.split("=", 1) for kv in a.operator_env)}
        log_path = state / "logs" / "operator.log"
        with open(log_path, "ab") as log:  # the child keeps its own copy of the descriptor
            operator = subprocess.Popen(
                [sys.executable, "-m", "pagoda_operator", f"--kubeconfig={cluster.kubeconfig}",
                 f"--metrics-port={port}", "--metrics-address=127.0.0.1", "--lease-namespace=pagoda-system",
                 "--daemon-image=pagoda-test:e2e", "--log-level=WARNING", "--scrape-timeout=1"],
                stdout=log, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL)
        cluster.wait_for(lambda: operator.poll() is not None or answers(port), timeout=120, what="the operator's metrics")
        time.sleep(5)  # leading, its watches started
        if operator.poll() is not None:
            raise RuntimeError(log_path.read_text()[-3000:])
        kube = Kube(load_configuration(cluster.kubeconfig))
        rss_before = rss_mib(operator.pid)

        ready_at: dict[str, float] = {}
        stop = threading.Event()

        def note(obj: dict) -> None:
            key = f"{obj['metadata'].get('namespace')}/{obj['metadata']['name']}"
            conds = (obj.get("status") or {}).get("conditions") or []
            if key not in ready_at and any(c["type"] == "Ready" and c["status"] == "True" for c in conds):
                ready_at[key] = time.monotonic()

        def watch() -> None:
            """A list, then a watch from its resourceVersion; again whenever the server ends the watch
            (it does after a while, or when the version is too old)."""
            collection = "/apis/pagoda.dev/v1alpha1/inferenceservices"
            while not stop.is_set():
                listed = kube.request("GET", collection)
                for obj in listed.get("items") or []:
                    note(obj)
                version = listed["metadata"]["resourceVersion"]
                resp = kube.pool.request("GET", kube.host + f"{collection}?watch=true&resourceVersion={version}",
                                         headers=kube._headers(None), preload_content=False, timeout=None)
                for line in resp:
                    if stop.is_set():
                        return
                    event = json.loads(line)
                    if event.get("type") in ("ADDED", "MODIFIED"):
                        note(event["object"])

        threading.Thread(target=watch, daemon=True).start()
        ops_0, api_0 = operator_requests(port), apiserver_requests(kube)
        passes_0, results_0 = reconciles(port)
        created_at: dict[str, float] = {}

        def create(i: int) -> None:
            ns, name = namespaces[i % len(namespaces)], f"svc-{i}"
            body = isvc(name)
            body["metadata"]["namespace"] = ns
            created_at[f"{ns}/{name}"] = time.monotonic()
            kube.create(body)

        pids = component_pids(state, operator.pid)
        cpu_0 = cpu_by_component(pids)
        t0 = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(create, range(a.objects)))
        last_create = time.monotonic()
        while len(ready_at) < a.objects and time.monotonic() - t0 < a.timeout:
            time.sleep(0.5)
        all_ready = time.monotonic()
        cpu_1 = cpu_by_component(pids)
        ops_1, api_1 = operator_requests(port), apiserver_requests(kube)
        rss_after = rss_mib(operator.pid)
        cached = cache_bytes(port)
        if os.environ.get("SCALE_SIGNAL_OPERATOR"):  # a debugging hook: e.g. a tracemalloc dump
            operator.send_signal(int(os.environ["SCALE_SIGNAL_OPERATOR"]))
            time.sleep(20)
        time.sleep(a.idle_s)
        ops_2, api_2 = operator_requests(port), apiserver_requests(kube)
        rss_idle = rss_mib(operator.pid)
        stop.set()
        latencies = sorted(ready_at[k] - created_at[k] for k in ready_at if k in created_at)

        def pct(q: float) -> float | None:
            return round(latencies[min(len(latencies) - 1, int(q * len(latencies)))], 2) if latencies else None

        busy = {k: round(v - api_0.get(k, 0)) for k, v in (api_1 - api_0).items() if v - api_0.get(k, 0) >= 1}
        idle = {k: round(v - api_1.get(k, 0)) for k, v in (api_2 - api_1).items() if v - api_1.get(k, 0) >= 1}
        passes_1, results_1 = reconciles(port)
        print("RESULT " + json.dumps({
            "label": a.label, "operator_root": str(root), "operator_env": a.operator_env, "objects": a.objects, "namespaces": a.namespaces,
            "nodes": a.nodes, "controller_qps": a.controller_qps or None, "ready": len(ready_at), "create_s": round(last_create - t0, 2),
            "create_to_ready_p50_s": pct(0.5), "create_to_ready_p99_s": pct(0.99),
            "last_ready_after_last_create_s": round(max(ready_at.values()) - last_create, 2) if ready_at else None,
            "all_ready_s": round(all_ready - t0, 2),
            # CPU seconds each part used from the first create to all Ready (or the timeout)
            "cpu_s_until_ready": {k: round(cpu_1[k] - cpu_0.get(k, 0.0), 1) for k in cpu_1},
            "operator_requests_per_object": (round((ops_1 - ops_0) / a.objects, 2)
                                             if ops_0 is not None and ops_1 is not None else None),
            "operator_idle_requests_per_object_per_s": (round((ops_2 - ops_1) / a.idle_s / a.objects, 5)
                                                        if ops_1 is not None and ops_2 is not None else None),
            "operator_rss_mib_before": round(rss_before, 1), "operator_rss_mib_after": round(rss_after, 1),
            "operator_rss_mib_idle": round(rss_idle, 1),
            "watch_cache_mib_by_kind": {k: round(v / 2**20, 2) for k, v in cached.items()},
            "operator_mib_per_100_objects": round((rss_after - rss_before) / a.objects * 100, 2),
            "operator_idle_mib_per_100_objects": round((rss_idle - rss_before) / a.objects * 100, 2),
            "apiserver_requests_until_ready": sum(busy.values()),
            "apiserver_requests_idle_per_s": round(sum(idle.values()) / a.idle_s, 2),
            "apiserver_by_verb_resource_until_ready": dict(sorted(busy.items(), key=lambda kv: -kv[1])[:15]),
            "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "median_latency_s": round(statistics.median(latencies), 2) if latencies else None,
            # passes by trigger from the first create to the end: "create" above the object count
            # means kopf ran the create handler more than once for some
            "reconciles_by_trigger": {k: round(v - passes_0.get(k, 0)) for k, v in passes_1.items()},
            "reconciles_by_result": {k: round(v - results_0.get(k, 0)) for k, v in results_1.items()},
        }), flush=True)
        return 0 if len(ready_at) == a.objects else 1
    finally:
        if operator is not None and operator.poll() is None:
            operator.terminate()
            operator.wait(timeout=30)
        cluster.stop()


if __name__ == "__main__":
    raise SystemExit(main())
