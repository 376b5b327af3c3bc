"""The NodeTopology CRD, the spec built from a report, and the publisher against a fake API."""

from __future__ import annotations

import copy
import json
import threading
from pathlib import Path

import pytest
import yaml

from pagoda_daemon.topology import NodeTopology, discover, plan_pinning
from pagoda_daemon.topology.publish import Publisher, node_name_from_env, run_agent, topology_spec

CRD = Path(__file__).resolve().parents[2] / "crds" / "nodetopologies.pagoda.dev.yaml"


@pytest.fixture(scope="module")
def crd():
    return yaml.safe_load(CRD.read_text())


@pytest.fixture(scope="module")
def schema(crd):
    (version,) = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def validate(value, schema, path="$"):
    """What the apiserver would prune or reject: undeclared keys, wrong types, bad enums, missing required."""
    kind = schema["type"]
    if kind == "object":
        assert isinstance(value, dict), f"{path}: not an object"
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            assert key in value, f"{path}: required {key} missing"
        for key, item in value.items():
            assert key in props, f"{path}.{key}: not in the CRD schema (the apiserver would prune it)"
            validate(item, props[key], f"{path}.{key}")
    elif kind == "array":
        assert isinstance(value, list), f"{path}: not an array"
        for i, item in enumerate(value):
            validate(item, schema["items"], f"{path}[{i}]")
    else:
        # An empty string reached the v1.20 apiserver as null and was rejected: never send one.
        assert value != "", f"{path}: empty string"
        python = {"string": str, "integer": int, "boolean": bool, "number": (int, float)}[kind]
        assert isinstance(value, python) and (kind != "integer" or not isinstance(value, bool)), (
            f"{path}: {value!r} is not {kind}"
        )
        if "enum" in schema:
            assert value in schema["enum"], f"{path}: {value!r} not in {schema['enum']}"


def _structural(schema, path="$"):
    """Every node typed (structural schema), and no CEL rules (Kubernetes 1.20 has none)."""
    assert "x-kubernetes-validations" not in schema, path
    assert "x-kubernetes-preserve-unknown-fields" not in schema, path
    assert "type" in schema, f"{path}: no type"
    for key, sub in schema.get("properties", {}).items():
        _structural(sub, f"{path}.{key}")
    if "items" in schema:
        _structural(schema["items"], f"{path}[]")


def test_crd_identity(crd):
    assert crd["apiVersion"] == "apiextensions.k8s.io/v1"
    spec = crd["spec"]
    assert crd["metadata"]["name"] == "nodetopologies.pagoda.dev"
    assert (spec["group"], spec["scope"]) == ("pagoda.dev", "Cluster")
    assert spec["names"]["kind"] == "NodeTopology"
    assert spec["names"]["shortNames"] == ["ntopo"] and spec["names"]["categories"] == ["pagoda"]
    (version,) = spec["versions"]
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
    assert version["subresources"] == {"status": {}}


def test_crd_schema_is_structural_without_cel(schema):
    _structural(schema)


@pytest.mark.parametrize("machine", ["laptop", "dgx", "pcie_box", "no_numa"])
def test_spec_of_every_fixture_fits_the_schema(machine, request, schema):
    report = discover(request.getfixturevalue(machine).root, env={"CUDA_VISIBLE_DEVICES": "0"})
    validate(topology_spec(report), schema["properties"]["spec"], "spec")


def test_spec_of_a_broken_tree_fits_the_schema(dgx, schema):
    for gpu in dgx.gpus[:2]:
        (dgx.root / "sys/bus/pci/devices" / gpu / "local_cpulist").write_text("\n")
    (dgx.root / "sys/devices/system/node/node1/cpulist").write_text("\n")  # a memory-only node
    (dgx.root / "proc/sys/kernel/osrelease").write_text("")
    report = discover(dgx.root)
    assert report.numa_nodes[1].cpus == frozenset() and report.gpus[0].local_cpus == frozenset()
    spec = topology_spec(report)
    validate(spec, schema["properties"]["spec"], "spec")
    assert "cpus" not in spec["numaNodes"][1] and "localCpus" not in spec["gpus"][0]


