"""The passes' watch-fed cache (operator/pagoda_operator/watch_cache.py), without a cluster: what
it lists and when, how events and the operator's own writes move it, and that reads it serves
never reach the API server."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from pagoda_operator.kube import ApiError, Kube
from pagoda_operator.watch_cache import MANAGED_SELECTOR, RELIST_AFTER_S, CachedKube, WatchCache, matches

MANAGED = {"app.kubernetes.io/managed-by": "pagoda-operator", "pagoda.dev/inferenceservice": "llama"}


def obj(kind: str, name: str, rv: int, namespace: str = "ns", labels: dict | None = None, **extra: Any) -> dict:
    return {"kind": kind, "metadata": {"name": name, "namespace": namespace, "resourceVersion": str(rv),
                                       "labels": dict(MANAGED if labels is None else labels)}, **extra}


class FakeApi(Kube):
    """An API server in a dict, counting the requests that reach it."""

    def __init__(self) -> None:  # no pool: nothing goes over the network
        self.objects: dict[tuple[str, str | None, str], dict] = {}
        self.calls: list[tuple[str, str]] = []
        self.version = 100

    def _bump(self, o: dict) -> dict:
        self.version += 1
        o = copy.deepcopy(o)
        o["metadata"]["resourceVersion"] = str(self.version)
        self.objects[(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"])] = o
        return copy.deepcopy(o)

    def get(self, kind, namespace, name):
        self.calls.append(("get", kind))
        o = self.objects.get((kind, namespace, name))
        return copy.deepcopy(o) if o else None

    def list(self, kind, namespace=None, selector=None):
        self.calls.append(("list", kind))
        return [copy.deepcopy(o) for (k, ns, _), o in self.objects.items()
                if k == kind and (namespace is None or ns == namespace)
                and matches(o["metadata"].get("labels") or {}, selector)]

    def topologies(self):
        return self.list("NodeTopology")

    def create(self, o):
        self.calls.append(("create", o["kind"]))
        if (o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) in self.objects:
            raise ApiError(409, "AlreadyExists")
        return self._bump(o)

    def replace(self, o):
        self.calls.append(("replace", o["kind"]))
        return self._bump(o)

    def merge_patch(self, kind, namespace, name, patch, sub=None):
        self.calls.append(("patch", kind))
        o = self.objects[(kind, namespace, name)]
        return self._bump({**o, **patch})

    def delete(self, kind, namespace, name):
        self.calls.append(("delete", kind))
        self.objects.pop((kind, namespace, name), None)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_kind_is_listed_once_per_namespace_then_served_from_memory_until_the_relist():
    api, clock = FakeApi(), Clock()
    api._bump(obj("Deployment", "llama", 1))
    api._bump(obj("Deployment", "other", 1, namespace="ns2"))
    kube = CachedKube(api, clock=clock)
    for _ in range(5):
        assert kube.get("Deployment", "ns", "llama")["metadata"]["name"] == "llama"
        assert kube.get("Deployment", "ns", "absent") is None  # a miss is an answer too
    assert api.calls == [("list", "Deployment")]
    kube.get("Deployment", "ns2", "other")
    assert api.calls == [("list", "Deployment")] * 2  # each namespace is listed on its own
    clock.now += RELIST_AFTER_S
    kube.get("Deployment", "ns", "llama")
    assert len(api.calls) == 3  # listed again: deletions a restarted watch never reports go


def test_the_priming_list_takes_only_the_operators_children():
    api = FakeApi()
    api._bump(obj("ConfigMap", "llama-config", 1))
    api._bump(obj("ConfigMap", "someone-elses", 1, labels={"app": "x"}))
    kube = CachedKube(api)
    assert kube.get("ConfigMap", "ns", "someone-elses") is None
    assert kube.get("ConfigMap", "ns", "llama-config") is not None
    # an InferenceService carries no managed-by label: all of them are listed
    api._bump(obj("InferenceService", "llama", 1, labels={}))
    assert kube.get("InferenceService", "ns", "llama") is not None


def test_events_move_entries_and_a_late_event_never_rolls_one_back():
    api = FakeApi()
    api._bump(obj("Pod", "llama-0", 1))
    cache = CachedKube(api).cache
    assert cache.get("Pod", "ns", "llama-0")["metadata"]["resourceVersion"] == "101"
    cache.observe("Pod", obj("Pod", "llama-0", 205, status={"phase": "Running"}))
    cache.observe("Pod", obj("Pod", "llama-0", 150, status={"phase": "Pending"}))  # older: ignored
    assert cache.get("Pod", "ns", "llama-0")["status"] == {"phase": "Running"}
    cache.observe("Pod", obj("Pod", "llama-1", 206))
    assert [p["metadata"]["name"] for p in cache.list("Pod", "ns", "pagoda.dev/inferenceservice=llama")] == \
        ["llama-0", "llama-1"]
    assert cache.list("Pod", "ns", "pagoda.dev/inferenceservice=other") == []
    cache.observe("Pod", obj("Pod", "llama-0", 207), deleted=True)
    assert cache.get("Pod", "ns", "llama-0") is None
    cache.observe("Pod", obj("Pod", "stray", 208, labels={"app": "x"}))  # not the operator's
    assert cache.get("Pod", "ns", "stray") is None
    cache.observe("Pod", obj("Pod", "elsewhere", 209, namespace="never-listed"))  # its list will hold it
    assert ("Pod", "never-listed") not in cache._stores
    assert api.calls == [("list", "Pod")]


def test_the_body_a_kopf_handler_gets_is_cached_too():
    """kopf hands handlers a Body: a Mapping, not a dict (json cannot write it as it is)."""
    import kopf

    api = FakeApi()
    api._bump(obj("Pod", "llama-0", 1))
    cache = CachedKube(api).cache
    assert cache.get("Pod", "ns", "llama-0") is not None  # listed: the namespace's store exists
    cache.observe("Pod", kopf.Body(obj("Pod", "llama-0", 300, status={"phase": "Running"})))
    assert cache.get("Pod", "ns", "llama-0")["status"] == {"phase": "Running"}


def test_entries_are_kept_without_managed_fields():
    """managedFields (server-side apply's bookkeeping, much of a pod's JSON) is dropped from what
    the cache keeps, from lists and events alike; the rest of the metadata stays."""
    api = FakeApi()
    fields = [{"manager": "kube-controller-manager", "operation": "Update", "fieldsType": "FieldsV1",
               "fieldsV1": {"f:spec": {"f:containers": {"k:{\"name\":\"daemon\"}": {".": {}}}}}}]
    api._bump(obj("Pod", "llama-0", 1))
    api.objects[("Pod", "ns", "llama-0")]["metadata"]["managedFields"] = fields
    cache = CachedKube(api).cache
    listed = cache.get("Pod", "ns", "llama-0")
    assert "managedFields" not in listed["metadata"] and listed["metadata"]["labels"] == MANAGED
    event = obj("Pod", "llama-0", 300, status={"phase": "Running"})
    event["metadata"]["managedFields"] = fields
    cache.observe("Pod", event)
    seen = cache.get("Pod", "ns", "llama-0")
    assert "managedFields" not in seen["metadata"] and seen["status"] == {"phase": "Running"}
    assert event["metadata"]["managedFields"] == fields  # the caller's object is left as it was


def test_the_operators_writes_are_read_back_without_a_request():
    api = FakeApi()
    kube = CachedKube(api)
    assert kube.get("Service", "ns", "llama") is None  # primes the namespace
    created = kube.create(obj("Service", "llama", 0, spec={"port": 1}))
    replaced = kube.replace({**created, "spec": {"port": 2}})
    assert kube.get("Service", "ns", "llama") == replaced
    kube.delete("Service", "ns", "llama")
    assert kube.get("Service", "ns", "llama") is None
    assert [c for c in api.calls if c[0] in ("get", "list")] == [("list", "Service")]
    # the status patch's answer is the whole object: kept
    api._bump(obj("InferenceService", "llama", 0, labels={}))
    kube.get("InferenceService", "ns", "llama")
    kube.merge_patch("InferenceService", "ns", "llama", {"status": {"ready": 1}}, sub="status")
    assert kube.get("InferenceService", "ns", "llama")["status"] == {"ready": 1}


def test_live_reads_and_kinds_outside_the_cache_reach_the_api_server():
    api = FakeApi()
    api._bump(obj("Lease", "pagoda-operator", 1))
    api._bump(obj("Deployment", "llama", 1, labels={"app": "not-ours"}))
    kube = CachedKube(api)
    assert kube.get("Lease", "ns", "pagoda-operator") is not None
    assert kube.get("Deployment", "ns", "llama") is None  # not the operator's: not in its lists
    assert kube.get_live("Deployment", "ns", "llama") is not None  # what _apply reads after a 409
    assert ("get", "Lease") in api.calls and ("get", "Deployment") in api.calls


def test_node_topologies_are_one_cluster_wide_store():
    api = FakeApi()
    api._bump(obj("NodeTopology", "node-a", 1, namespace=None, labels={}))
    kube = CachedKube(api)
    assert [t["metadata"]["name"] for t in kube.topologies()] == ["node-a"]
    kube.cache.observe("NodeTopology", obj("NodeTopology", "node-b", 300, namespace=None, labels={}))
    assert sorted(t["metadata"]["name"] for t in kube.topologies()) == ["node-a", "node-b"]
    assert api.calls == [("list", "NodeTopology")]


@pytest.mark.parametrize(("labels", "selector", "expected"), [
    ({"a": "1", "b": "2"}, "a=1,b=2", True),
    ({"a": "1"}, "a=1,b=2", False),
    ({"a": "1"}, "a==1", True),
    ({"a": "1"}, "a", True),
    ({}, "a", False),
    ({"a": "1"}, None, True),
    ({"app.kubernetes.io/managed-by": "pagoda-operator"}, MANAGED_SELECTOR, True),
])
def test_selectors(labels, selector, expected):
    assert matches(labels, selector) is expected


def test_a_watch_cache_without_kube():
    listed = []
    cache = WatchCache(lambda kind, ns, sel: listed.append((kind, ns, sel)) or [])
    assert cache.list("StatefulSet", "ns") == []
    assert listed == [("StatefulSet", "ns", MANAGED_SELECTOR)]


# ---- reconcile passes over the cache ----------------------------------------------------------

def test_passes_read_from_the_cache_and_see_watch_events(fake_kube):
    """After the first pass has listed each kind once, passes make no reads: a pod becoming
    ready or a bigger node appearing reaches them as watch events."""
    from pagoda_operator.reconcile import reconcile
    from tests.operator.operator_fakes import isvc, topology
    from tests.operator.test_reconcile import make

    fake_kube.put(topology("n1", 8))
    fake_kube.put(isvc(resources={"gpusPerReplica": 16}, parallelism={"tensor": 16}))
    reads: list[tuple[str, str]] = []

    class Recording:  # what reaches the API server from the cache's side
        def __getattr__(self, verb: str) -> Any:
            real = getattr(fake_kube, verb)
            if verb not in ("get", "get_live", "list", "topologies"):
                return real
            return lambda *a, **k: reads.append((verb, a[0] if a else "")) or real(*a, **k)

    kube = CachedKube(Recording())  # type: ignore[arg-type]
    ctx = make(kube)
    reconcile(ctx, "default", "llama", "create")
    first = len(reads)
    for trigger in ("timer", "pod", "timer"):
        reconcile(ctx, "default", "llama", trigger)
    assert len(reads) == first, (reads[:first], reads[first:])
    status = kube.get("InferenceService", "default", "llama")["status"]
    assert any("larger than any node offers" in c.get("message", "") for c in status["conditions"])
    bigger = topology("n2", 16)
    bigger["metadata"]["resourceVersion"] = "999"
    kube.cache.observe("NodeTopology", bigger)  # a bigger node appears on the watch
    reconcile(ctx, "default", "llama", "timer")
    status = kube.get("InferenceService", "default", "llama")["status"]
    assert not any("larger than any node offers" in c.get("message", "") for c in status["conditions"])
    assert len(reads) == first, reads[first:]


def test_events_seen_while_a_list_is_in_flight_land_in_its_result_and_never_wait_for_it():
    """The list runs without the cache's lock: an event on kopf's event loop does not wait for
    it, and what the events say is applied to the list's result by resourceVersion (a newer
    object added, a listed one deleted, an update older than the list ignored)."""
    import threading

    listing, release = threading.Event(), threading.Event()
    listed = [obj("Pod", "kept", 10), obj("Pod", "gone", 11)]

    def lister(kind: str, namespace: str | None, selector: str | None) -> list[dict]:
        listing.set()
        assert release.wait(10)
        return copy.deepcopy(listed)

    cache = WatchCache(lister)
    got: list = []
    reader = threading.Thread(target=lambda: got.append(cache.list("Pod", "ns")))
    reader.start()
    assert listing.wait(10)
    observer = threading.Thread(target=lambda: (
        cache.observe("Pod", obj("Pod", "new", 12)),
        cache.observe("Pod", obj("Pod", "gone", 13), deleted=True),
        cache.observe("Pod", obj("Pod", "kept", 9, extra="old")),
    ))
    observer.start()
    observer.join(5)
    assert not observer.is_alive(), "an event waited for the list"
    release.set()
    reader.join(10)
    names = {o["metadata"]["name"]: o for o in got[0]}
    assert set(names) == {"kept", "new"} and "extra" not in names["kept"]
    assert {o["metadata"]["name"] for o in cache.list("Pod", "ns")} == {"kept", "new"}


def test_a_failed_list_leaves_nothing_behind_and_the_next_read_lists_again():
    calls = []

    def lister(kind: str, namespace: str | None, selector: str | None) -> list[dict]:
        calls.append(kind)
        if len(calls) == 1:
            raise ApiError(500, "etcd leader changed")
        return [obj("Pod", "a", 5)]

    cache = WatchCache(lister)
    with pytest.raises(ApiError):
        cache.get("Pod", "ns", "a")
    cache.observe("Pod", obj("Pod", "b", 6))  # no store, no list in flight: left to the list
    assert [o["metadata"]["name"] for o in cache.list("Pod", "ns")] == ["a"]
    assert len(calls) == 2
