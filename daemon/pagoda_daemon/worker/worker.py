"""A Worker owns one device: it resolves the device and dtype, pins itself to the cores
nearest its GPU, loads the model, measures memory, allocates the KV cache, captures the CUDA
graphs and runs the steps the engine core schedules (through its ModelRunner).

The engine core never touches a device: it talks to an Executor, which drives one Worker
per device. Every method takes and returns plain values (a block count, a SchedulerOutput, a
launched step), so a Worker can live in its own process behind a message queue.
vLLM's ``v1/worker/gpu_worker.py`` is the model.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from pagoda_daemon.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from pagoda_daemon.distributed.layout import num_experts_of
from pagoda_daemon.distributed.parallel_state import (
    TensorParallel,
    any_over_ranks,
    gloo_group_like,
    min_over_ranks,
    tensor_parallel_group,
)
from pagoda_daemon.engine.scheduler_output import GrammarBitmask, SchedulerOutput
from pagoda_daemon.kv_offload.connector import OffloadWorker
from pagoda_daemon.models import loader
from pagoda_daemon.telemetry.profiling import phase
from pagoda_daemon.worker.model_runner import LaunchedStep, ModelRunner

if TYPE_CHECKING:
    from pagoda_daemon.distributed.lockstep import Lockstep

log = logging.getLogger(__name__)
# A background EPLB move gives up (and the engine with it) when a peer has not answered for this
# long: a rank that died mid-transfer, rather than a wait for ever.
EPLB_TRANSFER_TIMEOUT_S = 300
# KV offload's background disk reads: how long a rank waits for the others to finish a batch
# before its staging thread fails (a rank gone must not hold this process's exit for gloo's 30 min)
KV_STAGE_TIMEOUT_S = 300


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker tells the engine core about itself once it is set up (READY reports it)."""

    device: str
    dtype: str
    gpu: int | None  # the GPU's index on the node, when pinned next to one
    numa_node: int | None
    attention_backend: str
    uses_cuda_graphs: bool
    kv_block_bytes: int = 0  # one KV block over every layer, K and V, of this rank's heads
    kv_transfer_cpu: int | None = None  # the core its pinning plan keeps for KV-transfer threads


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but no CUDA device is available")
    return device


def resolve_dtype(name: str, model_config, device: torch.device) -> torch.dtype:
    if name != "auto":
        return loader.DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    ckpt = loader.checkpoint_dtype(model_config)
    return ckpt if ckpt in (torch.bfloat16, torch.float16) else torch.bfloat16


def pin_worker(device: torch.device, policy: str):
    """Pin this worker to the cores nearest its GPU; a topology problem costs a warning, not the engine."""
    from pagoda_daemon.topology import pin_this_process

    local_rank = (device.index or 0) if device.type == "cuda" else 0
    try:
        return pin_this_process(local_rank, policy)
    except (OSError, ValueError) as e:
        log.warning("CPU pinning (%s) skipped: %s", policy, e)
        return None