def test_nvml_spec_fits_the_schema_and_answers_placement_questions(dgx, dgx_nvml, schema):
    spec = topology_spec(discover(dgx.root, nvml=dgx_nvml))
    validate(spec, schema["properties"]["spec"], "spec")
    assert spec["summary"] == {
        "gpuCount": 8,
        "numaNodeCount": 2,
        "fabricAllToAll": True,
        "gpuModel": "NVIDIA H100 80GB HBM3",
    }
    assert spec["gpus"][5]["numaNode"] == 1
    assert spec["gpus"][5]["fabricPeers"] == [0, 1, 2, 3, 4, 6, 7]
    assert "hostname" not in spec and "allowedCpus" not in spec and "visibility" not in spec


def test_status_fits_the_schema(dgx, schema):
    api = FakeApi()
    Publisher(api, "node-a", clock=lambda: "2025-01-01T00:00:00Z").publish(discover(dgx.root))
    validate(api.objects["node-a"]["status"], schema["properties"]["status"], "status")


def test_printer_columns_point_at_real_fields(crd, dgx):
    spec = topology_spec(discover(dgx.root))
    for column in crd["spec"]["versions"][0]["additionalPrinterColumns"]:
        top, *rest = column["jsonPath"].lstrip(".").split(".")
        if top == "spec":
            value = spec
            for key in rest:
                value = value[key]


class ApiError(Exception):
    def __init__(self, status):
        super().__init__(f"HTTP {status}")
        self.status = status


class FakeApi:
    """CustomObjectsApi semantics that matter here: generation moves on spec changes only,
    resourceVersion on every write, stale writes conflict, status only through /status."""

    def __init__(self):
        self.objects = {}
        self.writes = []
        self.conflicts = 0

    def get_cluster_custom_object(self, group, version, plural, name):
        assert (group, version, plural) == ("pagoda.dev", "v1alpha1", "nodetopologies")
        if name not in self.objects:
            raise ApiError(404)
        return copy.deepcopy(self.objects[name])

    def create_cluster_custom_object(self, group, version, plural, body):
        body = copy.deepcopy(body)
        body.pop("status", None)
        body["metadata"].update(generation=1, resourceVersion="1")
        self.objects[body["metadata"]["name"]] = body
        self.writes.append("create")
        return copy.deepcopy(body)

    def _check(self, name, body):
        if self.conflicts:
            self.conflicts -= 1
            self.objects[name]["metadata"]["resourceVersion"] += "x"
        if body["metadata"]["resourceVersion"] != self.objects[name]["metadata"]["resourceVersion"]:
            raise ApiError(409)

    def replace_cluster_custom_object(self, group, version, plural, name, body):
        self._check(name, body)
        stored = self.objects[name]
        if body["spec"] != stored["spec"]:
            stored["metadata"]["generation"] += 1
        stored["spec"] = copy.deepcopy(body["spec"])
        stored["metadata"]["resourceVersion"] = str(
            int(stored["metadata"]["resourceVersion"].rstrip("x")) + 1
        )
        self.writes.append("replace")
        return copy.deepcopy(stored)

    def replace_cluster_custom_object_status(self, group, version, plural, name, body):
        self._check(name, body)
        stored = self.objects[name]
        stored["status"] = copy.deepcopy(body["status"])
        stored["metadata"]["resourceVersion"] = str(
            int(stored["metadata"]["resourceVersion"].rstrip("x")) + 1
        )
        self.writes.append("status")
        return copy.deepcopy(stored)


class Clock:
    def __init__(self):
        self.second = 0

    def __call__(self):
        self.second += 1
        return f"2025-01-01T00:00:{self.second:02d}Z"


def test_publish_creates_then_heartbeats_then_updates_on_change(dgx, dgx_nvml):
    api, clock = FakeApi(), Clock()
    publisher = Publisher(api, "gpu-node-1", clock=clock)

    assert publisher.publish(discover(dgx.root, nvml=dgx_nvml)) == "created"
    obj = api.objects["gpu-node-1"]
    assert obj["metadata"]["labels"] == {"app.kubernetes.io/managed-by": "pagoda-topology-agent"}
    assert obj["spec"]["summary"]["gpuCount"] == 8
    assert obj["status"]["lastHeartbeatTime"] == obj["status"]["lastUpdateTime"] == "2025-01-01T00:00:01Z"

    assert publisher.publish(discover(dgx.root, nvml=dgx_nvml)) == "unchanged"
    obj = api.objects["gpu-node-1"]
    assert obj["metadata"]["generation"] == 1
    assert obj["status"]["lastHeartbeatTime"] == "2025-01-01T00:00:02Z"
    assert obj["status"]["lastUpdateTime"] == "2025-01-01T00:00:01Z"
    assert api.writes == ["create", "status", "status"]

    dgx_nvml.p2p_blocked = {frozenset((0, 7))}  # the fabric changed
    assert publisher.publish(discover(dgx.root, nvml=dgx_nvml)) == "updated"
    obj = api.objects["gpu-node-1"]
    assert obj["metadata"]["generation"] == 2 and obj["status"]["observedGeneration"] == 2
    assert obj["status"]["lastUpdateTime"] == "2025-01-01T00:00:03Z"
    assert obj["spec"]["summary"]["fabricAllToAll"] is False


