"""The attention-backend interface: what the model runner hands every attention layer.

A step is one flattened, variable-length batch: the new tokens of every scheduled
sequence laid end to end. Backends write the step's K/V into the paged cache
(slot_mapping) and attend over each sequence's whole context (block_tables).
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    """The paged KV cache a model needs: the model declares it (``kv_cache_spec()``), the
    worker sizes and allocates the cache from it. One tensor
    ``[num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]``."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    def shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def block_bytes(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of one block over every layer, K and V."""
        elem = torch.empty((), dtype=dtype).element_size()
        return self.num_layers * 2 * block_size * self.num_kv_heads * self.head_dim * elem


@dataclass
class AttentionMetadata:
    # device tensors
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32: context length after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    # host copies, so backends never sync to learn shapes
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    # True when no sequence has cached context: attention may run on the fresh K/V only
    is_prefill_only: bool = False
    # False only in the memory-profiling pass, which runs without a cache
    has_kv_cache: bool = True
    # True when the step's K/V are in the cache already (written inside the piecewise graphs,
    # worker/piecewise_graphs.py): the backend then only attends
    kv_written: bool = False
    # What a backend computes once per step and every layer reuses (the Triton decode work
    # plan). Filled inside the forward pass, so a CUDA graph captures that work too: a graph
    # must be captured with fresh metadata, never with one a warm-up pass has filled.
    backend_state: dict = field(default_factory=dict)
    # KV offload: makes the step's stream wait until this step's loads have brought layer i's
    # KV in (kv_offload/connector.py, wait_for_layer); the model calls it before each attention
    wait_for_kv_layer: Callable[[int], None] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        """The step's own token rows; an eager step padded to a warmed-up size runs more
        (worker/step_shapes.py), which attention leaves out."""
        return self.query_start_loc_cpu[-1]

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @functools.cached_property
    def num_leading_decodes(self) -> int:
        """How many sequences at the head of the batch bring one token each: the scheduler puts
        running requests first, so in a mixed step these are its decodes (a backend may give
        them a decode kernel and the rest a prefill kernel)."""
        qsl = self.query_start_loc_cpu
        n = 0
        while n < len(qsl) - 1 and qsl[n + 1] - qsl[n] == 1:
            n += 1
        return n

    @functools.cached_property
    def leading_decode_context(self) -> int:
        """Context tokens of the leading decodes (the KV cache they read, per layer)."""
        return sum(self.seq_lens_cpu[: self.num_leading_decodes])


class AttentionBackend(ABC):
    """One instance per model; layers call forward() with their own cache slice."""

    name: str = "abstract"
    # True when the model should also use Pagoda's fused kernels (RMSNorm, RoPE, SiLU, MoE)
    # and decode steps may be captured as CUDA graphs (no host-side shapes in forward()).
    uses_kernels: bool = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, causal: bool = True) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        # False for an encoder (BERT): every token sees the whole sequence. Such a model's steps
        # bring each prompt whole, with no cached context (its engine neither chunks prompts nor
        # caches prefixes: engine_core.py, models/bert.py), so attention runs on the step's fresh K/V only.
        self.causal = causal
        if not causal and sliding_window is not None:
            raise ValueError("a sliding window is a causal model's: an encoder attends to its whole sequence")

    def check_bidirectional(self, meta: AttentionMetadata) -> None:
        """An encoder's step must bring whole sequences (none with cached context)."""
        if not meta.is_prefill_only and meta.has_kv_cache:
            raise RuntimeError("bidirectional attention over cached context: an encoder's prompts must come whole")

    @abstractmethod
    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """This step's K/V into their cache slots; rows whose slot is -1 (padding) write nothing."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        kv_cache: torch.Tensor | None,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        out: torch.Tensor | None = None,  # written and returned when given, else allocated like q
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...


def get_attention_backend(name: str, device: torch.device) -> type[AttentionBackend]:
    """torch: the pure-torch reference (any device). triton: Pagoda's Triton kernels.
    auto: Triton on a GPU (CUDA or ROCm) when the triton package imports, torch otherwise."""
    if name == "auto":
        name = "triton" if device.type == "cuda" and triton_kernels_available() else "torch"
    if name == "torch":
        from pagoda_daemon.attention.torch_paged import TorchPagedAttention

        return TorchPagedAttention
    if name == "triton":
        try:
            from pagoda_daemon.attention.triton_backend import TritonPagedAttention
        except ImportError as e:
            raise ValueError(f"attention backend 'triton' needs the triton package: {e}") from e
        return TritonPagedAttention
    raise ValueError(f"unknown attention backend {name!r} (known: auto, torch, triton)")


@functools.cache
def triton_kernels_available() -> bool:
    """Whether Triton and Pagoda's kernels import here (the sampler asks too)."""
    try:
        import triton  # noqa: F401

        import pagoda_kernels  # noqa: F401
    except ImportError:
        return False
    return True
