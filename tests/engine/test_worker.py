"""The Worker owns its device, the Executor stands between it and the engine core, and the
core's bookkeeping (stats, KV events) is get-and-reset."""

from __future__ import annotations

import random

import pytest
import torch

from pagoda_daemon.config import EngineConfig
from pagoda_daemon.engine.engine_core import EngineCore
from pagoda_daemon.engine.kv_cache_manager import KVCacheManager
from pagoda_daemon.engine.request import Request
from pagoda_daemon.engine.scheduler import Scheduler
from pagoda_daemon.executor.abstract import Executor
from pagoda_daemon.executor.uniproc import UniProcExecutor
from pagoda_daemon.models import loader
from pagoda_daemon.sampling_params import SamplingParams
from pagoda_daemon.worker.staging_buffers import CpuGpuBuffer
from pagoda_daemon.worker.worker import Worker


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_worker_sizes_allocates_and_runs_a_step_from_the_models_kv_spec(tiny_models, arch):
    config = EngineConfig(model=tiny_models[arch], device="cpu", kv_cache_memory_bytes=2 << 20, max_model_len=128)
    hf = loader.load_config(config.model)
    worker = Worker(config, hf, max_model_len=128)
    spec = worker.kv_cache_spec
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (
        hf.num_hidden_layers, hf.num_key_value_heads, head_dim)
    num_blocks = worker.available_kv_blocks()
    assert num_blocks == (2 << 20) // worker.kv_block_bytes()
    worker.initialize_cache(num_blocks)
    assert tuple(worker.runner.kv_cache.shape) == spec.shape(num_blocks, config.block_size)
    assert worker.info().device == "cpu" and worker.info().dtype == "float32"

    kv = KVCacheManager(num_blocks, config.block_size, True)
    sched = Scheduler(kv, 8, 256, 128)
    rng = random.Random()
    prompt = [rng.randrange(3, hf.vocab_size) for _ in range(rng.randrange(5, 40))]
    sched.add_request(Request("r", prompt, SamplingParams(temperature=0.0, max_tokens=2), None, config.block_size))
    result = worker.execute_model(sched.schedule()).result()
    assert set(result.sampled) == {"r"} and 0 <= result.sampled["r"] < hf.vocab_size


def test_the_engine_core_reaches_its_device_only_through_the_executor(tiny_models):
    config = EngineConfig(model=tiny_models["qwen3"], device="cpu", num_kv_blocks=64, max_model_len=128)
    executor = UniProcExecutor(config, loader.load_config(config.model), 128)
    core = EngineCore(config, executor=executor)
    assert isinstance(core.executor, Executor) and core.executor is executor
    assert not hasattr(core, "runner") and not hasattr(core, "device")
    core.add_request(Request("a", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                             None, config.block_size))
    tokens = []
    while core.has_unfinished_requests():
        tokens += [t for o in core.step() for t in o.new_token_ids]
    assert len(tokens) == 3


def test_stats_and_kv_events_are_get_and_reset(tiny_models):
    config = EngineConfig(model=tiny_models["llama"], device="cpu", num_kv_blocks=64, max_model_len=128,
                          enable_kv_events=True, block_size=16)
    core = EngineCore(config)
    prompt = list(range(3, 3 + 40))  # two full blocks: two BlockStored events
    for rid in ("a", "b"):  # b hits a's two full blocks in the prefix cache
        core.add_request(Request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=2), None, 16))
        while core.has_unfinished_requests():
            core.step()
    first = core.make_stats()
    assert first.num_steps > 0 and first.prefix_cache.hits == 32 and first.prefix_cache.queries == 80
    again = core.make_stats()
    assert (again.num_steps, again.num_preemptions, again.prefix_cache.queries, again.prefix_cache.hits) == (0, 0, 0, 0)
    assert again.num_kv_blocks == 64 and again.num_free_kv_blocks == 64  # gauges are not reset
    assert len(core.kv_cache.take_events()) >= 2 and core.kv_cache.take_events() == []


def test_a_cpu_buffer_is_its_own_device_twin():
    buf = CpuGpuBuffer(8, torch.int64, torch.device("cpu"))
    values = torch.randint(0, 100, (5,)).tolist()
    out = buf.fill(values)
    assert out.tolist() == values and out.data_ptr() == buf.host.data_ptr()
    buf.flip()  # no second half on a CPU
    assert buf.spare is None and buf.to_device(5).tolist() == values
