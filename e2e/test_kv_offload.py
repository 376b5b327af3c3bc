"""KV offload on the real-container cluster: an InferenceService with `kvOffload.cpuGiB` and a
primary KV cache of 24 blocks (`engine.numKvBlocks`) becomes Ready; prompts whose prefixes
together need far more than 24 blocks are sent twice, and the second round's prefixes come
back from host memory: the daemon's own metrics count offload hits and loaded bytes, and the
answers are the first round's (greedy)."""

from __future__ import annotations

import random

import httpx
from test_real_containers import PORT, cond, manifest, wait_ready

NAME = "kv-offload"
PROMPT_TOKENS = 200  # 12 full blocks of 16 each
PREFIXES = 8  # 96 full blocks in all: four times the primary cache


def metric(ip: str, name: str, medium: str | None = None) -> float:
    text = httpx.get(f"http://{ip}:{PORT}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and (medium is None or f'medium="{medium}"' in line))


def test_prefixes_evicted_from_a_small_cache_come_back_from_host_memory(local_cluster):
    ns = local_cluster.create_namespace("kv")
    doc = manifest(local_cluster, NAME)
    doc["spec"]["engine"].update(numKvBlocks=24, maxModelLen=256)
    doc["spec"]["kvOffload"] = {"cpuGiB": 0.05}
    try:
        local_cluster.apply(doc, namespace=ns)
        obj = wait_ready(local_cluster, ns, replicas=1, name=NAME)
        assert cond(obj, "Degraded")["status"] == "False"
        pod = local_cluster.kubectl_json("get", "pods", "-n", ns, "-l", f"pagoda.dev/inferenceservice={NAME}")
        limits = pod["items"][0]["spec"]["containers"][0]["resources"]["limits"]
        assert limits["memory"] == "4148Mi"  # the example's 4Gi and the 0.05 GiB host pool (51.2 Mi, rounded up)
        (ip,) = local_cluster.endpoints(NAME, ns)
        rng = random.Random(7)
        prompts = [[rng.randrange(3, 500) for _ in range(PROMPT_TOKENS)] for _ in range(PREFIXES)]

        def answer(prompt: list[int]) -> list[str]:
            body = {"model": doc["spec"]["model"]["name"], "prompt": prompt, "max_tokens": 4, "temperature": 0,
                    "ignore_eos": True}
            r = httpx.post(f"http://{ip}:{PORT}/v1/completions", timeout=60, json=body)
            assert r.status_code == 200, r.text
            return [c["text"] for c in r.json()["choices"]]

        first = [answer(p) for p in prompts]
        assert metric(ip, "pagoda:kv_offload_saved_bytes_total", "CPU") > 0
        hits_before = metric(ip, "vllm:external_prefix_cache_hits_total")
        second = [answer(p) for p in prompts]
        assert second == first
        hits = metric(ip, "vllm:external_prefix_cache_hits_total") - hits_before
        # every prompt's first 12 blocks were evicted from the 24-block cache by the ones after it
        assert hits >= PREFIXES * 11 * 16, hits
        assert metric(ip, "pagoda:kv_offload_loaded_bytes_total", "CPU") > 0
    finally:
        local_cluster.delete_namespace(ns)
