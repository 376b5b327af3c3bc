"""A real Prometheus (Debian's package) scrapes the real-container cluster the way a cluster's
Prometheus does, and every query of the Grafana dashboard returns series.

Discovery: Debian builds Prometheus without Kubernetes service discovery, so the test reads the
pods from the API server and writes file-discovery targets with what Kubernetes pod discovery
and the usual relabelling would give: daemon pods kept by the ``prometheus.io/*`` annotations
the operator renders on them (address from the port annotation, ``namespace`` and ``pod``
labels); the operator kept by its ``metrics`` container port, its own labels honoured. Then each
panel target and template query of ``charts/pagoda/dashboards/pagoda.json`` runs through the
query API with the variables as Grafana substitutes them ("All": ``.*``, ``$__rate_interval``: 1m).
No Grafana runs here (none installs offline); the dashboard's JSON is checked in
tests/operator/test_manifests.py, its queries here.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_real_containers import client, manifest, wait_ready  # e2e/ is on sys.path, as for conftest

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "charts" / "pagoda" / "dashboards" / "pagoda.json"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.skipif(PROMETHEUS is None or PROMTOOL is None,
                                reason="needs Debian's prometheus package (e2e/cluster/ensure-k8s.sh installs it)")


def scrape_config(daemons: Path, operator: Path) -> dict[str, Any]:
    """Two jobs fed by file service discovery (Debian builds Prometheus without Kubernetes
    discovery, so :func:`discover` writes what it would find: the same targets and labels)."""
    return {
        "global": {"scrape_interval": "2s", "evaluation_interval": "2s"},
        "scrape_configs": [
            {"job_name": "pagoda-daemons", "file_sd_configs": [{"files": [str(daemons)], "refresh_interval": "2s"}]},
            # Its series carry the InferenceService's namespace and name: honour them.
            {"job_name": "pagoda-operator", "honor_labels": True,
             "file_sd_configs": [{"files": [str(operator)], "refresh_interval": "2s"}]},
        ],
    }


def discover(pods: list[dict[str, Any]], operator_namespace: str) -> tuple[list[dict], list[dict]]:
    """What Kubernetes pod discovery with the usual relabelling yields: daemon pods by their
    ``prometheus.io/scrape|port|path`` annotations, labelled ``namespace`` and ``pod``; the
    operator's pods by their ``metrics`` container port."""
    daemons, operator = [], []
    for pod in pods:
        meta, ip = pod["metadata"], (pod.get("status") or {}).get("podIP")
        if not ip:
            continue
        notes = meta.get("annotations") or {}
        if notes.get("prometheus.io/scrape") == "true" and notes.get("prometheus.io/port"):
            daemons.append({"targets": [f"{ip}:{notes['prometheus.io/port']}"],
                            "labels": {"namespace": meta["namespace"], "pod": meta["name"],
                                       "__metrics_path__": notes.get("prometheus.io/path", "/metrics")}})
        labels = meta.get("labels") or {}
        if meta["namespace"] == operator_namespace and labels.get("app.kubernetes.io/component") == "operator":
            for c in pod["spec"]["containers"]:
                for p in c.get("ports") or []:
                    if p.get("name") == "metrics":
                        operator.append({"targets": [f"{ip}:{p['containerPort']}"], "labels": {"pod": meta["name"]}})
    return daemons, operator


