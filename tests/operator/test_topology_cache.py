"""NodeTopologies come from the watch, not from a cluster-wide list in every pass."""

from __future__ import annotations

from pagoda_operator.reconcile import reconcile
from pagoda_operator.topology_cache import TopologyCache
from tests.operator.operator_fakes import isvc, topology
from tests.operator.test_reconcile import make


def test_one_list_then_the_watch_events():
    lists = []

    def list_all():
        lists.append(1)
        return [topology("n1", 4), topology("n2", 8)]

    cache = TopologyCache()
    assert sorted(t["metadata"]["name"] for t in cache.get(list_all)) == ["n1", "n2"]
    cache.observe("n3", topology("n3", 2))
    cache.observe("n1", None)  # deleted
    cache.observe("n2", topology("n2", 4))  # changed
    now = {t["metadata"]["name"]: len(t["spec"]["gpus"]) for t in cache.get(list_all)}
    assert now == {"n2": 4, "n3": 2} and len(lists) == 1


def test_a_deletion_the_watch_missed_ends_with_the_next_list():
    nodes = {"n1": topology("n1", 4), "n2": topology("n2", 8)}
    clock = [0.0]
    cache = TopologyCache(relist_after=300, clock=lambda: clock[0])
    assert len(cache.get(lambda: list(nodes.values()))) == 2
    del nodes["n1"]  # gone while the watch was re-listing: no DELETED event
    clock[0] = 299.0
    assert len(cache.get(lambda: list(nodes.values()))) == 2
    clock[0] = 300.0
    assert [t["metadata"]["name"] for t in cache.get(lambda: list(nodes.values()))] == ["n2"]


def test_reconcile_passes_list_topologies_once(fake_kube, monkeypatch):
    fake_kube.put(topology("n1", 8))
    fake_kube.put(isvc(resources={"gpusPerReplica": 16}, parallelism={"tensor": 16}))
    calls = []
    real = fake_kube.topologies
    monkeypatch.setattr(fake_kube, "topologies", lambda: calls.append(1) or real())
    ctx = make(fake_kube)
    for trigger in ("create", "timer", "pod", "timer"):
        reconcile(ctx, "default", "llama", trigger)
    assert len(calls) == 1
    status = fake_kube.objects[("InferenceService", "default", "llama")]["status"]
    assert any("larger than any node offers" in c.get("message", "") for c in status["conditions"])
    ctx.topologies.observe("n2", topology("n2", 16))  # a bigger node appears on the watch
    reconcile(ctx, "default", "llama", "timer")
    status = fake_kube.objects[("InferenceService", "default", "llama")]["status"]
    assert not any("larger than any node offers" in c.get("message", "") for c in status["conditions"])
    assert len(calls) == 1
