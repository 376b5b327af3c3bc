"""KV offload at tensor parallel size 2 on CPU (gloo): rank 1 in a process the executor starts,
each rank keeping its own slice of every offloaded block, both driven by rank 0's plan. The
tokens must equal those of the same engine without offload, also when only rank 1's block
files are corrupted after their lookups (the ranks agree on the failed loads)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
import torch.multiprocessing as mp

from tests.kv_offload.test_offload import ENGINE, ORDER, corrupt, run, workload


def _main(_: int, path: str, out_dir: str) -> None:
    from pagoda_daemon import LLM

    torch.set_num_threads(1)
    results = {}
    prompts = workload(order=ORDER)
    for name, extra in (("off", {}), ("on", {"kv_offload_cpu_gib": 30 * 2 * 4096 / 2**30,
                                          "kv_offload_disk_path": str(Path(out_dir, "kv")),
                                          "kv_offload_disk_gib": 64 * 2 * 4096 / 2**30})):
        llm = LLM(path, tensor_parallel_size=2, **ENGINE, **extra)
        tokens = run(llm, prompts)
        if name == "off":
            tokens += run(llm, prompts)
        if name == "on":  # again, rank 1's files corrupted a third at a time after each request
            rng = random.Random(3)
            for p in prompts:
                files = sorted(Path(out_dir, "kv", "rank1").glob("*.kvblock"))
                for f in rng.sample(files, len(files) // 3):
                    corrupt(f)
                tokens += run(llm, [p])
        stats = llm.get_stats().kv_offload
        core = llm.engine.core
        results[name] = {
            "tokens": tokens, "block_bytes": [i.kv_block_bytes for i in core.executor.worker_infos()],
            "stats": None if stats is None else {"hits": stats.hits, "loaded": stats.loaded_bytes,
                                                 "failed_loads": stats.failed_loads},
            "free": core.kv_cache.num_free_blocks == core.kv_cache.num_blocks,
            "disk_files": None if core.connector is None else len(core.connector.disk),
        }
        core.shutdown()
    Path(out_dir, "result.json").write_text(json.dumps(results))


def test_offload_at_tensor_parallel_2_gives_the_same_tokens(tiny_models, tmp_path):
    mp.start_processes(_main, args=(tiny_models["llama"], str(tmp_path)), nprocs=1, start_method="spawn")
    result = json.loads((tmp_path / "result.json").read_text())
    off, on = result["off"], result["on"]
    assert on["block_bytes"] == [4096, 4096]  # each rank holds half the KV heads
    assert on["tokens"] == off["tokens"]
    assert on["stats"]["failed_loads"] > 0
    assert on["stats"]["hits"] > 0 and on["stats"]["loaded"].get("cpu", 0) > 0 and on["stats"]["loaded"].get("disk", 0) > 0
    assert on["free"] and off["free"]
    for rank in (0, 1):
        assert len(list((tmp_path / "kv" / f"rank{rank}").glob("*.kvblock"))) == on["disk_files"] > 0
