#!/usr/bin/env python3
"""A fake kubelet for tests, in the spirit of kwok (Kubernetes WithOut Kubelet).

It registers one Node that reports Ready with CPUs, memory and ``nvidia.com/gpu`` GPUs, and
marks every pod the scheduler puts on that node Running and Ready. No container runs: the
pod only *looks* alive to the API, which is what controllers, operators and their tests
look at. Pods deleted from the node are removed at once (no kubelet finishes a graceful
deletion otherwise).

Pod IPs are 127.0.0.1 so that nothing a test does with a pod address can leave the machine.
The price: the endpoints controller refuses loopback addresses, so Services get no endpoints.

Talks to the API server directly with the standard library (plus PyYAML to read the
kubeconfig), so it runs wherever the project's base install does.

    python3 e2e/cluster/fake_kubelet.py --kubeconfig STATE/admin.kubeconfig gpu-node-1 --gpus 8
"""

from __future__ import annotations

import argparse
import base64
import datetime
import json
import os
import signal
import ssl
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import yaml

# Taints the API server puts on a new Node until a kubelet reports it ready; the node
# lifecycle controller that would lift them is off in the test cluster, so we lift them.
STARTUP_TAINTS = {"node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"}


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def log(msg: str) -> None:
    print(f"fake-kubelet: {msg}", flush=True)


class ApiError(Exception):
    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status = status


