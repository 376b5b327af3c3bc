"""Elastic EP on two GPUs over NCCL: the tiny Qwen3-MoE (float32, CUDA graphs and async scheduling
on, as `pagoda serve` runs) resized 1 → 2 → 1 while requests run, the joining rank taking the
dense weights, the KV cache and the random states over NCCL and both ranks capturing their graphs
again; every request completes with the tokens of a replica that kept one rank, and each
transition's time is printed.

Skipped where fewer than two GPUs are visible; run on the GPU machine by
`benchmarks/run_gpu.sh elastic`.
"""

from __future__ import annotations

import faulthandler
import json
import time

import pytest
import torch
import torch.multiprocessing as mp

from tests.distributed.test_elastic_ep import _run

TIMEOUT_S = 240
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]


def _main(path: str, out: str) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    faulthandler.dump_traceback_later(TIMEOUT_S - 10)  # where it hangs, if it does
    started = time.monotonic()
    two = {"elastic_ep_max_size": 2}  # the GPUs there are: a larger bound is refused at start
    fixed, _, _ = _run(path, {}, two, start=1, device="cuda")
    fixed_s = time.monotonic() - started
    started = time.monotonic()
    tokens, outcomes, leak_free = _run(path, {3: 2, 9: 1}, two, start=1, device="cuda")
    with open(out, "w") as f:
        json.dump({"fixed": fixed, "tokens": tokens, "outcomes": outcomes, "leak_free": leak_free,
                   "fixed_run_s": fixed_s, "elastic_run_s": time.monotonic() - started}, f)


def test_one_gpu_grows_to_two_and_back_with_the_same_tokens(tiny_models, tmp_path):
    out = tmp_path / "elastic.json"
    proc = mp.get_context("spawn").Process(target=_main, args=(tiny_models["qwen3_moe"], str(out)))
    proc.start()
    proc.join(TIMEOUT_S)
    if proc.is_alive():
        proc.kill()
        pytest.fail(f"the elastic run did not finish in {TIMEOUT_S} s")
    assert proc.exitcode == 0 and out.exists()
    got = json.loads(out.read_text())
    print("ELASTIC_GPU", json.dumps({k: got[k] for k in ("outcomes", "fixed_run_s", "elastic_run_s")}))
    assert [o[:2] for o in got["outcomes"]] == [[2, "done"], [1, "done"]], got["outcomes"]
    assert got["tokens"] == got["fixed"] and got["leak_free"]