def test_publish_retries_on_conflict(dgx):
    api = FakeApi()
    publisher = Publisher(api, "n1")
    publisher.publish(discover(dgx.root))
    api.conflicts = 2
    assert publisher.publish(discover(dgx.root)) == "unchanged"
    api.conflicts = 3
    with pytest.raises(ApiError):
        publisher.publish(discover(dgx.root))


def test_publish_reports_warnings_in_status(dgx):
    (dgx.root / "sys/devices/system/node/node0/meminfo").unlink()
    api = FakeApi()
    Publisher(api, "n1").publish(discover(dgx.root))
    assert any("meminfo is missing" in w for w in api.objects["n1"]["status"]["warnings"])


def test_api_errors_other_than_not_found_propagate(dgx):
    class Forbidden(FakeApi):
        def get_cluster_custom_object(self, *args):
            raise ApiError(403)

    with pytest.raises(ApiError):
        Publisher(Forbidden(), "n1").publish(discover(dgx.root))


def test_agent_once_returns_failure_and_loop_survives_errors(dgx):
    report = discover(dgx.root)

    class Flaky:
        node_name = "n1"

        def __init__(self):
            self.calls = 0

        def publish(self, _report):
            self.calls += 1
            if self.calls == 1:
                raise ApiError(503)
            if self.calls == 3:
                stop.set()
            return "unchanged"

    stop = threading.Event()
    assert run_agent(Flaky(), lambda: report, 0.01, once=True) == 1
    flaky = Flaky()
    assert run_agent(flaky, lambda: report, 0.001, stop=stop) == 0
    assert flaky.calls == 3


@pytest.mark.parametrize("bad", ["", "Node_1", "-a", "a" * 254])
def test_node_name_must_be_a_valid_object_name(bad, monkeypatch):
    monkeypatch.delenv("NODE_NAME", raising=False)
    with pytest.raises(ValueError):
        node_name_from_env(bad)


def test_node_name_comes_from_the_downward_api(monkeypatch):
    monkeypatch.setenv("NODE_NAME", "ip-10-0-0-1.ec2.internal")
    assert node_name_from_env() == "ip-10-0-0-1.ec2.internal"
    assert node_name_from_env("other") == "other"


REPORTS = sorted((Path(__file__).parent / "fixtures" / "reports").glob("*.json"))


@pytest.mark.parametrize("path", REPORTS or [None], ids=[p.stem for p in REPORTS] or ["none-captured"])
def test_captured_reports_replay(path, schema):
    if path is None:
        pytest.skip("no captured reports in tests/topology/fixtures/reports yet")
    data = json.loads(path.read_text())
    report = NodeTopology.from_dict(data)
    assert report.to_dict() == data
    validate(topology_spec(report), schema["properties"]["spec"], "spec")
    plan = plan_pinning(report, None, None, "auto")
    assert len(plan.workers) == max(1, len(report.gpus))
    for pin in plan.workers:
        assert pin.cpus is None or pin.cpus <= report.allowed_cpus


def test_publish_at_start_says_forbidden_in_one_line(monkeypatch, caplog):
    """A daemon whose ServiceAccount may not write NodeTopology logs one short line, not the
    API server's whole response (the chart's topology agent publishes the object)."""
    import logging

    from pagoda_daemon.topology import publish

    class Forbidden(Exception):
        status, reason = 403, "Forbidden"

    def connect():
        raise Forbidden("(403)\nReason: Forbidden\nHTTP response headers: ...\nHTTP response body: {...}")

    monkeypatch.setenv("NODE_NAME", "node-1")
    monkeypatch.setattr(publish, "connect", connect)
    with caplog.at_level(logging.WARNING, logger=publish.log.name):
        assert publish.publish_at_start() is None
    (record,) = caplog.records
    assert record.getMessage() == "not publishing NodeTopology for node-1: 403 Forbidden (the topology agent publishes it)"


