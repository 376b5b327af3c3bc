"""`pagoda serve` on a Kubernetes node writes its node's NodeTopology at start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CRD = ROOT / "crds" / "nodetopologies.pagoda.dev.yaml"


def test_serve_publishes_the_node_topology_at_start(kube_cluster, tmp_path):
    from pagoda_daemon.models.tiny import build_tiny_model

    kube_cluster.kubectl("apply", "-f", str(CRD))
    kube_cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/nodetopologies.pagoda.dev")
    node = f"e2e-serve-{uuid.uuid4().hex[:8]}"
    model = build_tiny_model("qwen3", tmp_path / "model")
    env = {**os.environ, "NODE_NAME": node, "KUBECONFIG": kube_cluster.kubeconfig}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagoda_daemon", "serve", str(model), "--host", "127.0.0.1", "--port", "0",
         "--device", "cpu", "--numa-policy", "none", "--kv-cache-memory-bytes", str(16 << 20)],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        def published():
            # the daemon creates the object, then writes its status in a second call
            obj = kube_cluster.kubectl_json("get", "nodetopology", node)
            return obj if obj.get("status", {}).get("lastHeartbeatTime") else None

        obj = kube_cluster.wait_for(published, timeout=90, what=f"NodeTopology {node} with a heartbeat")
        spec = obj["spec"]
        assert spec["numaNodes"] and spec["cpu"]["logicalCpus"] >= 1
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        log.close()
        kube_cluster.kubectl("delete", "nodetopology", node, "--ignore-not-found", check=False)
