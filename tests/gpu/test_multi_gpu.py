"""On two or more GPUs: tensor and expert parallelism over NCCL, with the executor starting
rank 1 (CUDA graphs and async scheduling on, as `pagoda serve` runs), against transformers in
float32; and `pagoda serve --tensor-parallel-size 2` reporting both GPUs.

Skipped where fewer than two GPUs are visible (CI; a one-GPU machine); run on the GPU machine
by `benchmarks/run_gpu.sh multi-gpu`.
"""

from __future__ import annotations

import faulthandler
import json

import pytest
import torch
import torch.multiprocessing as mp

from tests.distributed.test_tensor_parallel import (
    CASES,
    EPLB,
    EPLB_ASYNC,
    _run_cases,
    check_against_transformers,
)

JOIN_TIMEOUT_S = 60 + 30 * len(CASES)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]


def _main(path: str, tensor: int, expert: int, seed: int, out: str, extra: dict | None = None) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    faulthandler.dump_traceback_later(JOIN_TIMEOUT_S - 5)  # where it hangs, if it does


    def record(case: str, result: dict) -> None:  # before the engine shuts down: a hung teardown keeps it
        with open(out, "a") as f:
            f.write(json.dumps({case: result}) + "\n")

    _run_cases(tensor * expert, path, seed, CASES, expert, device="cuda", on_case=record, extra=extra)


@pytest.mark.parametrize(("arch", "tensor", "expert", "extra"), [
    ("llama", 2, 1, None), ("qwen3", 2, 1, None), ("qwen3_moe", 2, 1, None), ("qwen3_moe", 1, 2, None),
    # EPLB every 3 steps, the experts moved at the rebalance (NCCL) or in the background (host
    # memory, a gloo group, a CUDA stream of its own)
    ("qwen3_moe", 1, 2, EPLB), ("qwen3_moe", 1, 2, EPLB_ASYNC),
], ids=["llama-2-1", "qwen3-2-1", "qwen3_moe-2-1", "qwen3_moe-1-2", "qwen3_moe-1-2-eplb", "qwen3_moe-1-2-eplb-async"])
def test_float32_on_two_gpus_matches_transformers(tiny_models, tmp_path, arch, tensor, expert, extra):
    """Every case's tokens against transformers, then that every case's engine shut down (the
    ranks left their NCCL world) within the time allowed; with EPLB, that experts moved."""
    path = tiny_models[arch]
    seed = int(torch.randint(0, 2**31, ()).item())
    out = tmp_path / "result.jsonl"
    proc = mp.get_context("spawn").Process(target=_main, args=(path, tensor, expert, seed, str(out), extra))
    proc.start()
    proc.join(timeout=JOIN_TIMEOUT_S)
    hung = proc.is_alive()
    if hung:
        proc.kill()
        proc.join()
    result = {k: v for line in (out.read_text().splitlines() if out.exists() else []) for k, v in json.loads(line).items()}
    check_against_transformers(path, result, seed)
    if extra is not None:
        from pagoda_daemon.distributed.eplb import initial_placement

        start = initial_placement(8, expert, (8 + extra["num_redundant_experts"]) // expert)
        assert all(r["rebalances"] >= 1 for r in result.values()), {c: r["rebalances"] for c, r in result.items()}
        assert any(p != start for r in result.values() for p in r["placements"]), "no expert moved"
    assert not hung and proc.exitcode == 0 and len(result) == len(CASES), (
        f"{len(result)} of {len(CASES)} cases ran; the process {'hung' if hung else f'exited {proc.exitcode}'}")


def test_pagoda_serve_on_two_gpus_reports_both(tiny_models, tmp_path):
    import httpx

    from tests.server.conftest import ServerProcess

    srv = ServerProcess(tiny_models["qwen3_moe"], "--max-model-len", "256", "--tensor-parallel-size", "2",
                        "--device", "cuda", "--numa-policy", "auto",
                        log_dir=tmp_path, served_name="tiny")
    try:
        srv.wait_ready(timeout=300)
        r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 8},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        placement = [line for line in httpx.get(srv.url + "/metrics").text.splitlines()
                     if line.startswith("pagoda:placement_info{")]
        assert len(placement) == 1 and 'gpus="0,1"' in placement[0], placement
    except BaseException:
        print(srv.log_path.read_text()[-8000:])  # the server's own account, into the test's output
        raise
    finally:
        assert srv.stop() == 0


def test_experts_spread_over_two_gpu_engines_match_one_engine(tiny_models, tmp_path):
    """`--data-parallel-size 2 --data-parallel-experts` on two GPUs (NCCL all-gather and
    reduce-scatter, CUDA graphs replayed by both engines together): the CPU test's checks."""
    from tests.distributed.test_data_parallel import check_experts_spread_over_two_engines

    torch.backends.cuda.matmul.allow_tf32 = False
    check_experts_spread_over_two_engines(tiny_models["qwen3_moe"], tmp_path, "cuda")


@pytest.mark.parametrize("eplb", ["sync", "async", "alltoallv"])
def test_eplb_moves_experts_between_two_gpu_engines_and_the_tokens_stay(tiny_models, tmp_path, eplb):
    """`--data-parallel-experts` with EPLB on two GPUs: two engine cores (async scheduling, CUDA
    graphs, padded steps) move experts between them while serving, over NCCL at the rebalance or
    over gloo in the background; the CPU test's checks (the one-process engine's tokens, one
    placement on both engines, experts moved). ``alltoallv``: eager steps send each engine's real
    rows by NCCL all-to-all to the engine holding their experts, graph replays still gather."""
    from tests.distributed.test_data_parallel import (
        SPREAD_EPLB,
        SPREAD_EPLB_ALLTOALLV,
        SPREAD_EPLB_ASYNC,
        check_engines_step_together,
    )

    options = {"sync": SPREAD_EPLB, "async": SPREAD_EPLB_ASYNC, "alltoallv": SPREAD_EPLB_ALLTOALLV}[eplb]
    check_engines_step_together(tiny_models["qwen3_moe"], tmp_path, "cuda", options)