class Worker:
    def __init__(self, config: EngineConfig, model_config, max_model_len: int) -> None:
        from pagoda_daemon.attention import get_attention_backend

        self.config = config
        self.lockstep: Lockstep | None = None  # with data_parallel_experts: the per-step agreement
        self.tp = (self._join_data_parallel_engines(config) if config.data_parallel_experts
                   else tensor_parallel_group(config.world_size, config.expert_parallel_size))
        if config.enable_eplb:
            self.tp = dataclasses.replace(self.tp, eplb=True, redundant_experts=config.num_redundant_experts)
        if config.elastic_ep:  # experts only are spread, with as many redundant slots as this size needs
            from pagoda_daemon.distributed.elastic import redundant_experts_for

            self.tp = dataclasses.replace(self.tp, replicated_dense=True, redundant_experts=redundant_experts_for(
                num_experts_of(model_config), self.tp.size, config.num_redundant_experts))
        self.device = resolve_device(config.device)
        if self.device.type == "cuda" and (self.tp.enabled or config.data_parallel_size > 1):
            # one GPU per rank, in launch order on the node, after the GPUs of the data-parallel engines before
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK",
                                                                  config.device_offset + self.tp.engine.rank)))
            torch.cuda.set_device(self.device)
        # Pin before anything big is allocated on the host, so it lands on local memory.
        self.cpu_pin = pin_worker(self.device, config.numa_policy)
        self.dtype = resolve_dtype(config.dtype, model_config, self.device)
        # Small all-reduces read from the other GPUs' memory (peer_all_reduce.py) in one pod: the
        # attention's and, for MoE models, the experts' combine (Qwen3-30B-A3B at EP = 2: +1.8%
        # against NCCL for the combine, 2 × H200, 2026-11-28). Elastic EP changes its group as it
        # resizes, and ranks in other pods cannot map this GPU's memory: NCCL there.
        if (self.tp.enabled and not self.tp.replicated_dense and config.nnodes == 1
                and not config.disable_custom_all_reduce):
            from pagoda_daemon.distributed import peer_all_reduce

            self.tp = dataclasses.replace(self.tp, peer=peer_all_reduce.create(self.tp.group, self.tp.size,
                                                                               self.device, self.dtype))
        torch.manual_seed(config.seed)
        self.backend = get_attention_backend(config.attention_backend, self.device)
        started = time.monotonic()
        model = loader.load_model(
            config.model, model_config, self.dtype, self.device, self.backend, max_model_len, config.load_format,
            self.tp,
        )
        seconds = time.monotonic() - started
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        log.info("start-up: weights %.2f GiB (%s%s) loaded in %.1f s, %.2f GB/s", weight_bytes / 2**30,
                 config.load_format, f", rank {self.tp.rank} of {self.tp.size}" if self.tp.enabled else "",
                 seconds, weight_bytes / max(seconds, 1e-9) / 1e9)
        self.kv_cache_spec = model.kv_cache_spec()
        self.balancer = None
        if config.enable_eplb:
            from pagoda_daemon.distributed.eplb import EplbConfig, ExpertBalancer

            layers = [m for m in model.modules() if getattr(m, "eplb", False)]
            self.balancer = ExpertBalancer(
                layers, EplbConfig(config.num_redundant_experts, config.eplb_step_interval, config.eplb_async_steps),
                self.tp, transfer_group=self._eplb_transfer_group() if config.eplb_async_steps else None)
            if self.lockstep is not None and self.balancer.is_async:  # the engines agree on it each step
                self.lockstep.eplb_layers_held = self.balancer.layers_held_everywhere
        self.runner = ModelRunner(model, model_config, config, self.device, self.dtype, max_model_len)
        self.uses_cuda_graphs = (self.device.type == "cuda" and self.backend.uses_kernels
                                 and not config.enforce_eager)
        self.offload: OffloadWorker | None = None  # KV offload's worker half, once the cache exists
        self._failed_kv_blocks: list[int] = []  # the latest step's blocks whose KV loads failed

    def _join_data_parallel_engines(self, config: EngineConfig) -> TensorParallel:
        """Data-parallel attention: join the world of the engines' processes (one GPU each) and
        take this engine's share of the experts; attention and dense layers stay whole here."""
        from pagoda_daemon.distributed.lockstep import Lockstep
        from pagoda_daemon.executor.world import Rendezvous, join_world

        if not config.data_parallel_rendezvous:
            raise ValueError("data_parallel_experts needs data_parallel_rendezvous (pagoda serve sets it)")
        device = resolve_device(config.device)
        # Every engine is in this pod: gloo's and NCCL's sockets on loopback only (unset, they take
        # the interface the host name resolves to: the pod's)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        control = join_world(config.data_parallel_rank, config.data_parallel_size,
                             Rendezvous(file=config.data_parallel_rendezvous), device.type, config.device_offset,
                             threading.Event())
        self.lockstep = Lockstep(control)
        size = config.data_parallel_size
        return TensorParallel(config.data_parallel_rank, size, dist.group.WORLD, expert_groups=size,
                              replicated_dense=True, spread_tokens=True,
                              alltoallv=config.all2all_backend == "alltoallv")

    def _eplb_transfer_group(self):
        """A gloo group over this replica's ranks for EPLB's background moves (through host memory,
        beside the steps' NCCL collectives; distributed/eplb.py); every rank creates it together."""
        return gloo_group_like(self.tp, EPLB_TRANSFER_TIMEOUT_S)

    def info(self) -> WorkerInfo:
        pin = self.cpu_pin
        return WorkerInfo(
            device=str(self.device), dtype=str(self.dtype).removeprefix("torch."),
            gpu=None if pin is None or self.device.type != "cuda" else pin.gpu,
            numa_node=None if pin is None else pin.numa_node,
            attention_backend=self.backend.name, uses_cuda_graphs=self.uses_cuda_graphs,
            kv_block_bytes=self.kv_block_bytes(), kv_transfer_cpu=None if pin is None else pin.kv_transfer_cpu,
        )

    # ---- KV cache ---------------------------------------------------------------------

    def kv_block_bytes(self) -> int:
        return self.kv_cache_spec.block_bytes(self.config.block_size, self.dtype)

    def available_kv_blocks(self) -> int:
        """How many KV blocks this device can hold: the GPU's from a profiling pass, the CPU's
        from its byte budget; ``num_kv_blocks`` overrides both. Under tensor parallelism, the
        smallest rank's count (every rank holds the same blocks of its own heads)."""
        per_block = self.kv_block_bytes()
        if self.config.num_kv_blocks is not None:
            blocks = self.config.num_kv_blocks
        elif self.device.type == "cuda":
            blocks = self._profile_gpu_blocks(per_block)
        else:
            blocks = (self.config.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES) // per_block
        return min_over_ranks(blocks, self.tp.engine)

    def _profile_gpu_blocks(self, per_block: int) -> int:
        """KV budget = gpu_memory_utilization x the memory left free after a profiling forward pass."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.runner.profile_peak_memory()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = total - free - torch.cuda.memory_reserved(self.device)
        free_after_profile = total - non_torch - peak
        from pagoda_daemon.kv_offload.tiered import device_staging_bytes

        budget = (int(free_after_profile * self.config.gpu_memory_utilization) - self.elastic_reserve_bytes()
                  - device_staging_bytes(self.config, per_block))
        log.info("start-up: memory profile: total %.1f GiB, peak torch %.2f GiB, other %.2f GiB, KV budget %.2f GiB",
                 total / 2**30, peak / 2**30, non_torch / 2**30, budget / 2**30)
        torch.cuda.empty_cache()
        return max(budget // per_block, 0)

    def elastic_reserve_bytes(self) -> int:
        """Under elastic EP, the memory a resize may need beyond today's experts: during a
        transition the old and the new experts live side by side (a failed one rolls back to
        weights never touched), and the most a rank ever holds is the smallest size's slots,
        twice. The KV cache is sized without it."""
        if not self.config.elastic_ep or self.balancer is None:
            return 0
        from pagoda_daemon.distributed.elastic import layout_for

        layers = self.balancer.layers
        slot_bytes = sum((m.w13[0].numel() + m.w2[0].numel()) * m.w13.element_size() for m in layers)
        smallest = layout_for(layers[0].num_experts, self.config.elastic_ep_min_size, self.config.num_redundant_experts)
        return max(0, 2 * smallest.slots - layers[0].w13.shape[0]) * slot_bytes

    def initialize_cache(self, num_blocks: int, capture: bool = True) -> None:
        """Allocate the KV cache, then capture the decode CUDA graphs over it (a rank joining
        an elastic replica captures once its experts have arrived)."""
        started = time.monotonic()
        self.runner.allocate_kv_cache(self.kv_cache_spec, num_blocks)
        block_size = self.config.block_size
        log.info("start-up: KV cache %d blocks of %d tokens = %d tokens, %.2f GiB, allocated in %.1f s", num_blocks,
                 block_size, num_blocks * block_size, num_blocks * self.kv_block_bytes() / 2**30,
                 time.monotonic() - started)
        from pagoda_daemon.kv_offload.tiered import build_worker, stages_in_background

        assert self.runner.kv_cache is not None
        engine = self.tp.engine
        # the background reads into host memory agree over a gloo group of the engine's ranks,
        # which every rank creates together
        group = gloo_group_like(engine, KV_STAGE_TIMEOUT_S) if stages_in_background(self.config) else None
        self.offload = build_worker(self.config, engine.rank, self.runner.kv_cache, self.kv_block_bytes(),
                                    transfer_cpu=None if self.cpu_pin is None else self.cpu_pin.kv_transfer_cpu,
                                    group=group)
        self.runner.prepare_eager_steps()
        if capture:
            self.capture_cuda_graphs()

    def capture_cuda_graphs(self) -> None:
        if self.uses_cuda_graphs:
            started = time.monotonic()
            self.runner.capture_cuda_graphs(self.tp.graph_capture)
            log.info("start-up: CUDA graphs captured in %.1f s", time.monotonic() - started)
        elif self.device.type == "cuda" and not self.config.enforce_eager:
            log.info("CUDA graphs off: the %s attention backend cannot be captured", self.backend.name)
        if self.balancer is not None:
            self.balancer.reset()  # profiling and capture ran the model on made-up tokens

    # ---- steps ------------------------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput) -> LaunchedStep | None:
        """KV offload copies first: the saves of blocks the GPU cache evicted for this step
        (write-back), then the prefetches (started beside the step, read by the next) and the
        loads (the step counts their tokens as computed; from host memory they cross beside the
        forward pass, each layer's attention waiting for its own); then the step, then the saves
        of the blocks it filled (write-through; docs/kv-offload.md, "How the copies run").

        A load that failed on any rank (a block file changed since its lookup) leaves wrong KV
        in its block and in the blocks computed on top of it: the step's result names the failed
        blocks (agreed by every rank), and the scheduler recomputes their requests and forgets
        what the step saved of them."""
        so = scheduler_output
        failed: set[int] = set()
        self.await_kv_prefetches()  # the blocks the previous step brought back, for this step to read
        if so.kv_evicted and self.offload is not None:  # write-back: before anything overwrites them
            with phase("pagoda.kv_offload_evict"):
                self.offload.run(so.kv_evicted, self.runner.kv_cache)
        if so.kv_prefetch and self.offload is not None:  # for the next step, beside this one
            with phase("pagoda.kv_offload_prefetch"):
                self.offload.prefetch(so.kv_prefetch, self.runner.kv_cache)
        if so.kv_loads and self.offload is not None:
            with phase("pagoda.kv_offload_load"):
                flags = self.offload.run(so.kv_loads, self.runner.kv_cache)
            if so.loads_may_fail:
                flags = any_over_ranks(flags, self.tp.engine)
            failed = {t.gpu_block for t, bad in zip(so.kv_loads, flags, strict=True) if bad}
        self._failed_kv_blocks = sorted(failed)
        loading = self.offload if so.kv_loads else None
        if self.balancer is not None:
            self.balancer.count_rows(so.num_scheduled_tokens)
        launched = self._with_failed_loads(self.runner.execute(so, loading.wait_for_layer if loading else None))
        if loading is not None:
            loading.await_layer_loads()  # any layer the pass did not wait for: before what follows
        if so.kv_saves and self.offload is not None:
            with phase("pagoda.kv_offload_save"):
                self.offload.run(so.kv_saves, self.runner.kv_cache)
        if launched is not None and self.offload is not None:  # (else sample_tokens takes them)
            launched.kv_writes = self.offload.take_step_writes()
        if so.kv_stages and self.offload is not None:  # into slots the saves may just have demoted from
            self.offload.stage(so.kv_stages, self.runner.kv_cache)
        if self.balancer is not None and (so.lockstep.tokens > 0 if so.lockstep is not None else not so.is_empty):
            # every rank (every data-parallel engine) runs the same forward passes: they rebalance together
            self.balancer.step(so.eplb_layers_held if so.lockstep is None else so.lockstep.eplb_layers_held)
        return launched

    def take_staged_kv(self) -> list[tuple[bytes, bool]]:
        """The disk blocks every rank has read into host memory since the last call (rank 0's
        answer, agreed over the ranks: TieredWorker.stage)."""
        return self.offload.take_staged() if self.offload is not None else []

    def await_kv_prefetches(self) -> None:
        """What runs next on the step's stream waits for the KV blocks prefetched so far."""
        if self.offload is not None:
            self.offload.await_prefetches()

    def sample_tokens(self, grammar: GrammarBitmask) -> LaunchedStep:
        launched = self._with_failed_loads(self.runner.sample(grammar))
        assert launched is not None
        if self.offload is not None:
            launched.kv_writes = self.offload.take_step_writes()
        return launched

    def _with_failed_loads(self, launched: LaunchedStep | None) -> LaunchedStep | None:
        """The step's result carries the blocks whose loads failed (a step with constrained rows
        launches its sampling, hence its result, later: sample_tokens)."""
        if launched is not None:
            launched.failed_kv_blocks = self._failed_kv_blocks
        return launched

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def release_cuda_graphs(self) -> None:
        self.synchronize()
        self.runner.release_cuda_graphs()

    # ---- elastic expert parallelism (executor/resize.py runs the protocol) ----------------

    def dense_tensors(self) -> list[torch.Tensor]:
        """Every weight and buffer but the experts' and their tables: what a joining rank
        takes from rank 0 as it is."""
        assert self.balancer is not None
        expert = {id(t) for m in self.balancer.layers
                  for t in (m.w13, m.w2, m.expert_load, m.replica_slots, m.replica_counts)}
        model = self.runner.model
        return ([p for p in model.parameters() if id(p) not in expert]
                + [b for b in model.buffers() if id(b) not in expert])

    def take_layout(self, tp, placements: list[list[int]], experts: list[list[torch.Tensor]]) -> None:
        """Serve with another expert-parallel layout: `tp` the new group, and for every MoE layer
        the replica's placement and this rank's (w13, w2). Graphs are captured again after."""
        assert self.balancer is not None
        self.tp = tp
        self.config = dataclasses.replace(self.config, expert_parallel_size=tp.size)
        for layer, placement, (w13, w2) in zip(self.balancer.layers, placements, experts, strict=True):
            layer.resize(tp, placement, w13, w2)
        self.runner.model.tp = tp
        self.balancer.tp = tp
        self.balancer.reset()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the old experts' memory back to the driver's pool
