"""Placement: NVLink cliques from NodeTopology, capacity checks, eligibility, affinity, per-replica status."""

from __future__ import annotations

import pytest

from pagoda_operator import placement
from pagoda_operator.spec import parse
from tests.operator.operator_fakes import every_capability, topology

MODEL = {"name": "m", "pvc": {"claimName": "w"}}


def spec(gpus: int, nvlink: bool = False, tensor: int | None = None):
    return parse(
        "svc",
        "ns",
        {
            "model": MODEL,
            "resources": {"gpusPerReplica": gpus},
            "parallelism": {"tensor": tensor or max(gpus, 1)} if gpus else {},
            "placement": {"requireNVLink": nvlink},
        },
        supports=every_capability,
    )


@pytest.mark.parametrize(
    "gpus, groups, clique",
    [
        (8, [list(range(8))], 8),  # DGX: NVSwitch, all-to-all
        (8, [[0, 1, 2, 3], [4, 5, 6, 7]], 4),  # two NVLink islands
        (8, [[0, 1], [2, 3], [4, 5], [6, 7]], 2),  # NVLink pairs (PCIe between pairs)
        (4, [], 1),  # PCIe only
        (0, [], 0),  # no GPU
        (6, [[0, 1, 2], [2, 3, 4, 5]], 4),  # overlapping groups: the larger clique wins
    ],
)
def test_nvlink_clique(gpus, groups, clique):
    t = topology("n", gpus, groups)
    assert placement.nvlink_clique(t) == clique
    assert placement.node_labels(t) == {"pagoda.dev/nvlink-gpus": str(clique)}


def test_ring_is_not_all_to_all():
    t = topology("n", 4, [])
    t["spec"]["links"] = [
        {"a": a, "b": b, "type": "NVLINK" if (a, b) in {(0, 1), (1, 2), (2, 3), (0, 3)} else "SYS"}
        for a in range(4)
        for b in range(a + 1, 4)
    ]
    assert placement.nvlink_clique(t) == 2
    assert not placement.pairs_all_to_all(t, [0, 1, 2, 3]) and placement.pairs_all_to_all(t, [0, 1])


def test_xgmi_counts_like_nvlink():
    t = topology("n", 2, [])
    t["spec"]["links"] = [{"a": 0, "b": 1, "type": "XGMI", "count": 7}]
    assert placement.nvlink_clique(t) == 2


@pytest.mark.parametrize(
    "gpus, nodes, error",
    [
        (8, [4, 8], None),
        (
            8,
            [4, 4],
            "resources.gpusPerReplica (8) is larger than any node offers: the largest NodeTopology shows 4 GPUs",
        ),
        (16, [], None),  # no NodeTopology at all: unknown, not an error
        (0, [0], None),  # CPU serving needs no GPU
    ],
)
def test_capacity_error(gpus, nodes, error):
    tops = [topology(f"n{i}", g, [list(range(g))]) for i, g in enumerate(nodes)]
    assert placement.capacity_error(spec(gpus), tops) == error


@pytest.mark.parametrize(
    "gpus, nvlink, expected",
    [
        (4, True, ["dgx", "island"]),
        (8, True, ["dgx"]),
        (2, True, ["dgx", "island", "pairs"]),
        (8, False, ["dgx", "island", "pairs", "pcie"]),
        (4, False, ["dgx", "island", "pairs", "pcie"]),
    ],
)
def test_eligible_nodes(gpus, nvlink, expected):
    tops = [
        topology("pcie", 8, []),
        topology("dgx", 8, [list(range(8))]),
        topology("island", 8, [[0, 1, 2, 3], [4, 5, 6, 7]]),
        topology("pairs", 8, [[0, 1], [2, 3], [4, 5], [6, 7]]),
    ]
    assert placement.eligible_nodes(spec(gpus, nvlink), tops) == expected


@pytest.mark.parametrize(
    "gpus, nvlink, value", [(4, True, "3"), (8, True, "7"), (4, False, None), (0, True, None)]
)
def test_affinity(gpus, nvlink, value):
    aff = placement.affinity(spec(gpus, nvlink))
    if value is None:
        assert aff is None
        return
    (term,) = aff["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term == {
        "matchExpressions": [{"key": "pagoda.dev/nvlink-gpus", "operator": "Gt", "values": [value]}]
    }


def pod(name, node=None, ready=True, deleting=False):
    p = {
        "metadata": {"name": name},
        "spec": {"nodeName": node} if node else {},
        "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }
    if deleting:
        p["metadata"]["deletionTimestamp"] = "2024-01-01T00:00:00Z"
    return p


def test_replica_placement():
    tops = {"n1": topology("n1", 8, [list(range(8))], numa=2)}
    pods = [pod("b", "n1"), pod("a", "n1", ready=False), pod("pending"), pod("old", "n1", deleting=True)]
    reported = {"b": {"gpus": ["4", "5"]}, "a": {"gpus": ["0"], "numaNodes": [0]}}
    assert placement.replica_placement(pods, tops, reported) == [
        {"pod": "a", "node": "n1", "ready": False, "gpus": ["0"], "numaNodes": [0]},
        {
            "pod": "b",
            "node": "n1",
            "ready": True,
            "gpus": ["4", "5"],
            "numaNodes": [1],
        },  # NUMA from the topology
    ]
    # GPUs named by UUID work too
    assert placement.numa_of(tops["n1"], ["GPU-n1-7"]) == [1]


def test_with_a_node_model_cache_pods_prefer_nodes_that_hold_their_model():
    body = {"model": {"name": "m", "uri": "hf://org/llm@main"}, "resources": {"gpusPerReplica": 4}, "parallelism": {"tensor": 4},
            "placement": {"requireNVLink": True}}
    s = parse("llm", "team-a", body, supports=every_capability)
    aff = placement.affinity(s, node_model_cache=True)["nodeAffinity"]
    assert aff["requiredDuringSchedulingIgnoredDuringExecution"]  # NVLink stays required
    (pref,) = aff["preferredDuringSchedulingIgnoredDuringExecution"]
    assert pref == {"weight": placement.MODEL_CACHE_WEIGHT, "preference": {"matchExpressions": [
        {"key": placement.model_label("team-a", "hf://org/llm@main"), "operator": "Exists"}]}}
    assert "preferredDuringSchedulingIgnoredDuringExecution" not in placement.affinity(s)["nodeAffinity"]
    local = parse("llm", "team-a", {"model": {"name": "m", "pvc": {"claimName": "w"}}}, supports=every_capability)
    assert placement.affinity(local, node_model_cache=True) is None
