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
    ns = local_cluster.create_namespace("prom")
    name = "tiny-prom"
    doc = manifest(local_cluster, name)
    # Autoscaled, so that the operator exports the autoscaler's signal and decision series.
    doc["spec"]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 2, "metric": "requestsWaiting", "target": 8}
    daemons_file, operator_file = tmp_path / "daemons.json", tmp_path / "operator.json"

    def rediscover() -> None:
        found = discover(local_cluster.kubectl_json("get", "pods", "-A")["items"], local_cluster.release_namespace)
        for path, targets in zip((daemons_file, operator_file), found):
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(targets))
            tmp.rename(path)  # Prometheus never reads half a file

    rediscover()
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump(scrape_config(daemons_file, operator_file)))
    check = subprocess.run([PROMTOOL, "check", "config", str(config)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    port = _free_port()
    log = (tmp_path / "prometheus.log").open("w")
    prom = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    api = f"http://127.0.0.1:{port}/api/v1"
    try:
        local_cluster.apply(doc, namespace=ns)
        wait_ready(local_cluster, ns, replicas=1, name=name, timeout=300)
        rediscover()
        (ip,) = local_cluster.endpoints(name, ns)
        for _ in range(6):  # traffic, so that the latency histograms have counts
            client(ip).completions.create(model="tiny-qwen3", prompt="Paged attention", max_tokens=8)

        def targets_up() -> bool:
            active = httpx.get(f"{api}/targets", timeout=10).json()["data"]["activeTargets"]
            jobs = {t["labels"]["job"] for t in active if t["health"] == "up"}
            return {"pagoda-daemons", "pagoda-operator"} <= jobs

        local_cluster.wait_for(targets_up, timeout=120, interval=1, what="both scrape jobs up")
        time.sleep(8)  # a few scrapes after the traffic: rate() needs two samples
        empty = []
        for query in dashboard_queries():
            body = httpx.get(f"{api}/query", params={"query": query}, timeout=30).json()
            assert body["status"] == "success", (query, body)
            if not body["data"]["result"]:
                empty.append(query)
        assert not empty, "dashboard queries without series:\n" + "\n".join(empty)
    finally:
        prom.terminate()
        prom.wait(30)
        log.close()
        local_cluster.delete_namespace(ns)
