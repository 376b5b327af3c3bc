"""Elastic expert parallelism on the real-container cluster (CPU ranks over gloo in one pod): an
InferenceService of a tiny random Qwen3-MoE with `parallelism.elastic {minExpert: 2, maxExpert: 3}`
grows its expert-parallel group under load and shrinks it again when idle, decided by the
operator from the daemon's metrics, with the decisions, the Scaling condition and each pod's
transition in `kubectl get pisvc -o yaml`, and no failed request from a client that loops through
both transitions."""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from test_real_containers import PORT, cond, manifest, wait_ready

NAME = "elastic-moe"
MODEL = "tiny-moe"
CLIENTS = 6  # streams at once: requestsRunning far above the target of 2
# A shrink waits for this long without load. With 0, a dip between the clients' requests on a
# 2-core CI machine let the operator shrink to 2 and grow to 3 again while the clients ran; the
# test then saw 2 serving under a newer decision for 3 (fresh-clone CI, 2026-11-27 and 2026-12-03).
SCALE_DOWN_WINDOW_S = 15


class LoopingClients:
    """`CLIENTS` openai clients streaming completions back to back; every failure is kept."""

    def __init__(self, url: str) -> None:
        import openai

        self.client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        self.done = 0
        self.failures: list[str] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(CLIENTS)]
        for t in self.threads:
            t.start()

    def _loop(self, who: int) -> None:
        i = 0
        while not self.stop.is_set():
            i += 1
            try:
                stream = self.client.completions.create(model=MODEL, prompt=f"client {who} request {i}", max_tokens=48,
                                                        temperature=0.0, stream=True, extra_body={"ignore_eos": True})
                last = [c for c in stream][-1]
                if last.choices[0].finish_reason != "length":
                    raise AssertionError(f"finished with {last.choices[0].finish_reason}")
                with self.lock:
                    self.done += 1
            except Exception as e:  # every failure counts; none may happen
                with self.lock:
                    self.failures.append(f"client {who} request {i}: {type(e).__name__}: {e}")

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(300)


def _elastic(local_cluster, ns: str) -> dict[str, Any]:
    obj = local_cluster.kubectl_json("get", "inferenceservice", NAME, "-n", ns)
    return obj.get("status") or {}


def _wait_size(local_cluster, ns: str, size: int, timeout: float, settled: bool = False) -> dict[str, Any]:
    """The status once every pod serves with `size` ranks; `settled` also wants the operator's
    desired size to be `size` (a pod can finish a shrink while a newer decision already wants
    it grown again)."""
    def served() -> dict[str, Any] | None:
        status = _elastic(local_cluster, ns)
        el = status.get("elastic") or {}
        pods = el.get("pods") or []
        if settled and el.get("desiredExpertParallel") != size:
            return None
        if el.get("currentExpertParallel") == size and pods and all(
                p.get("expertParallel") == size and p.get("phase") in ("done", "idle") for p in pods):
            return status
        return None

    return local_cluster.wait_for(served, timeout=timeout, interval=2,
                                  what=f"{ns}/{NAME} serving with {size} expert-parallel ranks")


def _transitions(metrics: str) -> dict[str, float]:
    """pagoda:elastic_ep_transitions_total of MODEL by outcome, from a /metrics body."""
    return {s.labels["outcome"]: s.value for family in text_string_to_metric_families(metrics)
            for s in family.samples
            if s.name == "pagoda:elastic_ep_transitions_total" and s.labels.get("model_name") == MODEL}


def test_elastic_ep_grows_under_load_and_shrinks_when_idle(local_cluster):
    ns = local_cluster.create_namespace("elastic")
    doc = manifest(local_cluster, NAME, model_path=str(local_cluster.moe_model_dir()))
    doc["spec"]["model"]["name"] = MODEL
    doc["spec"]["parallelism"] = {"expert": 2, "elastic": {
        "minExpert": 2, "maxExpert": 3, "metric": "requestsRunning", "target": 2, "tolerance": 0.1,
        "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": SCALE_DOWN_WINDOW_S}}
    doc["spec"]["engine"].update(numKvBlocks=160, maxModelLen=256)
    try:
        local_cluster.apply(doc, namespace=ns)
        obj = wait_ready(local_cluster, ns, replicas=1, name=NAME, timeout=300)
        assert cond(obj, "Degraded")["status"] == "False"
        secret = local_cluster.kubectl_json("get", "secret", f"{NAME}-pagoda-admin", "-n", ns)
        assert secret["metadata"]["ownerReferences"][0]["name"] == NAME
        (ip,) = local_cluster.endpoints(NAME, ns)
        _wait_size(local_cluster, ns, 2, timeout=120)  # the operator has read the daemon's state

        clients = LoopingClients(f"http://{ip}:{PORT}")
        try:
            grown = _wait_size(local_cluster, ns, 3, timeout=300)
        finally:
            clients.close()
        assert clients.failures == [], clients.failures[:5]
        assert clients.done > 0
        # the decision that grew it; a later one may already be there if a dip in the clients'
        # load outlasted SCALE_DOWN_WINDOW_S before the status showed 3 serving
        decisions = grown["elastic"]["decisions"]
        up = next((d for d in reversed(decisions) if (d["from"], d["to"]) == (2, 3)), None)
        assert up is not None, decisions
        assert up["metric"] == "requestsRunning" and up["value"] > 2, up
        assert grown["expertParallel"] == 3

        shrunk = _wait_size(local_cluster, ns, 2, timeout=300, settled=True)
        down = shrunk["elastic"]["decisions"][-1]
        assert (down["from"], down["to"]) == (3, 2), shrunk["elastic"]["decisions"]
        assert down["value"] < 2, down
        scaling = cond({"status": shrunk}, "Scaling")
        assert scaling["status"] == "False" and scaling["reason"] == "Stable", scaling
        pod = shrunk["elastic"]["pods"][0]
        assert pod["lastTransitionSeconds"] > 0 and "lastError" not in pod
        text = local_cluster.kubectl("get", "pisvc", NAME, "-n", ns, "-o", "yaml").stdout
        assert "desiredExpertParallel: 2" in text and "currentExpertParallel: 2" in text
        import httpx

        metrics = httpx.get(f"http://{ip}:{PORT}/metrics", timeout=10).text
        # 2 -> 3 -> 2, or more round trips if the load dipped for longer than the window: an even
        # count of finished transitions, none failed
        transitions = _transitions(metrics)
        done = transitions.get("done")
        assert done is not None and done >= 2 and done % 2 == 0, transitions
        assert not transitions.get("failed"), transitions
        assert f'pagoda:expert_parallel_size{{model_name="{MODEL}"}} 2.0' in metrics
    finally:
        local_cluster.delete_namespace(ns)
