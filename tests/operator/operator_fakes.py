"""Fakes and object factories for the operator unit tests."""

from __future__ import annotations

import copy
import socketserver
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from pagoda_operator.kube import ApiError, Kube
from pagoda_operator.watch_cache import matches

Server = TypeVar("Server", bound=socketserver.TCPServer)


@contextmanager
def serving(server: Server) -> Iterator[Server]:
    """``server`` (an HTTP server on loopback) answering on a thread of its own until the block ends."""
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def kube_for(server: socketserver.TCPServer) -> Kube:
    """The operator's API client, pointed at ``server`` over plain HTTP."""
    from kubernetes import client as k8s_client

    cfg = k8s_client.Configuration()
    cfg.host = f"http://127.0.0.1:{server.server_address[1]}"
    return Kube(cfg)


def isvc(name: str = "llama", namespace: str = "default", generation: int = 1, **spec: Any) -> dict[str, Any]:
    """An InferenceService object as the API server would return it."""
    body = {"model": {"name": "llama-3-8b", "pvc": {"claimName": "weights", "path": "llama"}}, **spec}
    return {
        "apiVersion": "pagoda.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}", "generation": generation},
        "spec": body,
    }


def topology(
    node: str, gpus: int, nvlink_groups: list[list[int]] | None = None, numa: int = 2
) -> dict[str, Any]:
    """A NodeTopology: `gpus` GPUs, NVLink all-to-all inside each group, PCIe (SYS) between groups."""
    links = []
    groups = nvlink_groups or []
    for a in range(gpus):
        for b in range(a + 1, gpus):
            same = any(a in g and b in g for g in groups)
            links.append({"a": a, "b": b, "type": "NVLINK" if same else "SYS", "count": 18 if same else 0})
    return {
        "apiVersion": "pagoda.dev/v1alpha1",
        "kind": "NodeTopology",
        "metadata": {"name": node},
        "spec": {
            "gpus": [
                {
                    "index": i,
                    "vendor": "nvidia",
                    "model": "H100",
                    "pciBusId": f"0000:{i:02x}:00.0",
                    "numaNode": i * numa // max(gpus, 1),
                    "uuid": f"GPU-{node}-{i}",
                }
                for i in range(gpus)
            ],
            "links": links,
            "numaNodes": [{"id": n, "cpus": "0-15"} for n in range(numa)],
            "cpu": {"sockets": numa, "logicalCpus": 32, "physicalCores": 16},
            "nics": [],
            "software": {"gpuBackend": "nvml"},
            "summary": {"gpuCount": gpus, "numaNodeCount": numa, "fabricAllToAll": False},
        },
    }


KEY_KINDS = {"NodeTopology", "Node"}


class FakeKube:
    """In-memory stand-in for pagoda_operator.kube.Kube with resourceVersion and generation semantics."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str | None, str], dict[str, Any]] = {}
        self.rv = 0
        self.writes: list[tuple[str, str, str]] = []

    def _key(self, kind: str, namespace: str | None, name: str) -> tuple[str, str | None, str]:
        return (kind, None if kind in KEY_KINDS else namespace, name)

    def put(self, obj: dict[str, Any]) -> dict[str, Any]:
        obj = copy.deepcopy(obj)
        self.rv += 1
        meta = obj.setdefault("metadata", {})
        meta["resourceVersion"] = str(self.rv)
        meta.setdefault("generation", 1)
        self.objects[self._key(obj["kind"], meta.get("namespace"), meta["name"])] = obj
        return copy.deepcopy(obj)

    def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        obj = self.objects.get(self._key(kind, namespace, name))
        return copy.deepcopy(obj) if obj else None

    def get_live(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        return self.get(kind, namespace, name)

    def list(
        self, kind: str, namespace: str | None = None, selector: str | None = None
    ) -> list[dict[str, Any]]:
        return [
            copy.deepcopy(o)
            for (k, ns, _), o in sorted(self.objects.items(), key=lambda kv: str(kv[0]))
            if k == kind
            and (namespace is None or ns == namespace)
            and matches(o["metadata"].get("labels") or {}, selector)
        ]

    def topologies(self) -> list[dict[str, Any]]:
        return self.list("NodeTopology")

    def pod_warnings(self, namespace: str) -> list[dict[str, Any]]:
        return [
            e
            for e in self.list("Event", namespace)
            if (e.get("involvedObject") or {}).get("kind") == "Pod" and e.get("type") == "Warning"
        ]

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        if "name" not in meta and "generateName" in meta:
            obj = copy.deepcopy(obj)
            meta = obj["metadata"]
            meta["name"] = f"{meta['generateName']}{self.rv + 1:05d}"
        if self.get(obj["kind"], meta.get("namespace"), meta["name"]):
            raise ApiError(409, "AlreadyExists")
        self.writes.append(("create", obj["kind"], meta["name"]))
        return self.put(obj)

    def replace(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        live = self.get(obj["kind"], meta.get("namespace"), meta["name"])
        if live is None:
            raise ApiError(404, "NotFound")
        if meta.get("resourceVersion") != live["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict")
        self.writes.append(("replace", obj["kind"], meta["name"]))
        obj = copy.deepcopy(obj)
        obj["metadata"]["generation"] = live["metadata"].get("generation", 1) + (
            obj.get("spec") != live.get("spec")
        )
        if "status" in live:
            obj["status"] = live["status"]
        return self.put(obj)

    def merge_patch(
        self, kind: str, namespace: str | None, name: str, patch: Any, sub: str | None = None
    ) -> Any:
        live = self.objects.get(self._key(kind, namespace, name))
        if live is None:
            raise ApiError(404, "NotFound")
        self.writes.append(("patch" + (f"/{sub}" if sub else ""), kind, name))
        _merge(live, copy.deepcopy(patch))
        self.rv += 1
        live["metadata"]["resourceVersion"] = str(self.rv)
        return copy.deepcopy(live)


    def delete(self, kind: str, namespace: str | None, name: str) -> None:
        if self.objects.pop(self._key(kind, namespace, name), None) is not None:
            self.writes.append(("delete", kind, name))


def _merge(target: dict[str, Any], patch: dict[str, Any]) -> None:
    for k, v in patch.items():
        if v is None:
            target.pop(k, None)
        elif isinstance(v, dict) and isinstance(target.get(k), dict):
            _merge(target[k], v)
        else:
            target[k] = v


def every_capability(_name: str) -> bool:
    """Accept every daemon capability: for tests of what the operator renders and validates for
    features the daemon of this build does not have yet (tensor/expert parallel, KV offload)."""
    return True
