"""Engine configuration: one dataclass, validated once, shared by every part of the engine."""

from __future__ import annotations

from dataclasses import dataclass

ALLOWED_BLOCK_SIZES = (16, 32, 64, 128)
ALLOWED_DTYPES = ("auto", "float32", "bfloat16", "float16")
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


@dataclass
class EngineConfig:
    """Everything the engine needs to start. Names follow vLLM's engine arguments."""

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"  # auto: the checkpoint's dtype on GPU, float32 on CPU
    device: str = "auto"  # auto: cuda when available, else cpu
    seed: int = 0
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # KV cache budget. GPU: this fraction of the memory free after a profiling forward pass.
    gpu_memory_utilization: float = 0.9
    # CPU: bytes for the KV cache (default 1 GiB).
    kv_cache_memory_bytes: int | None = None
    # Exact block count; overrides both budgets (tests use it to force preemption).
    num_kv_blocks: int | None = None
    # auto: Pagoda's Triton kernels on CUDA/ROCm when Triton is installed, else pure torch.
    attention_backend: str = "auto"  # auto | torch | triton
    # True: no CUDA graphs (every step runs eagerly). Graphs need the Triton backend.
    enforce_eager: bool = False
    # Schedule and prepare step N+1 while step N runs on the GPU. None: on for GPUs.
    async_scheduling: bool | None = None
    # Largest decode batch captured as a CUDA graph; bigger decode batches run eagerly.
    max_cudagraph_batch_size: int = 512
    # auto: the checkpoint's safetensors; dummy: random weights from config.json alone
    # (benchmarks and start-up measurements, like vLLM's --load-format dummy).
    load_format: str = "auto"
    # Collect KV-cache events (BlockStored/BlockRemoved/AllCleared) for a publisher to drain.
    enable_kv_events: bool = False
    # CPU pinning of the engine worker: auto (cores of the GPU's NUMA node) | none | cpus=<list>
    numa_policy: str = "auto"

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must name a model directory")
        if self.block_size not in ALLOWED_BLOCK_SIZES:
            raise ValueError(f"block_size must be one of {ALLOWED_BLOCK_SIZES}, got {self.block_size}")
        if self.dtype not in ALLOWED_DTYPES:
            raise ValueError(f"dtype must be one of {ALLOWED_DTYPES}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}")
        if self.numa_policy not in ("auto", "none") and not self.numa_policy.startswith("cpus="):
            raise ValueError(f"numa_policy must be auto, none or cpus=<list>, got {self.numa_policy!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        if self.max_cudagraph_batch_size < 1:
            raise ValueError(f"max_cudagraph_batch_size must be at least 1, got {self.max_cudagraph_batch_size}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}")
