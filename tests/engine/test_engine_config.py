"""EngineConfig: every declared option's bounds hold at construction, and options the build
cannot serve are refused by flag name (the same list the operator refuses specs with)."""

from __future__ import annotations

import math

import pytest

from pagoda_daemon.config import EngineConfig
from pagoda_daemon.options import declared


@pytest.mark.parametrize("field, value, message", [
    ("gpu_memory_utilization", 0.0, "greater than 0.0"),
    ("gpu_memory_utilization", 1.5, "at most 1.0"),
    ("gpu_memory_utilization", math.nan, "finite"),
    ("gpu_memory_utilization", math.inf, "finite"),
    ("block_size", 8, "one of"),
    ("dtype", "int4", "one of"),
    ("max_num_seqs", 0, "at least 1"),
    ("max_num_batched_tokens", -1, "at least 1"),
    ("num_kv_blocks", 0, "at least 1"),
    ("kv_offload_cpu_gib", -1.0, "at least 0.0"),
    ("device", "tpu", "device must be"),
    ("numa_policy", "nearest", "numa_policy must be"),
    ("tensor_parallel_size", 0, "at least 1"),
    ("tensor_parallel_size", 65, "at most 64"),
    ("expert_parallel_size", 65, "at most 64"),
    ("expert_parallel_size", 0, "at least 1"),
    ("num_redundant_experts", -1, "at least 0"),
    ("num_redundant_experts", 4097, "at most 4096"),
    ("eplb_step_interval", 0, "at least 1"),
    ("data_parallel_size", 0, "at least 1"),
    ("data_parallel_size", 65, "at most 64"),
    ("kv_cache_dtype", "fp8", "--kv-cache-dtype=fp8: an fp8 KV cache"),
    ("kv_offload_cpu_gib", math.nan, "finite"),
    ("kv_offload_disk_gib", math.inf, "finite"),
    ("kv_offload_disk_gib", -0.5, "at least 0.0"),
])
def test_out_of_bounds_and_unsupported_values_are_refused(field, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="/m", **{field: value})


def test_defaults_are_valid_and_every_option_is_declared():
    config = EngineConfig(model="/m")
    names = {d.name for d in declared(EngineConfig)}
    assert names == set(vars(config))
    assert all(d.info.help for d in declared(EngineConfig))


def test_more_than_64_ranks_in_all_are_refused():
    with pytest.raises(ValueError, match="tensor_parallel_size × expert_parallel_size = 128 ranks; at most 64"):
        EngineConfig(model="/m", tensor_parallel_size=16, expert_parallel_size=8)
