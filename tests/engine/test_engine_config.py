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


@pytest.mark.parametrize("fields, message", [
    ({"lora_modules": "a=/x"}, "need enable_lora"),
    ({"max_loras": 2}, "need enable_lora"),
    ({"max_lora_rank": 8}, "need enable_lora"),
    ({"enable_lora": True, "max_loras": 0}, "at least 1"),
    ({"enable_lora": True, "max_loras": 65}, "at most 64"),
    ({"enable_lora": True, "max_lora_rank": 0}, "at least 1"),
    ({"enable_lora": True, "max_lora_rank": 513}, "at most 512"),
    ({"enable_lora": True, "nnodes": 2, "tensor_parallel_size": 2}, "nnodes above 1"),
    ({"enable_lora": True, "expert_parallel_size": 2, "elastic_ep_min_size": 1, "elastic_ep_max_size": 2,
      "enable_eplb": True},
     "elastic expert parallelism"),
])
def test_lora_options_are_refused_where_they_cannot_serve(fields, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="/m", **fields)


def test_lora_modules_take_several_values_and_repeat():
    import argparse

    from pagoda_daemon.options import add_cli_args

    parser = argparse.ArgumentParser()
    add_cli_args(parser, EngineConfig)
    args = parser.parse_args(["--lora-modules", "a=/x", '{"name": "b", "path": "/y"}', "--lora-modules", "c=/z"])
    assert args.lora_modules == 'a=/x\n{"name": "b", "path": "/y"}\nc=/z'
    assert parser.parse_args([]).lora_modules is None