class KubeApi:
    """Just enough of a Kubernetes REST client: one kubeconfig context, JSON in and out."""

    def __init__(self, kubeconfig: str):
        with open(kubeconfig) as f:
            cfg = yaml.safe_load(f)
        ctx_name = cfg["current-context"]
        ctx = next(c["context"] for c in cfg["contexts"] if c["name"] == ctx_name)
        cluster = next(c["cluster"] for c in cfg["clusters"] if c["name"] == ctx["cluster"])
        user = next(u["user"] for u in cfg["users"] if u["name"] == ctx["user"])
        base = os.path.dirname(os.path.abspath(kubeconfig))
        self.server = cluster["server"].rstrip("/")
        self.ssl = ssl.create_default_context(cafile=self._file(cluster, "certificate-authority", base))
        if cluster.get("insecure-skip-tls-verify"):
            self.ssl.check_hostname = False
            self.ssl.verify_mode = ssl.CERT_NONE
        cert = self._file(user, "client-certificate", base)
        if cert:
            self.ssl.load_cert_chain(cert, self._file(user, "client-key", base))
        self.headers = {"Accept": "application/json"}
        if user.get("token"):
            self.headers["Authorization"] = f"Bearer {user['token']}"

    @staticmethod
    def _file(section: dict, key: str, base: str) -> str | None:
        """Path of a kubeconfig file reference, writing ``<key>-data`` to a temp file if inline."""
        if section.get(key):
            return os.path.join(base, section[key])
        if section.get(f"{key}-data"):
            fd, path = tempfile.mkstemp(prefix="fake-kubelet-")
            with os.fdopen(fd, "wb") as f:
                f.write(base64.b64decode(section[f"{key}-data"]))
            return path
        return None

    def _open(self, method: str, path: str, body: Any = None, content_type: str = "application/json",
              timeout: float = 30):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.server + path, data=data, method=method, headers=dict(self.headers))
        if data is not None:
            req.add_header("Content-Type", content_type)
        try:
            return urllib.request.urlopen(req, timeout=timeout, context=self.ssl)
        except urllib.error.HTTPError as e:
            raise ApiError(e.code, e.read().decode(errors="replace")) from None

    def request(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> dict:
        with self._open(method, path, body, content_type) as resp:
            return json.loads(resp.read() or b"{}")

    def merge_patch(self, path: str, body: dict) -> dict:
        return self.request("PATCH", path, body, "application/merge-patch+json")

    def watch(self, path: str, timeout_s: int):
        """Yield watch events (dicts with ``type`` and ``object``) until the server ends the watch."""
        sep = "&" if "?" in path else "?"
        with self._open("GET", f"{path}{sep}watch=1&timeoutSeconds={timeout_s}", timeout=timeout_s + 15) as resp:
            for line in resp:
                if line.strip():
                    yield json.loads(line)


class FakeKubelet:
    def __init__(self, api: KubeApi, node: str, gpus: int, cpu: str, memory: str,
                 labels: dict[str, str], bind_unscheduled: bool, max_pods: int = 110):
        self.api, self.node, self.bind_unscheduled = api, node, bind_unscheduled
        self.labels = {"kubernetes.io/hostname": node, "kubernetes.io/os": "linux",
                       "kubernetes.io/arch": "amd64", "type": "fake-kubelet", **labels}
        self.capacity = {"cpu": cpu, "memory": memory, "pods": str(max_pods), "ephemeral-storage": "100Gi"}
        # A real kubelet lists and watches only its own node's pods; so do we, unless we must
        # also see unscheduled ones to bind them. Every kubelet watching every pod made four
        # fake nodes parse four copies of each pod event.
        self.pods_path = "/api/v1/pods" if bind_unscheduled else (
            "/api/v1/pods?fieldSelector=" + urllib.parse.quote(f"spec.nodeName={node}"))
        if gpus:
            self.capacity["nvidia.com/gpu"] = str(gpus)

    # ---- node -------------------------------------------------------------------------
    def ensure_node(self) -> None:
        """Create the Node if needed, lift start-up taints, report Ready (also our heartbeat)."""
        path = f"/api/v1/nodes/{self.node}"
        try:
            self.api.request("POST", "/api/v1/nodes", {
                "apiVersion": "v1", "kind": "Node", "metadata": {"name": self.node, "labels": self.labels}})
        except ApiError as e:
            if e.status != 409:
                raise
            self.api.merge_patch(path, {"metadata": {"labels": self.labels}})
        taints = self.api.request("GET", path).get("spec", {}).get("taints") or []
        kept = [t for t in taints if t.get("key") not in STARTUP_TAINTS]
        if kept != taints:
            # Only our own start-up taints go: a taint a test put on the node stays.
            self.api.merge_patch(path, {"spec": {"taints": kept or None}})
        t = now()
        conditions = [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                       "message": "fake kubelet is posting ready status"}]
        conditions += [{"type": c, "status": "False", "reason": f"KubeletHasNo{c}"}
                       for c in ("MemoryPressure", "DiskPressure", "PIDPressure")]
        for c in conditions:
            c.update(lastHeartbeatTime=t, lastTransitionTime=t)
        self.api.merge_patch(f"{path}/status", {"status": {
            "capacity": self.capacity, "allocatable": self.capacity, "conditions": conditions,
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": self.node}],
            "nodeInfo": {"kubeletVersion": "v1.20.2-fake", "kubeProxyVersion": "v1.20.2-fake",
                         "architecture": "amd64", "operatingSystem": "linux", "containerRuntimeVersion": "fake://0",
                         "bootID": "", "kernelVersion": "", "machineID": "", "osImage": "fake", "systemUUID": ""}}})

    # ---- pods -------------------------------------------------------------------------
    def handle_pod(self, pod: dict) -> None:
        meta, spec, status = pod["metadata"], pod.get("spec", {}), pod.get("status", {})
        ns, name, node = meta["namespace"], meta["name"], spec.get("nodeName")
        pod_path = f"/api/v1/namespaces/{ns}/pods/{name}"
        if meta.get("deletionTimestamp"):
            if node == self.node:
                # The uid precondition keeps us from deleting a new pod of the same name.
                self.api.request("DELETE", pod_path, {"apiVersion": "v1", "kind": "DeleteOptions",
                                                      "gracePeriodSeconds": 0,
                                                      "preconditions": {"uid": meta["uid"]}})
                log(f"{ns}/{name} deleted")
            return
        if not node:
            if self.bind_unscheduled:   # only for a cluster without kube-scheduler
                self.api.request("POST", f"{pod_path}/binding", {
                    "apiVersion": "v1", "kind": "Binding", "metadata": {"name": name},
                    "target": {"apiVersion": "v1", "kind": "Node", "name": self.node}})
            return
        if node != self.node or status.get("phase") in ("Running", "Succeeded", "Failed"):
            return
        t = now()
        running = {"running": {"startedAt": t}}
        done = {"terminated": {"exitCode": 0, "reason": "Completed", "startedAt": t, "finishedAt": t}}
        self.api.merge_patch(f"{pod_path}/status", {"status": {
            "phase": "Running", "hostIP": "127.0.0.1", "podIP": "127.0.0.1",
            "podIPs": [{"ip": "127.0.0.1"}], "startTime": t,
            "conditions": [{"type": c, "status": "True", "lastTransitionTime": t}
                           for c in ("Initialized", "ContainersReady", "Ready", "PodScheduled")],
            "initContainerStatuses": [self._container_status(c, done, ready=True) for c in spec.get("initContainers", [])],
            "containerStatuses": [self._container_status(c, running, ready=True) for c in spec["containers"]]}})
        log(f"{ns}/{name} -> Running")

    @staticmethod
    def _container_status(container: dict, state: dict, ready: bool) -> dict:
        return {"name": container["name"], "image": container.get("image", ""), "imageID": "",
                "containerID": f"fake://{container['name']}", "ready": ready, "restartCount": 0,
                "started": "running" in state, "state": state}

    def sync(self) -> str:
        """Handle every existing pod; return the list's resourceVersion to watch from."""
        pods = self.api.request("GET", self.pods_path)
        for pod in pods["items"]:
            self._handle_quietly(pod)
        return pods["metadata"]["resourceVersion"]

    def _handle_quietly(self, pod: dict) -> None:
        try:
            self.handle_pod(pod)
        except ApiError as e:
            if e.status not in (404, 409):   # gone meanwhile, or a conflict the next event resolves
                raise

    def run(self) -> None:
        self.ensure_node()
        log(f"node {self.node} Ready (capacity {self.capacity})")
        while True:
            try:
                rv = self.sync()
                sep = "&" if "?" in self.pods_path else "?"
                for ev in self.api.watch(f"{self.pods_path}{sep}resourceVersion={rv}&allowWatchBookmarks=true", 50):
                    if ev["type"] == "ERROR":   # e.g. 410 Gone: relist
                        break
                    if ev["type"] in ("ADDED", "MODIFIED"):
                        self._handle_quietly(ev["object"])
                self.ensure_node()   # heartbeat, and re-register if a test deleted the node
            except (OSError, ApiError, ValueError) as e:   # keep serving across API hiccups
                log(f"error: {e}; retrying in 1s")
                time.sleep(1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("node", help="name of the Node to register")
    p.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG"), help="default: $KUBECONFIG")
    p.add_argument("--gpus", type=int, default=8, help="nvidia.com/gpu capacity (0: none)")
    p.add_argument("--cpu", default="32")
    p.add_argument("--memory", default="256Gi")
    p.add_argument("--max-pods", type=int, default=110, help="the node's pod capacity (the kubelet's default: 110)")
    p.add_argument("--label", action="append", default=[], metavar="KEY=VALUE", help="extra node label")
    p.add_argument("--bind-unscheduled", action="store_true",
                   help="bind pods with no node to this one (only for a cluster without kube-scheduler)")
    p.add_argument("--pid-file", help="write our PID here (stop-cluster.sh stops fake-kubelet-*.pid)")
    args = p.parse_args(argv)
    if not args.kubeconfig:
        p.error("--kubeconfig or $KUBECONFIG is required")
    labels = dict(kv.split("=", 1) for kv in args.label)
    if args.pid_file:
        with open(args.pid_file, "w") as f:
            f.write(f"{os.getpid()}\n")
    # SIGTERM is how we are stopped: exit quietly instead of with a traceback.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    FakeKubelet(KubeApi(args.kubeconfig), args.node, args.gpus, args.cpu, args.memory, labels,
                args.bind_unscheduled, args.max_pods).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
