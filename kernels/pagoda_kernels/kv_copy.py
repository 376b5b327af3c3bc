"""KV blocks from pinned host slots straight into the paged cache, in one kernel.

The host tier keeps a block's layers together, ``[slots, layers, 2, block_size, heads, head_dim]``;
the cache keeps a layer's blocks together, ``[layers, 2, blocks, block_size, heads, head_dim]``. A
block's bytes are therefore ``layers * 2`` pieces of ``block_size * heads * head_dim`` elements
apart on the GPU. This kernel reads the pinned slots over PCIe itself (pinned memory is mapped
into the GPU's address space) and stores each piece where it goes: no staging buffer, no copy per
run of consecutive slots, no scatter afterwards. Twin: ``reference.load_blocks_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK_BYTES = 8192  # bytes one program moves at a time (a 16-byte load per thread, 4 warps, 4 rounds)


@triton.jit
def _load_blocks_kernel(host_ptr, cache_ptr, slots_ptr, blocks_ptr, total,
                        slot_bytes, piece_stride, PIECE_BYTES: tl.constexpr,
                        PIECES: tl.constexpr, CHUNKS: tl.constexpr, CHUNK: tl.constexpr):
    offs = tl.arange(0, CHUNK)
    for work in range(tl.program_id(0), total, tl.num_programs(0)):
        chunk = work % CHUNKS
        piece = tl.cast((work // CHUNKS) % PIECES, tl.int64)  # piece * piece_stride passes 2**31
        i = work // (CHUNKS * PIECES)
        slot = tl.load(slots_ptr + i).to(tl.int64)
        block = tl.load(blocks_ptr + i).to(tl.int64)
        at = chunk * CHUNK + offs
        mask = at < PIECE_BYTES
        data = tl.load(host_ptr + slot * slot_bytes + piece * PIECE_BYTES + at, mask=mask)
        tl.store(cache_ptr + piece * piece_stride + block * PIECE_BYTES + at, data, mask=mask)


def load_blocks(host: torch.Tensor, slots: torch.Tensor, kv_cache: torch.Tensor, gpu_blocks: torch.Tensor,
                max_programs: int = 0) -> None:
    """``kv_cache[:, :, gpu_blocks[i]] = host[slots[i]]`` for every i, on the current stream.

    ``host``: ``[slots, layers, 2, ...]`` pinned (or on the cache's device), contiguous; ``slots``
    and ``gpu_blocks``: integer tensors on the cache's device;
    ``kv_cache``: ``[layers, 2, blocks, ...]`` with the same layer count and block shape, each
    block contiguous (a slice of layers of the whole cache is fine). ``max_programs``: at most
    this many programs, each looping over its share (0: one program per chunk of a piece), so
    that a load beside a forward pass leaves it most of the SMs.
    """
    layers = host.shape[1]
    assert kv_cache.shape[0] == layers and kv_cache.shape[3:] == host.shape[3:], (kv_cache.shape, host.shape)
    assert host.is_contiguous() and host.dtype == kv_cache.dtype
    assert kv_cache.stride(1) == kv_cache.stride(0) // 2 and kv_cache[0, 0].is_contiguous()
    n = len(slots)
    if n == 0:
        return
    size = kv_cache.element_size()
    piece_bytes = kv_cache[0, 0, 0].numel() * size
    pieces = layers * 2
    chunks = triton.cdiv(piece_bytes, CHUNK_BYTES)
    total = n * pieces * chunks
    programs = total if max_programs <= 0 else min(total, max_programs)
    _load_blocks_kernel[(programs,)](
        host.view(torch.uint8), kv_cache.view(torch.uint8), slots, gpu_blocks, total,
        host[0].numel() * size, kv_cache.stride(1) * size,
        PIECE_BYTES=piece_bytes, PIECES=pieces, CHUNKS=chunks, CHUNK=min(CHUNK_BYTES, triton.next_power_of_2(piece_bytes)),
        num_warps=4,
    )
