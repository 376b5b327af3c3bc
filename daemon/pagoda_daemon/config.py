"""Engine configuration: every engine option declared once, validated once, shared by every
part of the engine. The `pagoda generate` / `pagoda serve` flags and the `--config` file keys
are generated from these declarations (``options.py``); names follow vLLM's engine arguments."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from pagoda_daemon.hf_overrides import parse_hf_overrides
from pagoda_daemon.options import check_bounds, option

RUNNERS = ("auto", "generate", "pooling")  # pooling.py: an engine generates text or serves embeddings
POOLING_TYPES = ("auto", "last", "mean", "cls")  # pooling.py: the vector a pooling engine makes of a prompt
SCHEDULING_POLICIES = ("fcfs", "priority")  # engine/scheduler.py: the order of its queue and running list

MAX_TEMPLATE_BYTES = 1 << 20  # templates.py: a chat template (or its file) larger than this is not one


def is_template_text(value: str) -> bool:
    """Whether a chat_template value is the Jinja text itself (else it names a file): the
    daemon's reading (templates.py) and the operator's rule for engine.chatTemplate."""
    return "{{" in value or "{%" in value

ALLOWED_BLOCK_SIZES = (16, 32, 64, 128)
# engine/grammar.py implements each; the first is the default (why: engine/grammar.py)
STRUCTURED_OUTPUTS_BACKENDS = ("llguidance", "xgrammar")
# How MoE layers move tokens between data-parallel engines (distributed/token_dispatch.py); the
# first is the default, as in vLLM
ALL2ALL_BACKENDS = ("allgather_reducescatter", "alltoallv")
ALLOWED_DTYPES = ("auto", "float32", "bfloat16", "float16")
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
# With the disk KV tier alone, its hits are read into this much host memory (over the engine's
# ranks; pinned on GPUs) beside the steps, as a host tier in front of it would hold them
# (docs/kv-offload.md, "Disk reads beside the steps"); it caches nothing else. The operator adds
# it to a pod's memory as it adds kvOffload.cpuGiB.
DISK_READ_AHEAD_GIB = 1.0


def offload_host_gib(cpu_gib: float, disk_tier: bool) -> float:
    """The host memory an engine's KV offload holds: its host tier, or with a disk tier alone
    the memory its reads land in (the engine's and the operator's one rule)."""
    if cpu_gib > 0:
        return cpu_gib
    return DISK_READ_AHEAD_GIB if disk_tier else 0.0


@dataclass
class EngineConfig:
    """Everything the engine needs to start."""

    model: str = option("", "a Hugging Face-format model directory", cli=False)
    model_cache_dir: str | None = option(
        None, "where hf:// and s3:// models are fetched to (default: $PAGODA_CACHE_DIR, else ~/.cache/pagoda/models)")
    tokenizer: str | None = option(None, "tokenizer directory (default: the model's)")
    hf_overrides: str | None = option(
        None, "a JSON object set on the model's config.json as it is read (vLLM's --hf-overrides); e.g. "
        '{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"], '
        '"is_original_qwen3_reranker": true} serves the original Qwen3-Reranker as a classifier (docs/embeddings.md)')
    chat_template: str | None = option(
        None, "a Jinja chat template, or a file holding one, used instead of the tokenizer's (vLLM's "
        "--chat-template); a classifier renders each (query, document) pair by it (the score template: "
        "docs/embeddings.md)")
    dtype: str = option("auto", "weights and activations; auto: the checkpoint's dtype on GPU, float32 on CPU",
                        choices=ALLOWED_DTYPES)
    device: str = option("auto", "auto | cpu | cuda[:N]; auto: cuda when available, else cpu")
    seed: int = option(0, "seed of the engine's random state (weights of --load-format dummy, sampling)")
    max_model_len: int | None = option(None, "longest sequence (default: the model's max_position_embeddings)",
                                       minimum=1)
    block_size: int = option(16, "tokens per KV cache block", choices=ALLOWED_BLOCK_SIZES)
    # vLLM's default on GPUs of 70 GiB and more. 400 streamed requests at once on one H100
    # (2026-11-27): p99 TTFT 2.7-3.0 s at 256 (the 144 beyond it waited for a slot), 1.2-1.5 s at 1,024.
    max_num_seqs: int = option(1024, "most sequences in one step", minimum=1, maximum=1 << 20)
    max_num_batched_tokens: int = option(8192, "token budget of one step", minimum=1)
    enable_prefix_caching: bool = option(True, "reuse the KV cache of shared prompt prefixes")
    enable_chunked_prefill: bool = option(True, "split long prompts over several steps")
    scheduling_policy: str = option(
        "fcfs", "fcfs: requests are admitted in arrival order; priority: by each request's priority (lower "
        "first, then arrival), and a step short of KV blocks preempts the lowest-priority request",
        choices=SCHEDULING_POLICIES)
    gpu_memory_utilization: float = option(
        0.9, "GPU: the fraction of the memory left free after a profiling pass given to the KV cache",
        minimum=0.0, exclusive_minimum=True, maximum=1.0)
    kv_cache_memory_bytes: int | None = option(None, "CPU: bytes for the KV cache (default 1 GiB)", minimum=1)
    num_kv_blocks: int | None = option(None, "exact KV block count; overrides both budgets", minimum=1)
    attention_backend: str = option("auto", "auto: Pagoda's Triton kernels on CUDA/ROCm when Triton is "
                                    "installed, else pure torch", choices=("auto", "torch", "triton"))
    enforce_eager: bool = option(False, "no CUDA graphs: every step runs eagerly")
    async_scheduling: bool | None = option(
        None, "schedule and prepare step N+1 while step N runs on the GPU (default: on for GPUs)")
    pad_eager_steps: bool | None = option(
        None, "pad the token rows of steps that run without a CUDA graph to a grid of sizes warmed up at "
        "start-up (worker/step_shapes.py; default: on for CUDA)", cli=False)
    max_piecewise_graph_tokens: int = option(
        2048, "steps that carry prompts, up to this many tokens, replay CUDA graphs of everything but attention "
        "(0: they run eagerly)", minimum=0, maximum=1 << 20)
    max_cudagraph_batch_size: int = option(512, "largest decode batch captured as a CUDA graph; bigger "
                                           "decode batches run eagerly", minimum=1)
    load_format: str = option("auto", "auto: the checkpoint's safetensors; dummy: random weights from "
                              "config.json alone (benchmarks)", choices=("auto", "dummy"))
    structured_outputs_backend: str = option(
        STRUCTURED_OUTPUTS_BACKENDS[0], "what compiles JSON schemas, regexes, choices and grammars into token masks (vLLM's "
        "structured_outputs_config.backend)", choices=STRUCTURED_OUTPUTS_BACKENDS)
    enable_kv_events: bool = option(False, "collect KV-cache events for a publisher to drain", cli=False)
    numa_policy: str = option("auto", "CPU pinning of the engine worker: auto (cores of the GPU's NUMA "
                              "node) | none | cpus=<list>")
    # One rank per GPU, tensor × expert of them (docs/parallelism.md). Options this build cannot
    # do yet are declared so that the operator can render them and both sides refuse them by
    # name (capabilities.py).
    tensor_parallel_size: int = option(
        1, "ranks each MoE expert is sliced over; attention and dense layers are sliced over tensor × expert ranks",
        minimum=1, maximum=64, needs="tensor_parallel")
    expert_parallel_size: int = option(
        1, "groups of ranks the MoE experts are spread over (a MoE model only); the engine runs tensor × expert "
        "ranks, one per GPU", minimum=1, maximum=64, needs="expert_parallel")
    enable_eplb: bool = option(
        False, "balance the MoE experts' load over the expert-parallel ranks (or, with data_parallel_experts, "
        "the engines) while serving (EPLB)")
    num_redundant_experts: int = option(
        0, "with EPLB: extra expert slots, for copies of the busiest experts", minimum=0, maximum=4096)
    eplb_step_interval: int = option(
        3000, "with EPLB: engine steps between rebalances (the load is counted over them)", minimum=1,
        maximum=10**9)
    eplb_async_steps: int = option(
        0, "with EPLB: move the experts' weights in the background while serving on the old placement, MoE layer "
        "i switching to the new one this many steps + i after the rebalance (vLLM's eplb use_async); 0: move them "
        "at the rebalance, serving paused meanwhile", minimum=0, maximum=10**6)
    # Elastic expert parallelism (docs/elastic-ep.md): the replica's expert-parallel size changes
    # while it serves, between these bounds; attention and the dense layers are then whole on
    # every rank and only the experts are spread.
    elastic_ep_min_size: int = option(
        0, "elastic expert parallelism: the fewest ranks a resize may leave (0: elastic EP off; needs enable_eplb)",
        minimum=0, maximum=64)
    elastic_ep_max_size: int = option(
        0, "elastic expert parallelism: the most ranks a resize may reach", minimum=0, maximum=64)
    disable_custom_all_reduce: bool = option(
        False, "sum the ranks' partial products with NCCL only, not small ones from the other GPUs' memory "
        "over NVLink (one pod's GPUs)")
    # Data parallelism (docs/parallelism.md): engines of their own, each with its scheduler, KV
    # cache and tensor × expert ranks on GPUs of its own; the API server spreads requests over them.
    data_parallel_size: int = option(
        1, "engines in this daemon, each on tensor × expert GPUs of its own; the API server sends each request "
        "to the one that computed its prefix before, within a bound on the load, else to the least loaded",
        minimum=1, maximum=64, needs="data_parallel")
    data_parallel_rank: int = option(0, "which of those engines this is (the daemon sets it for each)",
                                     minimum=0, maximum=63, cli=False)
    data_parallel_experts: bool = option(
        False, "a MoE model's experts spread over the data-parallel engines (data-parallel attention: each engine "
        "keeps its own requests, attention and dense layers, and every engine runs each MoE layer with the others "
        "every step, an idle one on padding; vLLM's --enable-expert-parallel with --data-parallel-size); each "
        "engine one GPU", needs="data_parallel_experts")
    all2all_backend: str = option(
        ALL2ALL_BACKENDS[0], "with data_parallel_experts, how each MoE layer brings the engines' tokens to their "
        "experts: allgather_reducescatter (every engine's rows, padding included, to every GPU, the outputs summed "
        "back) or alltoallv (in eager steps, each engine's real rows only to the GPUs holding their experts; "
        "decode steps in CUDA graphs still gather)", choices=ALL2ALL_BACKENDS)
    data_parallel_rendezvous: str | None = option(
        None, "with data_parallel_experts: the file where the engines' processes meet (the daemon sets it)",
        cli=False)
    # Ranks over several pods (nodes): node 0 runs the API server and the engine core with its
    # share of the ranks; nodes 1..nnodes-1 run only theirs (docs/parallelism.md, "Across pods").
    nnodes: int = option(1, "pods (or hosts) the tensor × expert ranks are spread over, an equal share on each",
                         minimum=1, maximum=64)
    node_rank: int = option(0, "this pod's place among them: 0 serves the API, the others run ranks only",
                            minimum=0, maximum=63)
    master_addr: str = option("127.0.0.1", "with nnodes > 1: the address of node 0, where the ranks meet")
    master_port: int = option(29500, "with nnodes > 1: node 0's rendezvous port", minimum=1, maximum=65535)
    node_heartbeat_timeout: float = option(
        20.0, "with nnodes > 1: seconds without a heartbeat from the other pods' ranks (they beat every 2 s) "
        "before the group is taken for dead and this pod exits, so that its restart re-forms the group; an idle "
        "engine runs no collective that would notice sooner", minimum=5.0, maximum=3600.0)
    kv_cache_dtype: str = option("auto", "KV cache element type", choices=("auto", "fp8"), needs="kv_cache_fp8")
    kv_offload_cpu_gib: float = option(0.0, "host memory for offloaded KV blocks, GiB", minimum=0.0,
                                       needs="kv_offload")
    kv_offload_disk_path: str | None = option(None, "directory for offloaded KV blocks", needs="kv_offload")
    kv_offload_disk_gib: float = option(0.0, "disk space for offloaded KV blocks, GiB", minimum=0.0,
                                        needs="kv_offload")
    kv_offload_write_policy: str = option(
        "write-back", "when host memory gets a copy of a KV block: write-through (once the block is computed, "
        "beside the next steps) or write-back (only when the GPU cache evicts it: nothing is copied while every "
        "prefix fits the GPU); a disk tier alone is always written through", choices=("write-through", "write-back"),
        needs="kv_offload")
    kv_offload_disk_source: str | None = option(
        None, "prefill/decode disaggregation: another engine's kv_offload_disk_path (a prefill instance); "
        "blocks this engine's tiers lack are taken from there, hard-linked into its own disk tier "
        "(same filesystem); or tcp://HOST:PORT, another host's kv_transfer_port, from which they are fetched "
        "(the shared key in PAGODA_KV_TRANSFER_KEY); or 'request': from the prefill instance each request's "
        "signed x-pagoda-kv-source header names (pagoda pd-proxy passes it on)")
    kv_transfer_port: int = option(
        0, "prefill/decode disaggregation between hosts: serve this engine's disk-tier KV blocks on this TCP port "
        "of every interface to decode instances whose kv_offload_disk_source names it (0: off; the shared key in "
        "PAGODA_KV_TRANSFER_KEY)", minimum=0, maximum=65535)
    kv_transfer_host: str | None = option(
        None, "with kv_transfer_port: the address decode instances reach this instance at, which its answers name "
        "in their signed x-pagoda-kv-source header (default: this host's address)")
    enable_lora: bool = option(False, "serve LoRA adapters beside the base model; a request names one as its model")
    max_loras: int = option(
        1, "with enable_lora: adapters one step may use, each in a GPU slot (every slot's product is computed for "
        "every token: docs/lora.md)", minimum=1, maximum=64)
    max_lora_rank: int = option(16, "with enable_lora: the largest adapter rank served (the slots' width)",
                                minimum=1, maximum=512)
    lora_modules: str | None = option(
        None, "with enable_lora: adapters served from the start, each NAME=PATH (a PEFT adapter directory) or "
        'JSON {"name": NAME, "path": PATH}; several values, one per adapter', many=True)
    # Embeddings (pooling.py, docs/embeddings.md)
    runner: str = option(
        "auto", "generate text, or pool each prompt into one vector for /v1/embeddings (vLLM's --runner); auto: "
        "pooling for a model body without its head (Qwen3Model, ...) or a sentence-transformers directory "
        "(modules.json), else generate", choices=RUNNERS)
    pooling_type: str = option(
        "auto", "with runner pooling, the vector a prompt becomes: the last token's final hidden state, the mean of "
        "them all, or the first token's; auto: what the model's sentence-transformers Pooling config says, else last",
        choices=POOLING_TYPES)
    pooling_normalize: bool | None = option(
        None, "with runner pooling, scale vectors to unit length unless a request says otherwise; unset: as the "
        "model's sentence-transformers modules say (a Normalize module), else yes")

    @property
    def kv_offload_host_gib(self) -> float:
        """The host memory KV offload holds (offload_host_gib)."""
        return offload_host_gib(self.kv_offload_cpu_gib, self.kv_offload_disk_path is not None)

    @property
    def elastic_ep(self) -> bool:
        return self.elastic_ep_max_size > 0

    @property
    def data_experts_engines(self) -> int:
        """The engines the MoE experts are spread over (data_parallel_experts), else 0."""
        return self.data_parallel_size if self.data_parallel_experts else 0

    @property
    def device_offset(self) -> int:
        """The node-local index of this engine's first GPU: data-parallel engine d runs on GPUs
        d·ranks .. d·ranks + ranks − 1 of those visible."""
        return self.data_parallel_rank * self.ranks_per_node

    def for_data_parallel_rank(self, rank: int) -> EngineConfig:
        """The configuration of data-parallel engine `rank`: its place, and a disk tier of its own."""
        disk = self.kv_offload_disk_path
        if disk and self.data_parallel_size > 1:
            disk = os.path.join(disk, f"dp{rank}")
        return dataclasses.replace(self, data_parallel_rank=rank, kv_offload_disk_path=disk)

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def world_size(self) -> int:
        """Ranks of one engine, one per GPU: tensor × expert parallel size."""
        return self.tensor_parallel_size * self.expert_parallel_size

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must name a model directory")
        check_bounds(self)
        if self.hf_overrides is not None:
            parse_hf_overrides(self.hf_overrides)
        if self.chat_template is not None and not 0 < len(self.chat_template) <= MAX_TEMPLATE_BYTES:
            raise ValueError(f"chat_template must be a file or a template of 1 to {MAX_TEMPLATE_BYTES} characters")
        if self.world_size > 64:
            raise ValueError(f"tensor_parallel_size × expert_parallel_size = {self.world_size} ranks; at most 64")
        if self.world_size % self.nnodes:
            raise ValueError(f"{self.world_size} ranks (tensor × expert parallel size) cannot be split evenly over "
                             f"nnodes {self.nnodes}")
        if self.data_parallel_size > 1:
            self._check_data_parallel()
        elif self.data_parallel_experts:
            raise ValueError("data_parallel_experts spreads the experts over the data-parallel engines: it needs "
                             "data_parallel_size 2 or more")
        if self.all2all_backend != ALL2ALL_BACKENDS[0] and not self.data_parallel_experts:
            raise ValueError(f"all2all_backend {self.all2all_backend} moves tokens between the engines the experts "
                             "are spread over: it needs data_parallel_experts")
        if self.eplb_async_steps and not self.enable_eplb:
            raise ValueError("eplb_async_steps needs enable_eplb")
        if self.elastic_ep or self.elastic_ep_min_size:
            self._check_elastic()
        if not self.enable_lora and (self.lora_modules or self.max_loras != 1 or self.max_lora_rank != 16):
            raise ValueError("lora_modules, max_loras and max_lora_rank need enable_lora")
        if self.enable_lora and self.elastic_ep:
            raise ValueError("enable_lora does not combine with elastic expert parallelism: a joining rank would "
                             "start without the adapters the others hold")
        if self.enable_lora and self.nnodes > 1:
            raise ValueError("enable_lora does not combine with nnodes above 1 yet: each rank reads an adapter from "
                             "the path node 0 registered it at, which the other nodes do not have")
        if self.runner == "generate" and (self.pooling_type != "auto" or self.pooling_normalize is not None):
            raise ValueError("pooling_type and pooling_normalize need runner pooling (or auto)")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} must be below nnodes {self.nnodes}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.numa_policy not in ("auto", "none") and not self.numa_policy.startswith("cpus="):
            raise ValueError(f"numa_policy must be auto, none or cpus=<list>, got {self.numa_policy!r}")

    def _check_data_parallel(self) -> None:
        """What data parallelism does not combine with yet, all named in one message."""
        problems = []
        if self.data_parallel_rank >= self.data_parallel_size:
            problems.append(f"data_parallel_rank {self.data_parallel_rank} must be below data_parallel_size "
                            f"{self.data_parallel_size}")
        if self.data_parallel_size * self.world_size > 64:
            problems.append(f"data_parallel_size × tensor × expert parallel size = "
                            f"{self.data_parallel_size * self.world_size} GPUs; at most 64")
        if self.nnodes != 1:
            problems.append("data parallelism runs its engines in one pod (nnodes 1)")
        if self.elastic_ep:
            problems.append("elastic expert parallelism resizes one engine (data_parallel_size 1)")
        if self.device.startswith("cuda:"):
            problems.append(f"device {self.device} names one GPU; data-parallel engines take GPUs in order "
                            "(device cuda or auto)")
        if self.kv_offload_disk_source or self.kv_transfer_port:
            problems.append("prefill/decode disaggregation (kv_offload_disk_source, kv_transfer_port) runs one "
                            "engine per instance (data_parallel_size 1)")
        if self.data_parallel_experts and self.world_size != 1:
            problems.append("data_parallel_experts runs each engine on one GPU (tensor_parallel_size and "
                            "expert_parallel_size 1): the experts are spread over the engines")
        if problems:
            raise ValueError("; ".join(problems))

    def check_elastic_size(self, size: int) -> None:
        """A resize's size, refused (ValueError) outside the elastic bounds; the API and the
        engine core both ask."""
        if not self.elastic_ep:
            raise ValueError("elastic expert parallelism is off (elastic_ep_max_size 0)")
        if not self.elastic_ep_min_size <= size <= self.elastic_ep_max_size:
            raise ValueError(f"expert-parallel size {size} is outside the elastic bounds "
                             f"{self.elastic_ep_min_size}..{self.elastic_ep_max_size}")

    def _check_elastic(self) -> None:
        """Elastic EP's requirements, all named in one message (vLLM's elastic EP asks the same:
        EPLB on, attention not split over the expert ranks, one node)."""
        problems = []
        low, high, size = self.elastic_ep_min_size, self.elastic_ep_max_size, self.expert_parallel_size
        if not 1 <= low <= high or high < 2:
            problems.append(f"elastic_ep_min_size ({low}) must be at least 1 and at most elastic_ep_max_size ({high}), "
                            "which must be at least 2")
        elif not low <= size <= high:
            problems.append(f"expert_parallel_size {size} must lie within the elastic bounds {low}..{high}")
        if not self.enable_eplb:
            problems.append("elastic expert parallelism needs enable_eplb (the balancer places the experts of each size)")
        if self.tensor_parallel_size != 1:
            problems.append("elastic expert parallelism needs tensor_parallel_size 1 (attention is whole on every rank)")
        if self.nnodes != 1:
            problems.append("elastic expert parallelism runs its ranks in one pod (nnodes 1)")
        if self.kv_offload_cpu_gib or self.kv_offload_disk_path:
            problems.append("elastic expert parallelism does not combine with KV offload yet")
        if self.eplb_async_steps:
            problems.append("elastic expert parallelism moves the experts at each resize itself (eplb_async_steps 0)")
        if problems:
            raise ValueError("; ".join(problems))
