"""KV offload at tensor parallel size 2 on CPU (gloo): rank 1 in a process the executor starts,
each rank keeping its own slice of every offloaded block, both driven by rank 0's plan. The
tokens must equal those of the same engine without offload, also when only rank 1's block
files are corrupted after their lookups (the ranks agree on the failed loads), and with host
memory written back (saved as the GPU cache evicts blocks, before the step that reuses them)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
import torch.multiprocessing as mp

from tests.kv_offload.test_offload import ENGINE, ORDER, corrupt, run, workload
from tests.processes import warm_start_method


def _main(_: int, path: str, out_dir: str) -> None:
    from pagoda_daemon import LLM

    torch.set_num_threads(1)
    results = {}
    prompts = workload(order=ORDER)
    for name, extra in (("off", {}), ("on", {"kv_offload_cpu_gib": 30 * 2 * 4096 / 2**30,
                                          "kv_offload_disk_path": str(Path(out_dir, "kv")),
                                          "kv_offload_disk_gib": 64 * 2 * 4096 / 2**30}),
                        ("back", {"kv_offload_cpu_gib": 30 * 2 * 4096 / 2**30, "kv_offload_write_policy": "write-back"})):
        llm = LLM(path, tensor_parallel_size=2, **ENGINE, **extra)
        tokens = run(llm, prompts)
        if name in ("off", "back"):
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
            "disk_files": None if core.connector is None or core.connector.disk is None else len(core.connector.disk),
        }
        core.shutdown()
    Path(out_dir, "result.json").write_text(json.dumps(results))


def test_offload_at_tensor_parallel_2_gives_the_same_tokens(tiny_models, tmp_path):
    mp.start_processes(_main, args=(tiny_models["llama"], str(tmp_path)), nprocs=1, start_method=warm_start_method())
    result = json.loads((tmp_path / "result.json").read_text())
    off, on = result["off"], result["on"]
    assert on["block_bytes"] == [4096, 4096]  # each rank holds half the KV heads
    assert on["tokens"] == off["tokens"]
    assert on["stats"]["failed_loads"] > 0
    assert on["stats"]["hits"] > 0 and on["stats"]["loaded"].get("cpu", 0) > 0 and on["stats"]["loaded"].get("disk", 0) > 0
    assert on["free"] and off["free"]
    back = result["back"]  # host memory written back: both ranks copy each evicted block's half
    assert back["tokens"] == off["tokens"] and back["free"]
    assert back["stats"]["loaded"].get("cpu", 0) > 0 and back["stats"]["failed_loads"] == 0
    for rank in (0, 1):
        assert len(list((tmp_path / "kv" / f"rank{rank}").glob("*.kvblock"))) == on["disk_files"] > 0


def _transfer_main(_: int, path: str, out_dir: str) -> None:
    """A prefill engine at TP = 2 fills its disk tier; its files are then served on a transfer
    port (kv_offload/transfer.py) to a decode engine at TP = 2, which fetches both ranks' files of
    every block. (Two engines of several ranks cannot live in one process at once: one
    torch.distributed world each. The prefill engine has stopped; a BlockServer serves its tier.)"""
    import os

    from pagoda_daemon import LLM
    from pagoda_daemon.kv_offload import transfer, transfer_auth

    torch.set_num_threads(1)
    os.environ[transfer_auth.KEY_ENV] = "tp-transfer-key-0123456789"
    prompts = workload(num_prefixes=3, repeats=1)
    disk = {"kv_offload_disk_gib": 64 * 2 * 4096 / 2**30}
    results = {}
    for name, extra in (("off", {}), ("prefill", {"kv_offload_disk_path": str(Path(out_dir, "prefill")), **disk})):
        llm = LLM(path, tensor_parallel_size=2, **ENGINE, **extra)
        results[name] = run(llm, prompts)
        llm.engine.core.shutdown()
    server = transfer.BlockServer(str(Path(out_dir, "prefill")), 0, transfer_auth.transfer_key(), host="127.0.0.1")
    decode = LLM(path, tensor_parallel_size=2, **ENGINE, kv_offload_disk_path=str(Path(out_dir, "decode")),
                 kv_offload_disk_source=f"tcp://127.0.0.1:{server.port}", **disk)
    results["decode"] = run(decode, prompts)
    stats = decode.get_stats().kv_offload
    results["stats"] = {"hits": stats.hits, "fetched": stats.fetched_bytes, "failed_loads": stats.failed_loads}
    decode.engine.core.shutdown()
    server.close()
    Path(out_dir, "result.json").write_text(json.dumps(results))


def test_blocks_fetched_from_another_host_at_tensor_parallel_2_give_the_same_tokens(tiny_models, tmp_path):
    mp.start_processes(_transfer_main, args=(tiny_models["llama"], str(tmp_path)), nprocs=1, start_method=warm_start_method())
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["decode"] == result["prefill"] == result["off"]
    # every prompt's 6 full blocks, both ranks' halves (4,096 bytes each)
    assert result["stats"] == {"hits": 3 * 6 * 16, "fetched": 3 * 6 * 2 * 4096, "failed_loads": 0}
    for rank in (0, 1):
        assert len(list((tmp_path / "decode" / f"rank{rank}").glob("*.kvblock"))) == 3 * 6
