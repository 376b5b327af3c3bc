"""The GPU benchmark script runs end to end on tiny shapes (so it does not rot before the
GPU machine runs it), and reports every figure with its floor."""

from __future__ import annotations

import json

from tests.kernels import interp  # noqa: F401  (skips where the interpreter cannot run)

from benchmarks import kernels as bench  # isort: skip


def test_bench_smoke_prints_json(capsys):
    assert bench.main(["--smoke"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["copy"]["GB_per_s"] > 0 and report["matmul"]["TFLOP_per_s"] > 0
    assert all("fraction_of_copy" in r for r in report["decode"]["headline"] + report["decode"]["table"])
    assert all("fraction_of_matmul" in r for r in report["prefill"]["cases"])
    assert report["moe"][0]["fraction_of_dense"] > 0
    assert all(r["speedup"] > 0 and r["fraction_of_copy"] > 0 for r in report["sampling"])
    assert all(r["speedup"] > 0 and r["rel_err"] < 1e-2 and "torch_fraction_of_copy" in r for r in report["gemv"])


def test_moe_sweep_smoke_times_each_tile_set_and_reports_vllm_beside_it(capsys):
    assert bench.main(["--smoke", "--only", "moe-sweep"]) == 0
    rows = json.loads(capsys.readouterr().out)["moe_sweep"]
    assert rows[0]["engine"] == "vllm" and ("seconds" in rows[0] or "error" in rows[0])  # no vLLM here: an error row
    assert all(r["seconds"] > 0 and r["config"]["BLOCK_M"] for r in rows[1:])
