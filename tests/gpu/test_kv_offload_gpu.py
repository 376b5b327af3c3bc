"""KV offload on a GPU: the host tier's copies are asynchronous (on streams beside the step's,
docs/kv-offload.md), async scheduling is on, CUDA graphs are captured. Greedy float32 output
must equal the engine without offload, with every tier serving hits; and block files corrupted
after their lookups cost a recompute, not a wrong token.

Skipped without a GPU; run on the GPU machine by `benchmarks/run_gpu.sh kv-offload-tests`.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.kv_offload.test_offload import BS, ORDER, PAIRS_ORDER, corrupt, gib, run_pairs, workload

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ENGINE = dict(device="cuda", dtype="float32", block_size=BS, num_kv_blocks=16, max_model_len=256)


@pytest.fixture(scope="module")
def model(tiny_models) -> str:
    return tiny_models["llama"]


@pytest.mark.parametrize(("tiers", "policy", "layered"), [
    ("cpu", "write-through", False), ("cpu+disk", "write-through", False), ("cpu", "write-back", False),
    ("cpu+disk", "write-back", False), ("cpu", "write-through", True), ("cpu+disk", "write-back", True),
    ("disk", "write-through", False),
])
def test_outputs_identical_with_asynchronous_host_copies(model, tmp_path, monkeypatch, tiers, policy, layered):
    """``layered``: a step loads host-memory blocks for itself (up to 6 a step), in two layer
    groups on the load stream, its layers' attention waiting for each (off by default,
    kv_offload/tiered.py)."""
    from pagoda_daemon import LLM
    from pagoda_daemon.kv_offload import tiered

    if layered:
        monkeypatch.setattr(tiered, "LOAD_LAYER_GROUPS", 2)

    prompts = workload(order=ORDER + PAIRS_ORDER)
    reference = run_pairs(LLM(model, **ENGINE), prompts)
    plain = LLM(model, **ENGINE)
    block_bytes = plain.engine.core.worker_info.kv_block_bytes
    assert plain.engine.core.async_scheduling
    # the disk tier alone: its hits cross through the read-ahead slots the I/O threads fill
    opts: dict = {"kv_offload_cpu_gib": 0 if tiers == "disk" else gib(64 if tiers == "cpu" else 30, block_bytes),  # 30: some hits in each
                  "kv_offload_write_policy": policy}
    if "disk" in tiers:
        opts.update(kv_offload_disk_path=str(tmp_path / "kv"), kv_offload_disk_gib=gib(64, block_bytes))
    llm = LLM(model, **ENGINE, **opts)
    if layered:
        llm.engine.core.connector.step_load_blocks = 6
    assert all(d.is_pinned() for d in llm.engine.core.executor.worker.offload.cpu.data)
    assert len(llm.engine.core.executor.worker.offload.cpu.data) == (2 if layered else 1)
    assert run_pairs(llm, prompts) == reference
    stats = llm.get_stats().kv_offload
    for tier in tiers.split("+"):
        assert stats.loaded_bytes.get(tier, 0) > 0 and stats.saved_bytes.get(tier, 0) > 0, stats
    kv = llm.engine.core.kv_cache
    assert kv.num_free_blocks == kv.num_blocks
    llm.engine.core.connector.check()


def test_block_files_corrupted_after_their_lookup_cost_a_recompute(model, tmp_path):
    from pagoda_daemon import LLM

    prompts = workload(order=PAIRS_ORDER)
    reference = run_pairs(LLM(model, **ENGINE), prompts)
    block_bytes = LLM(model, **ENGINE).engine.core.worker_info.kv_block_bytes
    llm = LLM(model, **ENGINE, kv_offload_cpu_gib=gib(8, block_bytes), kv_offload_disk_path=str(tmp_path / "kv"),
              kv_offload_disk_gib=gib(64, block_bytes))
    rng = random.Random(5)

    def corrupt_a_third() -> None:
        files = sorted((tmp_path / "kv" / "rank0").glob("*.kvblock"))
        for path in rng.sample(files, len(files) // 3):
            corrupt(path)

    assert run_pairs(llm, prompts, corrupt_a_third) == reference
    assert llm.get_stats().kv_offload.failed_loads > 0
    kv = llm.engine.core.kv_cache
    assert kv.num_free_blocks == kv.num_blocks
