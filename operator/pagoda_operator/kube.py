"""A small JSON client for the Kubernetes API: plain dicts in and out.

Credentials come from the ``kubernetes`` package's config loaders (in-cluster service account,
else ``$KUBECONFIG`` / ``~/.kube/config``); requests go through one urllib3 pool. Plain dicts
keep the builders, the status code and the tests free of generated model classes.
"""

from __future__ import annotations

import json
import ssl
import threading
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode

import urllib3

from pagoda_operator import GROUP, PLURAL, TOPOLOGY_PLURAL, VERSION
from pagoda_operator.telemetry import API_REQUESTS, WRITES

# kind -> (API prefix, plural, namespaced)
RESOURCES = {
    "ConfigMap": ("/api/v1", "configmaps", True),
    "Secret": ("/api/v1", "secrets", True),  # created only (elastic EP's admin key), never read
    "Service": ("/api/v1", "services", True),
    "Pod": ("/api/v1", "pods", True),
    "Node": ("/api/v1", "nodes", False),
    "Event": ("/api/v1", "events", True),
    "Deployment": ("/apis/apps/v1", "deployments", True),
    "StatefulSet": ("/apis/apps/v1", "statefulsets", True),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies", True),
    # only where its CRD is installed (leader_worker_set.py)
    "LeaderWorkerSet": ("/apis/leaderworkerset.x-k8s.io/v1", "leaderworkersets", True),
    "Lease": ("/apis/coordination.k8s.io/v1", "leases", True),
    "InferenceService": (f"/apis/{GROUP}/{VERSION}", PLURAL, True),
    "NodeTopology": (f"/apis/{GROUP}/{VERSION}", TOPOLOGY_PLURAL, False),
    "SubjectAccessReview": ("/apis/authorization.k8s.io/v1", "subjectaccessreviews", False),
}

if TYPE_CHECKING:
    from kubernetes import client as k8s_client


class ApiError(Exception):
    def __init__(self, status: int, reason: str, body: Any = None):
        message = body.get("message") if isinstance(body, dict) else body
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.body = body


def path(kind: str, namespace: str | None = None, name: str | None = None, sub: str | None = None) -> str:
    prefix, plural, namespaced = RESOURCES[kind]
    p = prefix
    if namespaced and namespace:
        p += f"/namespaces/{quote(namespace)}"
    p += f"/{plural}"
    if name:
        p += f"/{quote(name)}"
    if sub:
        p += f"/{sub}"
    return p


def in_cluster_server(env: Mapping[str, str]) -> str | None:
    """The API server a pod talks to, as client-go and the ``kubernetes`` package find it: the
    ``kubernetes`` Service's address from the variables the kubelet sets. None outside a pod.

    Not the DNS name ``kubernetes.default.svc``: that needs cluster DNS, which a cluster may not run
    (the local cluster of ``make quickstart`` has none).
    """
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
    if not host or not port:
        return None
    if ":" in host and not host.startswith("["):  # IPv6
        host = f"[{host}]"
    return f"https://{host}:{port}"


def load_configuration(kubeconfig: str | None = None) -> k8s_client.Configuration:
    from kubernetes import client as k8s_client  # slow to import: only when connecting
    from kubernetes import config as k8s_config

    cfg = k8s_client.Configuration()
    if kubeconfig:
        k8s_config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        return cfg
    try:
        k8s_config.load_incluster_config(client_configuration=cfg)
    except k8s_config.ConfigException:
        k8s_config.load_kube_config(client_configuration=cfg)
    return cfg


def _payload(resp: urllib3.BaseHTTPResponse) -> Any:
    """A response's body: parsed JSON, else its text (an error page), else None."""
    text = resp.data.decode("utf-8", "replace")
    try:
        return json.loads(text) if text else None
    except json.JSONDecodeError:
        return text


