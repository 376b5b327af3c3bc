"""The topology agent against a real kube-apiserver: CRD, create, heartbeat, update, SIGTERM.

Heartbeat semantics under test (docs/topology.md): every run refreshes
status.lastHeartbeatTime through the status subresource; spec is replaced only
when the topology changed, so metadata.generation and status.lastUpdateTime
move exactly then.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CRD = REPO / "crds" / "nodetopologies.pagoda.dev.yaml"
DAEMON = REPO / "daemon"
if str(DAEMON) not in sys.path:
    sys.path.insert(0, str(DAEMON))


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def _fake_node(root: Path) -> list[str]:
    """Two sockets of 4 cores x 2 threads; one NVIDIA GPU behind each socket's root port."""
    _write(root, "sys/devices/system/cpu/online", "0-15")
    for core in range(8):
        for cpu in (core, core + 8):
            _write(
                root, f"sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list", f"{core},{core + 8}"
            )
            _write(root, f"sys/devices/system/cpu/cpu{cpu}/topology/physical_package_id", str(core // 4))
    for node in range(2):
        base = f"sys/devices/system/node/node{node}"
        _write(root, f"{base}/cpulist", f"{4 * node}-{4 * node + 3},{4 * node + 8}-{4 * node + 11}")
        _write(root, f"{base}/meminfo", f"Node {node} MemTotal:       {64 * 2**20} kB")
        _write(root, f"{base}/distance", "10 21" if node == 0 else "21 10")
    gpus = []
    for node, bus in ((0, 0x18), (1, 0x98)):
        bdf = f"0000:{bus:02x}:00.0"
        rel = f"sys/devices/pci0000:{bus - 1:02x}/0000:{bus - 1:02x}:01.0/{bdf}"
        for name, value in (("vendor", "0x10de"), ("device", "0x2330"), ("class", "0x030200")):
            _write(root, f"{rel}/{name}", value)
        _write(root, f"{rel}/numa_node", str(node))
        link = root / "sys/bus/pci/devices" / bdf
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(root / rel, link.parent), link)
        gpus.append(bdf)
    return gpus


def _agent(kube_cluster, root: Path, *extra: str) -> list[str]:
    """The agent command line; the node name comes from NODE_NAME, as the DaemonSet passes it."""
    return [
        sys.executable,
        "-m",
        "pagoda_daemon.topology",
        "--publish",
        "--sysfs-root",
        str(root),
        "--kubeconfig",
        kube_cluster.kubeconfig,
        *extra,
    ]


def _env(node: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(DAEMON), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "NODE_NAME": node}


def _publish_once(kube_cluster, root: Path, node: str) -> None:
    argv = _agent(kube_cluster, root, "--once")
    done = subprocess.run(argv, capture_output=True, text=True, env=_env(node), timeout=120)
    assert done.returncode == 0, done.stderr


def _get(kube_cluster, node: str) -> dict:
    return json.loads(kube_cluster.kubectl("get", "nodetopology", node, "-o", "json").stdout)


@pytest.fixture
def topology_crd(kube_cluster):
    kube_cluster.kubectl("apply", "-f", str(CRD))
    kube_cluster.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s", "crd/nodetopologies.pagoda.dev"
    )
    return kube_cluster


@pytest.fixture
def node_name(topology_crd):
    name = f"e2e-topo-{uuid.uuid4().hex[:8]}"
    yield name
    topology_crd.kubectl("delete", "nodetopology", name, "--ignore-not-found", check=False)


def test_agent_creates_heartbeats_and_updates_on_change(topology_crd, node_name, tmp_path):
    from pagoda_daemon.topology import discover
    from pagoda_daemon.topology.publish import topology_spec

    kube = topology_crd
    root = tmp_path / "root"
    gpus = _fake_node(root)

    _publish_once(kube, root, node_name)
    first = _get(kube, node_name)
    # The apiserver kept every field: nothing was pruned by the structural schema.
    assert first["spec"] == json.loads(json.dumps(topology_spec(discover(root))))
    assert first["spec"]["summary"]["gpuCount"] == 2
    assert [g["numaNode"] for g in first["spec"]["gpus"]] == [0, 1]
    assert first["spec"]["links"] == [{"a": 0, "b": 1, "type": "SYS", "count": 0}]
    assert first["metadata"]["generation"] == 1
    assert first["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "pagoda-topology-agent"
    assert first["status"]["observedGeneration"] == 1
    assert first["status"]["lastUpdateTime"] == first["status"]["lastHeartbeatTime"]

    # Short name, category and printer columns work.
    table = kube.kubectl("get", "ntopo", node_name).stdout
    assert "GPUS" in table.splitlines()[0] and node_name in table
    assert node_name in kube.kubectl("get", "pagoda").stdout

    time.sleep(1.1)  # timestamps have one-second resolution
    _publish_once(kube, root, node_name)
    second = _get(kube, node_name)
    assert second["metadata"]["generation"] == 1  # spec untouched
    assert second["spec"] == first["spec"]
    assert second["status"]["lastHeartbeatTime"] > first["status"]["lastHeartbeatTime"]
    assert second["status"]["lastUpdateTime"] == first["status"]["lastUpdateTime"]

    time.sleep(1.1)
    (root / "sys/bus/pci/devices" / gpus[1] / "numa_node").write_text("0\n")  # firmware now says node 0
    _publish_once(kube, root, node_name)
    third = _get(kube, node_name)
    assert third["metadata"]["generation"] == 2
    assert [g["numaNode"] for g in third["spec"]["gpus"]] == [0, 0]
    assert third["status"]["observedGeneration"] == 2
    assert third["status"]["lastUpdateTime"] == third["status"]["lastHeartbeatTime"]
    assert third["status"]["lastUpdateTime"] > second["status"]["lastUpdateTime"]


def test_agent_loop_heartbeats_and_stops_on_sigterm(topology_crd, node_name, tmp_path):
    root = tmp_path / "root"
    _fake_node(root)
    agent = subprocess.Popen(
        _agent(topology_crd, root, "--interval", "1"),
        env=_env(node_name),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        beats: set[str] = set()
        while len(beats) < 3 and time.monotonic() < deadline:
            found = topology_crd.kubectl("get", "nodetopology", node_name, "-o", "json", check=False)
            if found.returncode == 0:
                obj = json.loads(found.stdout)
                beats.add(obj.get("status", {}).get("lastHeartbeatTime", ""))
                assert obj["metadata"]["generation"] == 1
            time.sleep(0.3)
        beats.discard("")
        assert len(beats) >= 2, "the agent did not heartbeat"
    finally:
        agent.send_signal(signal.SIGTERM)
        _, err = agent.communicate(timeout=30)
    assert agent.returncode == 0, err
    assert "unchanged" in err  # later runs saw no change