def cached(root: Path, namespace: str, source: str, revision: str, used: float, size: int = 1000) -> Path:
    """An entry as fetch.py leaves it: the files, then the complete marker (its mtime: last use)."""
    import os

    from pagoda_daemon.models.fetch import COMPLETE_MARKER

    scheme, location = source.split("://", 1)
    entry = root / namespace / scheme / location.replace("/", "%2F") / revision
    entry.mkdir(parents=True)
    (entry / "model.safetensors").write_bytes(os.urandom(size))
    (entry / COMPLETE_MARKER).write_text(json.dumps({"source": source, "revision": revision}))
    os.utime(entry / COMPLETE_MARKER, (used, used))
    return entry


class ListingApi(FakeApi):
    def __init__(self, services):
        super().__init__()
        self.services = services

    def list_cluster_custom_object(self, group, version, plural):
        assert (group, version, plural) == ("pagoda.dev", "v1alpha1", "inferenceservices")
        if self.services is None:
            raise ApiError(403)
        return {"items": [{"metadata": {"namespace": ns}, "spec": {"model": {"uri": uri}}}
                          for ns, uri in self.services]}


def test_the_model_cache_is_tended_and_reported_in_status(dgx, dgx_nvml, tmp_path, schema):
    from pagoda_daemon.models.model_cache import hold
    from pagoda_daemon.topology.publish import ModelCacheKeeper

    root = tmp_path / "model-cache"

    old = cached(root, "team-a", "hf://org/llm", "1" * 40, used=100)
    named = cached(root, "team-a", "hf://org/llm", "2" * 40, used=200)
    unnamed = cached(root, "team-b", "s3://bucket/m", "3" * 16, used=300)
    held = cached(root, "team-b", "s3://bucket/gone", "4" * 16, used=50)
    lease = hold(held)
    assert lease is not None
    # hf://org/llm is named (in its canonical spelling); nothing names the others
    api = ListingApi([("team-a", "hf://org/llm"), ("team-c", "s3://bucket/m"), ("team-a", "not a uri")])
    keeper = ModelCacheKeeper(api, str(root), max_bytes=0)
    Publisher(api, "node-a", status_extra=keeper).publish(discover(dgx.root, nvml=dgx_nvml))
    status = api.objects["node-a"]["status"]
    validate(status, schema["properties"]["status"], "status")
    cache = status["modelCache"]
    assert {(e["namespace"], e["revision"]) for e in cache["evicted"]} == {("team-a", old.name), ("team-b", unnamed.name)}
    assert [(m["namespace"], m["source"], m["inUse"], m["complete"]) for m in cache["models"]] == [
        ("team-a", "hf://org/llm", False, True), ("team-b", "s3://bucket/gone", True, True)]
    assert cache["usedBytes"] == sum(m["bytes"] for m in cache["models"]) > 2000 and cache["maxBytes"] == 0
    assert named.exists() and held.exists() and not old.exists() and not unnamed.exists()
    lease.close()

    # InferenceServices that cannot be listed: nothing is evicted, the cache is still reported
    api.services = None
    Publisher(api, "node-a", status_extra=keeper).publish(discover(dgx.root, nvml=dgx_nvml))
    assert api.objects["node-a"]["status"]["modelCache"]["evicted"] == [] and held.exists()


def test_a_failing_cache_pass_does_not_stop_the_heartbeat(dgx, dgx_nvml):
    def broken():
        raise OSError("disk gone")

    api = FakeApi()
    Publisher(api, "node-a", status_extra=broken).publish(discover(dgx.root, nvml=dgx_nvml))
    assert "lastHeartbeatTime" in api.objects["node-a"]["status"]
    assert "modelCache" not in api.objects["node-a"]["status"]


def test_a_conflict_retries_the_write_not_the_status_extras(dgx, dgx_nvml):
    calls = []

    def extra():
        calls.append(1)
        return {"modelCache": {"usedBytes": 1}}

    api = FakeApi()
    publisher = Publisher(api, "node-a", status_extra=extra)
    publisher.publish(discover(dgx.root, nvml=dgx_nvml))
    api.conflicts = 1  # the next write meets a newer resourceVersion once
    publisher.publish(discover(dgx.root, nvml=dgx_nvml))
    assert len(calls) == 2 and api.objects["node-a"]["status"]["modelCache"] == {"usedBytes": 1}