def dashboard_queries() -> list[str]:
    """Every panel target and template query, with the variables as Grafana fills them in."""
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", []) if t.get("expr")]
    for var in dash.get("templating", {}).get("list", []):
        query = var.get("query")
        text = query.get("query") if isinstance(query, dict) else query
        found = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", text or "")
        if found:  # label_values(selector, label): the series that carry the label
            exprs.append(f"group by ({found.group(2)}) ({found.group(1)})")
    subs = {"$__rate_interval": "1m", "$namespace": ".*", "$model": ".*", "$isvc": ".*"}
    out = []
    for e in exprs:
        for k, v in subs.items():
            e = e.replace(k, v)
        out.append(e)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_every_dashboard_query_returns_series(local_cluster, tmp_path):
    """Every query but the prefill autoscaler's, which need prefill pods apart
    (e2e/test_disaggregation.py checks those the same way)."""
    ns = local_cluster.create_namespace("prom")
    name = "tiny-prom"
    doc = manifest(local_cluster, name)
    # Autoscaled, so that the operator exports the autoscaler's signal and decision series.
    doc["spec"]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 2, "metric": "requestsWaiting", "target": 8}
    with Prometheus(local_cluster, tmp_path) as prom:
        try:
            local_cluster.apply(doc, namespace=ns)
            wait_ready(local_cluster, ns, replicas=1, name=name, timeout=300)
            prom.rediscover()
            (ip,) = local_cluster.endpoints(name, ns)
            for _ in range(6):  # traffic, so that the latency histograms have counts
                client(ip).completions.create(model="tiny-qwen3", prompt="Paged attention", max_tokens=8)
            prom.wait_until_scraped({"pagoda-daemons", "pagoda-operator"})
            empty = [q for q in dashboard_queries() if PREFILL_SERIES not in q and not prom.query(q)]
            assert not empty, "dashboard queries without series:\n" + "\n".join(empty)
        finally:
            local_cluster.delete_namespace(ns)


# The prefill autoscaler's series (prefill pods apart): the dashboard's queries over them have
# series only where such an InferenceService runs.
PREFILL_SERIES = "pagoda_operator_prefill_"


class Prometheus:
    """Debian's Prometheus scraping the cluster's daemon pods and operator (file discovery, as
    :func:`discover` describes), for as long as the ``with`` block runs."""

    def __init__(self, local_cluster, tmp_path: Path) -> None:
        self.cluster, self.dir = local_cluster, tmp_path
        self.daemons, self.operator = tmp_path / "daemons.json", tmp_path / "operator.json"

    def rediscover(self) -> None:
        found = discover(self.cluster.kubectl_json("get", "pods", "-A")["items"], self.cluster.release_namespace)
        for path, targets in zip((self.daemons, self.operator), found):
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(targets))
            tmp.rename(path)  # Prometheus never reads half a file

    def __enter__(self) -> Prometheus:
        self.rediscover()
        config = self.dir / "prometheus.yml"
        config.write_text(yaml.safe_dump(scrape_config(self.daemons, self.operator)))
        check = subprocess.run([PROMTOOL, "check", "config", str(config)], capture_output=True, text=True, timeout=60)
        assert check.returncode == 0, check.stdout + check.stderr
        port = _free_port()
        self.log = (self.dir / "prometheus.log").open("w")
        self.proc = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={self.dir / 'data'}",
                                      f"--web.listen-address=127.0.0.1:{port}"], stdout=self.log,
                                     stderr=subprocess.STDOUT)
        self.api = f"http://127.0.0.1:{port}/api/v1"
        return self

    def __exit__(self, *_exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()

    def wait_until_scraped(self, jobs: set[str]) -> None:
        """Until these jobs' targets are up, then a few scrapes more (rate() needs two samples)."""
        def up() -> bool:
            try:
                reply = httpx.get(f"{self.api}/targets", timeout=10)
            except httpx.TransportError:  # still starting: not listening yet
                return False
            if reply.status_code == 503:  # listening, its storage not open yet ("Service Unavailable")
                return False
            active = reply.json()["data"]["activeTargets"]
            return jobs <= {t["labels"]["job"] for t in active if t["health"] == "up"}

        self.cluster.wait_for(up, timeout=120, interval=1, what=f"scrape jobs {sorted(jobs)} up")
        time.sleep(8)

    def query(self, expr: str) -> list[dict[str, Any]]:
        body = httpx.get(f"{self.api}/query", params={"query": expr}, timeout=30).json()
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]