class Kube:
    """Thread-safe; one per operator process."""

    def __init__(self, configuration: k8s_client.Configuration | None = None, timeout: float = 30.0,
                 connections: int = 8):
        """``connections``: kept open per API server, at least one per thread that calls it (a
        thread that finds none idle opens one more and closes it after: a TLS handshake each)."""
        self.cfg = configuration or load_configuration()
        self.host = self.cfg.host.rstrip("/")
        ctx = (
            ssl.create_default_context(cafile=self.cfg.ssl_ca_cert)
            if self.cfg.ssl_ca_cert
            else ssl.create_default_context()
        )
        if self.cfg.cert_file:
            ctx.load_cert_chain(self.cfg.cert_file, self.cfg.key_file)
        if not self.cfg.verify_ssl:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        self.pool = urllib3.PoolManager(num_pools=4, maxsize=connections, ssl_context=ctx, timeout=timeout)
        self._lock = threading.Lock()

    def _headers(self, content_type: str | None) -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": "pagoda-operator"}
        if content_type:
            headers["Content-Type"] = content_type
        with self._lock:  # token refresh hooks are not thread-safe
            auth = self.cfg.auth_settings()
        for setting in auth.values():
            if setting.get("in") == "header" and setting.get("value"):
                headers[setting["key"]] = setting["value"]
        return headers

    def _url(self, url_path: str, query: Mapping[str, Any] | None) -> str:
        """The server's URL for ``url_path``, with the query's set values (None: left out)."""
        given = {k: v for k, v in (query or {}).items() if v is not None}
        return self.host + url_path + ("?" + urlencode(given) if given else "")

    def request(
        self,
        method: str,
        url_path: str,
        body: Any = None,
        query: Mapping[str, Any] | None = None,
        content_type: str = "application/json",
    ) -> Any:
        url = self._url(url_path, query)
        data = json.dumps(body).encode() if body is not None else None
        API_REQUESTS.labels(method).inc()
        resp = self.pool.request(
            method, url, body=data, headers=self._headers(content_type if data else None)
        )
        payload = _payload(resp)
        if resp.status >= 400:
            raise ApiError(resp.status, resp.reason or "", payload)
        return payload

    # -- verbs -----------------------------------------------------------------------------
    def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        try:
            return self.request("GET", path(kind, namespace, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def get_live(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        """From the API server, whatever a subclass caches."""
        return Kube.get(self, kind, namespace, name)

    def list(
        self, kind: str, namespace: str | None = None, selector: str | None = None
    ) -> list[dict[str, Any]]:
        out = self.request("GET", path(kind, namespace), query={"labelSelector": selector})
        return list((out or {}).get("items") or [])

    def watch(self, kind: str, namespace: str | None, selector: str | None, resource_version: str | None,
              timeout_s: int) -> Iterator[dict[str, Any]]:
        """The watch events of ``kind`` after ``resource_version`` (None: the current objects as
        ADDED first), one per line, until the server ends the request after ``timeout_s``."""
        query = {"watch": "true", "allowWatchBookmarks": "true", "labelSelector": selector,
                 "resourceVersion": resource_version, "timeoutSeconds": timeout_s}
        API_REQUESTS.labels("WATCH").inc()
        resp = self.pool.request("GET", self._url(path(kind, namespace), query), headers=self._headers(None),
                                 preload_content=False, timeout=urllib3.Timeout(connect=30.0, read=timeout_s + 30.0))
        finished = False
        try:
            if resp.status >= 400:
                payload, finished = _payload(resp), True
                raise ApiError(resp.status, resp.reason or "", payload)
            for line in resp:
                if line.strip():
                    yield json.loads(line)
            finished = True
        finally:
            if not finished:  # left mid-stream: the server's later bytes must not reach another request
                resp.close()
            resp.release_conn()

    def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        WRITES.labels(obj["kind"], "create").inc()
        return self.request("POST", path(obj["kind"], meta.get("namespace")), obj)

    def replace(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        WRITES.labels(obj["kind"], "replace").inc()
        return self.request("PUT", path(obj["kind"], meta.get("namespace"), meta["name"]), obj)

    def merge_patch(
        self, kind: str, namespace: str | None, name: str, patch: Any, sub: str | None = None
    ) -> Any:
        WRITES.labels(kind, f"patch{'/' + sub if sub else ''}").inc()
        return self.request(
            "PATCH", path(kind, namespace, name, sub), patch, content_type="application/merge-patch+json"
        )

    def delete(self, kind: str, namespace: str | None, name: str) -> None:
        try:
            self.request("DELETE", path(kind, namespace, name))
        except ApiError as e:
            if e.status != 404:
                raise

    # -- helpers -------------------------------------------------------------------------
    def pod_warnings(self, namespace: str) -> list[dict[str, Any]]:
        """Warning Events about pods in ``namespace`` (the kubelet's FailedMount and the like)."""
        out = self.request(
            "GET",
            path("Event", namespace),
            query={"fieldSelector": "involvedObject.kind=Pod,type=Warning"},
        )
        return list((out or {}).get("items") or [])

    def user_can(
        self,
        user: Mapping[str, Any],
        verb: str,
        resource: str,
        namespace: str,
        name: str | None = None,
    ) -> bool:
        """Whether ``user`` (an admission request's ``userInfo``: username, uid, groups, extra) may
        ``verb`` the core-group ``resource`` in ``namespace`` (one object when ``name`` is set), as
        the API server's authorizers answer a SubjectAccessReview."""
        attributes = {"verb": verb, "resource": resource, "namespace": namespace}
        if name is not None:
            attributes["name"] = name
        review = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "spec": {
                "user": user.get("username") or "",
                "uid": user.get("uid") or "",
                "groups": list(user.get("groups") or []),
                "extra": {k: list(v) for k, v in (user.get("extra") or {}).items()},
                "resourceAttributes": attributes,
            },
        }
        out = self.request("POST", path("SubjectAccessReview"), review)
        return bool(((out or {}).get("status") or {}).get("allowed"))

    def topologies(self) -> list[dict[str, Any]]:
        """Every NodeTopology; empty when the CRD is not installed."""
        return self.list_if_served("NodeTopology")

    def list_if_served(self, kind: str, namespace: str | None = None, selector: str | None = None
                       ) -> list[dict[str, Any]]:
        """``list``, empty where the kind's CRD is not installed (the API server answers 404)."""
        try:
            return self.list(kind, namespace, selector)
        except ApiError as e:
            if e.status == 404:
                return []
            raise

    def served(self, api_version: str, plural: str) -> bool:
        """Whether the API server serves ``plural`` in ``api_version`` (``group/version``), by API
        discovery (readable by every authenticated client)."""
        try:
            found = self.request("GET", f"/apis/{api_version}")
        except ApiError as e:
            if e.status == 404:
                return False
            raise
        return any(r.get("name") == plural for r in (found or {}).get("resources") or [])
